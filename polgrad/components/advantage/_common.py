"""Entry checks and shared helpers of the advantage estimators (conventions: see the package docstring)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from polgrad.checks import check_b, check_bt, is_real, zero_pad
from polgrad.collective import all_max, all_sum
from polgrad.errors import ConfigError, ShapeError

_CRITIC_HINT = "this estimator needs a critic: set Algorithm.value_init (e.g. @value_init.policy)"
_GROUPS_HINT = (
    "this estimator compares samples of the same prompt: set Algorithm.group_size >= 2 so that "
    "the rollout samples several responses per prompt and assigns group ids"
)
_BASELINE_HINT = (
    "the rollout must produce the greedy baseline: decode each prompt greedily and score it "
    "(the part declares needs_baseline_rollout=True)"
)


# ---------------------------------------------------------------------------------------------
# Entry checks and shared helpers
# ---------------------------------------------------------------------------------------------


def _enter(
    where: str,
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
) -> tuple[Tensor, torch.dtype]:
    """Check shapes, dtypes and values; return (mask as 0/1 float of the computation dtype, dtype)."""
    b, _ = check_bt(where, mask, values=values, token_rewards=token_rewards)
    check_b(where, b, rewards=rewards, group_ids=group_ids, baseline_rewards=baseline_rewards)
    floats = {"rewards": rewards, "values": values, "token_rewards": token_rewards}
    floats["baseline_rewards"] = baseline_rewards
    for name, x in floats.items():
        if x is not None and not x.is_floating_point():
            raise ShapeError(f"{where}: {name} must be a float tensor, got {x.dtype}")
    if group_ids is not None and (
        group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool
    ):
        raise ShapeError(f"{where}: group_ids must be an integer tensor (int64), got {group_ids.dtype}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ShapeError(f"{where}: mask must hold only 0 and 1 (float 0/1 over response tokens)")
    valid = mask != 0
    for name, x in (("rewards", rewards), ("baseline_rewards", baseline_rewards)):
        if x is not None and not bool(torch.isfinite(x).all()):
            raise ShapeError(f"{where}: {name} must be finite, got NaN or inf")
    for name, x in (("values", values), ("token_rewards", token_rewards)):
        if x is not None and not bool((torch.isfinite(x) | ~valid).all()):
            raise ShapeError(f"{where}: {name} must be finite on valid tokens, got NaN or inf")
    dtype = rewards.dtype
    for x in (values, token_rewards, baseline_rewards):
        if x is not None:
            dtype = torch.promote_types(dtype, x.dtype)
    return valid.to(dtype), dtype


def _unit(where: str, name: str, value: float) -> float:
    """A hyperparameter in [0, 1] (gamma, lam)."""
    if not is_real(value, abc=True) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{where}: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _nonneg(where: str, name: str, value: float) -> float:
    """A hyperparameter >= 0 (eps)."""
    if not is_real(value, abc=True) or not float(value) >= 0.0:
        raise ConfigError(f"{where}: {name} must be a number >= 0, got {value!r}")
    return float(value)


def _flag(where: str, name: str, value: bool) -> bool:
    """A boolean switch (whiten, normalize, per_token): True or False, nothing else."""
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {name} must be True or False, got {value!r}")
    return value


def _choice(where: str, name: str, value: str, choices: tuple[str, ...]) -> str:
    """A string option out of `choices` (e.g. grpo's scale)."""
    if not isinstance(value, str) or value not in choices:
        valid = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{where}: {name} must be one of {valid}, got {value!r}")
    return value


def _masked(x: Tensor, m: Tensor) -> Tensor:
    """x on valid tokens, exactly 0 elsewhere (also if x holds garbage in padding)."""
    return zero_pad(m != 0, x)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den, and 0 where den == 0 (a zero-spread group or batch with eps = 0 gives 0, not NaN)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def _groups(where: str, rewards: Tensor, group_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Group bookkeeping for a sequence-level baseline.

    Returns (d [B], dsum [G], n [G], inv [B]) with d_i = r_i - max_{g(i)} r, dsum_g = sum_{i in g} d_i,
    n_g the group size and inv_i the group index of row i. Working with d instead of r keeps the
    arithmetic relative to the group's own spread (a constant group gives d = 0 exactly).
    Every group must have at least 2 rows; callers have checked that group_ids is given.
    """
    uniq, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    lonely = counts < 2
    if bool(lonely.any()):
        bad = uniq[lonely].tolist()
        listed = ", ".join(str(g) for g in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise ShapeError(
            f"{where}: group {listed} has a single sequence; group size must be >= 2 for a "
            f"group baseline (set Algorithm.group_size >= 2, and keep or drop whole groups)"
        )
    n = counts.to(rewards.dtype)
    top = torch.full_like(n, float("-inf")).scatter_reduce(0, inv, rewards, reduce="amax")
    d = rewards - top[inv]
    dsum = torch.zeros_like(n).index_add_(0, inv, d)
    return d, dsum, n, inv


def _centered(d: Tensor, dsum: Tensor, n: Tensor, inv: Tensor) -> Tensor:
    """r_i - mean_{g(i)} r, from the group-relative d (see _groups)."""
    return d - (dsum / n)[inv]


def last_token(rewards: Tensor, m: Tensor) -> Tensor:
    """[B,T] with rewards[i] on the last valid token of row i, 0 elsewhere (fully masked rows: all 0)."""
    t = m.shape[1]
    if t == 0:
        return torch.zeros_like(m)
    last = (t - 1) - torch.flip(m, dims=[1]).argmax(dim=1)  # argmax returns the first maximum
    has = m.sum(dim=1) > 0
    src = torch.where(has, rewards.to(m.dtype), torch.zeros_like(rewards, dtype=m.dtype))
    return torch.zeros_like(m).scatter_(1, last[:, None], src[:, None])


def _token_rewards(rewards: Tensor, token_rewards: Tensor | None, m: Tensor) -> Tensor:
    """The per-token rewards a token-level estimator uses: token_rewards, or rewards on the last token."""
    if token_rewards is None:
        return last_token(rewards, m)
    return _masked(token_rewards.to(m.dtype), m)


class _Compact:
    """The valid tokens of each row, moved to the front in order: row i becomes a sequence of
    n_i = sum_t mask[i,t] time steps, zero-padded to L = max_i n_i. Holes and padding vanish."""

    def __init__(self, m: Tensor):
        self.b, self.t = m.shape
        pos = torch.cumsum(m, dim=1).long() - 1  # rank of each valid token within its row
        self.idx = torch.where(m != 0, pos, torch.full_like(pos, self.t))  # masked -> spare slot T
        self.length = int(m.sum(dim=1).max().item()) if m.numel() else 0

    def pack(self, x: Tensor) -> Tensor:
        """[B,T] -> [B,L]: valid entries in order, 0 after each row's end."""
        out = x.new_zeros(self.b, self.t + 1).scatter_(1, self.idx, x)  # masked entries land in slot T
        return out[:, : self.length]

    def unpack(self, y: Tensor) -> Tensor:
        """[B,L] -> [B,T]: back to the original positions, 0 on masked tokens."""
        pad = y.new_zeros(self.b, self.t + 1 - self.length)
        return torch.cat([y, pad], dim=1).gather(1, self.idx)


def _decay_matrix(n: int, rate: float, like: Tensor) -> Tensor:
    """[n, n] upper-triangular W with W[j, k] = rate^(j-k) for j >= k, else 0 (0^0 = 1)."""
    k = torch.arange(n, device=like.device)
    e = k[:, None] - k[None, :]  # e[j, k] = j - k
    base = torch.tensor(rate, dtype=like.dtype, device=like.device)
    return torch.where(e >= 0, base.pow(e.clamp_min(0).to(like.dtype)), torch.zeros((), dtype=like.dtype))


def _discounted_sum(x: Tensor, rate: float) -> Tensor:
    """y_k = sum_{j >= k} rate^(j-k) x_j along dim 1 of x [B,L], without a loop over time.

    Two levels of the closed form y = x @ W (W[j,k] = rate^(j-k), j >= k), so that no L x L
    matrix is built: cut L into n chunks of C ~ sqrt(L) steps, take the within-chunk sums with one
    C x C matrix, the sums carried in from later chunks with one n x n matrix of rate^C, and add
    them back with the decay rate^(C - i) of position i in its chunk:
        y_i = inner_i + rate^(C - i mod C) * y_(start of the next chunk).
    Every weight is a power rate^e with e >= 0, in [0, 1]: no rate^(-k) rescaling that would
    overflow on long sequences. Cost O(B L sqrt(L)), memory O(B L).
    """
    b, length = x.shape
    if length == 0:
        return x.clone()
    c = math.isqrt(length - 1) + 1  # ceil(sqrt(L))
    n = -(-length // c)
    xs = torch.cat([x, x.new_zeros(b, n * c - length)], dim=1).view(b, n, c)
    inner = xs @ _decay_matrix(c, rate, x)  # [B, n, C] sums within each chunk
    carried = inner[:, :, 0] @ _decay_matrix(n, rate**c, x)  # [B, n] y at the start of each chunk
    nxt = torch.cat([carried[:, 1:], carried.new_zeros(b, 1)], dim=1)  # ... of the next chunk
    decay = torch.tensor(rate, dtype=x.dtype, device=x.device).pow(
        torch.arange(c, 0, -1, device=x.device).to(x.dtype)
    )  # rate^(C - i), i = 0..C-1
    return (inner + nxt[:, :, None] * decay).reshape(b, n * c)[:, :length]


def _batch_moments(x: Tensor, m: Tensor, *, ddof: int = 0) -> tuple[Tensor, Tensor]:
    """(x - mean) on valid entries (0 elsewhere) and the variance, over the valid entries of the
    whole batch: every data-parallel rank's share (polgrad.collective), not only this call's.

        mean = sum_valid x / N,   var = sum_valid (x - mean)^2 / (N - ddof)   (N - ddof >= 1)

    N counts the valid entries of all ranks; ddof = 0 is the population variance, 1 Bessel's.
    Computed from three reductions (the maximum, the sums of x and of the mask, the sum of squared
    deviations), so at world size 2 it equals the statistic of the concatenated batch, and relative
    to the batch's largest valid x, so that a batch whose values all tie gives exactly 0 (no
    rounding residue of the mean). Collective: every rank must call it, in the same order.
    Shapes: x, m of one shape ([B,T] tokens or [B] rows), m 0/1 -> (centred like x, var 0-dim).
    """
    valid = m != 0
    local_top = (
        torch.where(valid, x, torch.full_like(x, float("-inf"))).max()
        if x.numel()
        else x.new_full((), float("-inf"))
    )
    top = all_max(local_top)
    d = _masked(x - torch.where(torch.isfinite(top), top, torch.zeros_like(top)), m)
    sums = all_sum(torch.stack([d.sum(), m.sum().to(d.dtype)]))
    count = sums[1].clamp_min(1.0)
    centred = _masked(d - sums[0] / count, m)
    var = all_sum((centred * centred).sum()) / (count - ddof).clamp_min(1.0)
    return centred, var


def _whiten(x: Tensor, m: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the valid tokens of the whole batch (all ranks), population std
    (divide by N, as OpenRLHF's advantage normalisation); 0 on masked tokens.

    A batch whose returns all tie gives exactly 0, also with eps = 0 (see _batch_moments).
    """
    centred, var = _batch_moments(x, m)
    return _safe_div(centred, torch.sqrt(var) + eps)


def _return_to_go(r: Tensor, m: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= 0} gamma^k r_{t+k} over the valid tokens of each row (holes skipped), 0 elsewhere."""
    c = _Compact(m)
    return c.unpack(_discounted_sum(c.pack(r), gamma))
