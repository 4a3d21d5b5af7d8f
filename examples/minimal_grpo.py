"""GRPO on one screen: polgrad's registered parts composed by hand, in plain PyTorch.

No gin, no DeepSpeed, none of the trainer's strategies: a warm-started tiny policy, a frozen copy as
the reference, and a loop that samples a group of responses per prompt, scores them with the task,
and takes one AdamW step on GRPO's loss. `grpo_loss` is the whole algorithm; the trainer computes
the same number from registry/grpo.gin (tests/project/test_examples.py checks it on a batch of the trainer's).

    python examples/minimal_grpo.py --steps 20

GRPO (Shao et al. 2024; the RLHF book's policy-gradient chapter, eq. 58 and 60), per token t of
response i of a group of G responses to one prompt:

    A_i      = (r_i - mean_G r) / (std_G r + 1e-6)                       advantage.grpo
    l_{i,t}  = -min(ρ A_i, clip(ρ, 1 - 0.2, 1 + 0.2) A_i),  ρ = π/π_old   clip.ppo
             + β k3(π, π_ref),  k3 = e^{ref - logp} - (ref - logp) - 1   kl.k3 in the loss, β = 0.04
    L        = 1/B Σ_i 1/|o_i| Σ_t l_{i,t}                               aggregate.seq_mean_token_mean

Tensors (the project's names): logp, old_logp, ref_logp, mask [B,T]; rewards, group_ids [B].
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import Tensor

from polgrad.components.advantage._common import last_token
from polgrad.models.loading import freeze, load_policy
from polgrad.models.tokenizer import load_tokenizer
from polgrad.pretrain.sft import make_task, warm_start
from polgrad.registry import StepCounts, get
from polgrad.rollout import hf

# the default config's task (polgrad/defaults/base_tiny.gin), so that this script starts from the same
# cached warm start as `python -m polgrad.train registry/grpo.gin` with train.seed = --seed
TASK = {"digits": 2, "reverse": False, "pad": False, "partial": False, "eval_fraction": 0.1}


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor,
    rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    *,
    kl_coef: float = 0.04,
    eps: float = 0.2,
) -> Tensor:
    """GRPO's loss of one batch (the module docstring's formula) from four registered parts.

    logp [B,T] float64 with grad (the policy now); old_logp, ref_logp [B,T] (the sampling policy and
    the reference, no grad); rewards [B]; mask [B,T] 0/1; group_ids [B], each group >= 2 rows.
    Returns a scalar: the step's loss (one micro-batch is the whole step here)."""
    advantage = get("advantage", "grpo")
    clip = get("clip", "ppo")
    kl = get("kl", "k3")
    aggregate = get("aggregate", "seq_mean_token_mean")
    with torch.no_grad():  # advantages are constants of the update
        adv, _ = advantage(rewards, mask, group_ids=group_ids, token_rewards=last_token(rewards, mask))
    per_token, _metrics = clip(logp, old_logp, adv, mask, eps_low=eps, eps_high=eps)
    per_token = per_token + kl_coef * kl(logp, ref_logp, mask)
    return aggregate(per_token, mask, StepCounts.of_step([mask]))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt (G)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    task = make_task("add", TASK)
    path = warm_start("add", TASK, seed=args.seed)  # the SFT policy, cached after the first run
    policy, tokenizer = load_policy(path), load_tokenizer(path)
    reference = freeze(copy.deepcopy(policy))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    for step in range(args.steps):
        examples = task.examples("train", args.prompts, seed=1000 * args.seed + step)
        rollout = hf.generate(
            policy, tokenizer, examples, group_size=args.group_size,
            max_new_tokens=task.max_response_chars + 1, generator_seed=step,
        )  # fmt: skip
        rewards = torch.tensor(
            [task.reward(ex, text) for ex, text in zip(rollout.examples, rollout.texts, strict=True)]
        )
        with torch.no_grad():
            old_logp = hf.response_logprobs(policy, rollout).double()
            ref_logp = hf.response_logprobs(reference, rollout).double()
        policy.train()
        logp = hf.response_logprobs(policy, rollout).double()
        loss = grpo_loss(logp, old_logp, ref_logp, rewards, rollout.mask, rollout.group_ids)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        print(f"step {step + 1:3d}  reward {rewards.mean():.3f}  loss {loss.item():+.5f}")


if __name__ == "__main__":
    main()
