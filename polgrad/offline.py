"""The offline step: a preference spec (DPO, IPO, cDPO) updates on fixed pairs, not on its samples.

`pair_step` is steps 3-5 of `polgrad.trainer.train` for an `Algorithm` with a `preference`
part, in the same order as the RL step (`trainer.rl_step`):

    3. this step's preference pairs (prompt, chosen, rejected) from the task: the pairs the
       reward model learns from, drawn with the step's seed (each rank its own);
    4. the reference's log-prob of every chosen and rejected response (summed over its tokens);
    5. one optimizer step on the preference loss, micro-batched like the RL update: each
       micro-batch's loss is its share of the mean over the step's pairs (every rank's), so the
       step's gradient does not depend on the micro-batching or the world size.

Its row logs the mean loss, the implicit-reward accuracy (β·log-ratio of the chosen response
above the rejected one's), the mean margin and the two mean rewards; evaluation, logging and
checkpoints are the loop's. It samples nothing: the budget's counters (polgrad/stopping.py) count
the sequences it trains on, 2 per pair, and their response tokens.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from torch import Tensor

from polgrad import collective, config, hooks, stopping
from polgrad import distributed as dist_lib
from polgrad.algorithm import Algorithm
from polgrad.build import Models
from polgrad.loop_state import LoopState
from polgrad.models import encode_pairs, position_ids_from_mask
from polgrad.rollout.fused_logprobs import scored_logprobs


def sequence_logp(model, ids: Tensor, attn: Tensor, response_mask: Tensor) -> Tensor:
    """[B] float64: log-prob of each row's response tokens (EOS included), summed, under `model`.

    ids, attn, response_mask [B,S] as `polgrad.models.encode_pairs` makes them (right-padded;
    response_mask 1 on the response characters and the EOS). Token t is predicted at position t-1.
    """
    pos = position_ids_from_mask(attn)  # 0, 1, ... on each row's tokens (right-padded)
    logp = scored_logprobs(model, ids, attn, pos, ids[:, 1:])  # fused where the model allows
    return (logp.double() * response_mask[:, 1:].double()).sum(-1)


_WARNED: set[str] = set()


def _warn_raw_strings(tokenizer, pairs, chat_template: bool | None) -> None:
    """Once per process: DPO trains string pairs raw (TRL's rule) while the policy's tokenizer has a chat
    template, through which sampling and evaluation render every prompt (train.chat_template = None)."""
    if chat_template is not None or not getattr(tokenizer, "chat_template", None) or "raw" in _WARNED:
        return
    if any(getattr(p, "messages", None) is None for p, _, _ in pairs):
        _WARNED.add("raw")
        print(
            "warning: DPO trains string preference pairs raw, as TRL does, while evaluation renders prompts "
            "through the policy's chat template; bind train.chat_template = True to train them as one user "
            "and one assistant turn, or False to train and evaluate raw",
            file=sys.stderr,
            flush=True,
        )


def pair_step(
    cfg: config.TrainConfig, algo: Algorithm, m: Models, task, seed: int, state: LoopState
) -> tuple[dict[str, Any], float, LoopState]:
    """Steps 3-5 for a preference spec; returns (row, tokens, new state)."""
    # 3. This step's pairs, chosen responses first and rejected ones after, in one batch.
    pairs = task.preference_pairs(cfg.prompts_per_step, seed=seed)
    n = len(pairs)
    # Tokenised as TRL's DPOTrainer does (conversations through the chat template, strings raw + EOS).
    _warn_raw_strings(m.tokenizer, pairs, cfg.chat_template)
    ids, attn, resp = encode_pairs(m.tokenizer, pairs, as_chat=cfg.chat_template is True)
    # 4. The frozen reference's log-probs.
    with torch.no_grad(), hooks.phase("ref"):
        ref = sequence_logp(m.reference.module, ids, attn, resp)
    # 5. One optimizer step over micro-batches of pairs (micro_batch_size sequences: half as many pairs).
    n_pairs = float(collective.all_sum(torch.tensor(float(n), dtype=torch.float64)))
    micro = list(torch.arange(n).split(max(cfg.micro_batch_size // 2, 1)))
    m.engine.module.train()
    totals: dict[str, float] = {}
    for i, rows in enumerate(micro):
        both = torch.cat([rows, rows + n])  # the pairs' chosen rows, then their rejected rows
        with hooks.phase("policy_fwd"):
            logp = sequence_logp(m.engine, ids[both], attn[both], resp[both])
        k = len(rows)
        with hooks.phase("loss"):
            loss, metrics = algo.pair_loss(logp[:k], logp[k:], ref[rows], ref[rows + n], n_pairs)
        with hooks.phase("backward"):
            dist_lib.backward(m.engine, loss, boundary=i == len(micro) - 1)
        for key, value in metrics.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    with hooks.phase("optim"):
        applied = dist_lib.step(m.engine)
    keys = sorted(totals)
    summed = collective.all_sum(torch.tensor([totals[k] for k in keys], dtype=torch.float64)).tolist()
    state = dataclasses.replace(
        state, step=state.step + 1, skipped_steps=state.skipped_steps + (applied is False)
    )
    row = {"step": state.step, "pairs": n_pairs, **dict(zip(keys, summed, strict=True))}
    row.update(skipped_steps=state.skipped_steps, optimizer_steps=1)
    tokens = float(collective.all_sum(resp.sum().double()))
    # It samples nothing: the budget counts the sequences it trains on (2 per pair) and their tokens.
    state = stopping.counted(state, 2 * n_pairs, kept=2 * n_pairs, tokens=tokens)
    return row, tokens, state
