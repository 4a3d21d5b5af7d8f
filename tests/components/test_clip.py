"""clip parts: the chapter's identities and clipped cases, known values, GSPO/CISPO/TIS specifics, errors.

All tensors are float64. ρ = exp(logp - old_logp); gradients are taken wrt logp by autograd on the
per-token loss (each token's loss depends on its own logp only, so grad[t] = dloss_t/dlogp_t).
"""

from __future__ import annotations

import inspect
import math

import gin
import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

import polgrad  # noqa: F401  (registers the built-in parts)
from polgrad.config_parts import part
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import get, lookup, names

RULES = ["none", "ppo", "dual_clip", "gspo", "cispo", "tis", "icepop"]
COMMON_METRICS = {"clip_low", "clip_high", "approx_kl"}
EXTRA_METRICS = {
    "dual_clip": {"clip_dual"},
    "cispo": {"is_weight"},
    "tis": {"tis_weight"},
    "icepop": {"is_weight", "is_masked"},
}
OFF_POLICY = {"tis", "icepop"}
F64 = torch.float64


def _floats(lo: float, hi: float):
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, allow_subnormal=False)


# Advantages: 0, or of magnitude >= 1e-300. The exact identities below go through autograd's tie rule:
# where the clipped and unclipped terms are equal (rho inside the range), max/min send half the
# gradient to each, 0.5 A + 0.5 A, which is A exactly only while 0.5 A is a normal float
# (|A| >= 2^-1021 ~ 4.5e-308); hypothesis found A = 4.29e-308, whose halves lose their last bit.
def _advantages(lo: float, hi: float):
    return _floats(lo, hi).filter(lambda x: x == 0.0 or abs(x) >= 1e-300)


@st.composite
def batches(draw, d_lo: float = -1.5, d_hi: float = 1.5, seq_adv: bool = False):
    """old_logp, log-ratio d, adv, mask as numpy arrays of one random [B,T] shape."""
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    old = draw(hnp.arrays(np.float64, (b, t), elements=_floats(-6.0, 0.0), fill=st.nothing()))
    d = draw(hnp.arrays(np.float64, (b, t), elements=_floats(d_lo, d_hi), fill=st.nothing()))
    if seq_adv:  # one advantage per sequence, broadcast over its tokens (GRPO-style)
        adv = np.repeat(
            draw(hnp.arrays(np.float64, (b, 1), elements=_advantages(-3.0, 3.0), fill=st.nothing())),
            t,
            axis=1,
        )
    else:
        adv = draw(hnp.arrays(np.float64, (b, t), elements=_advantages(-3.0, 3.0), fill=st.nothing()))
    mask = draw(
        hnp.arrays(np.bool_, (b, t), elements=st.sampled_from([True, True, False]), fill=st.nothing())
    )
    return old, d, adv, mask


def _run(name, old, d, adv, mask, *, rollout=None, **hparams):
    """-> loss, metrics, grad wrt logp, ratio ρ as the part computes it (from the same tensors)."""
    old_logp = torch.as_tensor(old, dtype=F64)
    logp = (old_logp + torch.as_tensor(d, dtype=F64)).requires_grad_(True)
    adv_t, mask_t = torch.as_tensor(adv, dtype=F64), torch.as_tensor(mask, dtype=F64)
    rollout_t = None if rollout is None else torch.as_tensor(rollout, dtype=F64)
    loss, metrics = part("clip", name)(logp, old_logp, adv_t, mask_t, rollout_logp=rollout_t, **hparams)
    loss.sum().backward()
    ratio = torch.exp(logp.detach() - old_logp)
    return loss.detach(), metrics, logp.grad, ratio


def _near(r: torch.Tensor, bound: float) -> torch.Tensor:
    """Tokens within 1e-9 of a clip boundary: which side they fall on is rounding, so checks skip them."""
    return (r - bound).abs() < 1e-9


# ------------------------------------------------------------------------------------------------
# Contract: signature, metadata, metric keys.


@pytest.mark.parametrize("name", RULES)
def test_signature_meta_and_metric_keys(name):
    entry = lookup("clip", name)
    params = inspect.signature(entry.fn).parameters
    assert list(params)[:4] == ["logp", "old_logp", "adv", "mask"]
    kw = {p: v for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
    assert kw["rollout_logp"].default is None
    assert all(v.default is not inspect.Parameter.empty for v in kw.values())  # gin binds them
    assert len(params) == 4 + len(kw)
    assert isinstance(entry.meta["formula"], str) and entry.meta["formula"]
    assert entry.meta["ratio"] == ("sequence" if name == "gspo" else "token")
    assert entry.meta["off_policy"] is (name in OFF_POLICY)
    z = torch.zeros(2, 3, dtype=F64)
    _, metrics = entry.fn(z, z, z, torch.ones_like(z), rollout_logp=z)
    assert set(metrics) == COMMON_METRICS | EXTRA_METRICS.get(name, set())
    assert all(v.shape == (2, 3) and v.dtype == F64 and not v.requires_grad for v in metrics.values())


def test_registered_names():
    assert set(RULES) <= set(names("clip"))


# ------------------------------------------------------------------------------------------------
# Known values, worked by hand (eps_low = eps_high = 0.2 unless stated).


def _one(name, r, a, *, logp=-1.0, **kw):
    """Single token with ratio r (old_logp = logp - log r) and advantage a -> (loss, grad, metrics)."""
    loss, metrics, grad, _ = _run(name, [[logp - math.log(r)]], [[math.log(r)]], [[a]], [[True]], **kw)
    return loss.item(), grad.item(), {k: v.item() for k, v in metrics.items()}


@pytest.mark.parametrize(
    "r, a, want_loss, want_grad, flag",
    [
        # A>0, ρ=1.5 > 1.2: max(-1.5, -1.2) = -1.2, constant -> zero gradient (clip_high).
        (1.5, 1.0, -1.2, 0.0, "clip_high"),
        # A<0, ρ=0.5 < 0.8: max(0.5, 0.8) = 0.8, constant -> zero gradient (clip_low).
        (0.5, -1.0, 0.8, 0.0, "clip_low"),
        # A>0, ρ=1.1 inside: -ρA = -1.1; d(-ρA)/dlogp = -ρA = -1.1.
        (1.1, 1.0, -1.1, -1.1, None),
        # A>0, ρ=0.5 < 0.8: max(-0.5, -0.8) = -0.5 unclipped (chapter's case 1), gradient -0.5.
        (0.5, 1.0, -0.5, -0.5, None),
        # A<0, ρ=1.5 > 1.2: max(1.5, 1.2) = 1.5 unclipped (chapter's A<0 case 3), gradient -ρA = 1.5.
        (1.5, -1.0, 1.5, 1.5, None),
        # A=2, ρ=1.25: clipped at 1.2 -> -2.4, zero gradient.
        (1.25, 2.0, -2.4, 0.0, "clip_high"),
    ],
)
def test_ppo_known_values(r, a, want_loss, want_grad, flag):
    loss, grad, m = _one("ppo", r, a)
    assert loss == pytest.approx(want_loss, abs=1e-12)
    assert grad == pytest.approx(want_grad, abs=1e-12)
    assert m["clip_low"] == (flag == "clip_low") and m["clip_high"] == (flag == "clip_high")
    # approx_kl = (ρ - 1) - log ρ
    assert m["approx_kl"] == pytest.approx(r - 1 - math.log(r), abs=1e-12)


def test_clip_higher_known_values():
    # DAPO clip-higher: ρ=1.25, A=1 is clipped at eps_high=0.2 (loss -1.2) but not at 0.28 (loss -1.25).
    assert _one("ppo", 1.25, 1.0)[:2] == pytest.approx((-1.2, 0.0), abs=1e-12)
    assert _one("ppo", 1.25, 1.0, eps_high=0.28)[:2] == pytest.approx((-1.25, -1.25), abs=1e-12)
    # The lower side keeps eps_low = 0.2: ρ=0.75, A=-1 -> max(0.75, 0.8) = 0.8, zero gradient.
    assert _one("ppo", 0.75, -1.0, eps_high=0.28)[:2] == pytest.approx((0.8, 0.0), abs=1e-12)


def test_dual_clip_known_values():
    # ρ=5, A=-1, c=3: PPO loss max(5, 0.8) = 5; dual clip min(5, 3) = 3, constant -> zero gradient.
    loss, grad, m = _one("dual_clip", 5.0, -1.0)
    assert (loss, grad, m["clip_dual"], m["clip_low"]) == pytest.approx((3.0, 0.0, 1.0, 0.0), abs=1e-12)
    # ρ=2, A=-1: PPO loss 2 < 3, unchanged; gradient -ρA = 2.
    loss, grad, m = _one("dual_clip", 2.0, -1.0)
    assert (loss, grad, m["clip_dual"]) == pytest.approx((2.0, 2.0, 0.0), abs=1e-12)
    # ρ=5, A=+1: A >= 0 is plain PPO: -1.2, zero gradient, clip_high.
    loss, grad, m = _one("dual_clip", 5.0, 1.0)
    assert (loss, grad, m["clip_dual"], m["clip_high"]) == pytest.approx((-1.2, 0.0, 0.0, 1.0), abs=1e-12)


def test_tis_known_values():
    # old_logp - rollout_logp = log 3: w = min(3, 2) = 2. ρ=1.5, A=1: 2 · (-1.2) = -2.4, zero gradient.
    old = -1.0 - math.log(1.5)
    loss, metrics, grad, _ = _run(
        "tis", [[old]], [[math.log(1.5)]], [[1.0]], [[True]], rollout=[[old - math.log(3)]]
    )
    assert loss.item() == pytest.approx(-2.4, abs=1e-12) and grad.item() == 0.0
    assert metrics["tis_weight"].item() == pytest.approx(2.0, abs=1e-12)
    # log-ratio vs rollout = log 0.5: w = 0.5 (below the cap). ρ=1.1, A=1: 0.5 · (-1.1), gradient -0.55.
    old = -1.0 - math.log(1.1)
    loss, metrics, grad, _ = _run(
        "tis", [[old]], [[math.log(1.1)]], [[1.0]], [[True]], rollout=[[old + math.log(2)]]
    )
    assert (loss.item(), grad.item()) == pytest.approx((-0.55, -0.55), abs=1e-12)
    assert metrics["tis_weight"].item() == pytest.approx(0.5, abs=1e-12)


def test_cispo_known_values():
    # ρ=2, A=1, eps_high=0.28, logp=log 0.5: loss = -1.28 · 1 · log 0.5 = 0.8872; gradient -1.28 (not 0).
    loss, grad, m = _one("cispo", 2.0, 1.0, logp=math.log(0.5))
    assert loss == pytest.approx(-1.28 * math.log(0.5), abs=1e-12) and grad == pytest.approx(-1.28, abs=1e-12)
    assert (m["clip_high"], m["is_weight"]) == pytest.approx((1.0, 1.28), abs=1e-12)
    # ρ=0.1, A=-2, no lower bound (default eps_low=None): weight 0.1, gradient -0.1 · (-2) = 0.2.
    loss, grad, m = _one("cispo", 0.1, -2.0)
    assert grad == pytest.approx(0.2, abs=1e-12) and m["clip_low"] == 0.0
    # ... with eps_low=0.2 the weight is raised to 0.8: gradient 1.6.
    loss, grad, m = _one("cispo", 0.1, -2.0, eps_low=0.2)
    assert grad == pytest.approx(1.6, abs=1e-12) and m["clip_low"] == 1.0


# ------------------------------------------------------------------------------------------------
# The chapter's identities and clipped cases.


@given(batches(d_lo=-1.0, d_hi=1.0), _floats(0.05, 0.5), _floats(0.05, 0.5))
def test_ppo_equals_plain_pg_inside_the_trust_region(batch, eps_low, eps_high):
    old, u, adv, mask = batch
    # Map u in [-1, 1] to ρ inside [1 - 0.99 eps_low, 1 + 0.99 eps_high]: 1% away from each bound,
    # far beyond the ~1e-16 rounding of exp(log ρ).
    r = np.where(u < 0, 1 + 0.99 * eps_low * u, 1 + 0.99 * eps_high * u)
    d = np.log(r)
    pg_loss, _, pg_grad, ratio = _run("none", old, d, adv, mask)
    assert ((ratio >= 1 - eps_low) & (ratio <= 1 + eps_high)).all()
    others = {
        "ppo": _run("ppo", old, d, adv, mask, eps_low=eps_low, eps_high=eps_high),
        "dual_clip": _run("dual_clip", old, d, adv, mask, eps_low=eps_low, eps_high=eps_high),
        "tis": _run("tis", old, d, adv, mask, rollout=old, eps_low=eps_low, eps_high=eps_high),
        "icepop": _run("icepop", old, d, adv, mask, rollout=old, eps_low=eps_low, eps_high=eps_high),
    }
    for name, (loss, metrics, grad, _) in others.items():
        # Inside the region clip(ρ) = ρ exactly, so max(-ρA, -ρA) = -ρA bit for bit; autograd splits
        # the gradient of a tie 1/2 + 1/2 (exact in binary). TIS, IcePop: w = e^0 = 1 exactly (inside
        # IcePop's band [0.5, 5], so M(w) = 1). Hence 1e-15.
        torch.testing.assert_close(loss, pg_loss, rtol=1e-15, atol=1e-15, msg=name)
        torch.testing.assert_close(grad, pg_grad, rtol=1e-15, atol=1e-15, msg=name)
        assert not metrics["clip_low"].any() and not metrics["clip_high"].any()
    # plain PG gradient: d(-ρA)/dlogp = -ρA on valid tokens
    m = torch.as_tensor(mask)
    torch.testing.assert_close(
        pg_grad, torch.where(m, -ratio * torch.as_tensor(adv), 0.0), rtol=1e-14, atol=0.0
    )


@pytest.mark.parametrize("name", ["ppo", "dual_clip", "tis", "icepop"])
@given(batch=batches(d_lo=-2.0, d_hi=2.0), eps_low=_floats(0.05, 0.5), eps_high=_floats(0.05, 0.5))
def test_gradient_is_zero_exactly_in_the_clipped_cases(name, batch, eps_low, eps_high):
    old, d, adv, mask = batch
    kw = {"rollout": old} if name in OFF_POLICY else {}
    if name == "dual_clip":
        kw["c"] = 1e6  # out of reach here: this test is about the PPO cases only
    loss, metrics, grad, r = _run(name, old, d, adv, mask, eps_low=eps_low, eps_high=eps_high, **kw)
    a, m = torch.as_tensor(adv), torch.as_tensor(mask)
    lo, hi = 1 - eps_low, 1 + eps_high
    check = m & ~_near(r, lo) & ~_near(r, hi)
    # The chapter's cases after eq. 57: A>0, ρ>1+ε_high and A<0, ρ<1-ε_low are flat (zero gradient).
    clip_low, clip_high = (a < 0) & (r < lo), (a > 0) & (r > hi)
    clipped = clip_low | clip_high
    assert torch.equal(metrics["clip_low"][check].bool(), clip_low[check])
    assert torch.equal(metrics["clip_high"][check].bool(), clip_high[check])
    assert (grad[check & clipped] == 0).all()
    event(f"clipped tokens: {bool((check & clipped).any())}; live tokens: {bool((check & ~clipped).any())}")
    # Everywhere else the gradient is the plain PG one, -ρA (nonzero wherever A != 0).
    live = check & ~clipped
    torch.testing.assert_close(grad[live], -r[live] * a[live], rtol=1e-13, atol=0.0)
    assert (grad[live & (a != 0)] != 0).all()
    # Padding: zero loss, metrics and gradient.
    assert (loss[~m] == 0).all() and (grad[~m] == 0).all()
    assert all((v[~m] == 0).all() for v in metrics.values())


@given(batches(d_lo=0.0, d_hi=0.0))
def test_one_gradient_step_all_rules_give_the_pg_gradient(batch):
    # logp == old_logp (ρ = 1, first step on a fresh batch; chapter eq. 64). Every rule's gradient wrt
    # logp_t is then -A_t exactly:
    #   none/ppo/dual_clip: ρ = 1 lies inside every clip range (and below c), ∂(-ρA)/∂logp = -ρA = -A;
    #   tis, icepop: w = exp(old - rollout) = 1 with rollout == old (in icepop's band), times PPO's;
    #   gspo: s_i = exp(mean_t 0) = 1, ∂s_{i,t}/∂logp_t = s_i = 1 -> -A_t (the 1/|y_i| of GSPO's
    #         sequence objective lives in the aggregator, the same for every rule);
    #   cispo: ∂(-sg[clip(1)]·A·logp)/∂logp = -A.
    # Loss values agree (-A) except cispo, whose value is -A·logp (only its gradient is the surrogate's).
    old, _, adv, mask = batch
    a, m = torch.as_tensor(adv), torch.as_tensor(mask)
    want_grad = torch.where(m, -a, 0.0)
    for name in RULES:
        loss, _, grad, _ = _run(name, old, np.zeros_like(old), adv, mask, rollout=old)
        assert torch.equal(grad, want_grad), name
        want_loss = torch.where(m, -a * torch.as_tensor(old), 0.0) if name == "cispo" else want_grad
        torch.testing.assert_close(loss, want_loss, rtol=1e-15, atol=0.0, msg=name)


# ------------------------------------------------------------------------------------------------
# Dual clip.


@given(batch=batches(d_lo=-3.0, d_hi=3.0), c=_floats(1.05, 5.0))
def test_dual_clip_is_ppo_for_nonnegative_advantages_and_bounded_otherwise(batch, c):
    old, d, adv, mask = batch
    p_loss, _, p_grad, r = _run("ppo", old, d, adv, mask)
    loss, metrics, grad, _ = _run("dual_clip", old, d, adv, mask, c=c)
    a, m = torch.as_tensor(adv), torch.as_tensor(mask)
    pos, neg = m & (a >= 0), m & (a < 0)
    assert torch.equal(loss[pos], p_loss[pos]) and torch.equal(grad[pos], p_grad[pos])
    # A<0: loss = min(ppo_loss, c|A|) <= c|A|, and it differs from PPO exactly when ρ > c (there
    # ppo_loss = -ρA > -cA); those tokens are flat (zero gradient) and flagged clip_dual.
    assert (loss[neg] <= c * a[neg].abs()).all()
    torch.testing.assert_close(loss[neg], torch.minimum(p_loss[neg], -c * a[neg]), rtol=0.0, atol=0.0)
    capped = neg & (r > c) & ~_near(r, c)
    free = neg & (r < c) & ~_near(r, c)
    assert torch.equal(metrics["clip_dual"][capped | free].bool(), capped[capped | free])
    assert (grad[capped] == 0).all()
    event(f"dual-capped tokens: {bool(capped.any())}")
    assert torch.equal(grad[free], p_grad[free])
    assert (metrics["clip_dual"][~neg] == 0).all()


# ------------------------------------------------------------------------------------------------
# GSPO.


@given(batch=batches(d_lo=-0.5, d_hi=0.5, seq_adv=True), eps=_floats(0.01, 0.3))
def test_gspo_matches_the_sequence_level_objective(batch, eps):
    # GSPO (Zheng et al. 2025): J_i = min(s_i A_i, clip(s_i, 1-ε, 1+ε) A_i), s_i = exp(mean_t d_t),
    # with s_i NOT detached. The token form averaged per sequence (aggregate.seq_mean_token_mean)
    # has the same gradient: an unclipped token gives -A_i s_i, times 1/|y_i| from the mean, and
    # ∂(-s_i A_i)/∂logp_t = -A_i s_i / |y_i|; a clipped sequence is flat in both forms.
    old, d, adv, mask = batch
    loss, metrics, grad, _ = _run("gspo", old, d, adv, mask, eps_low=eps, eps_high=eps)
    m = torch.as_tensor(mask)
    n = m.sum(-1).clamp(min=1)
    old_t, a = torch.as_tensor(old), torch.as_tensor(adv)[:, 0]
    logp = (old_t + torch.as_tensor(d)).requires_grad_(True)
    s = torch.exp(torch.where(m, logp - old_t, 0.0).sum(-1) / n)
    seq_loss = torch.maximum(-s * a, -torch.clamp(s, 1 - eps, 1 + eps) * a)
    seq_loss.sum().backward()
    s = s.detach()
    check = ~_near(s, 1 - eps) & ~_near(s, 1 + eps)  # per sequence
    token_mean_grad = grad / n[:, None]
    event(f"clipped sequences: {bool((m.any(-1) & ((s < 1 - eps) | (s > 1 + eps))).any())}")
    torch.testing.assert_close(token_mean_grad[check], logp.grad[check], rtol=1e-12, atol=1e-15)
    # Loss value: every valid token of sequence i carries the sequence loss.
    torch.testing.assert_close(loss, torch.where(m, seq_loss.detach()[:, None], 0.0), rtol=1e-13, atol=1e-15)
    # Clipping is per sequence: the indicators are constant over a sequence's valid tokens.
    for key in ("clip_low", "clip_high"):
        flags = metrics[key]
        assert torch.equal(flags, torch.where(m, flags.max(-1, keepdim=True).values, 0.0))


def test_gspo_clips_whole_sequences():
    # Sequence 0: d = (0.3, -0.1) -> s = e^{0.1} = 1.105 > 1 + 4e-4, A = 1 -> both tokens flat.
    # Sequence 1: d = (0.3, -0.3) -> s = 1, inside -> each token's gradient is -A · s = -1,
    # although its own token ratio e^{0.3} = 1.35 is far outside PPO's range.
    d = [[0.3, -0.1], [0.3, -0.3]]
    loss, metrics, grad, _ = _run("gspo", np.full((2, 2), -1.0), d, np.ones((2, 2)), np.ones((2, 2), bool))
    assert (grad[0] == 0).all() and (metrics["clip_high"][0] == 1).all()
    torch.testing.assert_close(loss[0], torch.full((2,), -(1 + 4e-4), dtype=F64))
    torch.testing.assert_close(grad[1], torch.full((2,), -1.0, dtype=F64), rtol=1e-14, atol=1e-15)
    assert (metrics["clip_high"][1] == 0).all()


def test_gspo_gradient_respects_the_log_ratio_clamp_like_ppo():
    # One 4-token row, A = -1, logp = 0, old_logp = -25: every token's log-ratio 25 is beyond the
    # clamp at 20, where clip.py promises a zero gradient. ppo: ρ = e^{clamp(25)} = e^20 and
    # d clamp/d logp = 0 -> grad 0. gspo must agree: its sequence log-ratio is the mean of the
    # clamped token log-ratios, (4 * 20) / 4 = 20, s = e^20 = 4.85e8, and the token ratio's gradient
    # flows through the clamped log-ratio (0), not through logp (which gave 4.85e8 per token, i.e.
    # 1.2e8 per token after seq_mean_token_mean's 1/4).
    old, d, adv, mask = np.full((1, 4), -25.0), np.full((1, 4), 25.0), -np.ones((1, 4)), np.ones((1, 4), bool)
    g_loss, _, g_grad, _ = _run("gspo", old, d, adv, mask)
    p_loss, _, p_grad, _ = _run("ppo", old, d, adv, mask)
    assert torch.isfinite(g_loss).all() and torch.isfinite(g_grad).all()
    assert torch.equal(p_grad, torch.zeros(1, 4, dtype=F64))
    assert torch.equal(g_grad, p_grad)
    # loss value: -s A = e^20 on every token (the sequence log-ratio is capped at 20)
    torch.testing.assert_close(g_loss, torch.full((1, 4), math.exp(20.0), dtype=F64), rtol=1e-15, atol=0)
    # Mixed row: token 0 at log-ratio 30 (clamped to 20: no gradient), tokens 1-3 at -10/3 each;
    # sequence log-ratio = (20 - 10) / 4 = 2.5, s = e^2.5 > 1 + eps_high, A = -1 < 0: PPO's max
    # keeps -s A (not clipped for A < 0), so tokens 1-3 get d(-s_{i,t} A)/dlogp_t = s = e^2.5, token 0
    # gets 0 (beyond the clamp, as in ppo).
    d = np.array([[30.0, -10 / 3, -10 / 3, -10 / 3]])
    _, _, grad, _ = _run("gspo", np.full((1, 4), -30.0), d, -np.ones((1, 4)), mask)
    e = math.exp(2.5)
    torch.testing.assert_close(grad, torch.tensor([[0.0, e, e, e]], dtype=F64), rtol=1e-14, atol=0)


# ------------------------------------------------------------------------------------------------
# CISPO and TIS.


@given(
    batch=batches(d_lo=-2.0, d_hi=2.0),
    eps_high=_floats(0.05, 1.0),
    eps_low=st.one_of(st.none(), _floats(0.05, 0.5)),
)
def test_cispo_gradient_is_clipped_weight_times_pg_and_drops_no_token(batch, eps_high, eps_low):
    old, d, adv, mask = batch
    loss, metrics, grad, r = _run("cispo", old, d, adv, mask, eps_low=eps_low, eps_high=eps_high)
    a, m = torch.as_tensor(adv), torch.as_tensor(mask)
    lower = None if eps_low is None else 1 - eps_low
    w = torch.clamp(r, min=lower, max=1 + eps_high)
    # ∂(-sg[w]·A·logp)/∂logp = -w·A: the weight is only ever truncated, never zeroed.
    torch.testing.assert_close(grad, torch.where(m, -w * a, 0.0), rtol=1e-13, atol=0.0)
    assert (grad[m & (a != 0)] != 0).all()
    event(f"truncated weights: {bool((m & ((r > 1 + eps_high) | (r < (lower or 0)))).any())}")
    torch.testing.assert_close(metrics["is_weight"], torch.where(m, w, 0.0), rtol=1e-13, atol=0.0)
    check = m & ~_near(r, 1 + eps_high) & (True if lower is None else ~_near(r, lower))
    assert torch.equal(metrics["clip_high"][check].bool(), (r > 1 + eps_high)[check])
    if lower is None:
        assert (metrics["clip_low"] == 0).all()
    else:
        assert torch.equal(metrics["clip_low"][check].bool(), (r < lower)[check])


@given(
    batch=batches(),
    mismatch=hnp.arrays(np.float64, 15, elements=_floats(-3.0, 3.0), fill=st.nothing()),
    cap=_floats(0.5, 5.0),
)
def test_tis_weight_is_truncated_and_scales_ppo(batch, mismatch, cap):
    old, d, adv, mask = batch
    rollout = old - mismatch[: old.size].reshape(old.shape)  # old - rollout = mismatch
    loss, metrics, grad, _ = _run("tis", old, d, adv, mask, rollout=rollout, cap=cap)
    p_loss, p_metrics, p_grad, _ = _run("ppo", old, d, adv, mask)
    m = torch.as_tensor(mask)
    w = torch.as_tensor(old - rollout).exp().clamp(max=cap)
    torch.testing.assert_close(metrics["tis_weight"], torch.where(m, w, 0.0), rtol=1e-13, atol=0.0)
    assert (metrics["tis_weight"] <= cap * (1 + 1e-15)).all()
    event(f"weights at the cap: {bool((m & (w == cap)).any())}")
    torch.testing.assert_close(loss, w * p_loss, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad, w * p_grad, rtol=1e-13, atol=1e-15)  # w is detached: a pure scale
    assert torch.equal(metrics["clip_low"], p_metrics["clip_low"])


def test_icepop_known_values():
    # old_logp - rollout_logp = log 3: w = 3 in [0.5, 5], kept and weighted. ρ=1.1, A=1 (inside PPO's
    # range): 3 · (-1.1) = -3.3, gradient 3 · (-ρA) = -3.3.
    old = -1.0 - math.log(1.1)
    loss, m, grad, _ = _run(
        "icepop", [[old]], [[math.log(1.1)]], [[1.0]], [[True]], rollout=[[old - math.log(3)]]
    )
    assert (loss.item(), grad.item()) == pytest.approx((-3.3, -3.3), abs=1e-12)
    assert (m["is_weight"].item(), m["is_masked"].item()) == (pytest.approx(3.0, abs=1e-12), 0.0)
    # w = 6 > β = 5: masked out (tis would truncate it to its cap and keep it): loss 0, gradient 0.
    loss, m, grad, _ = _run(
        "icepop", [[old]], [[math.log(1.1)]], [[1.0]], [[True]], rollout=[[old - math.log(6)]]
    )
    assert (loss.item(), grad.item(), m["is_weight"].item(), m["is_masked"].item()) == (0.0, 0.0, 0.0, 1.0)
    # w = 0.25 < α = 0.5: masked too. With α = 0.2 it is kept: 0.25 · (-1.1) = -0.275.
    rollout = [[old + math.log(4)]]
    loss, m, grad, _ = _run("icepop", [[old]], [[math.log(1.1)]], [[1.0]], [[True]], rollout=rollout)
    assert (loss.item(), grad.item(), m["is_masked"].item()) == (0.0, 0.0, 1.0)
    loss, m, grad, _ = _run(
        "icepop", [[old]], [[math.log(1.1)]], [[1.0]], [[True]], rollout=rollout, alpha=0.2
    )
    assert (loss.item(), grad.item()) == pytest.approx((-0.275, -0.275), abs=1e-12)
    # A<0, ρ=0.5 < 0.8 (PPO's flat case) with w = 2: 2 · 0.8 = 1.6, zero gradient, clip_low.
    old = -1.0 - math.log(0.5)
    loss, m, grad, _ = _run(
        "icepop", [[old]], [[math.log(0.5)]], [[-1.0]], [[True]], rollout=[[old - math.log(2)]]
    )
    assert (loss.item(), grad.item(), m["clip_low"].item()) == (pytest.approx(1.6, abs=1e-12), 0.0, 1.0)


@given(
    batch=batches(),
    mismatch=hnp.arrays(np.float64, 15, elements=_floats(-3.0, 3.0), fill=st.nothing()),
    alpha=_floats(0.1, 1.0),
    beta=_floats(1.0, 10.0),
)
def test_icepop_keeps_weighted_tokens_inside_the_band_and_drops_the_rest(batch, mismatch, alpha, beta):
    old, d, adv, mask = batch
    rollout = old - mismatch[: old.size].reshape(old.shape)  # old - rollout = mismatch
    loss, metrics, grad, _ = _run("icepop", old, d, adv, mask, rollout=rollout, alpha=alpha, beta=beta)
    p_loss, p_metrics, p_grad, _ = _run("ppo", old, d, adv, mask)
    m = torch.as_tensor(mask)
    w = torch.as_tensor(old - rollout).exp()
    inside = (w >= alpha) & (w <= beta)
    check = m & ~_near(w, alpha) & ~_near(w, beta)  # which side of a band edge is rounding
    event(f"masked tokens: {bool((check & ~inside).any())}; kept: {bool((check & inside).any())}")
    assert torch.equal(metrics["is_masked"][check].bool(), ~inside[check])
    torch.testing.assert_close(metrics["is_weight"][check & inside], w[check & inside], rtol=1e-13, atol=0.0)
    assert (metrics["is_weight"][check & ~inside] == 0).all() and (metrics["is_weight"][~m] == 0).all()
    assert (loss[check & ~inside] == 0).all() and (grad[check & ~inside] == 0).all()
    kept = check & inside
    torch.testing.assert_close(loss[kept], w[kept] * p_loss[kept], rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(grad[kept], w[kept] * p_grad[kept], rtol=1e-13, atol=1e-15)
    assert torch.equal(metrics["clip_high"], p_metrics["clip_high"])


@given(batch=batches(d_lo=-3.0, d_hi=3.0), eps_low=_floats(0.05, 0.5), eps_high=_floats(0.05, 0.5))
def test_icepop_and_tis_equal_ppo_exactly_when_the_sampler_is_pi_old(batch, eps_low, eps_high):
    # rollout_logp == old_logp: log w = 0 exactly, w = e^0 = 1.0 exactly (inside IcePop's band and
    # under TIS's cap 2), and 1.0 · x == x in IEEE arithmetic: loss and gradient are PPO's bit for bit.
    old, d, adv, mask = batch
    p_loss, p_metrics, p_grad, _ = _run("ppo", old, d, adv, mask, eps_low=eps_low, eps_high=eps_high)
    for name in sorted(OFF_POLICY):
        loss, metrics, grad, _ = _run(
            name, old, d, adv, mask, rollout=old, eps_low=eps_low, eps_high=eps_high
        )
        assert torch.equal(loss, p_loss) and torch.equal(grad, p_grad), name
        assert all(torch.equal(metrics[k], p_metrics[k]) for k in COMMON_METRICS), name


# ------------------------------------------------------------------------------------------------
# Metrics, padding, errors, gin.


@pytest.mark.parametrize("name", RULES)
@given(batch=batches(d_lo=-3.0, d_hi=3.0))
def test_approx_kl_is_k3_of_old_vs_new(name, batch):
    old, d, adv, mask = batch
    _, metrics, _, r = _run(name, old, d, adv, mask, rollout=old)
    m = torch.as_tensor(mask)
    torch.testing.assert_close(
        metrics["approx_kl"], torch.where(m, r - 1 - r.log(), 0.0), rtol=1e-9, atol=1e-15
    )
    assert (metrics["approx_kl"] >= 0).all()


@pytest.mark.parametrize("name", RULES)
def test_padding_is_zero_and_gets_no_gradient_even_if_garbage(name):
    mask = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], dtype=F64)
    logp = torch.tensor([[-1.0, -math.inf, -0.5], [math.nan, -0.2, 5.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, 0.0, -0.6], [-1.0, -0.3, math.inf]], dtype=F64)
    adv = torch.tensor([[0.5, 7.0, -0.3], [math.nan, 1.0, 2.0]], dtype=F64)
    rollout = torch.tensor([[-1.0, math.nan, -0.6], [0.0, -0.4, -math.inf]], dtype=F64)
    # Valid tokens: every ratio is e^{0.1}, inside every rule's range (gspo's widened to 0.2 here).
    hparams = {"eps_low": 0.2, "eps_high": 0.2} if name == "gspo" else {}
    loss, metrics = get("clip", name)(logp, old, adv, mask, rollout_logp=rollout, **hparams)
    loss.sum().backward()
    pad = mask == 0
    for t in (loss, logp.grad, *metrics.values()):
        assert torch.isfinite(t).all() and (t[pad] == 0).all()
    assert not torch.signbit(loss[pad]).any(), "padding must be +0.0, not -0.0"
    assert (loss[~pad] != 0).all() and (logp.grad[~pad] != 0).all()


@pytest.mark.parametrize("name", RULES)
def test_metrics_stay_zero_on_padding_when_every_bound_binds(name):
    """Indicators and approx_kl get no select of their own (zero on padding by construction, see the
    module docstring): with zero-width bounds valid tokens are flagged, garbage padding still reads 0."""
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]], dtype=F64)
    logp = torch.tensor([[-1.0, -math.inf, -0.5, 3.0], [math.nan, -0.2, -2.0, -9.0]], dtype=F64)
    logp.requires_grad_(True)
    old = torch.tensor([[-1.5, 0.0, -0.1, -math.inf], [-1.0, -0.5, -1.0, 2.0]], dtype=F64)
    adv = torch.tensor([[1.0, 7.0, -2.0, -math.inf], [math.nan, -1.0, 1.0, -3.0]], dtype=F64)
    rollout = torch.tensor([[-1.0, math.inf, -0.6, 5.0], [-math.inf, -0.4, -1.2, math.nan]], dtype=F64)
    hparams = {} if name == "none" else {"eps_low": 0.0, "eps_high": 0.0}
    loss, metrics = get("clip", name)(logp, old, adv, mask, rollout_logp=rollout, **hparams)
    loss.sum().backward()
    pad = mask == 0
    for t in (loss, logp.grad, *metrics.values()):
        assert torch.isfinite(t).all() and (t[pad] == 0).all()
    flagged = metrics["clip_low"] + metrics["clip_high"]
    if name != "none":
        assert flagged[~pad].sum() >= 2  # the bounds do bind on valid tokens
    for key in EXTRA_METRICS.get(name, ()):
        if key not in ("clip_dual", "is_masked"):  # (no weight here is outside icepop's band)
            assert (metrics[key][~pad] > 0).all()  # IS weights: non-zero on valid tokens, 0 on padding


def test_rollout_logp_is_shape_checked_and_required_by_tis():
    z = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ShapeError, match=r"^clip\.tis needs rollout_logp but got None; .*sampler's logprobs"):
        get("clip", "tis")(z, z, z, torch.ones_like(z))
    with pytest.raises(
        ShapeError, match=r"^clip\.icepop needs rollout_logp but got None; .*sampler's logprobs"
    ):
        get("clip", "icepop")(z, z, z, torch.ones_like(z))
    with pytest.raises(ShapeError, match=r"clip\.icepop: rollout_logp must have the shape of mask"):
        get("clip", "icepop")(z, z, z, torch.ones_like(z), rollout_logp=torch.zeros(3, 2))
    with pytest.raises(ShapeError, match=r"clip\.ppo: rollout_logp must have the shape of mask"):
        get("clip", "ppo")(z, z, z, torch.ones_like(z), rollout_logp=torch.zeros(3, 2))


@pytest.mark.parametrize("name", RULES)
def test_shape_errors_name_the_part_and_tensor(name):
    z = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ShapeError, match=rf"^clip\.{name}: adv must have the shape of mask \[B,T\]=\[2,3\]"):
        get("clip", name)(z, z, torch.zeros(2), torch.ones_like(z), rollout_logp=z)
    with pytest.raises(ShapeError, match=rf"^clip\.{name}: mask must be a \[B,T\] tensor"):
        get("clip", name)(z, z, z, torch.ones(6), rollout_logp=z)


@pytest.mark.parametrize(
    "name, hparams, message",
    [
        ("ppo", {"eps_low": -0.1}, "clip.ppo.eps_low must be a number in [0, 1], got -0.1"),
        ("ppo", {"eps_low": 1.5}, "clip.ppo.eps_low must be a number in [0, 1], got 1.5"),
        ("ppo", {"eps_low": None}, "clip.ppo.eps_low must be a number in [0, 1], got None"),
        ("ppo", {"eps_high": -0.2}, "clip.ppo.eps_high must be a finite number >= 0, got -0.2"),
        ("gspo", {"eps_high": float("nan")}, "clip.gspo.eps_high must be a finite number >= 0, got nan"),
        ("cispo", {"eps_low": -1.0}, "clip.cispo.eps_low must be a number in [0, 1], got -1.0"),
        ("cispo", {"eps_high": "0.28"}, "clip.cispo.eps_high must be a finite number >= 0, got '0.28'"),
        ("dual_clip", {"c": 0.5}, "clip.dual_clip.c must be > 1, got 0.5"),
        ("dual_clip", {"c": 1}, "clip.dual_clip.c must be > 1, got 1"),
        ("dual_clip", {"eps_high": -1.0}, "clip.dual_clip.eps_high must be a finite number >= 0, got -1.0"),
        ("tis", {"cap": 0.0}, "clip.tis.cap must be a finite number > 0, got 0.0"),
        ("tis", {"cap": -2.0}, "clip.tis.cap must be a finite number > 0, got -2.0"),
        ("tis", {"eps_low": -0.2}, "clip.tis.eps_low must be a number in [0, 1], got -0.2"),
        ("icepop", {"alpha": 0.0}, "clip.icepop needs 0 < alpha <= 1 <= beta < inf, got alpha=0.0, beta=5.0"),
        ("icepop", {"beta": 0.9}, "clip.icepop needs 0 < alpha <= 1 <= beta < inf, got alpha=0.5, beta=0.9"),
        (
            "icepop",
            {"beta": math.inf},
            "clip.icepop needs 0 < alpha <= 1 <= beta < inf, got alpha=0.5, beta=inf",
        ),
        ("icepop", {"eps_high": -1.0}, "clip.icepop.eps_high must be a finite number >= 0, got -1.0"),
    ],
)
def test_bad_hyperparameters_raise_one_line_config_errors(name, hparams, message):
    z = torch.zeros(1, 2, dtype=F64)
    with pytest.raises(ConfigError) as info:
        get("clip", name)(z, z, z, torch.ones_like(z), rollout_logp=z, **hparams)
    # gin appends "\n  In call to configurable 'name' (...)" to any exception raised inside a
    # configurable; the part's own message is the first line.
    assert str(info.value).splitlines()[0] == message


def test_gin_bindings_reach_the_parts():
    gin.parse_config(["clip.ppo.eps_high = 0.28", "clip.dual_clip.c = 4.0"])
    # ρ=1.25 < 1.28 is inside the clip-higher range: loss -1.25 (not -1.2).
    assert _one("ppo", 1.25, 1.0)[0] == pytest.approx(-1.25, abs=1e-12)
    # ρ=3.5 < c=4: the dual clip does not bind, loss 3.5 (with c=3 it would be 3).
    assert _one("dual_clip", 3.5, -1.0)[0] == pytest.approx(3.5, abs=1e-12)
    gin.clear_config()
    gin.parse_config(["clip.dual_clip.c = 0.5"])
    with pytest.raises(ConfigError, match=r"^clip\.dual_clip\.c must be > 1, got 0\.5$"):
        _one("dual_clip", 1.0, -1.0)
