"""Reductions over the data-parallel ranks, for the statistics that span a whole batch.

Each data-parallel rank holds its own share of the rollout batch. A statistic of the batch (the
mean and std of a whitening, a batch std, the KL the controller reads, a logged mean) must be the
same number on every rank and equal to the statistic of the concatenated batch, so parts compute
it from sums, counts and maxima that these functions reduce over the ranks. Outside a process
group, or at world size 1, every function returns its input unchanged: a part stays a pure
function of its arguments on one process.

Collective: when the world size is above 1, every rank must make the same calls in the same order.
Groups (the G samples of one prompt) never straddle ranks: each rank samples whole groups, so
group statistics stay rank-local.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["all_max", "all_min", "all_sum", "moments", "rank", "rank_zero_first", "world_size"]


def world_size() -> int:
    """The number of data-parallel ranks (1 outside a process group)."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank (0 outside a process group)."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank()
    return 0


def _reduce(t: Tensor, op_name: str) -> Tensor:
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return t
    out = t.detach().clone()
    tdist.all_reduce(out, op=getattr(tdist.ReduceOp, op_name))
    return out


def all_sum(t: Tensor) -> Tensor:
    """`t` summed elementwise over the ranks (a detached copy); `t` itself at world size 1."""
    return _reduce(t, "SUM")


def all_max(t: Tensor) -> Tensor:
    """Elementwise maximum over the ranks; `t` itself at world size 1."""
    return _reduce(t, "MAX")


def all_min(t: Tensor) -> Tensor:
    """Elementwise minimum over the ranks; `t` itself at world size 1."""
    return _reduce(t, "MIN")


def moments(x: Tensor, ddof: int = 0) -> tuple[float, Tensor, Tensor]:
    """(N, x - mean, variance) over every entry of `x` on every rank (collective).

        N = number of entries over the ranks,  mean = sum x / N,
        var = sum (x - mean)^2 / (N - ddof)      (ddof 0: population, 1: Bessel; N - ddof >= 1)

    Two reductions (the count and sum, then the squared deviations), so at world size W the
    result equals the statistic of the concatenated batch. Shapes: x [n] -> (float, [n], 0-dim).
    """
    n, total = all_sum(torch.stack([x.new_tensor(float(x.numel())), x.sum()]))
    centred = x - total / n
    (squares,) = all_sum((centred * centred).sum().reshape(1))
    return float(n), centred, squares / (n - ddof).clamp_min(1.0)


@contextlib.contextmanager
def rank_zero_first() -> Iterator[None]:
    """Rank 0 runs the block first, the other ranks after it (a barrier each side); one process: just
    the block. For work that fills a cache every rank then reads, e.g. the SFT warm start: transformers
    writes a checkpoint from rank 0 only when torch.distributed is initialised, so a cache entry built
    by another rank would hold no weights. The block must not be collective. If rank 0 raises, the
    others are released and run it themselves (they raise too, or find what rank 0 left)."""
    import torch.distributed as tdist

    on = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1
    first = not on or tdist.get_rank() == 0
    if not first:
        tdist.barrier()
    try:
        yield
    finally:
        if on and first:
            tdist.barrier()
