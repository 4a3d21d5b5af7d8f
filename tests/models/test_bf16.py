"""train.bf16: bf16 matmuls, fp32 master weights and optimizer state, fp32+ loss math, and it learns.

What `train.bf16 = True` means is written in polgrad/distributed.py ("Mixed precision"): DeepSpeed's
bf16 config casts the module to bf16 and keeps fp32 masters + fp32 AdamW state in the optimizer;
logits are cast to fp32 before each log-softmax; the loss is float64.
"""

from __future__ import annotations

import copy
import json
import math
import os

import gin
import pytest
import torch
import torch.nn.functional as F
from learning import assert_learns

from polgrad import distributed as dist_lib
from polgrad import models
from polgrad.batch import Batch
from polgrad.config import load_spec, parse_config
from polgrad.registry import StepCounts
from polgrad.rollout import hf

pytestmark = pytest.mark.cpu_matrix

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "registry", "grpo.gin")
U_BF16 = 2.0**-8  # unit roundoff of bf16: 8 significant bits (7 stored + the implicit one)
U_FP32 = 2.0**-24


def _engine(model, bf16: bool, stage: int = 0, lr: float = 1e-4):
    return dist_lib.make_engine(
        copy.deepcopy(model), lr=lr, zero_stage=stage, micro_batch_size=16, grad_accum=1, bf16=bf16,
        grad_clip=1.0,
    )  # fmt: skip


def test_bf16_logprobs_are_fp32_log_softmax_of_the_bf16_logits(tiny):
    """bf16 stops at the logits: log-probs and entropy are the fp32 log-softmax of the bf16 model's
    logits. Reference: float64 log-softmax of the same logits. fp32 evaluation of log-softmax and
    gather/entropy costs a few fp32 roundings of numbers of size <= |z| + log V + |logp| < 10, so the
    error is <= ~8 * 10 * U_FP32 = 4.8e-6; 1e-5 allows it. A log-softmax in bf16 would be off by up
    to U_BF16 * |logp| ~ 1e-2 (mutation: drop `.float()` in `response_logprobs`)."""
    model, rollout = tiny
    engine = _engine(model, bf16=True)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    with torch.no_grad():
        out = hf.response_logprobs(engine, rollout, with_entropy=True, return_logits=True)
        t = rollout.response_ids.shape[1]
        ids = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
        attn = torch.cat([rollout.prompt_mask.long(), torch.ones_like(rollout.response_ids)], 1)
        pos = models.position_ids_from_mask(attn)
        raw = engine.module(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits
        raw = raw[:, -t - 1 : -1]
    assert raw.dtype == torch.bfloat16 and out.logp.dtype == torch.float32
    ref_all = F.log_softmax(raw.double(), -1)
    ref_logp = ref_all.gather(-1, rollout.response_ids[..., None]).squeeze(-1)
    ref_entropy = -(ref_all.exp() * ref_all).sum(-1)
    assert float((out.logp.double() - ref_logp).abs().max()) <= 1e-5
    assert float((out.entropy.double() - ref_entropy).abs().max()) <= 1e-5
    # the log-probs are not fp32's: the bf16 logits really differ from the fp32 model's
    with torch.no_grad():
        fp32 = hf.response_logprobs(model, rollout)
    assert float((fp32 - out.logp).abs().max()) > 1e-4


def _fixed_batch(model, rollout):
    """GRPO's batch at the fp32 policy: old_logp = the fp32 trainer's log-probs (ratio 1 in fp32),
    a reference 0.05 nats away per token, fixed random scores -> group advantages."""
    algo = load_spec(GRPO, ["Algorithm.group_size = 4"])
    mask = rollout.mask.double()
    with torch.no_grad():
        lp = hf.response_logprobs(model, rollout).double() * mask
    g = torch.Generator().manual_seed(0)
    ref = (lp - 0.05 * torch.randn(lp.shape, generator=g, dtype=torch.float64)) * mask
    scores = torch.rand(mask.shape[0], generator=g, dtype=torch.float64)
    batch = Batch(mask=mask, group_ids=rollout.group_ids, old_logp=lp, scores=scores,
                  truncated=rollout.truncated, rollout_logp=lp, ref_logp=ref, rollout=rollout)  # fmt: skip
    batch, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
    return algo, batch


def _loss(algo, batch, engine):
    """The trainer's micro-step loss (policy_fwd + Algorithm.loss), its d loss / d logp, logits, logp."""
    out = hf.response_logprobs(engine, batch.rollout, with_entropy=True, return_logits=True)
    logp = out.logp.double().detach().requires_grad_(True)
    counts = StepCounts.of_step([batch.mask])
    loss, _, _ = algo.loss(batch.replace(logp=logp, entropy=out.entropy.double()), counts,
                           kl_coef=algo.kl_coef)  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    return float(loss.detach()), grad, out.logits.detach().double(), out.logp.detach().double()


def test_bf16_loss_on_a_fixed_batch_matches_fp32_within_the_propagated_logit_error(tiny):
    """The loss of the same batch and weights, bf16 vs fp32, differs only by the bf16 logits' error.

    Tolerance, derived. The loss depends on the forward only through logp (float64 from here on),
    so to first order ΔL = Σ_t g_t Δlogp_t with g = ∂L/∂logp at the fp32 point (autograd). The
    log-softmax gives Δlogp_t = Δz_{t,y} - Σ_v p_v Δz_{t,v}, so |Δlogp_t| <= 2 δ_t with
    δ_t = max_v |z16 - z32|_{t,v}: |ΔL| <= 2 Σ_t |g_t| δ_t (+ second order, O(δ²) ~ 1e-5 of it here,
    covered by the factor 1.1). The logits' own error is bf16-sized: each of the R = 2 + 2·layers
    bf16 roundings of the residual stream or the final hidden state perturbs it by <= U_BF16
    relative (normwise) and RMSNorm keeps the layers from amplifying it, so δ <= 2·R·U_BF16·max|z|
    (a generous first-order bound: 0.10 here against 0.0067 measured; a wrong weight or fp16
    overflow breaks it). Measured here: |ΔL| 1.5e-4 against the bound 5.3e-3, and the first-order
    prediction Σ g Δlogp equals ΔL to 1e-6, which is the sharp check that the loss math adds no
    error of its own (it runs in float64: 1e-9 would do; 1e-6 leaves room for the O(δ²) term).
    Not vacuous: fp32 against a fresh fp32 engine is bitwise equal, bf16 differs."""
    model, rollout = tiny
    algo, batch = _fixed_batch(model, rollout)
    try:
        l32, g, z32, lp32 = _loss(algo, batch, _engine(model, bf16=False))
        l32_again, *_ = _loss(algo, batch, _engine(model, bf16=False))
        l16, _, z16, lp16 = _loss(algo, batch, _engine(model, bf16=True))
    finally:
        gin.clear_config()
    assert l32 == l32_again  # deterministic: any difference below comes from the precision
    assert l16 != l32
    mask = batch.mask
    delta = (z16 - z32).abs().amax(-1) * mask  # δ_t, masked-in tokens only
    layers = model.config.num_hidden_layers
    assert float(delta.max()) <= 2 * (2 + 2 * layers) * U_BF16 * float((z32.abs().amax(-1) * mask).max())
    bound = 1.1 * 2 * float((g.abs() * delta).sum())
    assert abs(l16 - l32) <= bound, (l16, l32, bound)
    first_order = float((g * (lp16 - lp32) * mask).sum())
    assert abs((l16 - l32) - first_order) <= 1e-6, (l16 - l32, first_order)


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_keeps_fp32_master_weights_and_optimizer_state(tiny, stage):
    """The module is bf16, the optimizer's parameters (masters) and AdamW moments fp32, and an update
    below bf16's resolution accumulates in the masters: lr 1e-6 moves a weight of size ~0.02 by ~1e-6
    per step, under half a bf16 ulp (~6e-5 at 0.02), so the bf16 module stays put while the masters
    move (mutation: train pure bf16, module and optimizer alike -> this fails)."""
    model, rollout = tiny
    engine = _engine(model, bf16=True, stage=stage, lr=1e-6)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    inner = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    masters = [p for group in inner.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in masters]
    module_before = [p.detach().clone() for p in engine.module.parameters()]
    out = hf.response_logprobs(engine, rollout)
    dist_lib.backward(engine, -(out * rollout.mask).sum() / rollout.mask.sum(), boundary=True)
    assert dist_lib.step(engine) is True
    assert masters and all(p.dtype == torch.float32 for p in masters)
    for p in masters:
        state = inner.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32
    moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(masters, before, strict=True))
    module_moved = sum(
        int((p.detach() != b).sum()) for p, b in zip(engine.module.parameters(), module_before, strict=True)
    )
    n = sum(p.numel() for p in engine.module.parameters())
    assert moved > 0
    assert module_moved < 0.05 * n, (module_moved, n)  # ~all bf16 weights unchanged by a 1e-6 step


@pytest.mark.slow
def test_a_bf16_grpo_run_learns(tmp_path, monkeypatch):
    """GRPO with train.bf16 on the base task, the fixed seed and budget of test_trainer's learning
    test: the final policy solves more held-out prompts than its warm start (paired). The reference
    is cast to bf16 like the policy, so the exact KL at the first step is 0 (an fp32 reference would
    differ from the bf16 policy by bf16 rounding of every weight). The sampler/trainer approx_kl of
    the first (on-policy) update is bf16 rounding only: small (measured 0.0 here: the warm-started
    policy's sampler and trainer log-probs agree bit for bit; 6e-7 on the bench's random-init model)."""
    gin.clear_config()
    parse_config([GRPO], ["train.bf16 = True", "train.steps = 40", "train.prompts_per_step = 8",
                          "train.eval_every = 100", "train.eval_size = None", "train.checkpoint_every = 100",
                          "train.progress = False"])  # fmt: skip
    from polgrad.rollout import hf
    from polgrad.train import run as train

    # The exact KL from a policy forward (not the sampler's distributions, which a KV-cached decode
    # rounds differently), so that step 1's KL of 0 says: the bf16 reference is the policy exactly.
    monkeypatch.setattr(hf, "MAX_KEPT_DISTRIBUTION", 0)
    try:
        train(str(tmp_path / "run"))
    finally:
        gin.clear_config()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert rows[0]["kl_exact"] == 0.0
    assert 0.0 <= rows[0]["clip/approx_kl"] < 1e-3, rows[0]["clip/approx_kl"]
    assert all(math.isfinite(r["pg_loss"]) and r["skipped_steps"] == 0 for r in rows)
    print(f"bf16 GRPO: step-1 approx_kl {rows[0]['clip/approx_kl']:.3g}")
    # learned: the final policy beats its own warm start on the same held-out prompts, paired
    # (tests/learning.py; a fixed rise of the train reward failed on an AVX2 CPU's warm start)
    assert_learns(tmp_path / "run")
