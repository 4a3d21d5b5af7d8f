"""StepCounts: the aggregators' only source of denominators (a kind's contract passes it;
polgrad/registry/kinds.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from polgrad.errors import ShapeError

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
