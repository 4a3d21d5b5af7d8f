"""Async rollouts (train.max_staleness > 0, polgrad/producer.py): the lag rule, exactness, resume, errors.

Fast tests drive a `Producer` directly on a randomly initialised tiny model whose weights are
changed by hand between "steps" (so every version differs); the slow ones train the tiny default
end to end (tests/loop/test_trainer.py's FAST settings).
"""

from __future__ import annotations

import json
import os
import threading

import gin
import pytest
import torch

import polgrad
from polgrad import config, hooks
from polgrad.config import parse_config
from polgrad.errors import ConfigError, PolgradError
from polgrad.io import new_file_mode
from polgrad.models import build_tiny, load_policy
from polgrad.producer import Producer, load_saved
from polgrad.rollout import hf
from polgrad.train import run as train
from polgrad.train_config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "registry", "grpo.gin")
STEPS = 6


# ------------------------------------------------------------------------------------------------
# The producer on its own: a model whose version j has every weight moved by j * 0.02.


@pytest.fixture(scope="module")
def setup():
    task = polgrad.get("task", "add")()
    model, tokenizer = build_tiny(task, seed=3)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    return task, model.eval(), tokenizer, base


def _set_version(model, base, j: int) -> None:
    with torch.no_grad():
        model.load_state_dict({k: v + 0.02 * j if v.is_floating_point() else v for k, v in base.items()})


def _draw(task):
    def draw(step: int):
        seed = 1000 + step
        kwargs = dict(group_size=2, temperature=1.0, top_p=1.0, max_new_tokens=6, greedy_baseline=False)
        return task.examples("train", 3, seed=seed), {**kwargs, "generator_seed": seed}

    return draw


def _reference(model, base, tokenizer, draw, step: int, version: int):
    """What the synchronous loop would sample at `step` with the weights of `version`."""
    _set_version(model, base, version)
    examples, kwargs = draw(step)
    return hf.generate(model, tokenizer, examples, **kwargs)


def _same(a, b) -> bool:
    return torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logp, b.rollout_logp)


def _drive(setup, k: int, start: int = 0, saved=None, stop: int = STEPS, out=None):
    """Run steps start..stop-1 of a producer with max_staleness k; returns (rollouts, staleness per step)."""
    task, model, tokenizer, base = setup
    draw = _draw(task)
    _set_version(model, base, start)
    prod = Producer(model, tokenizer, max_staleness=k, steps=STEPS, start=start, draw=draw, saved=saved)
    rollouts, staleness = {}, {}
    for s in range(start, stop):
        _set_version(model, base, s)  # the trainer's weights at the start of step s: version s
        prod.begin(s, model)
        examples, kwargs = draw(s)
        rollouts[s] = prod.sample(examples, **kwargs)
        staleness[s] = prod._staleness[0]
        if out is not None and s + 1 < STEPS:
            prod.save(out, s + 1)  # the checkpoint after step s
    prod.close()
    return rollouts, staleness


@pytest.mark.cpu_matrix
@pytest.mark.parametrize("k", [0, 1, 2])
def test_step_s_samples_with_the_weights_of_step_s_minus_k(setup, k):
    task, model, tokenizer, base = setup
    rollouts, staleness = _drive(setup, k)
    draw = _draw(task)
    assert staleness == {s: float(min(s, k)) for s in range(STEPS)}
    for s, got in rollouts.items():
        assert _same(got, _reference(model, base, tokenizer, draw, s, max(s - k, 0))), s
        if min(s, k) > 0:  # and not with the current weights (the versions do differ)
            assert not _same(got, _reference(model, base, tokenizer, draw, s, s)), s


def test_saved_versions_let_a_resumed_producer_sample_what_the_uninterrupted_one_did(setup, tmp_path):
    full, _ = _drive(setup, 2, out=str(tmp_path))
    assert sorted(load_saved(str(tmp_path), 3)) == [1, 2]  # steps 3 and 4 sample with versions 1, 2
    assert sorted(load_saved(str(tmp_path), 1)) == [0]
    resumed, staleness = _drive(setup, 2, start=3, saved=load_saved(str(tmp_path), 3))
    assert staleness == {3: 2.0, 4: 2.0, 5: 2.0}
    assert all(_same(resumed[s], full[s]) for s in resumed)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # atomic writes leave no temp file
    # the mode a new file gets (0o666 minus the umask), as every other file of a run folder; mkstemp's
    # 0600 made the saved versions unreadable to the group that reads the rest of the folder
    modes = {p: os.stat(tmp_path / p).st_mode & 0o777 for p in os.listdir(tmp_path) if p.endswith(".pt")}
    assert modes and set(modes.values()) == {new_file_mode()}, modes


def test_a_resume_without_the_saved_versions_says_so_and_samples_from_the_resume_weights(setup, capsys):
    _, staleness = _drive(setup, 2, start=3, saved={})
    assert "without the saved weights of versions [1, 2]" in capsys.readouterr().err
    assert staleness == {3: 0.0, 4: 1.0, 5: 2.0}


def test_an_error_in_the_producer_reaches_the_trainer_as_it_was_and_no_thread_is_left(setup):
    task, model, tokenizer, base = setup
    draw = _draw(task)

    def bad(step):
        examples, kwargs = draw(step)
        return examples, {**kwargs, "group_size": 0}  # generate() refuses it inside the producer

    prod = Producer(model, tokenizer, max_staleness=1, steps=STEPS, start=0, draw=bad)
    prod.begin(0, model)
    examples, kwargs = bad(0)
    with pytest.raises(
        ConfigError, match=r"^generate: group_size \(0\) and max_new_tokens \(6\) must be >= 1$"
    ):
        prod.sample(examples, **kwargs)
    prod.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("polgrad-producer")]


def test_a_round_drawn_ahead_with_other_prompts_is_an_error_not_a_silent_resample(setup):
    """The producer samples step s's first round ahead with the sampler's own prompt stream; the
    trainer's round of that seed asking for other prompts can only be a bug: one line, no resample."""
    task, model, tokenizer, base = setup
    draw = _draw(task)
    prod = Producer(model, tokenizer, max_staleness=1, steps=STEPS, start=0, draw=draw)
    prod.begin(0, model)
    examples, kwargs = draw(0)
    other, _ = draw(1)
    assert other != examples
    with pytest.raises(
        PolgradError, match=r"^step 0: the rollout sampled ahead for seed \d+ has other prompts"
    ):
        prod.sample(other, **kwargs)
    prod.close()


@pytest.mark.cpu_matrix
def test_a_further_sampling_round_is_sampled_from_the_same_stale_version(setup):
    """Dynamic sampling asks for rounds the producer did not queue (another seed): same version v(s)."""
    task, model, tokenizer, base = setup
    draw = _draw(task)
    _set_version(model, base, 0)
    prod = Producer(model, tokenizer, max_staleness=1, steps=STEPS, start=0, draw=draw)
    for s in range(3):
        _set_version(model, base, s)
        prod.begin(s, model)
    examples, kwargs = draw(2)
    extra = prod.sample(examples, **{**kwargs, "generator_seed": 77})
    prod.close()
    _set_version(model, base, 1)
    assert _same(extra, hf.generate(model, tokenizer, examples, **{**kwargs, "generator_seed": 77}))
    assert prod.stale


class _FakeProducer:
    """A producer whose rollouts are sampled with version 0 while the trainer holds version 2."""

    def __init__(self, model, base, tokenizer, stale: bool):
        self.model, self.base, self.tokenizer, self.stale = model, base, tokenizer, stale
        self.rollout = None

    def sample(self, examples, **kwargs):
        _set_version(self.model, self.base, 0 if self.stale else 2)
        self.rollout = hf.generate(self.model, self.tokenizer, examples, **kwargs)
        _set_version(self.model, self.base, 2)  # the trainer's weights when it scores the batch
        return self.rollout


@pytest.mark.parametrize("stale", [True, False])
def test_a_stale_rollout_gets_pi_old_recomputed_with_the_trainers_weights(setup, stale):
    """trainer.collect, the unit where the loop builds old_logp (π_old, from the async sampler's
    `old_logp`): under clip.ppo (no off-policy part), a stale rollout's π_old is the trainer's own
    forward on its tokens, not the sampler's log-probs; a fresh one keeps the sampler's (the same
    weights). Only a slow end-to-end test
    (690 s) caught a loop that kept the sampler's log-probs for stale rollouts."""
    from types import SimpleNamespace

    from polgrad import trainer as trainer_lib
    from polgrad.build import Models
    from polgrad.sampling import AsyncSampler

    task, model, tokenizer, base = setup
    gin.clear_config()
    parse_config(
        [GRPO], ["Algorithm.kl_coef = 0.0", "train.prompts_per_step = 3", "train.max_new_tokens = 6"]
    )
    cfg, algo, _ = config.build()
    assert not algo.needs_rollout_logp  # clip.ppo: only the staleness can ask for the recompute
    fake = _FakeProducer(model, base, tokenizer, stale)
    sampler = AsyncSampler(cfg, algo, task, "unused", model, tokenizer, seed_of=lambda s: s)
    sampler.producer = fake  # the async sampler as built, with a producer whose version is known
    m = Models(engine=SimpleNamespace(module=model), tokenizer=tokenizer, sampler=sampler)
    batch = trainer_lib.collect(cfg, algo, m, task, seed=11)
    mask = fake.rollout.mask.double()
    with torch.no_grad():
        trainers = hf.response_logprobs(model, fake.rollout, temperature=cfg.temperature).double() * mask
    sampler = fake.rollout.rollout_logp.double()
    assert torch.equal(batch.rollout_logp, sampler)  # the behaviour policy's, kept either way
    if stale:
        assert (trainers - sampler).abs().max() > 1e-2  # the versions differ: the test can tell them apart
        assert torch.allclose(batch.old_logp, trainers, rtol=0, atol=1e-6), (
            (batch.old_logp - trainers).abs().max()
        )
    else:
        assert torch.equal(batch.old_logp, sampler)  # no forward spent on a fresh rollout
    gin.clear_config()


def test_phases_opened_in_another_thread_do_not_nest_under_the_trainers():
    seen = []
    with hooks.listen(on_phase=lambda path, dt: seen.append(path)), hooks.phase("sample"):
        worker = threading.Thread(target=_decode_phase)
        worker.start()
        worker.join()
    assert seen == ["decode", "sample"]  # not "sample/decode": the worker's phases are its own


def _decode_phase():
    with hooks.phase("decode"):
        pass


# ------------------------------------------------------------------------------------------------
# Config errors: one line each.


@pytest.mark.parametrize(
    "bindings, message",
    [
        (["train.max_staleness = -1"], "train.max_staleness must be an integer >= 0, got -1"),
        (["train.max_staleness = 1.5"], "train.max_staleness must be an integer >= 0, got 1.5"),
        (
            ["train.steps = 20", "train.max_staleness = 1000000"],
            "train.max_staleness = 1000000 is above train.steps = 20: every rollout would be the starting "
            "policy's; use at most 8 (1 to 8 is the usual range)",
        ),
        (
            ["train.max_staleness = 1", "train.rollout_backend = 'vllm'", "train.zero_stage = 3"],
            "train.max_staleness > 0 with train.rollout_backend = 'vllm' needs train.zero_stage 0, 1 or 2, "
            "got 3 (untested: a resume loads vLLM from the partitioned weights); use 'hf' rollouts at ZeRO-3",
        ),
    ],
)
def test_bad_async_bindings_are_one_line_config_errors(bindings, message):
    parse_config([GRPO], bindings)
    with pytest.raises(ConfigError) as info:
        config.build()
    assert str(info.value) == message


def test_a_staleness_that_leaves_only_the_starting_policy_warns(capsys):
    """Step s samples the weights of step max(s - k, 0), s = 0 .. steps-1: with k >= steps - 1 every
    rollout is the starting policy's, so k = 3 of 4 steps (and k = 4) warn; k = 2 of 4 does not.
    Not an error: a run cut short to be resumed with more train.steps may mean it."""
    for k, warned in ((2, False), (3, True), (4, True)):
        gin.clear_config()
        parse_config([GRPO], ["train.steps = 4", f"train.max_staleness = {k}"])
        config.build()
        err = capsys.readouterr().err
        assert err == (
            f"warning: train.max_staleness = {k} with train.steps = 4: every rollout of these steps samples "
            "the starting policy (use at most 2, or more steps)\n"
            if warned
            else ""
        ), k


def test_a_staleness_above_the_sane_range_warns(capsys):
    """k in (8, steps]: accepted with one warning line (it used to pass silently); k = 8 and the
    synchronous default (k = 0) say nothing."""
    for bindings, warned in (
        (["train.steps = 20", "train.max_staleness = 9"], True),
        (["train.steps = 20", "train.max_staleness = 8"], False),
        (["train.steps = 20"], False),
    ):
        gin.clear_config()
        parse_config([GRPO], bindings)
        config.build()
        err = capsys.readouterr().err
        assert err == (
            "warning: train.max_staleness = 9 is above 8: the run trains on very stale rollouts "
            "(see polgrad/train_config.py)\n"
            if warned
            else ""
        ), bindings


def test_async_rollouts_are_accepted_with_either_backend():
    for backend in ("hf", "vllm"):  # the vLLM engine is the producer's (tests/rollout/test_async_vllm.py)
        gin.clear_config()
        parse_config([GRPO], ["train.max_staleness = 1", f"train.rollout_backend = '{backend}'"])
        cfg, _, _ = config.build()
        assert (cfg.asynchronous, cfg.rollout_backend) == (True, backend)


def test_async_is_refused_for_a_preference_spec_and_accepted_at_world_size_two_and_zero3():
    parse_config([os.path.join(REPO, "registry", "dpo.gin")], ["train.max_staleness = 1"])
    with pytest.raises(
        ConfigError, match=r"^train.max_staleness = 1 \(asynchronous rollouts\): dpo samples nothing"
    ):
        config.build()
    gin.clear_config()
    parse_config([GRPO], ["train.max_staleness = 1"])
    cfg, _, _ = config.build()
    assert (cfg.asynchronous, cfg.max_staleness) == (True, 1)
    config.check_world_size(cfg, 2)  # each rank's producer samples its own prompts (test_async_ranks.py)
    gin.clear_config()
    parse_config([GRPO], ["train.max_staleness = 1", "train.zero_stage = 3"])
    assert config.build()[0].zero_stage == 3  # the producer snapshots the gathered weights
    gin.clear_config()
    parse_config([GRPO], [])
    cfg, _, _ = config.build()
    assert (cfg.asynchronous, cfg.max_staleness) == (False, 0)  # the default: synchronous
    config.check_world_size(cfg, 2)


def test_the_removed_async_switch_says_what_replaced_it():
    """train.async_rollouts was a second switch for what train.max_staleness says alone."""
    with pytest.raises(ConfigError) as info:
        parse_config([GRPO], ["train.async_rollouts = True"])
    assert (
        "train.async_rollouts no longer exists: asynchronous rollouts are one setting, train.max_staleness"
        in str(info.value)
    )


# ------------------------------------------------------------------------------------------------
# End to end.

FAST = [
    "train.steps = 4",
    "train.prompts_per_step = 4",
    "train.eval_every = 100",
    "train.eval_size = 16",
    "train.checkpoint_every = 2",
    "train.progress = False",
]
TIMING = {"time_gen", "time_ref", "time_values", "time_adv", "time_update", "tokens_per_s", "time_s"}
TIMING |= {"peak_mem_mb", "rollout_wait_s"}
ASYNC_KEYS = {
    "staleness_mean",
    "staleness_max",
    "is_ratio_mean",
    "is_ratio_max",
    "is_ratio_min",
    "rollout_wait_s",
}


def _train(tmp_path, name, bindings, spec=GRPO, **kw):
    gin.clear_config()
    parse_config([spec], [*FAST, *bindings])
    out = tmp_path / name
    train(str(out), **kw)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows], load_policy(
        str(out / "final")
    ).state_dict()


def _equal_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.cpu_matrix
@pytest.mark.slow
def test_async_with_staleness_zero_is_the_synchronous_run_exactly(tmp_path, monkeypatch):
    """The producer at k = 0 (forced: train.max_staleness = 0 is the synchronous loop) samples what the
    synchronous loop samples, bit for bit: a staleness grid's k = 0 cell is the synchronous baseline
    whichever of the two ran it."""
    sync, w_sync = _train(tmp_path, "sync", [])
    monkeypatch.setattr(TrainConfig, "asynchronous", property(lambda self: True))
    asy, w_async = _train(tmp_path, "async", ["train.max_staleness = 0"])
    assert [r["staleness_max"] for r in asy] == [0.0] * 4
    assert [set(r) - set(s) for r, s in zip(asy, sync, strict=True)] == [ASYNC_KEYS - TIMING] * 4
    assert [{k: r[k] for k in s} for r, s in zip(asy, sync, strict=True)] == sync
    assert _equal_weights(w_sync, w_async)


@pytest.mark.slow
def test_the_exact_kl_reads_the_sampling_distributions_of_fresh_rollouts_only(
    tmp_path, monkeypatch, kl_sources
):
    """A stale rollout's sampling distributions are an older policy's: the exact KL (of the trainer's
    policy) then runs the policy forward. With k = 2, step 0 is fresh, steps 1-3 stale; the KL equals
    that of the same run with every distribution dropped (float error on the fresh step only)."""
    from polgrad.rollout import hf

    used = kl_sources
    kept, _ = _train(tmp_path, "kept", ["train.max_staleness = 2"])
    assert used == [True, False, False, False]
    monkeypatch.setattr(hf, "MAX_KEPT_DISTRIBUTION", 0)
    forward, _ = _train(tmp_path, "forward", ["train.max_staleness = 2"])
    assert [r["kl_exact"] for r in kept[1:]] == [r["kl_exact"] for r in forward[1:]]  # the same forward
    assert kept[0]["kl_exact"] == pytest.approx(forward[0]["kl_exact"], rel=0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("clip", ["ppo", "icepop"])
def test_staleness_two_logs_its_lag_and_keeps_the_behaviour_logprobs(tmp_path, clip):
    bind = ["train.max_staleness = 2", f"Algorithm.clip = @clip.{clip}"]
    rows, _ = _train(tmp_path, "k2", bind)
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    assert [r["staleness_mean"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    # Stale rollouts: the trainer recomputes old_logp (pi_old, its own weights) even for clip.ppo,
    # which ignores the behaviour log-probs kept beside it; they differ, so w = pi_old/pi_behaviour != 1.
    for r in rows[1:]:
        assert r["is_ratio_max"] > 1.0 > r["is_ratio_min"] > 0.0, r
    if clip == "ppo":  # step 0 is fresh: its sampling log-probs are pi_old's and are reused (w = 1)
        assert (rows[0]["is_ratio_max"], rows[0]["is_ratio_min"]) == (1.0, 1.0)
    if clip == "icepop":
        assert all(r["clip/is_weight"] > 0.0 and 0.0 <= r["clip/is_masked"] < 1.0 for r in rows)


@pytest.mark.slow
def test_a_resumed_async_run_ends_where_the_uninterrupted_one_ends(tmp_path):
    bind = ["train.max_staleness = 2", "Algorithm.clip = @clip.tis"]
    full, w_full = _train(tmp_path, "full", bind)
    _train(tmp_path, "cut", [*bind, "train.steps = 2"])
    resumed, w_resumed = _train(tmp_path, "cut", bind, resume=True)
    assert [r["staleness_max"] for r in resumed] == [0.0, 1.0, 2.0, 2.0]
    strip = {"eval_accuracy"}  # the cut run evaluates at its end
    assert [{k: v for k, v in r.items() if k not in strip} for r in resumed] == [
        {k: v for k, v in r.items() if k not in strip} for r in full
    ]
    assert _equal_weights(w_full, w_resumed)
    assert sorted(load_saved(str(tmp_path / "cut" / "checkpoints" / "sampler"), 2)) == [0, 1]


@pytest.mark.cpu_matrix
@pytest.mark.slow
def test_a_lora_policy_async_with_staleness_zero_is_the_synchronous_lora_run_exactly(tmp_path, monkeypatch):
    """LoRA (rank 8): the producer's copy of the peft model loads each version's snapshot (backbone and
    adapter) and samples with the policy adapter, as the trainer's module does synchronously."""
    lora = ["train.lora_r = 8", "train.lr = 3e-3"]
    sync, w_sync = _train(tmp_path, "sync", lora)
    monkeypatch.setattr(TrainConfig, "asynchronous", property(lambda self: True))
    asy, w_async = _train(tmp_path, "async", [*lora, "train.max_staleness = 0"])
    assert [{k: r[k] for k in s} for r, s in zip(asy, sync, strict=True)] == sync
    assert _equal_weights(w_sync, w_async)
    assert sync[-1]["kl"] > 1e-6  # the adapter moved: equal runs are not two untrained ones


@pytest.mark.slow
def test_a_lora_policy_trains_with_stale_rollouts(tmp_path):
    rows, _ = _train(tmp_path, "k2", ["train.lora_r = 8", "train.lr = 3e-3", "train.max_staleness = 2"])
    assert [r["staleness_max"] for r in rows] == [0.0, 1.0, 2.0, 2.0]
    for r in rows[1:]:  # the stale adapter's log-probs differ from pi_old's
        assert r["is_ratio_max"] > 1.0 > r["is_ratio_min"] > 0.0, r
