"""Options of the advantage estimators: gae's whitening, grpo's scale, rloo's normalisation, remax's
per-token form. Known values worked by hand, properties against plain-Python oracles, errors.

Float64 throughout; U = torch.finfo(float64).eps = 2u. Whitening tolerances follow the problem's
condition number, as in tests/components/test_advantage.py: rounding relative to the spread of the values,
divided by the std.
"""

from __future__ import annotations

import math

import gin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_advantage import F64, TOL_SUM, UNIT, U, assert_within, batches, broadcast, fn, own_message

from polgrad.errors import ConfigError

# ---------------------------------------------------------------------------------------------
# Oracles
# ---------------------------------------------------------------------------------------------


def whiten_values(vals: list[float], eps: float, ddof: int, eps_in_sqrt: bool):
    """(v - mean) / sqrt(var + eps) or / (std + eps), var = sum (v - mean)^2 / (N - ddof), by fsum;
    with the per-value tolerance 16 N U spread / den (1 + |a|) (centring rounds by <= N u spread)."""
    n = len(vals)
    if n == 0:
        return [], [], 0.0
    ref = vals[0]
    mean_d = math.fsum(v - ref for v in vals) / n
    cen = [(v - ref) - mean_d for v in vals]
    var = math.fsum(c * c for c in cen) / max(n - ddof, 1)
    den = math.sqrt(var + eps) if eps_in_sqrt else math.sqrt(var) + eps
    out = [c / den if den > 0 else 0.0 for c in cen]
    spread = max(vals) - min(vals)
    tol = [0.0 if den == 0 else 16 * n * U * spread / den * (1 + abs(a)) for a in out]
    return out, tol, var


def valid_list(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return x[mask != 0].tolist()


def put_valid(values: list[float], mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(mask)
    out[mask != 0] = torch.tensor(values, dtype=F64)
    return out


# ---------------------------------------------------------------------------------------------
# advantage.gae: whiten
# ---------------------------------------------------------------------------------------------


def test_gae_whiten_known_values():
    # gamma = lam = 1: A_t = sum_{k >= t} r_k - V_t. Row 0: r = [0, 4], V = [3, 1] -> G = [4, 4],
    # A = [1, 3]; row 1 (one valid token, then a masked one): r = [2], V = [0] -> A = [2].
    # Valid A = {1, 3, 2}: mean 2, deviations [-1, 1, 0], Bessel var = (1 + 1 + 0) / (3 - 1) = 1.
    # eps = 0: whitened = [-1, 1, 0]; eps = 0.44: divide by sqrt(1.44) = 1.2. Returns = A + V.
    tr = torch.tensor([[0.0, 4.0], [2.0, 9.0]], dtype=F64)
    v = torch.tensor([[3.0, 1.0], [0.0, 9.0]], dtype=F64)
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    r = torch.zeros(2, dtype=F64)
    kw = dict(values=v, token_rewards=tr, gamma=1.0, lam=1.0)
    adv, ret = fn("gae")(r, m, whiten=True, eps=0.0, **kw)
    assert adv.tolist() == [[-1.0, 1.0], [0.0, 0.0]]
    assert ret.tolist() == [[4.0, 4.0], [2.0, 0.0]]  # the critic's targets, not whitened
    adv, _ = fn("gae")(r, m, whiten=True, eps=0.44, **kw)
    torch.testing.assert_close(
        adv, torch.tensor([[-1 / 1.2, 1 / 1.2], [0.0, 0.0]], dtype=F64), rtol=0, atol=1e-15
    )


@given(b=batches(), gamma=UNIT, lam=UNIT, eps=st.sampled_from([0.0, 1e-8, 0.5]))
def test_gae_whiten_is_verl_masked_whiten_of_the_plain_advantages(b, gamma, lam, eps):
    kw = dict(values=b.values, token_rewards=b.token_rewards, gamma=gamma, lam=lam)
    plain, ret_plain = fn("gae")(b.rewards, b.mask, **kw)
    adv, ret = fn("gae")(b.rewards, b.mask, whiten=True, eps=eps, **kw)
    assert torch.equal(ret, ret_plain)  # returns are taken before whitening
    want, tol, _ = whiten_values(valid_list(plain, b.mask), eps, ddof=1, eps_in_sqrt=True)
    assert_within(adv, put_valid(want, b.mask), put_valid(tol, b.mask), "gae whiten")
    assert bool((adv[b.mask == 0] == 0).all())


@given(b=batches(), gamma=UNIT, lam=UNIT)
def test_gae_whiten_gives_mean_zero_and_unbiased_variance_one(b, gamma, lam):
    kw = dict(values=b.values, token_rewards=b.token_rewards, gamma=gamma, lam=lam)
    plain, _ = fn("gae")(b.rewards, b.mask, **kw)
    adv, _ = fn("gae")(b.rewards, b.mask, whiten=True, eps=0.0, **kw)
    vals, raw = valid_list(adv, b.mask), valid_list(plain, b.mask)
    if len(raw) < 2 or max(raw) == min(raw):
        assert all(x == 0 for x in vals)  # nothing to whiten (N <= 1, or ties): exactly 0, no NaN
        return
    _, tol, _ = whiten_values(raw, 0.0, ddof=1, eps_in_sqrt=True)
    n, bound = len(vals), max(tol)
    mean = math.fsum(vals) / n
    assert abs(mean) <= bound
    assert abs(math.fsum((x - mean) ** 2 for x in vals) / (n - 1) - 1) <= 4 * bound


def test_gae_whiten_of_tied_advantages_is_exactly_zero():
    # V = 0, one reward 0.1 per row on its last token, gamma = lam = 1: A = 0.1 on every valid token
    m = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]], dtype=F64)
    adv, _ = fn("gae")(
        torch.full((3,), 0.1, dtype=F64),
        m,
        values=torch.zeros(3, 3, dtype=F64),
        lam=1.0,
        whiten=True,
        eps=0.0,
    )
    assert bool((adv == 0).all())


# ---------------------------------------------------------------------------------------------
# advantage.grpo: scale
# ---------------------------------------------------------------------------------------------


def test_grpo_scale_known_values():
    # groups {0,1}: rewards [1, 0] -> centred [0.5, -0.5]; {2,3}: [2, 2] -> [0, 0].
    # batch: rewards [1, 0, 2, 2], mean 1.25, deviations [-0.25, -1.25, 0.75, 0.75],
    # sum of squares 0.0625 + 1.5625 + 0.5625 + 0.5625 = 2.75, Bessel var 2.75 / 3 = 11/12.
    # scale 'batch', eps = 0: [0.5, -0.5, 0, 0] / sqrt(11/12); eps = 1e-4 (TRL): / (sqrt(11/12) + 1e-4)
    # scale 'group': group std of [1, 0] = sqrt(0.5) -> 0.5 / sqrt(0.5) = sqrt(0.5); scale 'none': +-0.5
    r = torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=F64)
    m = torch.ones(4, 1, dtype=F64)
    g = torch.tensor([5, 5, 9, 9])
    s = math.sqrt(11 / 12)
    cases = {
        ("batch", 0.0): [0.5 / s, -0.5 / s, 0, 0],
        ("batch", 1e-4): [0.5 / (s + 1e-4), -0.5 / (s + 1e-4), 0, 0],
        ("group", 0.0): [math.sqrt(0.5), -math.sqrt(0.5), 0, 0],
        ("none", 0.0): [0.5, -0.5, 0, 0],
    }
    for (scale, eps), want in cases.items():
        adv, _ = fn("grpo")(r, m, group_ids=g, scale=scale, eps=eps)
        torch.testing.assert_close(adv[:, 0], torch.tensor(want, dtype=F64), rtol=0, atol=2e-16, msg=scale)


@given(b=batches(), eps=st.sampled_from([0.0, 1e-6, 0.5]))
def test_grpo_default_scale_is_group_and_none_is_dr_grpo(b, eps):
    kw = dict(group_ids=b.group_ids, eps=eps)
    assert torch.equal(
        fn("grpo")(b.rewards, b.mask, **kw)[0], fn("grpo")(b.rewards, b.mask, scale="group", **kw)[0]
    )
    none, _ = fn("grpo")(b.rewards, b.mask, scale="none", **kw)
    assert torch.equal(none, fn("dr_grpo")(b.rewards, b.mask, group_ids=b.group_ids)[0])


@given(b=batches(), eps=st.sampled_from([0.0, 1e-4, 0.5]))
def test_grpo_batch_scale_is_dr_grpo_over_the_batch_reward_std(b, eps):
    adv, _ = fn("grpo")(b.rewards, b.mask, group_ids=b.group_ids, scale="batch", eps=eps)
    dev, _ = fn("dr_grpo")(b.rewards, b.mask, group_ids=b.group_ids)
    r = b.rewards.tolist()
    # std_B of all B rewards (Bessel), fully masked rows included; the quotient rounds once more
    _, _, var = whiten_values(r, 0.0, ddof=1, eps_in_sqrt=True)
    den = math.sqrt(var) + eps
    want = dev / den if den > 0 else torch.zeros_like(dev)
    spread = max(r) - min(r)
    # dev (<= 16 n U spread, test_advantage's group bound) and std (relative 16 B U spread / std)
    tol = 0.0 if den == 0 else 32 * len(r) * U * spread * (1 + 1 / den) * (1 + float(want.abs().max()))
    assert_within(adv, want, torch.full_like(adv, tol), "grpo batch")


# ---------------------------------------------------------------------------------------------
# advantage.rloo: normalize
# ---------------------------------------------------------------------------------------------


def test_rloo_normalize_known_values():
    # group {0,1,2}: rewards [3, 0, 0] -> A = [3 - 0, 0 - 1.5, 0 - 1.5] = [3, -1.5, -1.5];
    # group {3,4}: [1, 0] -> [1, -1]. Over the 5 rows: mean 0, sum of squares 9 + 2.25 + 2.25 + 1 + 1
    # = 15.5, Bessel var 15.5 / 4 = 3.875. eps = 0: A / sqrt(3.875); eps = 1e-4 (TRL's): / (sqrt + 1e-4)
    r = torch.tensor([3.0, 0.0, 0.0, 1.0, 0.0], dtype=F64)
    m = torch.ones(5, 2, dtype=F64)
    g = torch.tensor([0, 0, 0, 1, 1])
    a = torch.tensor([3.0, -1.5, -1.5, 1.0, -1.0], dtype=F64)
    plain, _ = fn("rloo")(r, m, group_ids=g)
    assert plain[:, 0].tolist() == a.tolist()  # default: off
    for eps in (0.0, 1e-4):
        adv, _ = fn("rloo")(r, m, group_ids=g, normalize=True, eps=eps)
        torch.testing.assert_close(adv, (a / (math.sqrt(3.875) + eps))[:, None] * m, rtol=0, atol=4e-16)


@given(b=batches(), eps=st.sampled_from([0.0, 1e-4, 0.5]))
def test_rloo_normalize_standardises_the_advantages_over_all_rows(b, eps):
    plain, _ = fn("rloo")(b.rewards, b.mask, group_ids=b.group_ids)
    assert torch.equal(plain, fn("rloo")(b.rewards, b.mask, group_ids=b.group_ids, normalize=False)[0])
    adv, _ = fn("rloo")(b.rewards, b.mask, group_ids=b.group_ids, normalize=True, eps=eps)
    # per-row advantages of every row (padding rows too: they are in their group and in the batch)
    rows = torch.ones_like(b.mask)
    per_row, _ = fn("rloo")(b.rewards, rows, group_ids=b.group_ids)
    want, tol, _ = whiten_values(per_row[:, 0].tolist(), eps, ddof=1, eps_in_sqrt=False)
    spread = float(b.rewards.max() - b.rewards.min())
    # the rloo advantages themselves carry <= 16 n U spread (test_advantage's group bound)
    extra = [0.0 if t == 0 else t + 64 * len(want) * U * spread for t in tol]
    assert_within(adv, broadcast(b, want), broadcast(b, extra), "rloo normalize")


# ---------------------------------------------------------------------------------------------
# advantage.remax: per_token
# ---------------------------------------------------------------------------------------------


def test_remax_per_token_known_values_with_kl_in_the_reward():
    # score 1 on the last valid token, KL penalties 0.25, 0.125, 0.5 on the three valid tokens
    # (position 1 is a hole): token rewards [-0.25, -, -0.125, 1 - 0.5 = 0.5]; greedy baseline 0.25.
    # per token: rewards-to-go G = [0.125, -, 0.375, 0.5] -> A = G - 0.25 = [-0.125, 0, 0.125, 0.25]
    # sequence: R = 1 - (0.25 + 0.125 + 0.5) = 0.125 -> A = -0.125 on every valid token: the two
    # agree on the first token only.
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=F64)
    tr = torch.tensor([[-0.25, 7.0, -0.125, 0.5]], dtype=F64)
    r, base = torch.tensor([0.125], dtype=F64), torch.tensor([0.25], dtype=F64)
    adv, ret = fn("remax")(r, m, token_rewards=tr, baseline_rewards=base, per_token=True)
    assert adv.tolist() == [[-0.125, 0.0, 0.125, 0.25]] and ret is None
    seq, _ = fn("remax")(r, m, token_rewards=tr, baseline_rewards=base)
    assert seq.tolist() == [[-0.125, 0.0, -0.125, -0.125]]


@given(b=batches(token_rewards=False))
def test_remax_per_token_equals_the_sequence_form_when_the_only_reward_is_the_score(b):
    kw = dict(baseline_rewards=b.baseline_rewards)
    per_tok, _ = fn("remax")(b.rewards, b.mask, per_token=True, **kw)
    seq, _ = fn("remax")(b.rewards, b.mask, **kw)
    # G_t = R_i exactly (a sum of R_i and zeros), then the same subtraction
    assert torch.equal(per_tok, seq)


@given(b=batches(token_rewards=True))
def test_remax_per_token_is_reward_to_go_minus_baseline_and_matches_on_the_first_token(b):
    tr = b.token_rewards * b.mask
    r = tr.sum(-1)  # the scalar reward the loop folds from the same token rewards
    per_tok, _ = fn("remax")(r, b.mask, token_rewards=tr, baseline_rewards=b.baseline_rewards, per_token=True)
    seq, _ = fn("remax")(r, b.mask, token_rewards=tr, baseline_rewards=b.baseline_rewards)
    rtg = torch.flip(torch.cumsum(torch.flip(tr, [1]), 1), [1]) * b.mask  # plain reverse cumsum
    assert_within(per_tok, rtg - b.baseline_rewards[:, None] * b.mask, torch.full_like(tr, TOL_SUM), "rtg")
    first = (torch.cumsum(b.mask, 1) == 1) & (b.mask != 0)
    assert_within(per_tok[first], seq[first], torch.full_like(seq[first], TOL_SUM), "first token")


# ---------------------------------------------------------------------------------------------
# Errors and gin
# ---------------------------------------------------------------------------------------------

R = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=F64)
M = torch.ones(4, 2, dtype=F64)
G = torch.tensor([1, 1, 2, 2])
KW = dict(group_ids=G, values=torch.zeros(4, 2, dtype=F64), token_rewards=None, baseline_rewards=R)


@pytest.mark.parametrize(
    "name, hp, fragment",
    [
        (
            "grpo",
            {"scale": "batchwise"},
            "advantage.grpo: scale must be one of 'group', 'batch', 'none', got 'batchwise'",
        ),
        ("grpo", {"scale": None}, "advantage.grpo: scale must be one of"),
        ("gae", {"whiten": 1}, "advantage.gae: whiten must be True or False, got 1"),
        ("gae", {"eps": -1.0}, "advantage.gae: eps must be a number >= 0"),
        ("rloo", {"normalize": "yes"}, "advantage.rloo: normalize must be True or False"),
        ("rloo", {"eps": float("nan")}, "advantage.rloo: eps must be a number >= 0"),
        ("remax", {"per_token": None}, "advantage.remax: per_token must be True or False"),
    ],
)
def test_bad_options_raise_one_line_config_errors(name, hp, fragment):
    with pytest.raises(ConfigError) as e:
        fn(name)(R, M, **KW, **hp)
    assert fragment in own_message(e.value)


def test_gin_bindings_reach_the_options():
    plain = fn("grpo")(R, M, group_ids=G)[0]
    gin.parse_config("advantage.grpo.scale = 'batch'\nadvantage.rloo.normalize = True")
    assert not torch.equal(fn("grpo")(R, M, group_ids=G)[0], plain)
    gin.clear_config()
    assert torch.equal(fn("grpo")(R, M, group_ids=G)[0], plain)
    gin.parse_config("advantage.rloo.normalize = True")
    assert not torch.equal(
        fn("rloo")(R, M, group_ids=G)[0], fn("rloo")(R, M, group_ids=G, normalize=False)[0]
    )
