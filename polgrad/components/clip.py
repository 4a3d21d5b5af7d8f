"""Built-in clip parts: the per-token policy surrogate.

Call signature: `polgrad.registry.kinds.ClipFn`. Every part returns the per-token loss to
*minimise* (minus the surrogate objective), zero where mask is 0,
and per-token metric tensors (detached, zero where mask is 0) that the Algorithm averages over the
step's tokens. Every part reports

    clip_low    1 where the lower bound is active and the token gets no gradient: A < 0 and ρ < 1-ε_low
    clip_high   1 where the upper bound is active and the token gets no gradient: A > 0 and ρ > 1+ε_high
    approx_kl   k3 estimate of KL(π_old || π_θ) per token: (ρ - 1) - log ρ  (>= 0)

(`cispo` never drops a token; there the two indicators mark truncated importance weights, see its
docstring). ρ = π_θ(y_t)/π_old(y_t) = exp(logp - old_logp) is the chapter's policy ratio (eq. 57).

Numerical guard shared by all parts: the log-ratio logp - old_logp is clamped to [-20, 20] before
the exp (as verl does), so ρ stays finite in every float type; a ratio beyond e^{±20} is far outside
any trust region, and there its gradient is zero. Padding (mask 0) may hold any value, even -inf
or nan: it is selected out (torch.where, which passes no gradient to the unselected side) before
any nonlinearity, so value and gradient stay clean.

The parts rely on that selection to skip work (tests/components/test_clip.py checks the outcome): on padding
the log-ratio is exactly 0, so ρ = 1 and approx_kl = e^0 - 1 - 0 = 0, and A = 0, so the clip
indicators (A < 0 / A > 0; for cispo ρ = 1 outside [1-ε_low, 1+ε_high], which cannot be) are
already 0 there and need no second select. A metric that can be non-zero on padding (an IS weight
of 1, say) is selected out explicitly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from polgrad.checks import check_bt, is_real, require, zero_pad
from polgrad.errors import ConfigError
from polgrad.registry import register

_MAX_LOG_RATIO = 20.0

_PPO_FORMULA = "min(ρA, clip(ρ,1-ε_low,1+ε_high)A)"


# ---------------------------------------------------------------------------------------------
# Hyperparameter checks: one-line ConfigErrors naming the parameter as gin spells it.


def _bounds(part: str, eps_low, eps_high, *, low_optional: bool = False) -> tuple[float | None, float]:
    """Validate eps_low/eps_high of `clip.<part>` and return the ratio bounds (1-eps_low, 1+eps_high)."""
    if eps_low is None and low_optional:
        lower = None
    elif not is_real(eps_low) or not 0 <= eps_low <= 1:
        raise ConfigError(f"clip.{part}.eps_low must be a number in [0, 1], got {eps_low!r}")
    else:
        lower = 1.0 - eps_low
    if not is_real(eps_high) or not eps_high >= 0 or math.isinf(eps_high):
        raise ConfigError(f"clip.{part}.eps_high must be a finite number >= 0, got {eps_high!r}")
    return lower, 1.0 + eps_high


# ---------------------------------------------------------------------------------------------
# Shared pieces.


def _prepare(
    where: str, logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, rollout_logp: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Shape-check and return (valid, adv, log_ratio), both exactly 0 on padding.

    log_ratio = clamp(logp - old_logp, ±20). The difference is selected, not its two operands: the
    same values on valid tokens, one select fewer. A part that uses logp itself pads it first.
    """
    check_bt(where, mask, logp=logp, old_logp=old_logp, adv=adv, rollout_logp=rollout_logp)
    valid = mask > 0
    adv = zero_pad(valid, adv.detach())
    log_ratio = torch.clamp(zero_pad(valid, logp - old_logp.detach()), -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return valid, adv, log_ratio


def _plus_zero(loss: Tensor) -> Tensor:
    """The loss with +0.0 on padding. Every part's inputs are already 0 there (A = 0, ρ = 1, padded
    logp), so its loss is ±0 on padding: adding +0.0 turns -0.0 into +0.0 (IEEE 754) at a tenth of
    the cost of a select. Other values are unchanged but for a -0.0 on a valid token, also +0.0."""
    return loss + 0.0


def _ppo_loss(ratio: Tensor, adv: Tensor, lower: float, upper: float) -> Tensor:
    """Minus the clipped surrogate (chapter eq. 54-55): max(-ρA, -clip(ρ, lower, upper)A)."""
    return torch.maximum(-ratio * adv, -torch.clamp(ratio, lower, upper) * adv)


def _clipped(ratio: Tensor, adv: Tensor, lower: float, upper: float) -> tuple[Tensor, Tensor]:
    """(clip_low, clip_high) bool [B,T]: the chapter's two zero-gradient cases after eq. 57.

    Both are False on padding without a select, since `adv` is zero there (module docstring)."""
    r = ratio.detach()
    return (adv < 0) & (r < lower), (adv > 0) & (r > upper)


def _metrics(
    log_ratio: Tensor, clip_low: Tensor | None, clip_high: Tensor | None, **extra: Tensor
) -> dict[str, Tensor]:
    """The common metrics (see the module docstring) plus `extra` ones, detached, in log_ratio's dtype.

    Every tensor passed must already be zero on padding: indicators built from the zero-padded
    adv and ratio are; anything else goes through `_zero_pad` first. None is an indicator that is
    never set. approx_kl needs no select: the log-ratio is exactly 0 on padding.
    """
    d = log_ratio.detach()
    out = {"clip_low": clip_low, "clip_high": clip_high, "approx_kl": torch.expm1(d) - d, **extra}
    return {k: torch.zeros_like(d) if v is None else v.detach().to(d.dtype) for k, v in out.items()}


# ---------------------------------------------------------------------------------------------
# The parts.


@register("clip", "none", formula="ρA", ratio="token", off_policy=False)
def none(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *, rollout_logp: Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain importance-weighted policy gradient, no clipping: loss = -ρA, ρ = exp(logp - old_logp).

    ∇loss = -ρA ∇log π_θ. With logp == old_logp (one gradient step per batch) ρ = 1 and this is the
    chapter's eq. 64 simplification, loss value -A and gradient -A ∇log π_θ (REINFORCE with
    advantage A, eq. 50). Source: chapter eq. 50, 57, 64. clip_low/clip_high are always 0.
    Shapes: logp, old_logp, adv, mask [B,T] (rollout_logp ignored) -> loss [B,T], metrics [B,T].
    """
    _, adv, log_ratio = _prepare("clip.none", logp, old_logp, adv, mask, rollout_logp)
    ratio = torch.exp(log_ratio)
    loss = _plus_zero(-ratio * adv)
    return loss, _metrics(log_ratio, None, None)


@register("clip", "ppo", formula=_PPO_FORMULA, ratio="token", off_policy=False)
def ppo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    rollout_logp: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate: loss = max(-ρA, -clip(ρ, 1-ε_low, 1+ε_high)A).

    Source: chapter eq. 54-55 (Schulman et al. 2017) with the clip range split into ε_low/ε_high;
    ε_high > ε_low is DAPO's clip-higher (Yu et al. 2025). Inside [1-ε_low, 1+ε_high] this equals
    `none`; the gradient is zero exactly in the chapter's two clipped cases after eq. 57 (A > 0 and
    ρ > 1+ε_high; A < 0 and ρ < 1-ε_low), which `clip_high`/`clip_low` mark.
    Shapes: logp, old_logp, adv, mask [B,T] (rollout_logp ignored) -> loss [B,T], metrics [B,T].
    """
    lower, upper = _bounds("ppo", eps_low, eps_high)
    _, adv, log_ratio = _prepare("clip.ppo", logp, old_logp, adv, mask, rollout_logp)
    ratio = torch.exp(log_ratio)
    loss = _plus_zero(_ppo_loss(ratio, adv, lower, upper))
    return loss, _metrics(log_ratio, *_clipped(ratio, adv, lower, upper))


@register(
    "clip",
    "dual_clip",
    formula=_PPO_FORMULA + ", floored at cA when A<0",
    ratio="token",
    off_policy=False,
)
def dual_clip(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    rollout_logp: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    c: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Dual-clip PPO: the PPO loss, and for A < 0 additionally min(ppo_loss, -cA) = min(ppo_loss, c|A|).

    For A < 0 and a large ratio, PPO's loss -ρA grows without bound; dual clip caps it at c|A|, so
    tokens with A < 0 and ρ > c get no gradient (`clip_dual` marks them). For A >= 0 it is PPO.
    Source: Ye et al. 2020, "Mastering complex control in MOBA games with deep RL" (dual-clip PPO),
    as implemented in verl (`clip_ratio_c`, default 3). Requires c > 1.
    Shapes: logp, old_logp, adv, mask [B,T] (rollout_logp ignored) -> loss [B,T], metrics [B,T].
    """
    lower, upper = _bounds("dual_clip", eps_low, eps_high)
    if not is_real(c) or not c > 1 or math.isinf(c):
        raise ConfigError(f"clip.dual_clip.c must be > 1, got {c!r}")
    _, adv, log_ratio = _prepare("clip.dual_clip", logp, old_logp, adv, mask, rollout_logp)
    ratio = torch.exp(log_ratio)
    ppo_loss = _ppo_loss(ratio, adv, lower, upper)
    cap = -c * adv
    loss = torch.where(adv < 0, torch.minimum(ppo_loss, cap), ppo_loss)
    clip_dual = (adv < 0) & (ppo_loss.detach() > cap)
    # clip_dual, like the bounds' indicators, is False on padding: A = 0 there.
    metrics = _metrics(log_ratio, *_clipped(ratio, adv, lower, upper), clip_dual=clip_dual)
    return _plus_zero(loss), metrics


@register(
    "clip",
    "gspo",
    formula="min(s_iA, clip(s_i,1-ε_low,1+ε_high)A); s_i = (π_θ(y_i)/π_old(y_i))^{1/|y_i|}",
    ratio="sequence",
    off_policy=False,
)
def gspo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    rollout_logp: Tensor | None = None,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO's clip on the length-normalised *sequence* ratio, in its per-token (GSPO-token) form.

    s_i     = exp((1/|y_i|) Σ_t (logp_t - old_logp_t))    geometric mean of the token ratios over
                                                          the |y_i| valid tokens of sequence i
    s_{i,t} = sg[s_i] · exp(d_t - sg[d_t])                value s_i; ∇s_{i,t} = s_i ∇logp_t
    loss_t  = max(-s_{i,t} A_t, -clip(s_{i,t}, 1-ε_low, 1+ε_high) A_t)

    d_t = clamp(logp_t - old_logp_t, ±20) is the module's clamped log-ratio, used for s_i too and
    for the gradient path: a token beyond e^{±20} gets no gradient, as in `ppo` (without the clamp
    in the gradient path a row with A = -1 and every log-ratio at 25 had a gradient of e^20 per
    token). The sequence log-ratio, a mean of clamped values, is capped at ±20 as well (verl's
    GSPO caps the combined log-ratio at +10).

    Clipping is decided per sequence (every token of sequence i sees the same value s_i), and an
    unclipped token's gradient is -A_t s_i ∇logp_t. With a sequence-level advantage (A_t = A_i) and
    the per-sequence token mean (`aggregate.seq_mean_token_mean`), the gradient equals that of
    GSPO's sequence objective min(s_i A_i, clip(s_i) A_i): ∇s_i = s_i (1/|y_i|) Σ_t ∇logp_t, the
    1/|y_i| coming from the aggregator. With token_mean aggregation long sequences weigh more.
    Defaults ε_low = 3e-4, ε_high = 4e-4 are the paper's. Source: Zheng et al. 2025, "Group
    Sequence Policy Optimization" (GSPO and GSPO-token). Metrics' ratio is s_i; approx_kl is per token.
    Shapes: logp, old_logp, adv, mask [B,T] (rollout_logp ignored) -> loss [B,T], metrics [B,T].
    """
    lower, upper = _bounds("gspo", eps_low, eps_high)
    valid, adv, log_ratio = _prepare("clip.gspo", logp, old_logp, adv, mask, rollout_logp)
    n_valid = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
    seq_log_ratio = torch.clamp(  # [B,1]; padding is 0. A mean of clamped values: within ±20 already
        log_ratio.detach().sum(dim=-1, keepdim=True) / n_valid, -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    # value s_i; gradient s_i ∇(clamped log-ratio_t) = s_i ∇logp_t inside the clamp, 0 beyond it
    token_ratio = torch.exp(seq_log_ratio + (log_ratio - log_ratio.detach()))
    loss = _plus_zero(_ppo_loss(token_ratio, adv, lower, upper))
    return loss, _metrics(log_ratio, *_clipped(token_ratio, adv, lower, upper))


@register(
    "clip",
    "cispo",
    formula="sg[clip(ρ,1-ε_low,1+ε_high)]·A·log π_θ",
    ratio="token",
    off_policy=False,
)
def cispo(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    rollout_logp: Tensor | None = None,
    eps_low: float | None = None,
    eps_high: float = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE with a clipped, detached IS weight: loss = -sg[clip(ρ, 1-ε_low, 1+ε_high)]·A·logp.

    The gradient -clip(ρ)·A·∇logp flows only through logp, so no token is ever dropped (PPO zeroes
    the gradient of clipped tokens, which the paper finds removes rare "fork" tokens); the weight is
    only truncated. The loss *value* is not the surrogate (it is -w·A·logp); use it for gradients.
    eps_low = None means no lower bound, as in the paper ("we did not impose a lower bound on the
    IS weight ... we only tuned ε_high"). The paper gives no value for ε_high; polgrad's default
    0.28 is DAPO's clip-higher value, a conservative choice (larger values, e.g. 5 in SkyRL's CISPO
    example, let high-ratio tokens count more). Metrics: here clip_low/clip_high mark tokens whose
    weight was truncated at that bound (ρ < 1-ε_low / ρ > 1+ε_high, any sign of A; their gradient
    is scaled, not zeroed); `is_weight` is the clipped weight.
    Source: MiniMax 2025, "MiniMax-M1: Scaling test-time compute efficiently with lightning
    attention" (arXiv 2506.13585), the CISPO objective.
    Shapes: logp, old_logp, adv, mask [B,T] (rollout_logp ignored) -> loss [B,T], metrics [B,T].
    """
    lower, upper = _bounds("cispo", eps_low, eps_high, low_optional=True)
    valid, adv, log_ratio = _prepare("clip.cispo", logp, old_logp, adv, mask, rollout_logp)
    logp = zero_pad(valid, logp)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, min=lower, max=upper).detach()
    loss = _plus_zero(-weight * adv * logp)
    # Truncation indicators, whatever the sign of A (CISPO scales these tokens, it never drops them).
    # Both are False on padding (ρ = 1 there); the weight, clip(1) there, is selected out.
    r = ratio.detach()
    trunc_low = r < lower if lower is not None else None
    metrics = _metrics(log_ratio, trunc_low, r > upper, is_weight=zero_pad(valid, weight))
    return loss, metrics


_TIS_HINT = (
    "clip.tis needs the sampler's logprobs of the sampled tokens (rollout_logp [B,T] from the rollout "
    "backend) to correct the rollout/trainer mismatch; use clip.ppo if they are not recorded"
)


@register(
    "clip",
    "tis",
    formula="min(π_old/π_rollout, C)·" + _PPO_FORMULA,
    ratio="token",
    off_policy=True,
)
def tis(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    rollout_logp: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    cap: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling: loss = w · ppo_loss, w = sg[min(exp(old_logp - rollout_logp), cap)].

    The rollout engine (e.g. vLLM) and the trainer compute different probabilities for the same
    policy, so the samples come from π_rollout, not π_old: reweighting by π_old/π_rollout corrects
    that, and truncating the weight at `cap` bounds its variance. The weight is detached.
    Source: Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
    training" (TIS, cap C = 2 in their runs); PPO part as in `ppo` (chapter eq. 54-55).
    Metrics: as `ppo`, plus `tis_weight` (w).
    Shapes: logp, old_logp, adv, mask, rollout_logp [B,T] -> loss [B,T], metrics [B,T].
    """
    lower, upper = _bounds("tis", eps_low, eps_high)
    if not is_real(cap) or not cap > 0 or math.isinf(cap):
        raise ConfigError(f"clip.tis.cap must be a finite number > 0, got {cap!r}")
    require("clip.tis", "rollout_logp", rollout_logp, _TIS_HINT)
    valid, adv, log_ratio = _prepare("clip.tis", logp, old_logp, adv, mask, rollout_logp)
    ratio = torch.exp(log_ratio)
    # min(exp(d), cap) = exp(min(d, log cap)): same value, and exp cannot overflow.
    log_w = zero_pad(valid, old_logp.detach() - rollout_logp.detach())
    weight = torch.exp(torch.clamp(log_w, max=math.log(cap))).detach()
    loss = _plus_zero(weight * _ppo_loss(ratio, adv, lower, upper))
    return loss, _metrics(log_ratio, *_clipped(ratio, adv, lower, upper), tis_weight=zero_pad(valid, weight))


@register(
    "clip",
    "icepop",
    formula="M(π_old/π_rollout; α, β)·" + _PPO_FORMULA + "; M(w) = w on [α, β], else 0",
    ratio="token",
    off_policy=True,
)
def icepop(
    logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    rollout_logp: Tensor | None = None,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    alpha: float = 0.5,
    beta: float = 5.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling (IcePop): loss = M(w) · ppo_loss, w = sg[exp(old_logp - rollout_logp)].

    M(w) = w if α <= w <= β, else 0: a token whose behaviour probability (the sampler's: a stale
    policy in async rollouts, or another engine's numerics) is too far from π_old's is masked out
    of the loss instead of truncated as in `tis`; the others are importance-weighted by w. The
    weight is detached. Source: Ling Team 2025, "Every step evolves: scaling reinforcement learning
    for trillion-scale thinking model" (Ring-1T, arXiv 2510.18855), IcePop, band [0.5, 5] (their
    α, β); the masked-IS correction of the slime/AReaL line of asynchronous RL. PPO part as `ppo`.
    With rollout_logp == old_logp, w = e^0 = 1 lies in the band and the loss is `ppo`'s exactly.
    Metrics: as `ppo`, plus `is_weight` (M(w)) and `is_masked` (1 where w is outside [α, β]).
    Shapes: logp, old_logp, adv, mask, rollout_logp [B,T] -> loss [B,T], metrics [B,T].
    """
    lower, upper = _bounds("icepop", eps_low, eps_high)
    if not is_real(alpha) or not is_real(beta) or not 0 < alpha <= 1 <= beta < math.inf:
        raise ConfigError(
            f"clip.icepop needs 0 < alpha <= 1 <= beta < inf, got alpha={alpha!r}, beta={beta!r}"
        )
    require("clip.icepop", "rollout_logp", rollout_logp, _TIS_HINT.replace("clip.tis", "clip.icepop"))
    valid, adv, log_ratio = _prepare("clip.icepop", logp, old_logp, adv, mask, rollout_logp)
    ratio = torch.exp(log_ratio)
    # log w clamped like the policy log-ratio: e^{±20} is far outside any band, and exp stays finite.
    log_w = torch.clamp(
        zero_pad(valid, old_logp.detach() - rollout_logp.detach()), -_MAX_LOG_RATIO, _MAX_LOG_RATIO
    )
    w = torch.exp(log_w)
    keep = (w >= alpha) & (w <= beta)  # True on padding (w = 1 there): selected out below
    weight = torch.where(keep, w, torch.zeros_like(w)).detach()
    loss = _plus_zero(weight * _ppo_loss(ratio, adv, lower, upper))
    extra = {"is_weight": zero_pad(valid, weight), "is_masked": valid & ~keep}
    return loss, _metrics(log_ratio, *_clipped(ratio, adv, lower, upper), **extra)
