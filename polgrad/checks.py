"""Shape checks for parts, built-in or your own: one-line `ShapeError`s naming the part and tensor.

A part checks its inputs on entry, so a wrong shape fails at the part with the part's name
instead of broadcasting silently three functions later:

    import torch
    from polgrad.checks import check_b, check_bt, require, zero_pad
    from polgrad.registry import register


    @register("advantage", "median_baseline", level="sequence", needs_groups=True)
    def median_baseline(rewards, mask, *, group_ids, values=None, token_rewards=None,
                        baseline_rewards=None):
        '''A_i = r_i - median of its group's rewards, broadcast over the response.'''
        where = "advantage.median_baseline"
        require(where, "group_ids", group_ids, "the loop passes it; pass it when testing")  # not None
        b, _ = check_bt(where, mask)                  # mask is [B,T]; returns (B, T)
        check_b(where, b, rewards=rewards, group_ids=group_ids)   # each is a [B] vector
        med = torch.stack([rewards[group_ids == g].median() for g in group_ids])
        return zero_pad(mask.bool(), (rewards - med)[:, None].expand_as(mask)), None

`check_bt(where, mask, **tensors)` also checks that each named tensor has the mask's [B,T] shape;
`None` tensors are skipped by every check except `require`. `zero_pad(keep, x)` puts an exact 0
where `keep` is False without letting padding's nan/inf reach the value or the gradient.
"""

from __future__ import annotations

import torch

from polgrad.errors import ShapeError

__all__ = ["check_b", "check_bt", "require", "zero_pad"]


def zero_pad(keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x where `keep` (bool, broadcastable to x) is set, exactly +0 elsewhere.

    torch.where with a 0-dim zero: no [B,T] fill, and whatever padding holds (nan, inf) reaches
    neither the value nor the gradient (torch.where passes no gradient to the side it drops)."""
    return torch.where(keep, x, x.new_zeros(()))


def check_bt(where: str, mask: torch.Tensor, **tensors: torch.Tensor | None) -> tuple[int, int]:
    """Check that `mask` is [B,T] float 0/1 and every given tensor is [B,T] too. Returns (B, T)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ShapeError(f"{where}: mask must be a [B,T] tensor, got {_desc(mask)}")
    b, t = mask.shape
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (b, t):
            raise ShapeError(f"{where}: {name} must have the shape of mask [B,T]=[{b},{t}], got {_desc(x)}")
    return b, t


def check_b(where: str, b: int, **tensors: torch.Tensor | None) -> None:
    """Check that every given tensor is a vector of length B."""
    for name, x in tensors.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (b,):
            raise ShapeError(f"{where}: {name} must be a [B]=[{b}] vector, got {_desc(x)}")


def require(where: str, name: str, x, hint: str) -> None:
    """A tensor an estimator needs was not supplied: say which binding provides it."""
    if x is None:
        raise ShapeError(f"{where} needs {name} but got None; {hint}")


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {list(x.shape)} ({x.dtype})"
    return type(x).__name__
