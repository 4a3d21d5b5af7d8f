"""A reward that raises, or returns NaN, inf, None or a non-number, on one sample (issue 14).

`train.reward_errors` decides: 'raise' (one line naming the task, the reward function, the
sample and the problem), 'zero' (scored 0, warned once) or 'skip_group' (the prompt's whole
group leaves the update). The scorer is exercised through `Models.score` (what the loop calls),
the group drop through `Batch.without_faulty_groups`, and the whole loop end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
import time
from types import SimpleNamespace

import gin
import pytest
import torch

from polgrad import config, pretrain, trainer
from polgrad.batch import Batch
from polgrad.build import Models, RewardModelScorer, TaskScorer
from polgrad.errors import PolgradError
from polgrad.registry import register
from polgrad.tasks.base import Example
from polgrad.tasks.rewards import RewardGuard
from polgrad.tasks.synthetic import Add
from polgrad.train import run as run_training

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "registry", "grpo.gin")

# What the faulty reward does on a prompt whose first digit is odd, and whether it is faulty at all.
FAULT = {"kind": "raise", "on": True}
PRODUCE = {
    "raise": lambda: 1 / 0,
    "nan": lambda: float("nan"),
    "inf": lambda: float("inf"),
    "none": lambda: None,
    "str": lambda: "abc",
}
PROBLEM = {  # what the message must say, as a user would read it
    "raise": "raised ZeroDivisionError: division by zero",
    "nan": "returned NaN",
    "inf": "returned inf",
    "none": "returned None",
    "str": "returned a non-number 'abc' (str)",
}


@dataclasses.dataclass(frozen=True)
class FaultyAdd(Add):
    """task.add whose reward is faulty (FAULT['kind']) on prompts that start with an odd digit."""

    name: str = dataclasses.field(default="test_faulty", init=False)

    def reward(self, example, response):
        if FAULT["on"] and example.prompt[0] in "13579":
            return PRODUCE[FAULT["kind"]]()
        return super().reward(example, response)


@register("task", "test_faulty")
def faulty_task(*, digits: int = 2) -> FaultyAdd:
    return FaultyAdd(digits=digits)


RELEASE = threading.Event()  # set at the end of a hang test: the abandoned reward thread returns


@dataclasses.dataclass(frozen=True)
class HangingAdd(Add):
    """task.add whose reward hangs (up to 60 s) on prompts that start with an odd digit."""

    name: str = dataclasses.field(default="test_hanging", init=False)

    def reward(self, example, response):
        if FAULT["on"] and example.prompt[0] in "13579":
            RELEASE.wait(60)
        return super().reward(example, response)


@register("task", "test_hanging")
def hanging_task(*, digits: int = 2) -> HangingAdd:
    return HangingAdd(digits=digits)


@pytest.fixture
def release_hung_rewards():
    RELEASE.clear()
    yield
    RELEASE.set()


def _rollout(prompts_and_texts):
    return SimpleNamespace(
        examples=[Example(p, "0") for p, _ in prompts_and_texts], texts=[t for _, t in prompts_and_texts]
    )


ROLLOUT = _rollout([("22+4=", "26"), ("13+5=", "18"), ("40+1=", "41"), ("71+1=", "99")])


def _models(rewards: RewardGuard | None = None, reward_model=None) -> Models:
    """The run's Models as far as scoring goes: the task's verifier, or `reward_model`, checked by
    `rewards` (default: 'raise'), as `build_models` makes them."""
    rewards = rewards or RewardGuard()
    score = TaskScorer(rewards) if reward_model is None else RewardModelScorer(reward_model, rewards)
    return Models(engine=None, tokenizer=None, sampler=None, rewards=rewards, score=score)


# ----------------------------------------------------------------------------- 'raise' (default)
@pytest.mark.parametrize("kind", sorted(PRODUCE))
def test_a_faulty_reward_stops_with_one_line_naming_task_function_sample_and_problem(kind):
    FAULT.update(kind=kind, on=True)
    m = _models()  # the default policy: 'raise'
    with pytest.raises(PolgradError) as err:
        m.score(ROLLOUT, FaultyAdd())
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(
        "reward of task.test_faulty (test_reward_errors.FaultyAdd.reward) failed on prompt '13+5=', "
        f"response '18': {PROBLEM[kind]} (and 1 more in this batch); "
    )
    assert "train.reward_errors = 'zero'" in msg and "'skip_group'" in msg


def test_a_long_sample_is_truncated_in_the_message():
    FAULT.update(kind="nan", on=True)
    with pytest.raises(PolgradError) as err:
        _models().score(_rollout([("1" + "2" * 500 + "=", "7" * 500)]), FaultyAdd())
    assert "'1" + "2" * 59 + "...'" in str(err.value) and len(str(err.value)) < 400


def test_a_reward_model_that_gives_nan_is_named(monkeypatch):
    from polgrad.rollout import hf as hf_rollout

    monkeypatch.setattr(hf_rollout, "rollout_scores", lambda rm, r: torch.tensor([0.5, math.nan, 0.25, -1.0]))
    m = _models(reward_model=torch.nn.Identity())
    m.rewards.reward_model = "the reward model /tmp/rm"
    with pytest.raises(
        PolgradError,
        match=r"^reward of the reward model /tmp/rm failed on prompt '13\+5=', response '18': returned NaN;",
    ):
        m.score(ROLLOUT, FaultyAdd())
    m.rewards.policy = "zero"
    assert m.score(ROLLOUT, FaultyAdd()).tolist() == [0.5, 0.0, 0.25, -1.0]


# ----------------------------------------------------------------------------- train.reward_timeout_s
@pytest.mark.parametrize("policy", ["raise", "zero", "skip_group"])
def test_a_reward_over_its_time_limit_stops_in_one_line_naming_task_function_and_limit(
    release_hung_rewards, policy
):
    """A hung reward used to hang the run forever (only Sweep.timeout_s stopped a sweep's cell);
    with train.reward_timeout_s it stops within the limit, whatever train.reward_errors says."""
    FAULT["on"] = True
    m = _models(rewards=RewardGuard(policy, timeout_s=0.3))
    t0 = time.monotonic()
    with pytest.raises(PolgradError) as err:
        m.score(ROLLOUT, HangingAdd())
    assert time.monotonic() - t0 < 5
    assert str(err.value) == (
        "reward of task.test_hanging (test_reward_errors.HangingAdd.reward) did not return within "
        "train.reward_timeout_s = 0.3 s on prompt '13+5=', response '18'; fix the reward (does it hang on "
        "this sample?) or raise train.reward_timeout_s"
    )


def test_rewards_within_the_limit_are_the_same_scores_and_faults():
    """With a limit the reward runs in the guard's worker thread: same values, same fault handling."""
    FAULT.update(kind="raise", on=True)
    plain, timed = RewardGuard("zero"), RewardGuard("zero", timeout_s=30)
    assert torch.equal(
        plain.task_scores(FaultyAdd(), ROLLOUT.examples, ROLLOUT.texts),
        timed.task_scores(FaultyAdd(), ROLLOUT.examples, ROLLOUT.texts),
    )
    assert plain.take() == timed.take() == 2


def test_a_reward_raising_system_exit_under_a_limit_is_a_fault_not_a_hang():
    """SystemExit is no Exception: in the worker thread it used to end the thread silently, and the
    run then reported the call as 'did not return within' the limit. It is the sample's fault."""

    class ExitingAdd(FaultyAdd):
        def reward(self, example, response):
            raise SystemExit(3)

    guard = RewardGuard("zero", timeout_s=5)
    t0 = time.monotonic()
    scores = guard.task_scores(ExitingAdd(), ROLLOUT.examples, ROLLOUT.texts)
    assert time.monotonic() - t0 < 5 and scores.tolist() == [0.0] * len(ROLLOUT.texts)
    assert guard.take() == len(ROLLOUT.texts)
    with pytest.raises(PolgradError, match=r"raised SystemExit"):
        RewardGuard("raise", timeout_s=5).task_scores(ExitingAdd(), ROLLOUT.examples, ROLLOUT.texts)


@pytest.mark.parametrize("value", ["0", "-1.0", "'60'", "True", "float('inf')"])
def test_a_bad_reward_timeout_is_a_one_line_config_error(value):
    gin.clear_config()
    config.parse_config([GRPO], [f"train.reward_timeout_s = {value}"] if "inf" not in value else [])
    if "inf" in value:
        gin.bind_parameter("train.reward_timeout_s", float("inf"))
    with pytest.raises(PolgradError) as err:
        config.build()
    assert str(err.value).startswith(
        "train.reward_timeout_s must be a number of seconds > 0 or None (no limit)"
    )
    gin.clear_config()


def test_the_warm_start_stops_on_a_hung_reward_within_its_limit(tmp_path, release_hung_rewards):
    """The SFT warm start scores its probe with the task's reward too: train.reward_timeout_s reaches
    it (polgrad.train with a hanging reward hung there for good, before any RL step)."""
    FAULT["on"] = True
    t0 = time.monotonic()
    with pytest.raises(
        PolgradError,
        match=r"^reward of task.test_hanging .* did not return within "
        r"train.reward_timeout_s = 0.5 s on prompt '[13579]",
    ):
        pretrain.warm_start(
            "test_hanging", {}, None, sft_steps=0, cache_dir=tmp_path, progress=False, reward_timeout_s=0.5
        )
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_the_loop_stops_on_a_hung_reward_within_its_limit(
    tmp_path, release_hung_rewards, faults_after_the_warm_start
):
    """End to end: the run's guard gets train.reward_timeout_s (the reward is sound in the warm start)."""
    gin.clear_config()
    config.parse_config([GRPO], [*FAST, "train.task = @task.test_hanging", "train.reward_timeout_s = 1.0"])
    with pytest.raises(
        PolgradError,
        match=r"^reward of task.test_hanging \(test_reward_errors.HangingAdd.reward\) "
        r"did not return within train.reward_timeout_s = 1 s on prompt '[13579]",
    ):
        run_training(str(tmp_path / "run"))


# ----------------------------------------------------------------------------- 'zero'
def test_zero_scores_the_faulty_samples_0_warns_once_and_counts_them(capsys):
    FAULT.update(kind="none", on=True)
    m = _models(rewards=RewardGuard("zero", "test_faulty"))
    rollout = _rollout([("22+4=", "26"), ("13+5=", "18"), ("40+1=", "41"), ("71+1=", "72")])
    rollout.examples = [
        Example(p, t)
        for p, t in zip(["22+4=", "13+5=", "40+1=", "71+1="], ["26", "18", "0", "0"], strict=True)
    ]
    assert m.score(rollout, FaultyAdd()).tolist() == [1.0, 0.0, 0.0, 0.0]  # rows 1 and 3 faulty
    assert m.score(rollout, FaultyAdd()).tolist() == [1.0, 0.0, 0.0, 0.0]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: reward of task.test_faulty")
    assert "returned None; scored 0" in err[0]
    assert m.rewards.take() == 4 and m.rewards.take() == 0  # per call of take: since the last one


# ----------------------------------------------------------------------------- 'skip_group'
def _batch(scores, groups):
    b = len(scores)
    return Batch(
        mask=torch.ones(b, 3, dtype=torch.float64),
        group_ids=torch.tensor(groups),
        old_logp=torch.zeros(b, 3, dtype=torch.float64),
        scores=torch.tensor(scores, dtype=torch.float64),
    )


def test_skip_group_drops_the_whole_group_before_any_group_statistic():
    FAULT.update(kind="raise", on=True)
    m = _models(rewards=RewardGuard("skip_group", "test_faulty"))
    rollout = _rollout([("22+4=", "1"), ("24+4=", "28"), ("13+5=", "18"), ("42+1=", "43")])
    rollout.examples = [
        Example(p, a)
        for p, a in zip(["22+4=", "24+4=", "13+5=", "42+1="], ["26", "28", "18", "43"], strict=True)
    ]
    scores = m.score(rollout, FaultyAdd())
    assert scores[[0, 1, 3]].tolist() == [0.0, 1.0, 1.0] and math.isnan(scores[2])
    # groups of 2: rows 0-1 are group 0, rows 2-3 group 1 (its row 3 is fine but goes too)
    kept = _batch(scores.tolist(), [0, 0, 1, 1]).without_faulty_groups()
    assert kept.group_ids.tolist() == [0, 0] and kept.scores.tolist() == [0.0, 1.0]
    # GRPO's group statistics see only the kept group: advantages are those of group 0 alone
    gin.clear_config()
    config.parse_config([GRPO], ["Algorithm.group_size = 2", "Algorithm.kl_coef = 0.0"])
    _, algo, _ = config.build()
    adv = algo.prepare(kept, kl_coef=0.0)[0].adv
    alone = algo.prepare(_batch([0.0, 1.0], [0, 0]), kl_coef=0.0)[0].adv
    assert torch.isfinite(adv).all() and torch.equal(adv, alone)


def test_a_faulty_greedy_baseline_drops_its_group_too():
    batch = dataclasses.replace(
        _batch([1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1]),
        baseline_scores=torch.tensor([0.0, 0.0, math.nan, math.nan]),
    )
    assert batch.without_faulty_groups().group_ids.tolist() == [0, 0]


def test_every_rank_keeps_as_many_groups_as_the_rank_with_the_fewest(monkeypatch):
    batch = _batch([0.0] * 6, [0, 0, 1, 1, 2, 2])
    assert trainer.same_groups_on_every_rank(batch) is batch  # world size 1: unchanged
    monkeypatch.setattr(trainer.collective, "all_min", lambda t: torch.tensor(2.0))  # another rank has 2
    assert trainer.same_groups_on_every_rank(batch).group_ids.tolist() == [0, 0, 1, 1]


# ----------------------------------------------------------------------------- the loop, end to end
FAST = [
    "train.task = @task.test_faulty",
    "train.sft_steps = 0",
    "train.steps = 3",
    "train.prompts_per_step = 4",
    "train.eval_every = 3",
    "train.eval_size = 16",
    "train.checkpoint_every = 100",
    "train.progress = False",
]


@pytest.fixture
def faults_after_the_warm_start(monkeypatch):
    """The reward is sound during the (cached, untrained) warm start and faulty afterwards."""
    original = pretrain.warm_start

    def warm_start(*args, **kwargs):
        FAULT["on"] = False
        try:
            return original(*args, **kwargs)
        finally:
            FAULT["on"] = True

    monkeypatch.setattr(pretrain, "warm_start", warm_start)
    yield
    FAULT["on"] = True


@pytest.mark.slow
def test_the_loop_stops_on_a_faulty_reward_with_the_one_line_message(tmp_path, faults_after_the_warm_start):
    FAULT["kind"] = "nan"
    gin.clear_config()
    config.parse_config([GRPO], FAST)
    with pytest.raises(
        PolgradError, match=r"^reward of task.test_faulty \(test_reward_errors.FaultyAdd.reward\) "
    ):
        run_training(str(tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["zero", "skip_group"])
def test_the_loop_goes_on_past_faulty_rewards_and_counts_them(tmp_path, faults_after_the_warm_start, policy):
    FAULT["kind"] = "raise"
    gin.clear_config()
    config.parse_config([GRPO], [*FAST, f"train.reward_errors = '{policy}'"])
    summary = run_training(str(tmp_path / "run"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    errors = [r["reward_errors"] for r in rows]
    assert sum(errors) > 0 and summary["reward_errors"] == sum(errors)
    assert all(math.isfinite(r["reward_mean"]) for r in rows)
    # 4 prompts x 8 samples; a faulty prompt's 8 samples are all faulty, and with 'skip_group' its
    # group is not trained on
    trained = [32 - e if policy == "skip_group" else 32 for e in errors]
    assert [r["update_seqs"] for r in rows] == trained
    assert summary["status"] == "ok"


@pytest.mark.slow
def test_warm_start_time_is_reported_apart_from_the_rl_wall_time(tmp_path, monkeypatch):
    """warm_start_s is the time in polgrad.pretrain; wall_time_s and time_s leave it out."""
    original = pretrain.warm_start

    def slow_warm_start(*args, **kwargs):
        time.sleep(3.0)
        return original(*args, **kwargs)

    monkeypatch.setattr(pretrain, "warm_start", slow_warm_start)
    FAULT["on"] = False
    gin.clear_config()
    config.parse_config([GRPO], FAST)
    t0 = time.time()
    try:
        summary = run_training(str(tmp_path / "run"))
    finally:
        FAULT["on"] = True
    elapsed = time.time() - t0
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert summary["warm_start_s"] >= 3.0
    assert summary["wall_time_s"] <= elapsed - 3.0
    assert rows[-1]["time_s"] <= elapsed - 3.0
    assert summary["wall_time_s"] + summary["warm_start_s"] == pytest.approx(elapsed, abs=1.0)


@pytest.mark.parametrize(
    "value, expected",
    [
        (1, (1.0, None)),
        (True, (1.0, None)),
        (torch.tensor(0.25), (0.25, None)),
        ("1.0", (math.nan, "returned a non-number '1.0' (str)")),
        ([1.0], (math.nan, "returned a non-number [1.0] (list)")),
        (torch.tensor([1.0, 2.0]), (math.nan, "returned a non-number tensor([1., 2.]) (Tensor)")),
        (-math.inf, (math.nan, "returned -inf")),
    ],
)
def test_what_counts_as_a_reward(value, expected):
    from polgrad.tasks.rewards import check_value

    got = check_value(value)
    assert got[1] == expected[1] and (got[0] == expected[0] or math.isnan(got[0]) and math.isnan(expected[0]))
