"""The one call signature of each kind, as typing Protocols.

The training loop calls every part of a kind exactly this way and never branches on a name.
Tensor names are the glossary's (CONTRIBUTING.md): B sequences, T response tokens, V vocabulary.

    logp, old_logp, ref_logp, rollout_logp  [B,T]  log-prob of each sampled response token
    mask        [B,T]  float 0/1, 1 on response tokens that count (holes allowed)
    rewards     [B]    one scalar per sequence (score, after shaping; plus folded KL if placed in reward)
    token_rewards [B,T] per-token rewards (score on the last valid token, minus beta*kl per token)
    group_ids   [B]    int64, sequences sampled from the same prompt share an id
    values, old_values, returns, adv  [B,T]

Hyperparameters are keyword-only and bound by gin (`advantage.grpo.eps = 1e-6`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from polgrad.errors import ShapeError


class AdvantageFn(Protocol):
    def __call__(
        self,
        rewards: Tensor,
        mask: Tensor,
        *,
        group_ids: Tensor | None = None,
        values: Tensor | None = None,
        token_rewards: Tensor | None = None,
        baseline_rewards: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """-> (adv [B,T] zero where mask is 0, returns [B,T] or None when no critic is trained)."""
        ...


class KLFn(Protocol):
    def __call__(
        self,
        logp: Tensor,
        ref_logp: Tensor,
        mask: Tensor,
        *,
        logits: Tensor | None = None,
        ref_logits: Tensor | None = None,
    ) -> Tensor:
        """-> per-token KL estimate [B,T] (zero where mask is 0)."""
        ...


class ClipFn(Protocol):
    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        adv: Tensor,
        mask: Tensor,
        *,
        rollout_logp: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """-> (per-token loss to minimise [B,T], per-token metric tensors [B,T] such as
        'clip_low', 'clip_high' (0/1 indicators) and 'approx_kl'); the Algorithm averages
        metrics over the step's tokens."""
        ...


class AggregateFn(Protocol):
    def __call__(self, loss: Tensor, mask: Tensor, counts: StepCounts) -> Tensor:
        """-> scalar; the denominators come from `counts`, the whole optimizer step's counts."""
        ...


class ValueLossFn(Protocol):
    def __call__(self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
        """-> per-token value loss [B,T]."""
        ...


class KLControllerFn(Protocol):
    def __call__(self, coef: float, measured_kl: float, n_steps: int) -> float:
        """-> the KL coefficient for the next step."""
        ...


class RewardShapingFn(Protocol):
    def __call__(self, scores: Tensor, mask: Tensor, *, truncated: Tensor) -> Tensor:
        """scores [B] float, mask [B,T], truncated [B] bool (no EOS within the budget) -> scores [B]."""
        ...


class FilterFn(Protocol):
    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """-> keep [B] bool: which sequences enter the update."""
        ...


_STEP_COUNTS_TOKEN = object()


@dataclass(frozen=True)
class StepCounts:
    """Denominators of one optimizer step: over ALL its micro-batches and ALL data-parallel ranks.

    The only constructor is `StepCounts.of_step(masks)`, which sees every micro-batch mask of the
    step (and all-reduces over ranks when torch.distributed is initialised). Aggregators take a
    StepCounts and nothing else for their denominators, so a per-micro-batch denominator, the bug
    that makes gradient accumulation change the loss, cannot be written by accident.

    num_tokens: sum of mask over the step.
    num_seqs:   number of sequences with at least one valid token (fully masked rows are padding).
    """

    num_tokens: float
    num_seqs: float
    _token: object = None

    def __post_init__(self):
        if self._token is not _STEP_COUNTS_TOKEN:
            raise ShapeError(
                "StepCounts must be built with StepCounts.of_step(masks_of_every_microbatch), "
                "so that denominators are those of the whole optimizer step"
            )
        if self.num_tokens <= 0 or self.num_seqs <= 0:
            raise ShapeError(
                f"StepCounts: the step has no valid tokens (num_tokens={self.num_tokens}, "
                f"num_seqs={self.num_seqs}); every sequence is masked out"
            )

    @classmethod
    def of_step(cls, masks: list[Tensor] | tuple[Tensor, ...] | Tensor) -> StepCounts:
        """Counts over every micro-batch mask of the step, summed over data-parallel ranks."""
        if isinstance(masks, Tensor):
            masks = [masks]
        if not masks:
            raise ShapeError("StepCounts.of_step needs at least one mask")
        for m in masks:
            if not isinstance(m, Tensor) or m.dim() != 2:
                raise ShapeError("StepCounts.of_step: every mask must be a [B,T] tensor")
        tokens = sum(float(m.sum()) for m in masks)
        seqs = sum(float((m.sum(-1) > 0).sum()) for m in masks)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            t = torch.tensor([tokens, seqs], dtype=torch.float64)
            torch.distributed.all_reduce(t)
            tokens, seqs = float(t[0]), float(t[1])
        return cls(num_tokens=tokens, num_seqs=seqs, _token=_STEP_COUNTS_TOKEN)
