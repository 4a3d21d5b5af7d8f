"""Loss numerics: polgrad's GRPO loss against TRL's on one batch, and the hand-fused GRPO loss.

`fused_grpo_loss` is registry/grpo.gin's loss written as one function (the composition benchmark's
baseline, and an identity the tests check); `loss_numerics` puts one identical batch through polgrad's
`Algorithm.loss` and TRL's `GRPOTrainer._compute_loss`.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from benchmarks.timing import patched
from benchmarks.trl_run import _trl_reward_fn, trl_config
from benchmarks.workload import REPO_ROOT, Workload, bench_task, grpo_bindings


def fused_grpo_loss(
    logp,
    old_logp,
    ref_logp,
    adv,
    mask,
    entropy=None,
    *,
    num_tokens: float,
    num_seqs: float,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.04,
    max_log_ratio: float = 20.0,
    kl_max_log_ratio: float = 20.0,
    kl_max_value: float = 10.0,
    with_metrics: bool = True,
):
    """GRPO's micro-batch loss in one function: what registry/grpo.gin composes from parts.

    With ρ = exp(clamp(logp - old_logp, ±20)), x = clamp(logp - ref_logp, ±20), valid = mask > 0:

        l_t  = max(-ρA, -clip(ρ, 1-ε_low, 1+ε_high)A) + β·clamp(e^{-x} - 1 + x, 0, 10)     (clip.ppo + kl.k3)
        loss = (1/N_seqs) Σ_i Σ_t m_it l_it / max(|a_i|, 1)               (aggregate.seq_mean_token_mean)

    padding zeroed before any arithmetic, as the parts do. `num_tokens`/`num_seqs` are the step's
    StepCounts. With `with_metrics` also the Algorithm's metrics (clip/clip_low, clip/clip_high,
    clip/approx_kl, pg_loss, kl_loss, entropy), else an empty dict. Returns (loss, metrics).
    """
    import torch

    valid = mask > 0
    m = mask.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype)
    lp = torch.where(valid, logp, zero)
    log_ratio = torch.clamp(lp - torch.where(valid, old_logp.detach(), zero), -max_log_ratio, max_log_ratio)
    a = torch.where(valid, adv.detach(), zero)
    ratio = torch.exp(log_ratio)
    pg = torch.where(
        valid, torch.maximum(-ratio * a, -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * a), zero
    )
    x = torch.clamp(torch.where(valid, logp - ref_logp, zero), -kl_max_log_ratio, kl_max_log_ratio)
    kl = torch.where(valid, torch.clamp(torch.expm1(-x) + x, min=0.0, max=kl_max_value), zero)
    per_token = pg + beta * kl
    seq_len = m.sum(-1).clamp_min(1.0)

    def aggregate(t):
        return ((torch.where(valid, t, zero) * m).sum(-1) / seq_len).sum() / num_seqs

    loss = aggregate(per_token)
    if not with_metrics:
        return loss, {}
    r = ratio.detach()
    d = log_ratio.detach()
    metrics = {
        "clip/clip_low": (((a < 0) & (r < 1.0 - eps_low)).to(m.dtype) * m).sum() / num_tokens,
        "clip/clip_high": (((a > 0) & (r > 1.0 + eps_high)).to(m.dtype) * m).sum() / num_tokens,
        "clip/approx_kl": (torch.where(valid, torch.expm1(d) - d, zero) * m).sum() / num_tokens,
        "pg_loss": aggregate(pg.detach()),
        "kl_loss": (kl.detach() * m).sum() / num_tokens,
    }
    if entropy is not None:
        metrics["entropy"] = (entropy.detach() * m).sum() / num_tokens
    return loss, metrics


def grpo_algorithm(w: Workload | None = None, extra: tuple[str, ...] = ()):
    """registry/grpo.gin as an Algorithm with the bench constants (and `extra` bindings).

    Its parts hold the values gin had when it was built (registry.Bound); the bindings stay parsed
    for whatever else reads them: call `gin.clear_config()` when done.
    """
    from polgrad.config import load_spec

    w = w or Workload()
    return load_spec(os.path.join(REPO_ROOT, "registry", "grpo.gin"), [*grpo_bindings(w), *extra])


def loss_inputs(b: int, t: int, seed: int = 0, dtype=None) -> dict[str, Any]:
    """A random micro-batch as the trainer builds it (float64, ragged mask, |log-ratios| up to ~0.5)."""
    import torch

    dtype = dtype or torch.float64
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3.0
    logp = (old + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)).clamp(max=0.0)
    ref = (old + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)).clamp(max=0.0)
    adv = torch.randn(b, 1, generator=g, dtype=dtype) * mask
    entropy = torch.rand(b, t, generator=g, dtype=dtype) * 2.0
    return {"logp": logp, "old_logp": old, "ref_logp": ref, "adv": adv, "mask": mask, "entropy": entropy}


def unpadded_rollout(w: Workload, model, tok):
    """(the bench task, its first `w.prompts` prompts of one length ("dd+dd="), a rollout of `model`
    on them): prompts of equal length have no left padding, so TRL's training forward (positions
    0..S-1) and polgrad's (positions counted over attended tokens) see the same positions."""
    from polgrad.rollout import hf as hf_rollout

    task = bench_task()
    pool = task.examples("train", 50 * w.prompts, seed=w.seed)
    examples = [e for e in pool if len(e.prompt) == 6][: w.prompts]
    rollout = hf_rollout.generate(
        model,
        tok,
        examples,
        group_size=w.group_size,
        temperature=1.0,
        max_new_tokens=w.max_new_tokens,
        generator_seed=w.seed,
    )
    return task, examples, rollout


def loss_numerics(w: Workload, model_dir: str, work_dir: str) -> dict[str, Any]:
    """polgrad's Algorithm.loss vs TRL's GRPOTrainer._compute_loss on one batch, at two levels.

    Models: the reference (the bench checkpoint), the sampling policy `old` (reference + noise) and the
    current policy (old + more noise), so that KL, ratios and clipping are all non-trivial. One polgrad
    rollout from `old` on equal-length prompts (no left padding: TRL's training forward uses positions
    0..S-1 while polgrad counts attended tokens; without padding they coincide); random rewards.

    `fn_*`: the loss functions alone. Both get the same float64 inputs: the current policy's log-probs
    (one leaf tensor; TRL's log-prob function is replaced by one returning it), old and reference
    log-probs, polgrad's advantages. Differences here are the formulas' (expected ~1e-16).
    `e2e_*`: each framework end to end on the same weights: its own fp32 forward (TRL: its fused,
    chunked LM head), its own advantage formula, its own dtype (TRL fp32, polgrad float64 after the
    forward). Differences here are fp32 rounding (log-probs differ by ~1e-7 per token).
    """
    import copy

    import gin
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

    from polgrad import models
    from polgrad.components import kl as kl_parts
    from polgrad.registry import StepCounts
    from polgrad.rollout import hf as hf_rollout

    transformers.logging.set_verbosity_error()
    torch.manual_seed(w.seed)
    ref = models.load_reference(model_dir)
    tok = models.load_tokenizer(model_dir)

    def noisy(m, scale):
        m = copy.deepcopy(m)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * p.abs().mean() * torch.randn_like(p))
        return m

    old = noisy(ref, 0.1)
    policy_pg = noisy(old, 0.3)
    for p in policy_pg.parameters():
        p.requires_grad_(True)
    policy_pg.train()
    policy_trl = copy.deepcopy(policy_pg)

    task, examples, rollout = unpadded_rollout(w, old, tok)
    b = len(rollout)
    rewards = torch.rand(b, generator=torch.Generator().manual_seed(w.seed), dtype=torch.float64)
    mask = rollout.mask.double()
    with torch.no_grad():
        old_logp = hf_rollout.response_logprobs(old, rollout)
        ref_logp = hf_rollout.response_logprobs(ref, rollout)

    algo = grpo_algorithm(w)
    batch = {
        "scores": rewards,
        "mask": mask,
        "truncated": rollout.truncated,
        "group_ids": rollout.group_ids,
        "old_logp": old_logp.double(),
        "rollout_logp": old_logp.double(),
        "ref_logp": ref_logp.double(),
    }
    batch, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
    counts = StepCounts.of_step([mask])

    # TRL's trainer around the same weights (its __init__ patches the fused LM head onto the model)
    dataset = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])
    tok_trl = AutoTokenizer.from_pretrained(model_dir)
    tok_trl.padding_side = "left"
    config = trl_config(w, os.path.join(work_dir, "trl-numerics"), 1)
    config.model_init_kwargs = None  # the model is passed instantiated
    trainer = GRPOTrainer(
        model=policy_trl,
        reward_funcs=_trl_reward_fn(task),
        args=config,
        train_dataset=dataset,
        processing_class=tok_trl,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    grouped = rewards.view(-1, w.group_size)
    adv_trl = (rewards - grouped.mean(1).repeat_interleave(w.group_size)) / (
        nanstd(grouped, dim=1).repeat_interleave(w.group_size) + w.adv_eps
    )
    trl_inputs = {
        "prompt_ids": rollout.prompt_ids,
        "prompt_mask": rollout.prompt_mask,
        "completion_ids": rollout.response_ids,
        "completion_mask": rollout.mask.long(),
        "num_items_in_batch": rollout.mask.sum(),
    }

    # --- 1. the loss functions alone, identical float64 inputs
    with torch.no_grad():
        out = hf_rollout.response_logprobs(policy_pg, rollout, with_entropy=True)
    leaf_pg = out.logp.double().requires_grad_(True)
    leaf_trl = out.logp.double().requires_grad_(True)
    loss_fn_pg, _, _ = algo.loss(
        dict(batch, logp=leaf_pg, entropy=out.entropy.double()), counts, kl_coef=algo.kl_coef
    )
    loss_fn_pg.backward()
    given = {"logps": (leaf_trl, out.entropy.double(), None)}
    with patched([(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: given["logps"])]):
        loss_fn_trl = trainer._compute_loss(
            trainer.model,
            dict(
                trl_inputs,
                advantages=batch["adv"][:, 0],
                old_per_token_logps=old_logp.double(),
                ref_per_token_logps=ref_logp.double(),
            ),
        )
    loss_fn_trl.backward()
    m = rollout.mask.bool()
    fn_grad_diff = float((leaf_pg.grad - leaf_trl.grad)[m].abs().max())
    # polgrad's k3 guards (log-ratio and value clamps; TRL has none) switched off: the same spec built
    # with both bound to None (a built Algorithm's parts keep their values: rebinding would not reach it)
    guards = inspect.signature(kl_parts.k3).parameters
    max_value, max_log_ratio = guards["max_value"].default, guards["max_log_ratio"].default
    no_guards = grpo_algorithm(w, ("kl.k3.max_value = None", "kl.k3.max_log_ratio = None"))
    assert no_guards.kl.hparams["max_value"] is None and no_guards.kl.hparams["max_log_ratio"] is None
    leaf_ng = out.logp.double().requires_grad_(True)
    loss_fn_ng, _, _ = no_guards.loss(
        dict(batch, logp=leaf_ng, entropy=out.entropy.double()), counts, kl_coef=no_guards.kl_coef
    )
    loss_fn_ng.backward()
    x_ref = out.logp.double() - ref_logp.double()
    k3 = torch.expm1(-x_ref) + x_ref
    guard_tokens = int((((k3 > max_value) | (x_ref.abs() > max_log_ratio)) & rollout.mask.bool()).sum())

    # --- 2. end to end: each framework's own forward, advantage formula and dtype
    out = hf_rollout.response_logprobs(policy_pg, rollout, with_entropy=True)
    loss_pg, _, _ = algo.loss(
        dict(batch, logp=out.logp.double(), entropy=out.entropy.double()), counts, kl_coef=algo.kl_coef
    )
    loss_pg.backward()
    loss_trl = trainer._compute_loss(
        trainer.model,
        dict(
            trl_inputs,
            advantages=adv_trl.float(),
            old_per_token_logps=old_logp,
            ref_per_token_logps=ref_logp,
        ),
    )
    loss_trl.backward()
    with torch.no_grad():
        logp_trl, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            rollout.input_ids,
            torch.cat([rollout.prompt_mask, rollout.mask.long()], 1),
            rollout.response_ids.shape[1],
        )
    gin.clear_config()

    loss_fn_pg, loss_fn_trl, loss_fn_ng = loss_fn_pg.detach(), loss_fn_trl.detach(), loss_fn_ng.detach()
    loss_pg, loss_trl = loss_pg.detach(), loss_trl.detach()
    g_pg = torch.cat([p.grad.flatten() for p in policy_pg.parameters()]).double()
    g_trl = torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).double()
    lp = out.logp.detach()
    ratio = (lp - old_logp).exp()
    adv = batch["adv"][:, :1].expand_as(lp)
    clipped = ((adv < 0) & (ratio < 1 - w.clip_eps)) | ((adv > 0) & (ratio > 1 + w.clip_eps))
    # the natural scale of the loss: the mean of |per-token terms| (the loss itself is a cancelling sum)
    scale = float(((ratio * adv).abs() * mask).sum(-1).div(mask.sum(-1)).mean())
    diff = abs(float(loss_pg) - float(loss_trl))
    return {
        "batch": b,
        "tokens_per_completion": float(mask.sum(1).mean()),
        "frac_tokens_clipped": float(clipped[m].float().mean()),
        "mean_kl_k3": float(((ref_logp - lp).exp() - (ref_logp - lp) - 1)[m].mean()),
        "fn_loss_polgrad": float(loss_fn_pg),
        "fn_loss_trl": float(loss_fn_trl),
        "fn_loss_abs_diff": abs(float(loss_fn_pg) - float(loss_fn_trl)),
        "fn_grad_max_abs_diff": fn_grad_diff,
        "fn_grad_max_abs": float(leaf_pg.grad.abs().max()),
        "k3_guard_tokens": guard_tokens,
        "fn_noguard_loss_polgrad": float(loss_fn_ng),
        "fn_noguard_loss_abs_diff": abs(float(loss_fn_ng) - float(loss_fn_trl)),
        "fn_noguard_grad_max_abs_diff": float((leaf_ng.grad - leaf_trl.grad)[m].abs().max()),
        "adv_max_abs_diff": float((batch["adv"][:, 0] - adv_trl).abs().max()),
        "e2e_loss_polgrad": float(loss_pg),
        "e2e_loss_trl": float(loss_trl),
        "e2e_loss_abs_diff": diff,
        "e2e_loss_scale": scale,
        "e2e_loss_diff_over_scale": diff / scale,
        "e2e_logp_max_abs_diff": float((lp - logp_trl)[m].abs().max()),
        "e2e_grad_rel_diff": float((g_pg - g_trl).norm() / g_trl.norm()),
        "e2e_grad_cosine": float(torch.nn.functional.cosine_similarity(g_pg, g_trl, dim=0)),
    }
