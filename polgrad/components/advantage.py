"""Built-in advantage parts: per-token advantages (and critic targets) from rewards, values and groups.

Call signature: `polgrad.registry.kinds.AdvantageFn` (printed by `python -m polgrad.registry`),
the same for every estimator, plus keyword-only hyperparameters bound by gin.

`adv` is exactly 0 where mask is 0; `returns` (the critic's regression target) is given only by the
estimators that need a critic, and is 0 where mask is 0 as well. An estimator ignores the inputs it
does not use (the loop hands every estimator everything it has).

Conventions, shared by all estimators:

- Sequence-level estimators (reinforce, grpo, dr_grpo, rloo, remax) compute one number per
  sequence from `rewards` and broadcast it over the sequence's valid tokens.
- Token-level estimators (gae, mc, reinforce_pp, reinforce_pp_baseline) use `token_rewards`; when
  it is None they place `rewards[i]` on the last valid token of row i. A masked position is not a
  time step (verl's convention): the valid tokens of a row, in order, are the episode; the next
  value and the running sums carry across a hole unchanged, token rewards and values at masked
  positions are ignored, and after the last valid token V = 0 (the episode ends).
- Fully masked rows (padding, or a response with no trainable token) get adv = 0. Their rewards
  still count in their group: a group is what `group_ids` says it is, and the mask only says where
  advantages go. So a zero-length response still takes part in the group baseline of the other
  samples of its prompt. REINFORCE's batch-mean baseline, in contrast, averages only over rows
  with at least one valid token (the "real" rows, as in StepCounts.num_seqs), because a batch of
  prompts has no group to say which rows belong together, and padding rows do not.
- Groups: `group_ids` are arbitrary integers (any order, any values, mixed group sizes >= 2).
  Group statistics are computed relative to the group's largest reward, so a group whose rewards
  are all equal (all correct or all wrong, common with verifiable rewards) gets exactly 0; the
  same holds for REINFORCE++'s batch whitening when all returns tie.
- Everything is vectorised: groups through torch.unique + index_add_, discounted sums over time
  through the compacted valid tokens and (rate^k) upper-triangular matrices (no loop over T).
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from polgrad.checks import check_b, check_bt, require, zero_pad
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import register

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
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ConfigError(f"{where}: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _nonneg(where: str, name: str, value: float) -> float:
    """A hyperparameter >= 0 (eps)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) >= 0.0:
        raise ConfigError(f"{where}: {name} must be a number >= 0, got {value!r}")
    return float(value)


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


def _whiten(x: Tensor, m: Tensor, eps: float) -> Tensor:
    """(x - mean) / (std + eps) over the valid tokens of the whole batch, population std (divide by N,
    as OpenRLHF's advantage normalisation); 0 on masked tokens.

    Computed relative to the largest valid x (like the group statistics), so that a batch whose
    returns all tie gives exactly 0, also with eps = 0 (no 0/0, no rounding residue divided by a
    rounding-sized std).
    """
    valid = m != 0
    top = torch.where(valid, x, torch.full_like(x, float("-inf"))).max() if x.numel() else x.new_zeros(())
    d = _masked(x - torch.where(torch.isfinite(top), top, torch.zeros_like(top)), m)
    count = m.sum().clamp_min(1.0)
    centred = _masked(d - d.sum() / count, m)
    std = torch.sqrt((centred * centred).sum() / count)
    return _safe_div(centred, std + eps)


def _return_to_go(r: Tensor, m: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{k >= 0} gamma^k r_{t+k} over the valid tokens of each row (holes skipped), 0 elsewhere."""
    c = _Compact(m)
    return c.unpack(_discounted_sum(c.pack(r), gamma))


# ---------------------------------------------------------------------------------------------
# Token-level estimators with a critic
# ---------------------------------------------------------------------------------------------


@register(
    "advantage",
    "gae",
    level="token",
    needs_groups=False,
    needs_critic=True,
    needs_baseline_rollout=False,
    formula="A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t",
)
def gae(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the valid tokens, with a learned critic (PPO).

        delta_t = r_t + gamma V_{t+1} - V_t                  (the chapter's eq. 66)
        A_t     = sum_{l >= 0} (gamma lam)^l delta_{t+l}     (eq. 65 family, mixed by lambda)
        returns_t = A_t + V_t                                (the critic's target)

    Source: Schulman et al. (2016), "High-dimensional continuous control using generalized
    advantage estimation"; the chapter's eq. (65)-(66). lam = 0 gives the TD residual, lam = 1 the
    Monte-Carlo return minus V (= `mc`). t runs over the valid tokens of a row only (holes are
    skipped, V = 0 after the last valid token).

    Shapes: rewards [B] (used only when token_rewards is None: placed on the last valid token),
    mask [B,T], values [B,T] (required), token_rewards [B,T]. Returns (adv [B,T], returns [B,T]),
    both 0 where mask is 0. group_ids and baseline_rewards are ignored.
    Hyperparameters: gamma in [0,1] (discount, 1.0 for LM RLHF), lam in [0,1] (GAE lambda).
    """
    where = "advantage.gae"
    require(where, "values", values, _CRITIC_HINT)
    m, dtype = _enter(where, rewards, mask, values=values, token_rewards=token_rewards)
    gamma, lam = _unit(where, "gamma", gamma), _unit(where, "lam", lam)
    r, v = _token_rewards(rewards, token_rewards, m), _masked(values.to(dtype), m)
    c = _Compact(m)
    r_c, v_c = c.pack(r), c.pack(v)
    v_next = torch.cat([v_c[:, 1:], v_c.new_zeros(c.b, min(1, c.length))], dim=1)  # V = 0 after the end
    delta = r_c + gamma * v_next - v_c
    adv = c.unpack(_discounted_sum(delta, gamma * lam))
    return adv, _masked(adv + v, m)


@register(
    "advantage",
    "mc",
    level="token",
    needs_groups=False,
    needs_critic=True,
    needs_baseline_rollout=False,
    formula="A_t = G_t - V_t, G_t = sum_k gamma^k r_{t+k}",
)
def mc(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
    gamma: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Monte-Carlo return minus a learned critic baseline (no GAE mixing).

        G_t = sum_{k >= 0} gamma^k r_{t+k}      (the chapter's eq. 33, return-to-go over valid tokens)
        A_t = G_t - V_t,   returns_t = G_t      (eq. 49 with b(s_t) = V(s_t))

    Source: Williams (1992) REINFORCE with a state-value baseline; the chapter's eq. (33), (49).
    Equal to `gae` with lam = 1 (up to float rounding); the critic regresses on the MC return.

    Shapes: rewards [B] (used only when token_rewards is None: placed on the last valid token),
    mask [B,T], values [B,T] (required), token_rewards [B,T]. Returns (adv [B,T], returns [B,T]),
    both 0 where mask is 0. group_ids and baseline_rewards are ignored.
    Hyperparameters: gamma in [0,1].
    """
    where = "advantage.mc"
    require(where, "values", values, _CRITIC_HINT)
    m, dtype = _enter(where, rewards, mask, values=values, token_rewards=token_rewards)
    gamma = _unit(where, "gamma", gamma)
    r, v = _token_rewards(rewards, token_rewards, m), _masked(values.to(dtype), m)
    ret = _return_to_go(r, m, gamma)
    return _masked(ret - v, m), ret


# ---------------------------------------------------------------------------------------------
# Token-level estimators without a critic (REINFORCE++)
# ---------------------------------------------------------------------------------------------


@register(
    "advantage",
    "reinforce_pp",
    level="token",
    needs_groups=False,
    needs_critic=False,
    needs_baseline_rollout=False,
    formula="A_t = (G_t - mean_batch G) / (std_batch G + eps), G_t = sum_k gamma^k r_{t+k}",
)
def reinforce_pp(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, None]:
    """REINFORCE++: token-level return-to-go, whitened over every valid token of the batch.

        G_t = sum_{k >= 0} gamma^k r_{t+k}             (return-to-go of the per-token rewards)
        A_t = (G_t - mean(G)) / (std(G) + eps)        (mean, std over all valid tokens of the batch)

    Source: Hu (2025), "REINFORCE++: a simple and efficient approach for aligning large language
    models", arXiv:2501.03262; OpenRLHF's implementation (seed 003). The std is the population std
    (divide by the token count N), as OpenRLHF's advantage normalisation. Note that the whitening
    is over this call's batch: the loop should call it once on the whole rollout batch.

    Shapes: rewards [B] (used only when token_rewards is None: placed on the last valid token),
    mask [B,T], token_rewards [B,T] (score on the last token minus beta*kl per token).
    Returns (adv [B,T], None), adv 0 where mask is 0. Other inputs are ignored.
    Hyperparameters: gamma in [0,1]; eps >= 0 (with eps = 0 a batch of equal returns gives 0).
    """
    where = "advantage.reinforce_pp"
    m, _ = _enter(where, rewards, mask, token_rewards=token_rewards)
    gamma, eps = _unit(where, "gamma", gamma), _nonneg(where, "eps", eps)
    r = _token_rewards(rewards, token_rewards, m)
    ret = _return_to_go(r, m, gamma)
    return _whiten(ret, m, eps), None


@register(
    "advantage",
    "reinforce_pp_baseline",
    level="token",
    needs_groups=True,
    needs_critic=False,
    needs_baseline_rollout=False,
    formula="A_t = whiten_batch(G_t), G_t = return-to-go with score R_i - mean_G R",
)
def reinforce_pp_baseline(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-8,
) -> tuple[Tensor, None]:
    """REINFORCE++-baseline: subtract the group mean reward from the score, then REINFORCE++.

        r'_t = r_t - [t = last valid token] * mean_{j in G(i)} R_j
        G_t  = sum_{k >= 0} gamma^k r'_{t+k},   A_t = (G_t - mean(G)) / (std(G) + eps)

    Source: Hu (2025), arXiv:2501.03262, the "-baseline" variant for several samples per prompt;
    OpenRLHF (seed 003). The group mean is taken of `rewards`, so when KL is placed in the reward
    it includes the group's summed KL (OpenRLHF subtracts the mean of the raw scores, before KL;
    the two agree when KL is in the loss, as in registry/reinforce_pp_baseline.gin). The baseline
    is subtracted where the score sits, on the last valid token. Group means include fully masked
    rows (see the module docstring); whitening is over the batch's valid tokens (population std).

    Shapes: rewards [B], mask [B,T], group_ids [B] (required, groups of >= 2), token_rewards [B,T]
    (None: rewards on the last valid token). Returns (adv [B,T], None), adv 0 where mask is 0.
    Hyperparameters: gamma in [0,1]; eps >= 0.
    """
    where = "advantage.reinforce_pp_baseline"
    require(where, "group_ids", group_ids, _GROUPS_HINT)
    m, dtype = _enter(where, rewards, mask, group_ids=group_ids, token_rewards=token_rewards)
    gamma, eps = _unit(where, "gamma", gamma), _nonneg(where, "eps", eps)
    dev = _centered(*_groups(where, rewards.to(dtype), group_ids))  # R_i - mean_G R
    if token_rewards is None:
        r = last_token(dev, m)  # the centred score on the last valid token
    else:
        r = _masked(token_rewards.to(dtype), m) - last_token(rewards.to(dtype) - dev, m)
    ret = _return_to_go(r, m, gamma)
    return _whiten(ret, m, eps), None


# ---------------------------------------------------------------------------------------------
# Sequence-level estimators (one advantage per sequence, broadcast over its valid tokens)
# ---------------------------------------------------------------------------------------------


@register(
    "advantage",
    "reinforce",
    level="sequence",
    needs_groups=False,
    needs_critic=False,
    needs_baseline_rollout=False,
    formula="A_i = R_i - mean_B R",
)
def reinforce(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
) -> tuple[Tensor, None]:
    """REINFORCE with the batch-mean reward as baseline.

        A_i = R_i - b,   b = mean of R_j over the real rows j of the batch

    Source: Williams (1992), "Simple statistical gradient-following algorithms for connectionist
    reinforcement learning"; the chapter's eq. (48)-(49) with b the batch mean. Real rows are rows
    with at least one valid token: fully masked rows are padding and do not enter b (with no real
    row at all, b = 0 and adv = 0).

    Shapes: rewards [B], mask [B,T]. Returns (adv [B,T], None), adv_{i,t} = A_i * mask_{i,t}.
    Other inputs are ignored. No hyperparameters.
    """
    where = "advantage.reinforce"
    m, dtype = _enter(where, rewards, mask)
    r = rewards.to(dtype)
    real = (m.sum(dim=1) > 0).to(dtype)
    b = (r * real).sum() / real.sum().clamp_min(1.0)
    return _masked((r - b)[:, None], m), None


@register(
    "advantage",
    "grpo",
    level="sequence",
    needs_groups=True,
    needs_critic=False,
    needs_baseline_rollout=False,
    formula="A_i = (r_i - mean_G r) / (std_G r + eps)",
)
def grpo(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, None]:
    """GRPO's group-normalised advantage.

        A_i = (r_i - mean_G r) / (std_G r + eps),   std with Bessel's correction (divide by G - 1)

    Source: Shao et al. (2024), DeepSeekMath; the chapter's eq. (60); verl's GRPO (seed 004,
    torch.std and eps = 1e-6). G is the size of i's group (groups may differ in size, >= 2).
    A group with equal rewards gets exactly 0 (also with eps = 0). Fully masked rows count in
    their group's mean and std.

    Shapes: rewards [B], mask [B,T], group_ids [B] (required). Returns (adv [B,T], None),
    adv_{i,t} = A_i * mask_{i,t}. Other inputs are ignored.
    Hyperparameters: eps >= 0 (added to the std).
    """
    where = "advantage.grpo"
    require(where, "group_ids", group_ids, _GROUPS_HINT)
    m, dtype = _enter(where, rewards, mask, group_ids=group_ids)
    eps = _nonneg(where, "eps", eps)
    d, dsum, n, inv = _groups(where, rewards.to(dtype), group_ids)
    dev = _centered(d, dsum, n, inv)
    std = torch.sqrt(torch.zeros_like(n).index_add_(0, inv, dev * dev) / (n - 1))
    return _masked(_safe_div(dev, std[inv] + eps)[:, None], m), None


@register(
    "advantage",
    "dr_grpo",
    level="sequence",
    needs_groups=True,
    needs_critic=False,
    needs_baseline_rollout=False,
    formula="A_i = r_i - mean_G r",
)
def dr_grpo(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
) -> tuple[Tensor, None]:
    """Dr. GRPO ("GRPO done right"): the group mean as baseline, no std normalisation.

        A_i = r_i - (1/G) sum_{j in G} r_j

    Source: Liu et al. (2025), "Understanding R1-Zero-like training: a critical perspective";
    the chapter's eq. (61). Equals (G-1)/G times RLOO (eq. 62-63). Fully masked rows count in
    their group's mean.

    Shapes: rewards [B], mask [B,T], group_ids [B] (required). Returns (adv [B,T], None),
    adv_{i,t} = A_i * mask_{i,t}. Other inputs are ignored. No hyperparameters.
    """
    where = "advantage.dr_grpo"
    require(where, "group_ids", group_ids, _GROUPS_HINT)
    m, dtype = _enter(where, rewards, mask, group_ids=group_ids)
    d, dsum, n, inv = _groups(where, rewards.to(dtype), group_ids)
    return _masked(_centered(d, dsum, n, inv)[:, None], m), None


@register(
    "advantage",
    "rloo",
    level="sequence",
    needs_groups=True,
    needs_critic=False,
    needs_baseline_rollout=False,
    formula="A_i = r_i - 1/(G-1) sum_{j != i} r_j",
)
def rloo(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
) -> tuple[Tensor, None]:
    """REINFORCE leave-one-out: the mean reward of the other samples of the prompt as baseline.

        A_i = r_i - (1/(G-1)) sum_{j in G, j != i} r_j  =  G/(G-1) (r_i - mean_G r)

    Source: Kool et al. (2019), "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et
    al. (2024), "Back to basics"; the chapter's eq. (51)-(53) (and (62)). Computed in the
    leave-one-out form (51)-(52). Fully masked rows count in their group's baseline.

    Shapes: rewards [B], mask [B,T], group_ids [B] (required). Returns (adv [B,T], None),
    adv_{i,t} = A_i * mask_{i,t}. Other inputs are ignored. No hyperparameters.
    """
    where = "advantage.rloo"
    require(where, "group_ids", group_ids, _GROUPS_HINT)
    m, dtype = _enter(where, rewards, mask, group_ids=group_ids)
    d, dsum, n, inv = _groups(where, rewards.to(dtype), group_ids)
    adv = d - (dsum[inv] - d) / (n[inv] - 1)  # the shift by the group max cancels in the difference
    return _masked(adv[:, None], m), None


@register(
    "advantage",
    "remax",
    level="sequence",
    needs_groups=False,
    needs_critic=False,
    needs_baseline_rollout=True,
    formula="A_i = R_i - R(greedy_i)",
)
def remax(
    rewards: Tensor,
    mask: Tensor,
    *,
    group_ids: Tensor | None = None,
    values: Tensor | None = None,
    token_rewards: Tensor | None = None,
    baseline_rewards: Tensor | None = None,
) -> tuple[Tensor, None]:
    """ReMax: the reward of the greedy decode of the same prompt as baseline.

        A_i = R(x_i, y_i) - R(x_i, y_i^greedy)

    Source: Li et al. (2023), "ReMax: a simple, effective, and efficient reinforcement learning
    method for aligning large language models" (mentioned in the chapter's further reading).

    Shapes: rewards [B], mask [B,T], baseline_rewards [B] (required: the greedy response's reward
    for row i's prompt, supplied by the rollout). Returns (adv [B,T], None),
    adv_{i,t} = A_i * mask_{i,t}. Other inputs are ignored. No hyperparameters.
    """
    where = "advantage.remax"
    require(where, "baseline_rewards", baseline_rewards, _BASELINE_HINT)
    m, dtype = _enter(where, rewards, mask, baseline_rewards=baseline_rewards)
    adv = rewards.to(dtype) - baseline_rewards.to(dtype)
    return _masked(adv[:, None], m), None
