"""End to end: every spec trains the tiny default on a real HF model through DeepSpeed.

The policy is the cached SFT warm start of experiments/base_tiny.gin (trained once per machine,
~40 s, then reused). Runs are in-process; each test clears gin.
"""

from __future__ import annotations

import glob
import json
import math
import os

import gin
import pytest
import torch

from polgrad.config import parse_config
from polgrad.registry import StepCounts, register
from polgrad.train import run as train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = sorted(glob.glob(os.path.join(REPO, "registry", "*.gin")))
# Keys whose values are wall-clock measurements: everything else in a metrics row is a
# deterministic function of the seed on CPU.
TIMING_KEYS = {
    "time_gen",
    "time_ref",
    "time_values",
    "time_adv",
    "time_update",
    "tokens_per_s",
    "time_s",
    "peak_mem_mb",
}

FAST = [
    "train.steps = 3",
    "train.prompts_per_step = 4",
    "train.eval_every = 3",
    "train.eval_size = 16",
    "train.checkpoint_every = 100",
    "train.progress = False",
]


def run(tmp_path, spec: str, bindings=(), name: str = "run", **kwargs) -> list[dict]:
    gin.clear_config()
    parse_config([spec], [*FAST, *bindings])
    out = tmp_path / name
    train(str(out), **kwargs)
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def deterministic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=lambda p: os.path.basename(p))
def test_every_spec_trains_a_few_steps_with_finite_losses(tmp_path, spec):
    rows = run(tmp_path, spec)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("pg_loss", "reward_mean", "entropy"):
            if key in r:
                assert math.isfinite(r[key]), (key, r)
        assert r["skipped_steps"] == 0
    assert "eval_accuracy" in rows[-1]
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert summary["status"] == "ok" and summary["steps"] == 3
    # the run records the Table-5 row of the Algorithm it built (the leaderboard reads it from there)
    assert summary["table5"]["method"] == os.path.splitext(os.path.basename(spec))[0]
    assert set(summary["table5"]) == {
        "method",
        "type",
        "reward_model",
        "value_function",
        "reference_policy",
        "core_loss",
    }
    assert (tmp_path / "run" / "config.gin").read_text().strip()


@pytest.mark.slow
def test_ppo_has_a_critic_and_reports_its_loss(tmp_path):
    rows = run(tmp_path, os.path.join(REPO, "registry", "ppo.gin"))
    assert all(math.isfinite(r["value_loss"]) for r in rows)
    assert all("explained_variance" in r for r in rows)


@pytest.mark.slow
def test_ppo_with_reward_model_reward_and_critic_from_it(tmp_path):
    """The classic four-model set-up: actor, reference, critic (from the RM), reward model.

    On `sort`: a Bradley-Terry RM reaches ~0.94 held-out pairwise accuracy there, while on `add`
    it stays near chance with this budget (its negatives differ by one carried digit)."""
    rows = run(
        tmp_path,
        os.path.join(REPO, "registry", "ppo.gin"),
        [
            "train.task = @task.sort",
            "train.reward_source = 'reward_model'",
            "Algorithm.value_init = @value_init.reward_model",
        ],
    )
    assert rows[0]["rm_heldout_accuracy"] > 0.6  # well above chance (0.5) on held-out pairs
    assert all(math.isfinite(r["value_loss"]) for r in rows)


@pytest.mark.slow
def test_remax_baseline_is_scored_by_the_reward_model_too(tmp_path, monkeypatch):
    """With reward_source='reward_model' the greedy baseline must get the same scorer as the samples
    (a task-verifier baseline against reward-model scores would make ReMax's advantage meaningless)."""
    from polgrad.rollout import hf as hf_rollout

    scored = []
    real = hf_rollout.rollout_scores

    def spy(reward_model, rollout):
        scored.append(rollout.temperature)
        return real(reward_model, rollout)

    monkeypatch.setattr(hf_rollout, "rollout_scores", spy)
    rows = run(
        tmp_path,
        os.path.join(REPO, "registry", "remax.gin"),
        ["train.task = @task.sort", "train.reward_source = 'reward_model'", "train.steps = 2"],
    )
    assert len(rows) == 2
    # per step: the sampled rollout (temperature 1) and its greedy baseline (temperature 0)
    assert scored.count(0.0) >= 2 and scored.count(1.0) >= 2


@pytest.mark.slow
def test_same_seed_gives_identical_metrics(tmp_path):
    spec = os.path.join(REPO, "registry", "grpo.gin")
    a = run(tmp_path, spec, name="a")
    b = run(tmp_path, spec, name="b")
    assert deterministic(a) == deterministic(b)
    # the warm start pinned to seed 0's: only the RL seed differs (and no second SFT to train)
    c = run(tmp_path, spec, ["train.seed = 1", "train.init_seed = 0"], name="c")
    assert deterministic(a) != deterministic(c)


@pytest.mark.slow
def test_interrupt_and_resume_ends_where_an_uninterrupted_run_ends(tmp_path):
    """A run stopped after its step-4 checkpoint and resumed to step 6 writes the same rows as
    one that ran 6 steps straight (eval-only keys aside: the stopped run evaluates at its end)."""
    spec = os.path.join(REPO, "registry", "ppo.gin")  # policy + critic engines, KL in reward
    common = ["train.checkpoint_every = 2", "train.eval_every = 100"]
    full = run(tmp_path, spec, [*common, "train.steps = 6"], name="full")
    run(tmp_path, spec, [*common, "train.steps = 4"], name="cut")
    resumed = run(tmp_path, spec, [*common, "train.steps = 6"], name="cut", resume=True)
    strip = {"eval_accuracy"}
    assert [{k: v for k, v in r.items() if k not in strip} for r in deterministic(resumed)] == [
        {k: v for k, v in r.items() if k not in strip} for r in deterministic(full)
    ]


@pytest.mark.slow
def test_the_kl_coefficient_is_loop_state_restored_on_resume(tmp_path):
    """With the adaptive controller the coefficient moves every step; it lives in the checkpoint
    (not in the spec), so a resumed run continues from the moved value, not the spec's initial one."""
    spec = os.path.join(REPO, "registry", "ppo.gin")
    common = [
        "train.checkpoint_every = 2",
        "train.eval_every = 100",
        "Algorithm.kl_controller = @kl_controller.adaptive",
    ]
    full = run(tmp_path, spec, [*common, "train.steps = 4"], name="full")
    coefs = [r["kl_coef"] for r in full]
    assert len(set(coefs)) == len(coefs), coefs  # it moved every step
    run(tmp_path, spec, [*common, "train.steps = 2"], name="cut")
    resumed = run(tmp_path, spec, [*common, "train.steps = 4"], name="cut", resume=True)
    assert [r["kl_coef"] for r in resumed] == coefs
    strip = {"eval_accuracy"}
    assert [{k: v for k, v in r.items() if k not in strip} for r in deterministic(resumed)] == [
        {k: v for k, v in r.items() if k not in strip} for r in deterministic(full)
    ]


_MEASURED: list[tuple[float, int]] = []


@register("kl_controller", "test_recorder", formula="beta (records what it is fed)")
def recording_controller(coef, measured_kl, n_steps):
    """Test part: keeps beta and records the KL and sample count the loop feeds the controller."""
    _MEASURED.append((float(measured_kl), int(n_steps)))
    return coef


def test_the_controller_is_fed_the_per_sequence_kl(tmp_path):
    """Ziegler et al.'s KL target is in nats per sequence, so the loop feeds controllers the mean
    over sequences of the summed per-token KL (all ranks), and the number of sequences. With the
    whole sampled batch trained on (no filter) and the same mask, that is the per-token KL times
    the mean response length: kl_seq = sum(kl) / n_seqs = (sum(kl) / n_tokens) * (n_tokens / n_seqs)."""
    _MEASURED.clear()
    spec = os.path.join(REPO, "registry", "ppo.gin")
    rows = run(
        tmp_path, spec, ["Algorithm.kl_controller = @kl_controller.test_recorder", "train.eval_every = 100"]
    )
    # (the spec's construction probes the part once with made-up numbers first)
    assert _MEASURED[-len(rows) :] == [(r["kl_seq"], r["update_seqs"]) for r in rows]
    for r in rows:
        assert r["update_seqs"] == 4 * 1  # prompts_per_step x group size 1
        assert r["kl_seq"] == pytest.approx(r["kl"] * r["response_len"], rel=1e-9, abs=1e-15)
        # the exact KL in the same two units (the x-axis of over-optimisation curves)
        assert r["kl_exact_seq"] == pytest.approx(r["kl_exact"] * r["response_len"], rel=1e-9, abs=1e-15)
    assert any(abs(r["kl_seq"]) > 2 * abs(r["kl"]) > 0 for r in rows)  # the two units differ here


@register("clip", "test_nan_loss")
def nan_clip(logp, old_logp, adv, mask, *, rollout_logp=None):
    """Test part: plain PG plus a NaN on every token (e.g. an overflowed ratio)."""
    loss = -torch.exp(logp - old_logp) * adv * mask
    z = torch.zeros_like(mask)
    return loss + float("nan"), {"clip_low": z, "clip_high": z, "approx_kl": z}


@pytest.mark.slow
def test_non_finite_loss_never_reaches_the_optimizer(tmp_path):
    spec = os.path.join(REPO, "registry", "reinforce.gin")
    out = tmp_path / "run"
    before = {k: v.clone() for k, v in _policy_after(tmp_path, spec, 0).items()}
    rows = run(
        tmp_path,
        spec,
        ["Algorithm.clip = @clip.test_nan_loss", "train.steps = 3", "train.checkpoint_every = 1"],
    )
    # Every step was skipped and counted; the run went on.
    assert [r["skipped_steps"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["reward_mean"]) for r in rows)
    # ... and the weights never moved: the NaN never reached the optimizer.
    after = _policy_after(tmp_path, spec, 3, out=out)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_the_exact_kl_from_the_sampler_equals_the_policy_forwards_and_changes_no_training(
    tmp_path, monkeypatch, kl_sources
):
    """kl_exact reads π_θ from the distributions the HF sampler drew from (on-policy: the same weights)
    instead of a second, no-grad policy forward. Against the same run with that forward forced (the
    fallback for vLLM, async and large vocabularies): the weights and every other metric bit-identical
    (the metric cannot touch training), kl_exact equal to float error."""
    from polgrad.rollout import hf

    used = kl_sources
    spec = os.path.join(REPO, "registry", "ppo.gin")  # KL in the reward, a critic, 2 minibatches
    kept = run(tmp_path, spec, name="kept")
    assert used == [True] * 3  # one exact KL per step, each from the sampler's distributions
    used.clear()
    monkeypatch.setattr(hf, "MAX_KEPT_DISTRIBUTION", 0)  # too large to keep: the policy forward
    forward = run(tmp_path, spec, name="forward")
    assert used == [False] * 3
    exact = {"kl_exact", "kl_exact_seq"}
    strip = [{k: v for k, v in r.items() if k not in exact} for r in deterministic(kept)]
    assert strip == [{k: v for k, v in r.items() if k not in exact} for r in deterministic(forward)]
    for a, b in zip(kept, forward, strict=True):
        # per-token KL up to ~1e-2 nat here; a KV-cached decode and a full forward differ by ~1e-7
        assert a["kl_exact"] == pytest.approx(b["kl_exact"], rel=0, abs=1e-6)
        assert a["kl_exact_seq"] == pytest.approx(b["kl_exact_seq"], rel=0, abs=1e-5)  # x ~10 tokens
    assert max(r["kl_exact"] for r in forward) > 1e-4  # the policy moved: a KL to compare
    w_kept, w_forward = (
        _policy_after(tmp_path, spec, 3, tmp_path / "kept"),
        _policy_after(tmp_path, spec, 3, tmp_path / "forward"),
    )
    assert w_kept.keys() == w_forward.keys()
    assert all(torch.equal(w_kept[k], w_forward[k]) for k in w_kept)


def _policy_after(tmp_path, spec, steps: int, out=None) -> dict:
    """The policy weights of a run's last DeepSpeed checkpoint, or of the start when steps == 0."""
    from polgrad import models, pretrain

    if steps == 0:
        gin.clear_config()
        parse_config([spec], FAST)
        path = pretrain.warm_start(
            "add",
            {"digits": 2, "reverse": False, "pad": False, "partial": False, "eval_fraction": 0.1},
            None,
            seed=0,
            progress=False,
        )
        return {k: v.detach().clone() for k, v in models.load_policy(path).state_dict().items()}
    files = glob.glob(str(out / "checkpoints" / "policy" / f"step{steps}" / "*model_states.pt"))
    state = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    return {k: v for k, v in state.items()}


@pytest.mark.slow
def test_grpo_beats_its_warm_start_on_held_out_prompts(tmp_path):
    """Smoke test of learning: GRPO on the base task, fixed seed, 40 steps of 8 prompts x 8, then
    greedy accuracy on every held-out prompt against the warm start's on the same prompts, paired
    (tests/learning.py: an exact sign test, so the check holds whatever warm start the machine's CPU
    produces; a fixed rise of the train reward did not)."""
    from learning import assert_learns

    rows = run(
        tmp_path,
        os.path.join(REPO, "registry", "grpo.gin"),
        [
            "train.steps = 40",
            "train.prompts_per_step = 8",
            "train.eval_every = 100",
            "train.eval_size = None",
        ],
    )
    assert len(rows) == 40 and all(r["skipped_steps"] == 0 for r in rows)
    assert_learns(tmp_path / "run")


def test_step_counts_are_global_in_the_loop():
    """The loop's denominators come from all micro-batches of a step (not each micro-batch)."""
    masks = [torch.ones(2, 3), torch.ones(1, 3)]
    c = StepCounts.of_step(masks)
    assert (c.num_tokens, c.num_seqs) == (9.0, 3.0)


def test_bad_train_binding_is_one_line(tmp_path):
    from polgrad.errors import ConfigError

    gin.clear_config()
    parse_config([os.path.join(REPO, "registry", "grpo.gin")], ["train.reward_source = 'oracle'"])
    with pytest.raises(ConfigError, match=r"train.reward_source must be one of \('task', 'reward_model'\)"):
        train(str(tmp_path / "x"))


def test_response_lengths_of_right_and_wrong_responses():
    """step_row's response_len_correct / _incorrect: the mean generated length (EOS included) of the
    responses scoring 1.0 and of the others, worked by hand on six samples; None when a kind is absent."""
    from types import SimpleNamespace as NS

    from polgrad.trainer import step_row

    lengths = [2, 4, 3, 7, 5, 1]
    scores = [1.0, 0.0, 1.0, 0.5, float("nan"), 0.0]  # NaN: a faulty reward, counted as wrong
    mask = torch.tensor([[1.0] * n + [0.0] * (8 - n) for n in lengths])

    from polgrad.build import Models, RewardModelScorer
    from polgrad.tasks.rewards import RewardGuard

    def models(score=None):
        return Models(engine=None, tokenizer=None, sampler=None, score=score)

    def row(scores):
        sampled = NS(scores=torch.tensor(scores), rollout=NS(mask=mask), gold_scores=None)
        batch = NS(mask=mask, size=len(scores), ref_logp=None, values=None)
        return step_row(models(), sampled, batch, NS(step=1, kl_coef=0.0, skipped_steps=0), {}, {})

    r = row(scores)
    assert r["response_len_correct"] == pytest.approx((2 + 3) / 2, abs=1e-12)
    assert r["response_len_incorrect"] == pytest.approx((4 + 7 + 5 + 1) / 4, abs=1e-12)
    assert r["response_len"] == pytest.approx(22 / 6, abs=1e-12)
    assert r["train_accuracy"] == pytest.approx(2 / 6, abs=1e-12)
    # a reward-model run: right and wrong by the gold (the verifier), not by the proxy score
    gold = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    proxy = torch.tensor([5.0, -2.0, 3.0, 0.5, 9.0, 1.5])
    sampled = NS(scores=proxy, rollout=NS(mask=mask), gold_scores=gold)
    batch = NS(mask=mask, size=6, ref_logp=None, values=None)
    state = NS(step=1, kl_coef=0.0, skipped_steps=0)
    rm = models(RewardModelScorer(torch.nn.Identity(), RewardGuard()))  # its model never runs here
    r_rm = step_row(rm, sampled, batch, state, {}, {})
    assert r_rm["response_len_correct"] == pytest.approx((4 + 5) / 2, abs=1e-12)
    assert r_rm["response_len_incorrect"] == pytest.approx((2 + 3 + 7 + 1) / 4, abs=1e-12)
    assert r_rm["train_accuracy"] == pytest.approx(4 / 6, abs=1e-12)  # the proxy's, as before
    r = row([0.0] * 6)
    assert r["response_len_correct"] is None and r["response_len_incorrect"] == pytest.approx(
        22 / 6, abs=1e-12
    )
    r = row([1.0] * 6)
    assert r["response_len_incorrect"] is None and r["response_len_correct"] == pytest.approx(
        22 / 6, abs=1e-12
    )


def test_summary_lengths_of_right_and_wrong_responses(tmp_path):
    """summary.json's final_len_correct / final_len_incorrect are the means over the last 10 steps that
    had such responses, len_incorrect_change the last 10 minus the first 10 (worked by hand: wrong
    lengths 1..25 give (16+...+25)/10 - (1+...+10)/10 = 20.5 - 5.5 = 15; right lengths 3 on every
    fifth step, so the last ten such steps average 3); absent when no step had them."""
    from polgrad.summary import summarize

    rows = []
    for step in range(1, 26):
        rows.append(
            {
                "step": step,
                "reward_mean": 0.0,
                "response_len_incorrect": float(step),
                "response_len_correct": 3.0 if step % 5 == 0 else None,
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize(str(tmp_path), 1.0, unstable_skip_frac=1.0)
    assert s["final_len_incorrect"] == pytest.approx(20.5, abs=1e-12)
    assert s["len_incorrect_change"] == pytest.approx(15.0, abs=1e-12)
    assert s["final_len_correct"] == pytest.approx(3.0, abs=1e-12)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:15]))
    s = summarize(str(tmp_path), 1.0, unstable_skip_frac=1.0)
    assert "len_incorrect_change" not in s  # fewer than 20 steps: no change measured
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.0}) + "\n")
    assert not {"final_len_correct", "final_len_incorrect"} & set(
        summarize(str(tmp_path), 1.0, unstable_skip_frac=1.0)
    )
