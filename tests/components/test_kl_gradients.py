"""Which gradient each KL placement follows: exact checks of Liu et al. 2025, "Rethinking KL Regularization
in RLHF: From Value Estimation to Gradient Optimization" (arXiv:2510.01555), on polgrad's kl parts.

Notation: π = π_θ, x = log π(y) - log π_ref(y), r = π_ref(y)/π(y) = e^{-x}, sg[.] = stop-gradient. "k as
loss" differentiates k through x; "k1 in reward" (PPO-style) uses -β·sg[k1] as a reward, so the policy
gradient step descends the surrogate sg[k1]·log π(y). Every expectation E_{y~π}[.] is an exact sum over
the vocabulary (or over all sequences) with sampling weights sg[π(y)]; nothing is sampled.

One token (categorical π = softmax(θ)):
- per sampled token, ∇k2 = sg[k1]·∇log π(y) exactly, so on-policy the k2-as-loss gradient equals the
  k1-in-reward gradient sample by sample, not only in expectation;
- k1 as loss: E[∇k1] = E[∇log π] = 0, no regularising gradient;
- k2 as loss and k1 in reward: expected gradient ∇KL(π‖π_ref), the reverse KL;
- k3 as loss: E[∇k3] = ∇KL(π_ref‖π), the forward KL; it differs from ∇KL(π‖π_ref) by exactly
  E[(1 - r - x)·∇log π], which is O(ε²) when π_ref is ε away from π (a first-order approximation).

Several tokens (tabular autoregressive π over all V^H sequences):
- k1 in reward with rewards-to-go (or with the full return) gives ∇KL_seq(π‖π_ref), the gradient of
  the sequence-level reverse KL;
- per-token k2 as loss (Σ_t k2_t) gives E[Σ_t sg[k1_t]·∇log π_t], which equals k1 in reward crediting
  each token with its own k1 only (no rewards-to-go) and equals the gradient of
  Σ_t E_{prefix}[KL(π(·|prefix)‖π_ref(·|prefix))] with the prefix distribution held fixed; it misses
  ∇KL_seq's term through the prefix distribution and in general differs from ∇KL_seq (on the last
  position's rows the two agree);
- per-token k3 as loss gives the same fixed-prefix gradient for the forward KL;
- k1 as loss again has expected gradient 0.
So the paper's on-policy equivalence of k2 as loss and k1 in reward is exact for one token; over a
sequence it holds when k1 in reward credits each token with its own k1 alone, not with rewards-to-go.

polgrad's k3 has numerical guards (max_log_ratio=20, max_value=10) that are on by default; they are
switched off here, since the value guard removes the gradient of every token beyond it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polgrad import registry

DT = torch.float64
ATOL = 1e-12  # float64 sums of O(10) terms: rounding is ~1e-14, so 1e-12 leaves room and is still exact
EXAMPLES = settings(max_examples=40, deadline=None)


# ------------------------------------------------------------------------------------------------
# Helpers: polgrad's parts on [B,T] tensors, exact expectations, closed-form KLs.


def kl_part(name: str, logp, ref_logp):
    """polgrad's kl part `name` on [B,T] log-probs with a full mask; k3 with its guards off."""
    kw = {"max_log_ratio": None, "max_value": None} if name == "k3" else {}
    return registry.get("kl", name)(logp, ref_logp, torch.ones_like(logp), **kw)


def grad(value, theta):
    """∇_θ value; the graph is kept because several objectives share the same log-probabilities."""
    return torch.autograd.grad(value, theta, retain_graph=True)[0]


def expected_grad(weights, per_sample, theta):
    """E_{s~π}[∇ per_sample(s)] = Σ_s sg[π(s)]·∇per_sample(s): the sampling weights carry no gradient."""
    return grad((weights.detach() * per_sample).sum(), theta)


def kl(lp, lq):
    """Closed-form KL(p‖q) = Σ p (log p - log q) over the last axis, differentiable in both."""
    return (lp.exp() * (lp - lq)).sum(-1)


def close(a, b, atol=ATOL):
    torch.testing.assert_close(a, b, rtol=0.0, atol=atol)


def logit_lists(n: int):
    return st.lists(st.floats(-3.0, 3.0, allow_subnormal=False), min_size=n, max_size=n)


@st.composite
def categorical_pair(draw):
    """(θ, φ): policy and reference logits over a vocabulary of 2..6 tokens; θ requires grad."""
    v = draw(st.integers(2, 6))
    theta = torch.tensor(draw(logit_lists(v)), dtype=DT, requires_grad=True)
    return theta, torch.tensor(draw(logit_lists(v)), dtype=DT)


def token_logps(theta, phi):
    """Every token y as a [B=V, T=1] batch: (log π(y), log π_ref(y), sg[π(y)])."""
    lp = torch.log_softmax(theta, -1)[:, None]
    lq = torch.log_softmax(phi, -1)[:, None]
    return lp, lq, lp.detach().exp()


# ------------------------------------------------------------------------------------------------
# 1. Per token: ∇k2(y) = sg[k1(y)]·∇log π(y).


@EXAMPLES
@given(categorical_pair())
def test_k2_gradient_is_k1_times_score_per_token(pair):
    theta, phi = pair
    lq = torch.log_softmax(phi, -1)[:, None]

    def k2_all(th):
        return kl_part("k2", torch.log_softmax(th, -1)[:, None], lq)[:, 0]

    def logp_all(th):
        return torch.log_softmax(th, -1)

    jac_k2 = torch.autograd.functional.jacobian(k2_all, theta)  # row y: ∇_θ k2(y)
    jac_logp = torch.autograd.functional.jacobian(logp_all, theta)  # row y: ∇_θ log π(y)
    k1 = kl_part("k1", torch.log_softmax(theta, -1)[:, None].detach(), lq)
    # ∇(x²/2) = x·∇x and ∇x = ∇log π(y) (the reference is fixed), with x = k1(y).
    close(jac_k2, k1 * jac_logp)


# ------------------------------------------------------------------------------------------------
# 2. One step, exact expectation over the vocabulary.


@EXAMPLES
@given(categorical_pair())
def test_one_step_expected_gradients(pair):
    theta, phi = pair
    lp, lq, pi = token_logps(theta, phi)
    x = (lp - lq).detach()
    reverse = grad(kl(lp[:, 0], lq[:, 0]), theta)  # ∇KL(π‖π_ref)
    forward = grad(kl(lq[:, 0], lp[:, 0]), theta)  # ∇KL(π_ref‖π)

    # a. Σ π ∇log π = ∇Σ π = ∇1 = 0.
    close(expected_grad(pi, kl_part("k1", lp, lq), theta), torch.zeros_like(theta))
    # b. ∇Σ π x = Σ π x ∇log π + Σ π ∇x, and the second sum is Σ π ∇log π = 0; E[∇k2] = Σ π x ∇log π.
    k2_loss = expected_grad(pi, kl_part("k2", lp, lq), theta)
    close(k2_loss, reverse)
    # c. The surrogate sg[k1]·log π has gradient x ∇log π per sample, the same sum as in (b).
    k1_reward = expected_grad(pi, kl_part("k1", lp, lq).detach() * lp, theta)
    close(k1_reward, reverse)
    close(k1_reward, k2_loss)
    # d. ∇k3 = (1 - e^{-x})∇log π, so E[∇k3] = Σ (π - π_ref) ∇log π = -Σ π_ref ∇log π = ∇KL(π_ref‖π).
    k3_loss = expected_grad(pi, kl_part("k3", lp, lq), theta)
    close(k3_loss, forward)
    # Subtracting (b): E[∇k3] - ∇KL(π‖π_ref) = E[(1 - r - x) ∇log π] with r = e^{-x}.
    bias = expected_grad(pi, (1.0 - torch.exp(-x) - x) * lp, theta)
    close(k3_loss - reverse, bias)


def k3_bias(theta, phi):
    """E[∇k3] - ∇KL(π‖π_ref), both by autograd: k3 through polgrad, the KL in closed form."""
    lp, lq, pi = token_logps(theta, phi)
    return expected_grad(pi, kl_part("k3", lp, lq), theta) - grad(kl(lp[:, 0], lq[:, 0]), theta)


def k3_bias_limit(theta, delta):
    """lim bias/ε² for π_ref = softmax(θ + εδ): with c = δ - E_π[δ], x = -εc + O(ε²) and
    1 - e^{-x} - x = -x²/2 + O(x³), so bias/ε² → -½ Σ_y π_y c_y² (e_y - π)."""
    pi = torch.softmax(theta.detach(), -1)
    c = delta - (pi * delta).sum()
    return -0.5 * (pi * c.square())[:, None].mul(torch.eye(len(pi), dtype=DT) - pi).sum(0)


@EXAMPLES
@given(categorical_pair(), st.data())
def test_k3_bias_is_second_order(pair, data):
    theta, _ = pair
    n = len(theta)
    delta = torch.tensor(data.draw(st.lists(st.floats(-1.0, 1.0), min_size=n, max_size=n)), dtype=DT)
    limit = k3_bias_limit(theta, delta)
    for eps in (1e-2, 1e-3, 1e-4):
        ratio = k3_bias(theta, (theta + eps * delta).detach()) / eps**2
        # Next order: bias/ε² = limit + ε Σ π_y (c_y Var_π(δ)/2 - c_y³/6)(e_y - π) + O(ε²); with |δ| <= 1,
        # |c| <= 2 and Var <= 1 each component is <= 2·(1 + 8/6)·ε < 5ε (+ rounding ~1e-8 at ε = 1e-4).
        close(ratio, limit, atol=10 * eps)


# ------------------------------------------------------------------------------------------------
# 3. Several tokens: a tabular autoregressive policy, exact enumeration of all V^H sequences.


class Tabular:
    """Every prefix of length < H indexes a row of V logits; sequences and prefixes are enumerated."""

    def __init__(self, v: int, h: int):
        self.v, self.h = v, h
        self.prefixes = [p for t in range(h) for p in itertools.product(range(v), repeat=t)]
        self.row = {p: i for i, p in enumerate(self.prefixes)}
        seqs = list(itertools.product(range(v), repeat=h))
        self.pref_idx = torch.tensor([[self.row[s[:t]] for t in range(h)] for s in seqs])
        self.tokens = torch.tensor(seqs)

    def token_logps(self, table):
        """log π(y_t | y_<t) for every sequence and position: [B=V^H, T=H]."""
        return torch.log_softmax(table, -1)[self.pref_idx, self.tokens]

    def prefix_logprob(self, table):
        """log P(prefix) of every prefix (rows of the table), the product of its tokens' probabilities."""
        lsm = torch.log_softmax(table, -1)
        return torch.stack(
            [
                sum((lsm[self.row[p[:i]], p[i]] for i in range(len(p))), lsm.new_zeros(()))
                for p in self.prefixes
            ]
        )


def rewards_to_go(k):
    """G_t = Σ_{t' >= t} k_{t'} along the last axis."""
    return k.flip(-1).cumsum(-1).flip(-1)


@st.composite
def tabular_pair(draw):
    v, h = draw(st.integers(2, 3)), draw(st.integers(2, 3))
    tab = Tabular(v, h)
    n = len(tab.prefixes) * v
    theta = torch.tensor(draw(logit_lists(n)), dtype=DT).view(-1, v).requires_grad_(True)
    return tab, theta, torch.tensor(draw(logit_lists(n)), dtype=DT).view(-1, v)


def sequence_gradients(tab, theta, phi):
    """Expected gradients of each placement and the exact objectives' gradients, by name."""
    lp, lq = tab.token_logps(theta), tab.token_logps(phi)
    w = lp.sum(-1, keepdim=True).exp().detach()  # π(seq) [B,1], the sampling weights
    k1 = kl_part("k1", lp, lq)
    log_p = tab.prefix_logprob(theta)
    kl_rows = kl(torch.log_softmax(theta, -1), torch.log_softmax(phi, -1))  # KL(π(·|p)‖π_ref(·|p))
    fwd_rows = kl(torch.log_softmax(phi, -1), torch.log_softmax(theta, -1))  # KL(π_ref(·|p)‖π(·|p))
    kl_seq = (lp.sum(-1).exp() * (lp - lq).sum(-1)).sum()  # Σ π(s) log π(s)/π_ref(s)
    return {
        "kl_seq": kl_seq.detach(),
        "chain_rule": (log_p.exp() * kl_rows).sum().detach(),  # Σ_prefixes P(p) KL_p
        "grad_kl_seq": grad(kl_seq, theta),
        "k1_reward_to_go": expected_grad(w, rewards_to_go(k1).detach() * lp, theta),
        "k1_reward_full_return": expected_grad(w, k1.sum(-1, keepdim=True).detach() * lp, theta),
        "k1_reward_own_token": expected_grad(w, k1.detach() * lp, theta),
        "k2_loss": expected_grad(w, kl_part("k2", lp, lq), theta),
        "k3_loss": expected_grad(w, kl_part("k3", lp, lq), theta),
        "k1_loss": expected_grad(w, k1, theta),
        "fixed_prefix_reverse": grad((log_p.exp().detach() * kl_rows).sum(), theta),
        "fixed_prefix_forward": grad((log_p.exp().detach() * fwd_rows).sum(), theta),
        "through_prefixes": grad((log_p.exp() * kl_rows.detach()).sum(), theta),
    }


@EXAMPLES
@given(tabular_pair())
def test_sequence_expected_gradients(case):
    tab, theta, phi = case
    g = sequence_gradients(tab, theta, phi)
    # Chain rule of KL: log π(s)/π_ref(s) = Σ_t x_t, and E[x_t | prefix] = KL_prefix.
    close(g["kl_seq"], g["chain_rule"])
    # a. ∇KL_seq = E[X ∇log π(s)] with X = Σ_t x_t (the Σ π ∇X term is E[∇log π(s)] = 0); in
    # E[x_t' ∇log π_t] the terms t' < t vanish since E[∇log π_t | y_<t] = 0, leaving rewards-to-go.
    close(g["k1_reward_to_go"], g["grad_kl_seq"])
    close(g["k1_reward_full_return"], g["grad_kl_seq"])
    # b. ∇k2_t = sg[k1_t] ∇log π_t per token (test 1), so E[Σ_t ∇k2_t] is k1 in reward crediting each
    # token with its own k1 only; for a fixed prefix p, E_{y_t}[x_t ∇log π_t] = ∇KL_p (test 2b), hence
    # the sum is ∇ Σ_p sg[P(p)] KL_p.
    close(g["k2_loss"], g["k1_reward_own_token"])
    close(g["k2_loss"], g["fixed_prefix_reverse"])
    # ∇KL_seq = ∇Σ_p P(p) KL_p = Σ_p P ∇KL_p + Σ_p ∇P KL_p: k2 misses the term through the prefixes.
    close(g["grad_kl_seq"] - g["k2_loss"], g["through_prefixes"])
    # Per-token k3: for a fixed prefix E[∇k3_t] = ∇KL(π_ref‖π)(p) (test 2d), so ∇ Σ_p sg[P(p)] KL_fwd(p).
    close(g["k3_loss"], g["fixed_prefix_forward"])
    # c. E[∇ Σ_t k1_t] = Σ_t E[∇log π_t] = 0, each term zero given its prefix.
    close(g["k1_loss"], torch.zeros_like(theta))


def fixed_tabular(v=3, h=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tab = Tabular(v, h)
    theta = (1.5 * torch.randn(len(tab.prefixes), v, generator=gen, dtype=DT)).requires_grad_(True)
    return tab, theta, 1.5 * torch.randn(len(tab.prefixes), v, generator=gen, dtype=DT)


def test_per_token_k2_is_not_the_sequence_kl_gradient():
    tab, theta, phi = fixed_tabular()
    g = sequence_gradients(tab, theta, phi)
    gap = (g["grad_kl_seq"] - g["k2_loss"]).abs().max().item()
    assert gap > 1e-3, gap
    with pytest.raises(AssertionError):
        close(g["k2_loss"], g["grad_kl_seq"])
    # The missing part Σ_p ∇P(p) KL_p moves only rows that are a strict prefix of some p: the last
    # position's rows (prefixes of length H-1) are none, so there the two gradients agree.
    last = [i for i, p in enumerate(tab.prefixes) if len(p) == tab.h - 1]
    close(g["k2_loss"][last], g["grad_kl_seq"][last])


# ------------------------------------------------------------------------------------------------
# 4. Non-vacuity: the same harness rejects wrong claims on a fixed asymmetric instance.


def test_harness_detects_wrong_claims():
    theta = torch.tensor([2.0, 0.0, -1.0], dtype=DT, requires_grad=True)
    phi = torch.tensor([0.0, 1.0, 0.5], dtype=DT)
    lp, lq, pi = token_logps(theta, phi)
    reverse = grad(kl(lp[:, 0], lq[:, 0]), theta)
    k3_loss = expected_grad(pi, kl_part("k3", lp, lq), theta)
    k1_loss = expected_grad(pi, kl_part("k1", lp, lq), theta)
    # k3 as loss is not the reverse-KL gradient here ...
    assert (k3_loss - reverse).abs().max().item() > 1e-3
    with pytest.raises(AssertionError):
        close(k3_loss, reverse)
    # ... and k1 as loss (zero) is not it either: ∇KL(π‖π_ref) is far from 0.
    assert reverse.abs().max().item() > 1e-3
    with pytest.raises(AssertionError):
        close(k1_loss, reverse)
    # The O(ε²) bias of k3 is exactly second order here, not smaller: its ε² coefficient is not 0.
    delta = torch.tensor([0.3, -1.0, 0.8], dtype=DT)
    assert k3_bias_limit(theta, delta).abs().max().item() > 1e-3
    # With polgrad's default k3 guards on, the value guard binds (k3 = 10 beyond x ≈ -2.61) and cuts
    # that token's gradient, so the forward-KL identity of (2d) fails: the guards must be off for it.
    theta = torch.tensor([4.0, -4.0], dtype=DT, requires_grad=True)
    lp, lq, pi = token_logps(theta, torch.tensor([-4.0, 4.0], dtype=DT))  # x(token 1) ≈ -8
    guarded = registry.get("kl", "k3")(lp, lq, torch.ones_like(lp))
    assert guarded[1, 0].item() == 10.0
    forward = grad(kl(lq[:, 0], lp[:, 0]), theta)
    close(expected_grad(pi, kl_part("k3", lp, lq), theta), forward)
    assert (expected_grad(pi, guarded, theta) - forward).abs().max().item() > 0.5
