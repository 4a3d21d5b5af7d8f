"""RLOO step parity: polgrad's registry/rloo.gin (with the KL penalty TRL's RLOOTrainer applies) against
`trl.RLOOTrainer` on one step with the samples forced, the same weights, prompts and completions.

TRL's own code runs on both sides of the comparison: its `_generate_and_score_completions` (rewards,
reference log-probs, the sequence-level k1 penalty in the reward, the leave-one-out advantages) with
its sampler replaced by polgrad's rollout, then its `_compute_loss` and a backward. polgrad runs
`Algorithm.prepare` and `Algorithm.loss` on the same rollout with its own forward passes.

On-policy (one gradient step per batch, registry/rloo.gin's ppo_epochs = 1): TRL's sequence ratio
exp(Σ_t logp - Σ_t old_logp) and polgrad's per-token ratios are all 1 in value, so both gradients are
-(1/B) Σ_i A_i Σ_t ∇ log π(y_it) and agree to fp32 rounding. Their loss *values* differ by design:
TRL's is -(1/B) Σ_i A_i (a sequence ratio), polgrad's seq_mean_token_sum gives -(1/B) Σ_i A_i |y_i|
(a sum over tokens); `loss_value_identity` checks each against its own formula.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from benchmarks.numerics import unpadded_rollout
from benchmarks.timing import patched
from benchmarks.trl_run import _trl_reward_fn, quiet_args
from benchmarks.workload import REPO_ROOT, Workload

BETA = 0.05  # TRL RLOOConfig's default beta; polgrad: kl.k1 in the reward at this coefficient


def rloo_algorithm(group_size: int, beta: float = BETA):
    """registry/rloo.gin with TRL RLOOTrainer's default KL: k1 summed over the sequence in the reward."""
    import gin

    from polgrad.config import load_spec

    gin.clear_config()
    return load_spec(
        os.path.join(REPO_ROOT, "registry", "rloo.gin"),
        [
            f"Algorithm.group_size = {group_size}",
            "Algorithm.kl = @kl.k1",
            "Algorithm.kl_placement = 'reward'",
            f"Algorithm.kl_coef = {beta}",
        ],
    )


def rloo_numerics(w: Workload, model_dir: str, work_dir: str) -> dict[str, Any]:
    """One forced step through TRL's RLOOTrainer and polgrad's rloo spec; the differences."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    from polgrad import models
    from polgrad.registry import StepCounts
    from polgrad.rollout import hf as hf_rollout

    transformers.logging.set_verbosity_error()
    torch.manual_seed(w.seed)
    ref = models.load_reference(model_dir)  # TRL loads its reference from model_dir too
    tok = models.load_tokenizer(model_dir)
    policy = copy.deepcopy(ref)
    with torch.no_grad():  # the policy has moved away from the reference: a non-zero KL penalty
        for p in policy.parameters():
            p.add_(0.1 * p.abs().mean() * torch.randn_like(p))
    for p in policy.parameters():
        p.requires_grad_(True)
    policy_trl = copy.deepcopy(policy)

    task, examples, rollout = unpadded_rollout(w, policy, tok)  # as the GRPO numerics
    b = len(rollout)
    assert rollout.group_ids.tolist() == [i // w.group_size for i in range(b)]  # TRL's layout too

    # --- TRL: its trainer around the same weights, its sampler replaced by polgrad's rollout
    tok_trl = AutoTokenizer.from_pretrained(model_dir)
    tok_trl.padding_side = "left"
    config = RLOOConfig(
        output_dir=os.path.join(work_dir, "trl-rloo"),
        use_cpu=True,
        use_vllm=False,
        model_init_kwargs=None,
        per_device_train_batch_size=b,
        gradient_accumulation_steps=1,
        num_generations=w.group_size,
        max_completion_length=w.max_new_tokens,
        temperature=1.0,
        beta=BETA,
        num_iterations=1,
        normalize_advantages=False,
        learning_rate=w.lr,
        bf16=False,
        **quiet_args(w, 1),
    )
    policy_trl.config._name_or_path = model_dir  # where TRL loads its reference model from
    dataset = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])
    trainer = RLOOTrainer(
        model=policy_trl,
        reward_funcs=_trl_reward_fn(task),
        args=config,
        train_dataset=dataset,
        processing_class=tok_trl,
    )
    trainer.model.train()
    keep = rollout.mask.bool()
    forced = (
        [row.tolist() for row in rollout.prompt_ids],
        [r[k].tolist() for r, k in zip(rollout.response_ids, keep, strict=True)],
        list(rollout.texts),
    )
    inputs = [{"prompt": e.prompt, "answer": e.answer} for e in rollout.examples]
    with patched([(trainer, "_generate", lambda prompts: forced)]):
        scored = trainer._generate_and_score_completions(inputs)
    loss_trl = trainer._compute_loss(trainer.model, scored)
    loss_trl.backward()

    # --- polgrad: the same rollout, its own forwards, reward and spec
    algo = rloo_algorithm(w.group_size)
    scores = torch.tensor(
        [task.reward(e, t) for e, t in zip(rollout.examples, rollout.texts, strict=True)], dtype=torch.float64
    )
    mask = rollout.mask.double()
    with torch.no_grad():
        old_logp = hf_rollout.response_logprobs(policy, rollout).double() * mask
        ref_logp = hf_rollout.response_logprobs(ref, rollout).double() * mask
    batch = {
        "scores": scores,
        "mask": mask,
        "truncated": rollout.truncated,
        "group_ids": rollout.group_ids,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
    }
    batch_in = dict(batch)
    batch, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
    counts = StepCounts.of_step([mask])
    out = hf_rollout.response_logprobs(policy, rollout, with_entropy=True)
    loss_pg, _, _ = algo.loss(
        dict(batch, logp=out.logp.double(), entropy=out.entropy.double()), counts, kl_coef=algo.kl_coef
    )
    loss_pg.backward()
    # non-vacuity of the KL's part: the same spec without the penalty gives other advantages
    plain = rloo_algorithm(w.group_size, beta=0.0)
    adv_plain = plain.prepare(dict(batch_in, ref_logp=ref_logp), kl_coef=0.0)[0]["adv"][:, 0]
    import gin

    gin.clear_config()

    adv_pg = batch["adv"][:, 0]
    adv_trl = scored["advantages"].double()
    lengths = mask.sum(-1)
    g_pg = torch.cat([p.grad.flatten() for p in policy.parameters()]).double()
    g_trl = torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).double()
    kl_seq = (old_logp - ref_logp).sum(-1)
    return {
        "batch": b,
        "tokens_per_completion": float(lengths.mean()),
        "reward_mean": float(scores.mean()),
        "kl_seq_mean": float(kl_seq.mean()),
        "old_logps_max_abs_diff": float((scored["old_logps"].double() - old_logp.sum(-1)).abs().max()),
        "adv_max_abs_diff": float((adv_pg - adv_trl).abs().max()),
        "adv_max_abs": float(adv_trl.abs().max()),
        "adv_without_kl_max_abs_diff": float((adv_plain - adv_trl).abs().max()),
        # each loss value against its own formula (module docstring), from the shared advantages; both
        # are ~0 here: RLOO's advantages sum to 0 in each group and every completion has the same length
        "loss_trl": float(loss_trl.detach()),
        "loss_trl_formula_diff": abs(float(loss_trl.detach()) + float(adv_trl.mean())),
        "loss_polgrad": float(loss_pg.detach()),
        "loss_polgrad_formula_diff": abs(float(loss_pg.detach()) + float((adv_pg * lengths).mean())),
        "grad_rel_diff": float((g_pg - g_trl).norm() / g_trl.norm()),
        "grad_cosine": float(torch.nn.functional.cosine_similarity(g_pg, g_trl, dim=0)),
    }
