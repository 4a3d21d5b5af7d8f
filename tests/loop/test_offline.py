"""A preference spec (DPO) runs through `polgrad.train`: its validation, its offline step, its row."""

from __future__ import annotations

import json
import math
import os

import gin
import pytest
import torch

from polgrad import config
from polgrad.errors import ConfigError
from polgrad.registry import register
from polgrad.tasks.synthetic import Add

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DPO = os.path.join(REPO, "registry", "dpo.gin")


@pytest.mark.parametrize(
    ("binding", "named"),
    [
        ("Algorithm.advantage = @advantage.grpo", "Algorithm.advantage"),
        ("Algorithm.kl = @kl.k1", "Algorithm.kl"),
        ("Algorithm.filters = [@filter.zero_variance_groups]", "Algorithm.filters"),
    ],
)
def test_a_preference_spec_refuses_on_policy_parts_by_name(binding, named):
    gin.clear_config()
    config.parse_config([DPO], [binding])
    with pytest.raises(ConfigError, match=f"Algorithm.preference = @preference.dpo .* no {named}: remove"):
        config.build()


def test_an_rl_spec_without_an_advantage_names_the_choices():
    gin.clear_config()
    config.parse_config(
        [],
        ["Algorithm.name = 'x'", "Algorithm.clip = @clip.ppo", "Algorithm.aggregate = @aggregate.token_mean"],
    )
    with pytest.raises(
        ConfigError,
        match=r"Algorithm.advantage is required \(one of @advantage\.dr_grpo, @advantage\.gae.*"
        r"unless Algorithm.preference",
    ):
        config.build()


def _pair_gradient(micro_batch_size: int) -> dict[str, torch.Tensor]:
    """The policy's gradient after one offline step's backward (before the optimizer applies it)."""
    from polgrad import distributed as dist_lib
    from polgrad import hooks, offline
    from polgrad.build import build_models
    from polgrad.loop_state import LoopState

    gin.clear_config()
    config.parse_config([DPO], ["train.prompts_per_step = 6", f"train.micro_batch_size = {micro_batch_size}"])
    cfg, algo, task = config.build()
    dist_lib.setup(seed=cfg.seed)
    m = build_models(cfg, algo, task, out_dir=".", seed_of=lambda s: s)  # nothing sampled: DPO
    grads: dict[str, torch.Tensor] = {}

    def on_phase(path, _dt):
        if path.endswith("backward") and m.engine.is_gradient_accumulation_boundary():
            grads.update({n: p.grad.detach().clone() for n, p in m.engine.module.named_parameters()})

    with hooks.listen(on_phase=on_phase):
        row, _, state = offline.pair_step(cfg, algo, m, task, seed=5, state=LoopState())
    assert state.step == 1 and row["pairs"] == 6.0
    return grads | {"_loss": torch.tensor(row["pref_loss"])}


def test_the_offline_step_does_not_depend_on_its_micro_batching():
    """6 pairs in one micro-batch vs three of 2 pairs (micro_batch_size counts sequences): each
    micro-batch's loss is its share of the mean over the step's 6 pairs, so the summed gradient is
    the full-batch one up to fp32 summation order (<= 1e-5 of the largest entry: sums of ~10^2-10^3
    fp32 terms, see tests/loop/test_data_parallel.py). A per-micro-batch mean would scale it by 3."""
    whole, split = _pair_gradient(12), _pair_gradient(4)
    assert whole["_loss"].item() == pytest.approx(split["_loss"].item(), rel=1e-9)
    # the first step's policy is the reference (the warm start): every log-ratio is 0, so the loop's
    # loss is log 2 per pair exactly when it subtracts the reference's log-probs
    assert whole["_loss"].item() == pytest.approx(math.log(2), abs=1e-6)
    scale = max(g.abs().max().item() for k, g in whole.items() if k != "_loss")
    err = max((split[k] - g).abs().max().item() for k, g in whole.items() if k != "_loss")
    assert scale > 0 and err <= 1e-5 * scale, (err, scale)


def test_pair_loss_uses_the_reference_log_ratios():
    """Algorithm.pair_loss hands the part log pi_theta - log pi_ref, not the policy's log-probs alone
    (the parts are tested on log-ratios; dropping the reference in the loop passed every fast test).
    registry/dpo.gin: beta = 0.5. Pair 1: chosen -1.0 (ref -1.5), rejected -3.0 (ref -2.0): ratios
    0.5 and -1.0, margin m = 1.5. Pair 2: chosen -2.0 (ref -1.0), rejected -1.5 (ref -2.5): ratios
    -1.0 and 1.0, m = -2.0. loss = mean of -log sigma(0.5 m) = (log(1 + e^-0.75) + log(1 + e^1)) / 2;
    without the reference the margins would be 2.0 and -0.5."""
    algo = config.load_spec(DPO)  # beta is read from gin at the call
    logp = torch.tensor([-1.0, -2.0, -3.0, -1.5], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -1.0, -2.0, -2.5], dtype=torch.float64)
    loss, metrics = algo.pair_loss(logp[:2], logp[2:], ref[:2], ref[2:], 2.0)
    expected = (math.log1p(math.exp(-0.75)) + math.log1p(math.exp(1.0))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["reward_margin"].item() == pytest.approx(0.5 * (1.5 - 2.0) / 2, rel=1e-12)
    assert metrics["chosen_reward"].item() == pytest.approx(0.5 * (0.5 - 1.0) / 2, rel=1e-12)
    assert metrics["reward_accuracy"].item() == 0.5  # pair 1's chosen reward is above, pair 2's below
    gin.clear_config()


@pytest.mark.slow
def test_dpo_trains_through_polgrad_train(tmp_path):
    from polgrad.train import run as train

    gin.clear_config()
    config.parse_config(
        [DPO], ["train.steps = 3", "train.eval_every = 3", "train.eval_size = 16", "train.progress = False"]
    )
    summary = train(str(tmp_path / "run"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    first = rows[0]
    # the first step: policy = reference, so every log-ratio is 0: loss log 2, margin 0, accuracy 0
    assert first["pref_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    for r in rows:
        assert {"pref_loss", "reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward"} <= set(r)
        assert r["pairs"] == 32.0 and r["skipped_steps"] == 0
    assert rows[1]["pref_loss"] != rows[0]["pref_loss"]  # the first step moved the policy
    assert summary["status"] == "ok" and summary["eval_accuracy"] is not None
    assert summary["table5"]["type"] == "Off-policy" and summary["table5"]["reward_model"] == "No"


class _NoPairs:
    """task.add without preference pairs: a user task that only samples and scores."""

    name = "test_no_pairs"

    def __init__(self, digits: int):
        self._add = Add(digits=digits)
        for attr in ("alphabet", "max_prompt_chars", "max_response_chars"):
            setattr(self, attr, getattr(self._add, attr))
        self.examples, self.eval_examples = self._add.examples, self._add.eval_examples
        self.reward, self.demonstrations = self._add.reward, self._add.demonstrations


@register("task", "test_no_pairs")
def _no_pairs_task(*, digits: int = 2) -> _NoPairs:
    return _NoPairs(digits=digits)


@pytest.mark.parametrize("preference", ["dpo", "ipo", "cdpo"])
def test_a_preference_spec_on_a_task_without_pairs_fails_in_build_naming_task_spec_and_choices(preference):
    """build() (the trainer's and the sweep dry run's check) refuses it before any model is built;
    it used to pass and the run died after the warm start and the first evaluation with a bare
    AttributeError: '_NoPairs' object has no attribute 'preference_pairs'."""
    gin.clear_config()
    config.parse_config(
        [DPO], ["train.task = @task.test_no_pairs", f"Algorithm.preference = @preference.{preference}"]
    )
    with pytest.raises(ConfigError) as err:
        config.build()
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        f"Algorithm.preference = @preference.{preference} (spec 'dpo') needs the task's preference_pairs(), "
        "and train.task = @task.test_no_pairs (_NoPairs) has none; tasks with preference_pairs: "
        "add, file, reasoning_gym, reverse, running_sum, sort"  # built-ins; other test modules may add theirs
    ), msg
    listed = msg.split("tasks with preference_pairs: ")[1].split(";")[0].split(", ")
    assert "test_no_pairs" not in listed and listed == sorted(listed), listed
    gin.clear_config()


def test_a_learned_reward_model_on_a_task_without_pairs_fails_in_build():
    """train.reward_source = 'reward_model' trains its reward model on the task's preference pairs:
    on a task without them build() refuses in one line (it used to die late, in the reward model's
    training, after the warm start); GRPO declares no part that needs them, so this is its own check."""
    gin.clear_config()
    config.parse_config(
        [os.path.join(REPO, "registry", "grpo.gin")],
        ["train.task = @task.test_no_pairs", "train.reward_source = 'reward_model'"],
    )
    with pytest.raises(ConfigError) as err:
        config.build()
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        "train.reward_source = 'reward_model' trains a reward model on the task's preference_pairs(), and "
        "train.task = @task.test_no_pairs (_NoPairs) has none; tasks with preference_pairs: add, file, "
    ), msg
    assert msg.endswith("pick one of them, or train.reward_source = 'task'"), msg
    gin.clear_config()
