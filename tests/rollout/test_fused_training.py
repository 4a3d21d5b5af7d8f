"""The fused log-prob path in the model code (polgrad/rollout/hf.py `response_logprobs`): the same
values and gradients as the plain full-logits path through every wrapper a run uses (DeepSpeed engine,
peft LoRA policy, the adapter-disabled LoRA reference), a whole run whose chunks really split gives
the plain run's metrics, and one log-prob-and-backward at a large vocabulary adds at most one fp32
copy of the logits to the process's peak memory (the plain path adds several).

Tolerances: both paths run the same fp32 ops per row (projection, / temperature, log_softmax,
gather, -sum p log p); only the projection's matrix product may be blocked differently for a chunk
of rows than for the whole batch, which reorders sums of H = 128 fp32 products. Each logit then moves
by at most ~H u max|h_i w_i| (u = 2^-24), about 1e-5 at the tiny model's O(1) products, and a
log-prob or entropy by at most twice its largest logit error. So 1e-5 absolute (plus 1e-5 relative
for gradients, summed over the batch) is the bound; a wrong row, target, temperature or missing
adapter moves these values by >= 1e-3.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import gin
import pytest
import torch

from polgrad import models
from polgrad.components import logit_rows
from polgrad.registry import get
from polgrad.rollout import fused_logprobs, hf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5


def _plain(monkeypatch):
    """Force the plain path (no family is fused)."""
    monkeypatch.setattr(fused_logprobs, "FUSED_MODEL_TYPES", frozenset())


def _logp_and_grads(model, rollout, temperature):
    model.zero_grad(set_to_none=True)
    out = hf.response_logprobs(model, rollout, temperature=temperature, with_entropy=True)
    m = rollout.mask
    # a loss that weights log-probs and entropies differently, so both gradients are checked
    ((out.logp * m).sum() * 0.7 - (out.entropy * m).sum() * 0.3).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logp.detach() * m, out.entropy.detach() * m, grads


def _compare(a, b):
    for x, y in zip(a[:2], b[:2], strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=TOL)
    assert a[2].keys() == b[2].keys() and a[2]
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], rtol=TOL, atol=TOL, msg=name)


@pytest.mark.cpu_matrix  # fused vs plain kernels: the same numbers under every ISA
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_and_plain_paths_give_the_same_logprobs_entropy_and_gradients(tiny, monkeypatch, temperature):
    """The tiny model (tied embeddings), chunks of 5 rows (the rollout has 16 x 12): values and the
    gradient of every parameter, the tied embedding's included."""
    model, rollout = tiny
    model = copy.deepcopy(model)
    assert fused_logprobs.output_projection(model) is model.lm_head  # the fused path is taken
    monkeypatch.setattr(logit_rows, "CHUNK_ELEMENTS", 5 * model.config.vocab_size)
    fused = _logp_and_grads(model, rollout, temperature)
    _plain(monkeypatch)
    assert fused_logprobs.output_projection(model) is None
    plain = _logp_and_grads(model, rollout, temperature)
    _compare(fused, plain)
    # the sampler's own log-probs are the same numbers (the on-policy ratio starts at 1)
    if temperature == 1.0:
        torch.testing.assert_close(fused[0], rollout.rollout_logp * rollout.mask, rtol=0, atol=TOL)


@pytest.mark.cpu_matrix  # fused vs plain kernels: the same numbers under every ISA
def test_the_fused_path_goes_through_the_engine_and_peft(tiny, monkeypatch):
    """A DeepSpeed engine (ZeRO-0), a peft LoRA policy and its adapter-disabled reference: each finds
    the output projection, and gives the plain path's numbers (the LoRA policy's own, with its
    adapter moved off zero so that a skipped adapter would show)."""
    from polgrad import distributed as dist_lib
    from polgrad.models import lora

    model, rollout = tiny
    engine = dist_lib.make_engine(copy.deepcopy(model), lr=1e-4, zero_stage=0, micro_batch_size=16,
                                  grad_accum=1, bf16=False, grad_clip=1.0)  # fmt: skip
    config = lora.lora_config(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"], dropout=0.0)
    policy = lora.add_policy_adapter(copy.deepcopy(model), config)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    reference = lora.AdapterDisabled(policy)
    monkeypatch.setattr(logit_rows, "CHUNK_ELEMENTS", 7 * model.config.vocab_size)
    for wrapped in (engine, policy, reference):
        assert fused_logprobs.output_projection(wrapped) is not None, type(wrapped).__name__
    fused = [hf.response_logprobs(w, rollout, with_entropy=True) for w in (engine, policy, reference)]
    _plain(monkeypatch)
    plain = [hf.response_logprobs(w, rollout, with_entropy=True) for w in (engine, policy, reference)]
    m = rollout.mask.bool()
    for f, p in zip(fused, plain, strict=True):
        torch.testing.assert_close(f.logp[m], p.logp[m], rtol=0, atol=TOL)
        torch.testing.assert_close(f.entropy[m], p.entropy[m], rtol=0, atol=TOL)
    assert (fused[1].logp - fused[2].logp)[m].abs().max() > 1e-3  # the adapter is in the policy's numbers


def test_logits_within_one_chunk_take_the_plain_path(tiny, monkeypatch):
    """At the default chunk the tiny model's logits (16 tokens) fit one chunk: the plain path, so its
    runs are bit for bit what they were before the fused path; one row past the chunk fuses."""
    model, rollout = tiny
    head = fused_logprobs.output_projection(model)
    rows = rollout.response_ids.numel()
    assert not fused_logprobs.fuses(head, rows)
    calls, real = [], fused_logprobs.token_logprobs
    monkeypatch.setattr(fused_logprobs, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    hf.response_logprobs(model, rollout, with_entropy=True)
    assert not calls
    monkeypatch.setattr(logit_rows, "CHUNK_ELEMENTS", (rows - 1) * head.out_features)
    assert fused_logprobs.fuses(head, rows)
    hf.response_logprobs(model, rollout, with_entropy=True)
    assert calls == [1]


def test_models_the_fused_path_cannot_serve_take_the_plain_one(tiny):
    """A family outside FUSED_MODEL_TYPES, and an output projection that is not a plain Linear (LoRA on
    the output layer), keep the plain path: correct whatever the model computes after its hidden
    states."""
    model, _ = tiny
    other = copy.deepcopy(model)
    other.config.model_type = "gemma2"  # soft-caps its logits after the projection
    assert fused_logprobs.output_projection(other) is None
    from polgrad.models import lora

    config = lora.lora_config(r=4, alpha=8.0, target_modules=["q_proj", "lm_head"], dropout=0.0)
    on_head = lora.add_policy_adapter(copy.deepcopy(model), config)
    assert fused_logprobs.output_projection(on_head) is None
    config = lora.lora_config(r=4, alpha=8.0, target_modules=["q_proj"], dropout=0.0)
    assert fused_logprobs.output_projection(lora.add_policy_adapter(copy.deepcopy(model), config)) is not None


def test_the_plain_path_beyond_one_chunk_says_why_once(tiny, monkeypatch, capsys):
    """A model the fused path cannot serve, with logits above one chunk, prints one `warning:` line per
    reason and process naming what holds the logits and how to change it; within one chunk, or on the
    fused path, nothing."""
    from polgrad.models import lora

    model, rollout = tiny
    monkeypatch.setattr(fused_logprobs, "_WARNED", set())
    config = lora.lora_config(r=4, alpha=8.0, target_modules=["q_proj", "lm_head"], dropout=0.0)
    on_head = lora.add_policy_adapter(copy.deepcopy(model), config)
    partitioned = copy.deepcopy(model)
    partitioned.get_output_embeddings().weight.ds_id = 7  # as DeepSpeed marks a ZeRO-3 partition
    rows = rollout.response_ids.numel()
    hf.response_logprobs(on_head, rollout)  # 16 tokens: within one chunk
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(logit_rows, "CHUNK_ELEMENTS", rows * model.config.vocab_size - 1)
    for m in (model, on_head, on_head, partitioned, partitioned):
        hf.response_logprobs(m, rollout, with_entropy=True)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines  # the fused model says nothing; each reason once
    assert all(line.startswith("warning: log-probs at V = ") for line in lines)
    assert "LoRA on lm_head: drop 'lm_head' from train.lora_target_modules" in lines[0]
    assert "ZeRO-3 partitions its output layer" in lines[1]


@pytest.mark.cpu_matrix  # fused vs plain kernels: the same numbers under every ISA
def test_the_offline_path_scores_sequences_fused_as_it_did_plain(tiny, monkeypatch):
    """DPO's summed response log-prob (polgrad/offline.py `sequence_logp`) on right-padded sequences
    of different lengths, fused with chunks of 4 rows vs plain: the same per-row sums and gradients."""
    from polgrad.models import build_tokenizer, encode_sequences
    from polgrad.offline import sequence_logp

    model, _ = tiny
    model = copy.deepcopy(model)
    tok = build_tokenizer(get("task", "add")(digits=2).alphabet)
    ids, attn, resp = encode_sequences(tok, ["1+2=", "12+30=", "5+5="], ["3", "42", "10"])
    monkeypatch.setattr(logit_rows, "CHUNK_ELEMENTS", 4 * model.config.vocab_size)

    def scored():
        model.zero_grad(set_to_none=True)
        out = sequence_logp(model, ids, attn, resp)
        out.sum().backward()
        return out.detach(), model.lm_head.weight.grad.clone()

    fused = scored()
    _plain(monkeypatch)
    plain = scored()
    torch.testing.assert_close(fused[0], plain[0], rtol=0, atol=TOL)
    torch.testing.assert_close(fused[1], plain[1], rtol=TOL, atol=TOL)


@pytest.mark.cpu_matrix  # fused vs plain kernels: the same numbers under every ISA
@pytest.mark.parametrize("kept", [False, True], ids=["policy_forward", "sampler_distributions"])
def test_the_exact_kl_metric_from_hidden_states_equals_the_row_chunked_one(tiny, monkeypatch, kept):
    """evaluation.exact_kl (the kl_exact metric and ref_logp) with both models' logits made from their
    hidden states a chunk of 5 positions at a time, against the plain row-chunked path: the same KL
    and reference log-probs, with the policy's side from its own forward or from the distributions
    the sampler kept. Tolerance as above (fp32 reordering of the projection's sums)."""
    from polgrad.evaluation import exact_kl

    model, _ = tiny
    policy, reference = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # a reference that differs from the policy, so the KL is not 0
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    task = get("task", "add")(digits=2)
    tok = models.build_tokenizer(task.alphabet)
    rollout = hf.generate(policy, tok, task.examples("train", 4, seed=3), group_size=4, max_new_tokens=12,
                          generator_seed=2, temperature=0.8, keep_distribution=kept)  # fmt: skip
    assert (rollout.policy_logp_all is not None) == kept
    monkeypatch.setattr(logit_rows, "CHUNK_ELEMENTS", 5 * model.config.vocab_size)
    calls, real_rows = [], logit_rows.HeadLogits.rows
    monkeypatch.setattr(logit_rows.HeadLogits, "rows", lambda *a: calls.append(1) or real_rows(*a))
    fused = exact_kl(policy, reference, rollout, temperature=0.8)
    assert calls  # the logits came from the hidden states
    _plain(monkeypatch)
    plain = exact_kl(policy, reference, rollout, temperature=0.8, max_elements=40 * 16)
    assert float(plain[0].sum()) > 1e-3
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def _run(tmp_path, name, spec, overrides):
    from polgrad.config import parse_config
    from polgrad.train import run as train

    gin.clear_config()
    parse_config([os.path.join(REPO, "registry", spec)], overrides)
    try:
        train(str(tmp_path / name))
    finally:
        gin.clear_config()
    return [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]


# The rows' machine measurements (wall time, throughput, memory), not functions of the run's numbers.
MEASURED = {"time_s", "time_gen", "time_ref", "time_values", "time_adv", "time_update", "tokens_per_s",
            "peak_mem_mb"}  # fmt: skip


@pytest.mark.cpu_matrix
@pytest.mark.parametrize(
    "spec, extra", [("ppo.gin", []), ("grpo.gin", ["Algorithm.kl = @kl.full"])], ids=["ppo", "grpo_kl_full"]
)
def test_a_run_whose_chunks_split_gives_the_plain_runs_metrics(tmp_path, monkeypatch, spec, extra):
    """PPO (policy, frozen reference, critic), and GRPO with the exact KL in the loss (kl.full on
    HeadLogits of the policy and the reference, checkpointed chunk by chunk), for 3 steps: once with
    chunks of 3 positions (every training, old-log-prob, reference and KL computation splits) and once
    on the plain path: every metric of every row agrees to float reordering. A 3-row matrix product
    sums in another order than the whole batch's: ~1e-7 relative per logit, which three Adam steps
    carry into the weights. Measured on an AVX-512 EPYC with partial-credit rewards: at most 1.3e-5
    relative on metrics above 1e-3 (kl at step 2 of the kl.full run; 3.9e-6 for PPO), so 1e-4
    relative. Numbers that are differences of O(1) terms can be near 0 (adv_mean ~1e-16, GRPO's
    pg_loss ~1e-8, step 1's KL ~1e-7, explained_variance = 1 - a variance ratio near 1): their error
    is absolute, at most 4.3e-7 measured (1.3e-6 for explained_variance at one torch thread), so
    1e-5 absolute. A missing temperature, a shifted row or target moves these by > 1e-2."""
    overrides = ["train.steps = 3", "train.prompts_per_step = 4", "train.eval_every = 100",
                 "train.eval_size = None", "train.checkpoint_every = 100",
                 "train.progress = False", "task.add.partial = True", *extra]  # fmt: skip
    with monkeypatch.context() as mp:
        mp.setattr(logit_rows, "CHUNK_ELEMENTS", 3 * 16)
        calls, chunks = [], []
        real, real_rows = fused_logprobs.token_logprobs, logit_rows.HeadLogits.rows
        mp.setattr(fused_logprobs, "token_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
        mp.setattr(
            logit_rows.HeadLogits,
            "rows",
            lambda *a: chunks.append(a[0].hidden.requires_grad) or real_rows(*a),
        )
        fused = _run(tmp_path, "fused", spec, overrides)
        assert calls  # the run took the fused path
        assert chunks  # the kl_exact metric made its logits from the hidden states (no grad)
        assert any(chunks) == bool(extra)  # and kl.full in the loss from the training forward's
    _plain(monkeypatch)
    plain = _run(tmp_path, "plain", spec, overrides)
    assert len(fused) == len(plain) == 3
    # Partial credit: rewards that differ within the batch. With all rewards 0 (the task's exact-match
    # reward at this budget) PPO's whitened advantages are the KL penalty's rounding noise scaled to
    # O(1), and two runs that differ by one ulp in ref_logp train apart: no test of anything.
    assert all(r["reward_std"] > 0.05 for r in plain), [r["reward_std"] for r in plain]
    for f, p in zip(fused, plain, strict=True):
        assert f.keys() == p.keys()
        for k, v in f.items():
            if isinstance(v, float) and k not in MEASURED:
                assert v == pytest.approx(p[k], rel=1e-4, abs=1e-5), k


MEMORY_SCRIPT = textwrap.dedent(
    """
    import copy, resource, sys, torch  # the measure is VmHWM (polgrad.machine.peak_rss_mib)
    from transformers import Qwen2Config, Qwen2ForCausalLM
    import polgrad
    from polgrad.registry import get
    from polgrad.components import logit_rows
    from polgrad.rollout import fused_logprobs, hf
    if sys.argv[2] == "plain":
        fused_logprobs.FUSED_MODEL_TYPES = frozenset()
    logit_rows.CHUNK_ELEMENTS = 1 << 21  # an eighth of the default: the copy below is 16 chunks
    torch.set_num_threads(1)
    V, B, P, T = 32768, 16, 8, 64
    cfg = Qwen2Config(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=32, intermediate_size=64,
                      max_position_embeddings=P + T, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    reference = copy.deepcopy(model).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (B, P), generator=g)
    response = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    def rss_kb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() // 1024
    def step(prompt, mask, response):
        b, t = response.shape
        kl = sys.argv[1] == "kl"
        out = hf.response_logprobs(model, prompt, mask, response, with_entropy=True, logit_rows=kl)
        loss = out.logp.sum() + out.entropy.sum()
        if kl:  # the trainer's exact-KL step: a no-grad reference forward, kl.full on both in float64
            with torch.no_grad():
                ref = hf.response_logprobs(reference, prompt, mask, response, logit_rows=True)
            ones = torch.ones(b, t, dtype=torch.float64)
            loss = loss + get("kl", "full")(out.logp.double(), ref.logp.double(), ones,
                                            logits=out.logits.to(torch.float64),
                                            ref_logits=ref.logits.to(torch.float64)).sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
    step(prompt[:1], mask[:1], response[:1, :2])  # warm-up: the allocator's and kernels' first use
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
    before = rss_kb()
    step(prompt, mask, response)
    from polgrad.machine import peak_rss_mib
    print(int(peak_rss_mib() * 2**20) - before * 1024, B * T * V * 4)
    """
)


@pytest.mark.parametrize("step", ["logprobs", "kl"])
def test_one_step_at_a_large_vocabulary_adds_at_most_one_fp32_logits_copy(step):
    """V = 32,768 and 16 x 64 scored tokens: one fp32 copy of the logits is 128 MiB. In a fresh
    process (its peak RSS is its own), the fused path's forward with entropy and its backward
    (`logprobs`), and that plus a reference forward and kl.full in float64 (`kl`, the exact-KL spec's
    step), raise the peak by at most that copy. What they hold is a number of [C,V] chunk blocks
    that does not grow with the batch: two for the log-probs, about eight for kl.full's chunk
    backward (its fp64 log-softmaxes, probabilities, product and their gradients). So the bound is
    about the ratio of the copy to a chunk, set here to 16 (an 8 MiB chunk), which is the ratio of a
    real batch to the default chunk (2,048 positions x V = 151,936: 1.24 GB, 19 chunks of 64 MiB).
    Measured on an AVX-512 EPYC: +33 MiB and +66 MiB; the plain path, which holds the logits, their
    log-softmax and the entropy's product with their graph, +644 MiB and +1,321 MiB. (At twice this
    chunk `kl` measured +123-130 MiB: eight blocks of 16 MiB, no longer under the copy.) Scaled down
    so that the test takes seconds; the ratio to the copy is what it checks."""
    # At the default chunk every [C,V] block is 64 MiB, above glibc's largest mmap threshold (32 MiB):
    # each is its own mapping, returned when freed. The small blocks here (8-16 MiB) would come
    # from the heap instead, whose fragmentation grew the peak with the number of chunks (+526 MiB
    # measured for `kl`); a fixed 1 MiB threshold gives them the default size's allocation.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, step, "fused"], capture_output=True,
                          text=True, timeout=600, cwd=REPO, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    extra, copy_bytes = map(int, proc.stdout.split()[-2:])
    mib = 2**20
    print(f"{step}: +{extra / mib:.0f} MiB peak, logits copy {copy_bytes / mib:.0f} MiB")
    assert extra <= copy_bytes, (extra, copy_bytes)
