"""Built-in kl parts: per-token estimates of KL(π_θ || π_ref).

Call signature: `polgrad.registry.kinds.KLFn`; each returns kl [B,T], zero where mask is 0, computed
from the log-ratio x = logp - ref_logp = log π_θ(y_t) - log π_ref(y_t) of the sampled token y_t.
The tokens were sampled from the policy, so an estimator k is *unbiased* when E_{y~π_θ}[k] equals
KL(π_θ || π_ref) = E_{y~π_θ}[x] at that position (Schulman 2020, "Approximating KL divergence",
http://joschu.net/blog/kl-approx.html; in his notation r = π_ref/π_θ = e^{-x}):

    k1 = x                 unbiased, high variance, can be negative per token
    k2 = x^2 / 2           biased (exact to second order in x), low variance, >= 0
    k3 = e^{-x} - 1 + x    unbiased, >= 0, low variance while π_θ is near π_ref (verl's `low_var_kl`)
    abs = |x|              biased, >= 0
    full                   exact per-token KL from the full log-softmax over the vocabulary

Gradients matter as much as values when the KL is placed in the loss. At one position, with y ~ π_θ
(current policy), E[∇k2] = E[x ∇log π_θ(y)] = ∇KL(π_θ || π_ref), the reverse KL (score-function identity,
E[∇log π_θ] = 0), while E[∇k1] = E[∇log π_θ] = 0 and E[∇k3] = E[(1 - e^{-x}) ∇log π_θ] = ∇KL(π_ref ||
π_θ), the forward KL. Over a sequence these hold per position with the prefix distribution held fixed:
Σ_t k2_t as a loss gives the gradient of Σ_t KL(π_θ(·|prefix) || π_ref(·|prefix)) for fixed prefixes,
which misses the sequence-level KL's term through the prefix distribution and in general differs from
∇KL_seq(π_θ || π_ref) (tests/components/test_kl_gradients.py proves both statements exactly). The
straight-through variants `k1_st`, `k3_st`, `abs_st` therefore keep the forward value of their estimator
(what is logged / folded into rewards) and take the gradient of k2:
value = k2 + sg[est - k2].
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from polgrad.checks import check_bt, is_real, require, zero_pad
from polgrad.components.logit_rows import LogitRows, as_logit_rows, chunk_rows, piece_logits
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import register


def _log_ratio(where: str, logp: Tensor, ref_logp: Tensor, mask: Tensor) -> Tensor:
    """x = logp - ref_logp on valid tokens and exactly 0 elsewhere (padding may hold -inf or nan;
    selecting before any nonlinearity keeps those out of both the value and the gradient).

    Every sample-based estimator maps x = 0 to exactly 0 (k1, k2, k3, abs and their straight-through
    forms, with or without k3's guards), so its result is already zero on padding and needs no
    second select; the padding tests in tests/components/test_kl.py check value and gradient there."""
    check_bt(where, mask, logp=logp, ref_logp=ref_logp)
    diff = logp - ref_logp
    return zero_pad(mask > 0, diff)


def _k2(x: Tensor) -> Tensor:
    return 0.5 * x.square()


def _k3(x: Tensor, max_log_ratio: float | None, max_value: float | None) -> Tensor:
    if max_log_ratio is not None:
        x = torch.clamp(x, -max_log_ratio, max_log_ratio)
    # expm1(-x) + x rather than exp(-x) - 1 + x: for small |x| the latter cancels catastrophically
    # and can come out (slightly) negative. The lower clamp at 0 is mathematically exact (k3 >= 0)
    # and only removes rounding noise; verl clamps at -10, which can never bind.
    k3 = torch.expm1(-x) + x
    return torch.clamp(k3, min=0.0, max=max_value)


def _straight_through(value: Tensor, x: Tensor) -> Tensor:
    """Forward: `value`; backward: the gradient of k2 = x^2/2 (i.e. x * ∇x)."""
    k2 = _k2(x)
    return k2 + (value - k2).detach()


def _check_guard(where: str, name: str, value) -> None:
    if value is None:
        return
    if not is_real(value) or not value > 0:
        raise ConfigError(f"{where}.{name} must be > 0 (or None to disable the guard), got {value!r}")


@register("kl", "k1", formula="k1 = x", unbiased=True, needs_logits=False)
def k1(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> Tensor:
    """k1 = x = log π_θ(y) - log π_ref(y): the naive unbiased estimator (Schulman 2020).

    Unbiased for KL(π_θ||π_ref) under y ~ π_θ but high variance and negative on some tokens; its
    gradient ∇log π_θ has expectation zero, so as a loss term it only adds noise (use `k1_st`).
    Source: Schulman 2020 "Approximating KL divergence"; verl `kl_penalty='k1'`.
    Shapes: logp, ref_logp, mask [B,T] -> [B,T]; logits unused.
    """
    return _log_ratio("kl.k1", logp, ref_logp, mask)


@register("kl", "k2", formula="k2 = x^2/2", unbiased=False, needs_logits=False)
def k2(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> Tensor:
    """k2 = x^2 / 2: low-variance, biased estimator whose gradient is, per position, the KL's gradient.

    Value: E[k2] = KL + O(x^3) (biased). Gradient at one position: E_{y~π_θ}[x ∇log π_θ(y)] =
    ∇KL(π_θ||π_ref) (the reverse KL); over a sequence, with the prefix distribution held fixed (see the
    module docstring).
    Source: Schulman 2020 "Approximating KL divergence"; verl `kl_penalty='mse'`/'k2'.
    Shapes: logp, ref_logp, mask [B,T] -> [B,T]; logits unused.
    """
    x = _log_ratio("kl.k2", logp, ref_logp, mask)
    return _k2(x)


@register("kl", "k3", formula="k3 = e^{-x} - 1 + x", unbiased=True, needs_logits=False)
def k3(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
    max_log_ratio: float | None = 20.0,
    max_value: float | None = 10.0,
) -> Tensor:
    """k3 = e^{-x} - 1 + x = (r - 1) - log r with r = π_ref/π_θ: unbiased, >= 0, low variance near π_ref.

    Variance: for π_θ near π_ref, Var[k1] ≈ 2 KL while Var[k3] = O(KL^2); far apart e^{-x} is heavy
    where π_ref >> π_θ and k3 can be noisier than k1 (tests/components/test_kl.py has such a pair).

    Source: Schulman 2020 "Approximating KL divergence" (k3); verl `kl_penalty='low_var_kl'`.
    Numerical guards, as in verl: x is clamped to [-max_log_ratio, max_log_ratio] before the exp
    (e^{-x} overflows fp32 for x < -88: a token the policy has all but abandoned would otherwise
    give inf and nan gradients; compute in fp32 or wider), and the result is clamped to <= max_value
    so that one outlier token cannot dominate the penalty. The value guard is not harmless: k3 = 10
    at x ≈ -2.61 (π_ref/π_θ ≈ 13.6) and at x ≈ 11, so every token beyond those ratios counts as 10
    and gets no KL gradient, which biases the estimate low once the policy has moved that far (the
    unbiasedness test disables the guards). Set either guard to None to disable it.
    Shapes: logp, ref_logp, mask [B,T] -> [B,T]; logits unused.
    """
    _check_guard("kl.k3", "max_log_ratio", max_log_ratio)
    _check_guard("kl.k3", "max_value", max_value)
    x = _log_ratio("kl.k3", logp, ref_logp, mask)
    return _k3(x, max_log_ratio, max_value)


@register("kl", "abs", formula="|x|", unbiased=False, needs_logits=False)
def abs_(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> Tensor:
    """abs = |x| = |log π_θ(y) - log π_ref(y)|: biased, >= 0.

    Source: verl `kl_penalty='abs'`. Shapes: logp, ref_logp, mask [B,T] -> [B,T]; logits unused.
    """
    x = _log_ratio("kl.abs", logp, ref_logp, mask)
    return x.abs()


_LOGITS_HINT = (
    "`Algorithm.kl = @kl.full` (meta needs_logits=True) needs the full-vocabulary logits [B,T,V] of the "
    "policy (logits) and of the reference (ref_logits); pick k1/k2/k3/abs if they are not available"
)


@register("kl", "full", formula="Σ_v π(v) (log π(v) - log π_ref(v))", unbiased=True, needs_logits=True)
def full(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | LogitRows | None = None,
    ref_logits: Tensor | LogitRows | None = None,
) -> Tensor:
    """Exact per-token KL(π_θ(·|s_t) || π_ref(·|s_t)) = Σ_v π_θ(v) (log π_θ(v) - log π_ref(v)).

    Computed from the log-softmax of the full logits, so it is neither a sample estimate nor
    dependent on the sampled token; its gradient (wrt logits, not logp) is the exact gradient of the
    per-position KL. Half-precision logits are upcast to float32 for the log-softmax. Vocabulary
    entries with π_θ(v) = 0 (logit -inf) contribute 0 (the 0·log 0 = 0 convention).
    Source: the definition of KL; verl `kl_penalty='full'`.

    The logits come as [B,T,V] tensors or as `LogitRows` (polgrad/components/logit_rows.py: the
    training forward's are made from its hidden states a chunk at a time). Positions are taken
    `chunk_rows(V, dtype)` at a time (64 MiB per [C,V] block); when that splits the batch, each
    chunk is checkpointed (its logits, log-softmaxes and products are recomputed in the backward,
    not kept), so memory holds a chunk, never [B,T,V]. One chunk is the plain computation, unchanged.
    Shapes: logits, ref_logits [B,T,V]; logp, ref_logp, mask [B,T] -> [B,T] (dtype of logp).
    """
    where = "kl.full"
    b, t = check_bt(where, mask, logp=logp, ref_logp=ref_logp)
    require(where, "logits", logits, _LOGITS_HINT)
    require(where, "ref_logits", ref_logits, _LOGITS_HINT)
    pol = as_logit_rows(where, "logits", logits)
    ref = as_logit_rows(where, "ref_logits", ref_logits)
    for name, z in (("logits", pol), ("ref_logits", ref)):
        if tuple(z.shape[:2]) != (b, t):
            raise ShapeError(f"{where}: {name} must be [B,T,V] with [B,T]=[{b},{t}], got {list(z.shape)}")
    if pol.shape != ref.shape:
        raise ShapeError(
            f"{where}: logits and ref_logits must have the same shape [B,T,V], got "
            f"{list(pol.shape)} and {list(ref.shape)}"
        )
    dtype = torch.promote_types(pol.dtype, torch.float32)
    n, rows = b * t, chunk_rows(pol.shape[2], dtype)
    if rows >= n:
        kl = _full_rows(pol.rows(0, n), ref.rows(0, n), dtype)
    else:
        # a held tensor is split once, outside the checkpoints: slicing it inside each would make
        # every chunk's backward a zero-filled [B,T,V] gradient (quadratic in the chunk count)
        kl = torch.cat(
            [
                checkpoint(_full_chunk, p, q, dtype, use_reentrant=False)
                for p, q in zip(pol.pieces(rows), ref.pieces(rows), strict=True)
            ]
        )
    return zero_pad(mask > 0, kl.view(b, t).to(logp.dtype))  # the logits' KL is not 0 on padding


def _full_chunk(pol, ref, dtype: torch.dtype) -> Tensor:
    """`_full_rows` of one piece of each side (logit_rows: a [C,V] tensor or a HeadLogits chunk)."""
    return _full_rows(piece_logits(pol), piece_logits(ref), dtype)


def _full_rows(pol: Tensor, ref: Tensor, dtype: torch.dtype) -> Tensor:
    """kl.full's sum over the vocabulary for one chunk of positions, logits [C,V] -> [C]."""
    lp = torch.log_softmax(pol.to(dtype), dim=-1)
    lq = torch.log_softmax(ref.to(dtype), dim=-1)
    p = lp.exp()
    # Select before multiplying so that p = 0 entries give 0, not 0·(-inf) = nan, in value and gradient.
    diff = torch.where(p > 0, lp - lq, lp.new_zeros(()))
    return (p * diff).sum(dim=-1)


@register("kl", "k1_st", formula="k1 = x (∇ of x^2/2)", unbiased=True, needs_logits=False)
def k1_st(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> Tensor:
    """Straight-through k1: value k1 = x, gradient of k2 (x ∇x): value = k2 + sg[k1 - k2].

    The value is the unbiased k1; the gradient is k2's, whose expectation under y ~ π_θ is, per
    position with the prefix held fixed, ∇KL(π_θ||π_ref) (see the module docstring). Source:
    Schulman 2020 (estimators); which estimator placed in the loss gives which gradient: Tang &
    Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL". The straight-through
    pairing is polgrad's.
    Shapes: logp, ref_logp, mask [B,T] -> [B,T].
    """
    x = _log_ratio("kl.k1_st", logp, ref_logp, mask)
    return _straight_through(x, x)


@register("kl", "k3_st", formula="k3 = e^{-x} - 1 + x (∇ of x^2/2)", unbiased=True, needs_logits=False)
def k3_st(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
    max_log_ratio: float | None = 20.0,
    max_value: float | None = 10.0,
) -> Tensor:
    """Straight-through k3: value k3 = e^{-x} - 1 + x (with k3's guards), gradient of k2 (x ∇x).

    value = k2 + sg[k3 - k2]. Plain k3 as a loss term follows the gradient of the *forward* KL
    (E[∇k3] = ∇KL(π_ref||π_θ)); this variant keeps k3's low-variance, unbiased value and uses
    k2's gradient, per position (prefix held fixed) the gradient of the reverse KL(π_θ||π_ref).
    Guards as in `k3` (gin: `kl.k3_st.max_log_ratio`, `kl.k3_st.max_value`). Source: Schulman 2020;
    see `k1_st`.
    Shapes: logp, ref_logp, mask [B,T] -> [B,T].
    """
    _check_guard("kl.k3_st", "max_log_ratio", max_log_ratio)
    _check_guard("kl.k3_st", "max_value", max_value)
    x = _log_ratio("kl.k3_st", logp, ref_logp, mask)
    return _straight_through(_k3(x, max_log_ratio, max_value), x)


@register("kl", "abs_st", formula="|x| (∇ of x^2/2)", unbiased=False, needs_logits=False)
def abs_st(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    *,
    logits: Tensor | None = None,
    ref_logits: Tensor | None = None,
) -> Tensor:
    """Straight-through abs: value |x|, gradient of k2 (x ∇x): value = k2 + sg[|x| - k2].

    Source: verl `abs` for the value; the straight-through construction as in `k1_st`.
    Shapes: logp, ref_logp, mask [B,T] -> [B,T].
    """
    x = _log_ratio("kl.abs_st", logp, ref_logp, mask)
    return _straight_through(x.abs(), x)
