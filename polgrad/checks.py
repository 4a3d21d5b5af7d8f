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

`is_int(v)` and `is_real(v)` are the one numeric type test of every binding check in polgrad
(a bool is an int to Python, never a number to a config): check the type here, the range
(finite, > 0, ...) where the value is used.
"""

from __future__ import annotations

import numbers

import torch

from polgrad.errors import ShapeError

__all__ = ["check_b", "check_bt", "is_int", "is_real", "require", "zero_pad"]


def is_int(v, *, abc: bool = False) -> bool:
    """True if `v` is an int and not a bool (True is 1 to Python, never a count to a config).

    abc=False: the built-in `int` only (what gin, JSON and YAML produce); a numpy int is not one.
    abc=True: any `numbers.Integral` (numpy ints too), for a part called with values from code."""
    return isinstance(v, numbers.Integral if abc else int) and not isinstance(v, bool)


def is_real(v, *, abc: bool = False) -> bool:
    """True if `v` is an int or a float and not a bool. nan and +-inf count: a caller that needs a
    finite value or a range compares after this test (`not 0 < v < math.inf` also rejects nan).

    abc=False: the built-in `int`/`float` (numpy float64 is a float, numpy float32 and int64 are not).
    abc=True: any `numbers.Real` (numpy scalars, Fraction), for a part called with values from code."""
    return isinstance(v, numbers.Real if abc else (int, float)) and not isinstance(v, bool)


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
