"""Shape checks on entry to every component: one-line `ShapeError`s that name the part and tensor."""

from __future__ import annotations

import torch

from polgrad.errors import ShapeError


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
