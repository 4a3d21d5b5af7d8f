"""Advantage estimators: known values worked by hand, identities as hypothesis properties, errors.

Everything runs in float64. Each property compares against an independent plain-Python oracle
(math.fsum sums, per-row recursions over the valid tokens) with an explicit error bound:

- sums over time (gae, mc): |error| <= TOL_SUM, derived at its definition;
- group baselines (grpo, dr_grpo, rloo): both the code and the oracle work relative to a member
  of the group, so rounding is relative to the group's range R_g, not to |r|;
- whitening (reinforce_pp*): rounding of the returns (relative to their magnitude) divided by
  the batch std, i.e. the problem's own condition number.

Unit roundoff u = 2^-53 ~ 1.1e-16; below U = 2u = torch.finfo(float64).eps.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, replace

import gin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from polgrad import registry
from polgrad.config_parts import part
from polgrad.errors import ConfigError, ShapeError


def gae_loop(token_rewards, values, mask, gamma: float, lam: float):
    """Reference GAE with a plain backward loop over time (the test oracle for advantage.gae).

    verl's masked recursion on the original layout: at a valid token t
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next,
    then V_next <- V_t and A_next <- A_t; at a masked token nothing changes (V_next, A_next carry
    over). V_next = A_next = 0 after the last valid token. Returns (adv, returns = adv + V), both 0
    where mask is 0.
    """
    b, t = mask.shape
    valid = mask != 0
    zero = torch.zeros(b, dtype=values.dtype, device=values.device)
    adv = torch.zeros_like(values)
    next_v, running = zero.clone(), zero.clone()
    for s in reversed(range(t)):
        ok = valid[:, s]
        delta = token_rewards[:, s] + gamma * next_v - values[:, s]
        running = torch.where(ok, delta + gamma * lam * running, running)
        next_v = torch.where(ok, values[:, s], next_v)
        adv[:, s] = torch.where(ok, running, zero)
    returns = torch.where(valid, adv + values, torch.zeros_like(values))
    return adv, returns


F64 = torch.float64
U = torch.finfo(F64).eps  # 2.2e-16 = 2u

NAMES = [
    "gae",
    "mc",
    "reinforce",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "grpo",
    "dr_grpo",
    "rloo",
    "remax",
]
GROUP_SEQ = ["grpo", "dr_grpo", "rloo"]
TOKEN = ["gae", "mc", "reinforce_pp", "reinforce_pp_baseline"]

# Sums over time. Inputs are bounded by the strategy: |rewards| <= 10, |token_rewards| <= 1,
# |values| <= 5, T <= 8. So |delta| <= 10 + 1 + 5 + 5 = 21 and any partial sum is <= 8 * 21 = 168.
# Each of the <= 8 steps does ~3 rounded operations of size <= 168 in the code and in the oracle,
# and (gamma*lam)^k by pow vs. by repeated products differs by <= k*u relatively:
# 2 * 3 * 8 * 1.1e-16 * 168 + 8 * 1.1e-16 * 168 ~ 1.0e-12. TOL_SUM leaves a factor 10.
TOL_SUM = 1e-11


def fn(name):
    """The estimator as a build binds it: gin's values now (none bound: its defaults)."""
    return part("advantage", name)


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

# Rewards: small integers (ties, 0/1-style verifiable rewards, constant groups) or floats in
# [-10, 10] rounded to 1e-6 (moderate range; no subnormals or 1e-300s whose squares underflow).
REWARD = st.one_of(
    st.integers(-3, 3).map(float),
    st.floats(-10, 10, allow_nan=False, allow_infinity=False).map(lambda x: round(x, 6)),
)
UNIT = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0, 1, allow_subnormal=False))


@dataclass(frozen=True)
class Batch:
    rewards: torch.Tensor  # [B]
    mask: torch.Tensor  # [B,T] float64 0/1, holes and possibly a fully masked row
    group_ids: torch.Tensor  # [B] int64, arbitrary shuffled ids, groups of 2..5
    values: torch.Tensor  # [B,T] in [-5, 5]
    token_rewards: torch.Tensor | None  # [B,T] in [-1, 1], or None (rewards on the last token)
    baseline_rewards: torch.Tensor  # [B] in [-10, 10]

    def kwargs(self):
        return dict(
            group_ids=self.group_ids,
            values=self.values,
            token_rewards=self.token_rewards,
            baseline_rewards=self.baseline_rewards,
        )


@st.composite
def batches(draw, max_t: int = 8, token_rewards: bool | None = None) -> Batch:
    sizes = draw(st.lists(st.integers(2, 5), min_size=1, max_size=4))
    ids = draw(st.lists(st.integers(-(2**40), 2**40), min_size=len(sizes), max_size=len(sizes), unique=True))
    gids = draw(st.permutations([g for g, n in zip(ids, sizes, strict=True) for _ in range(n)]))
    b = len(gids)
    t = draw(st.integers(1, max_t))
    # Arbitrary 0/1 rows: trailing zeros are variable lengths, inner zeros are holes. Each row is one
    # integer's t bits, column j its bit j (one draw per row, not t: drawing booleans one by one was most
    # of this module's time). Hypothesis draws such an integer about uniformly and more often at its
    # bounds: over 6,000 rows at t = 8 (two runs), 2.5-3.4% empty and 0.7-1.9% full, against 1.0-1.3%
    # and 0.2% with the booleans, holes and every length in between as before. It shrinks towards 0,
    # i.e. towards rows whose later columns are masked. Measured up to t = 8 only:
    assert max_t <= 8, "a longer row: check how hypothesis draws an integer of more than 8 bits first"
    bits = draw(st.lists(st.integers(0, 2**t - 1), min_size=b, max_size=b))
    rows = [[bool(n >> j & 1) for j in range(t)] for n in bits]
    pad = draw(st.none() | st.integers(0, b - 1))
    if pad is not None:
        rows[pad] = [False] * t
    rewards = draw(st.lists(REWARD, min_size=b, max_size=b))
    with_tr = draw(st.booleans()) if token_rewards is None else token_rewards
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    values = torch.rand(b, t, generator=gen, dtype=F64) * 10 - 5
    tr = torch.rand(b, t, generator=gen, dtype=F64) * 2 - 1
    base = torch.rand(b, generator=gen, dtype=F64) * 20 - 10
    return Batch(
        rewards=torch.tensor(rewards, dtype=F64),
        mask=torch.tensor(rows, dtype=F64),
        group_ids=torch.tensor(gids, dtype=torch.int64),
        values=values,
        token_rewards=tr if with_tr else None,
        baseline_rewards=base,
    )


HPARAMS = {
    "gae": st.fixed_dictionaries({"gamma": UNIT, "lam": UNIT}),
    "mc": st.fixed_dictionaries({"gamma": UNIT}),
    "reinforce_pp": st.fixed_dictionaries({"gamma": UNIT, "eps": st.sampled_from([0.0, 1e-8, 0.1])}),
    "reinforce_pp_baseline": st.fixed_dictionaries({"gamma": UNIT, "eps": st.sampled_from([0.0, 1e-8, 0.1])}),
    "grpo": st.fixed_dictionaries({"eps": st.sampled_from([0.0, 1e-6, 0.5])}),
    "dr_grpo": st.just({}),
    "rloo": st.just({}),
    "reinforce": st.just({}),
    "remax": st.just({}),
}


# ---------------------------------------------------------------------------------------------
# Plain-Python oracle: what each estimator should return, and how far rounding may move it
# ---------------------------------------------------------------------------------------------


def valid_positions(mask):
    return [[t for t, m in enumerate(row) if m != 0] for row in mask.tolist()]


def step_rewards(b: Batch):
    """Per row, the rewards of its valid tokens in order (rewards[i] on the last one if no token_rewards)."""
    out, r = [], b.rewards.tolist()
    tr = None if b.token_rewards is None else b.token_rewards.tolist()
    for i, pos in enumerate(valid_positions(b.mask)):
        if tr is not None:
            out.append([tr[i][t] for t in pos])
        else:
            out.append([0.0] * (len(pos) - 1) + [r[i]] if pos else [])
    return out


def discounted(seq, rate):
    """Return-to-go by the backward recursion G_k = x_k + rate * G_{k+1}, G_n = 0."""
    out, acc = [0.0] * len(seq), 0.0
    for k in reversed(range(len(seq))):
        acc = seq[k] + rate * acc
        out[k] = acc
    return out


def scatter_rows(b: Batch, rows) -> torch.Tensor:
    """Per-row lists aligned with valid_positions -> [B,T] tensor, 0 on masked tokens."""
    x = [[0.0] * b.mask.shape[1] for _ in range(b.mask.shape[0])]
    for i, pos in enumerate(valid_positions(b.mask)):
        for t, v in zip(pos, rows[i], strict=True):
            x[i][t] = v
    return torch.tensor(x, dtype=F64).reshape(b.mask.shape)


def broadcast(b: Batch, per_seq) -> torch.Tensor:
    return torch.tensor(per_seq, dtype=F64)[:, None] * b.mask


def group_members(gids):
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(gids.tolist()):
        groups.setdefault(g, []).append(i)
    return groups


def group_oracle(name, rewards, gids, eps=1e-6):
    """Per-sequence advantage of grpo / dr_grpo / rloo, per-row tolerance, and per-row group std.

    Sums are relative to the group's first member (exact for constant groups). Error bound: the
    code and the oracle each round the differences r_i - ref (<= u R_g each), their sums (<= n u R_g)
    and the std (relative <= n u R_g / std); the grpo quotient then errs by
    <= n u R_g (1 + |A|) / (std + eps). With U = 2u and a factor 16 of slack:
    tol_i = 16 n U R_g (1 + 1/(std + eps)) (1 + |A_i|). Note R_g / std <= sqrt(2 (n - 1)) <= 3,
    so this is ~1e-13 (1 + |A|): tight, except through eps.
    """
    r = [float(x) for x in rewards]
    adv, tol, stds = [0.0] * len(r), [0.0] * len(r), [0.0] * len(r)
    for rows in group_members(gids).values():
        n, ref = len(rows), r[rows[0]]
        d = [r[i] - ref for i in rows]
        mean_d = math.fsum(d) / n
        dev = [x - mean_d for x in d]
        std = math.sqrt(math.fsum(x * x for x in dev) / (n - 1))
        rng = max(r[i] for i in rows) - min(r[i] for i in rows)
        for k, i in enumerate(rows):
            if name == "dr_grpo":
                a = dev[k]
            elif name == "rloo":
                a = d[k] - math.fsum(d[j] for j in range(n) if j != k) / (n - 1)
            else:
                a = dev[k] / (std + eps) if std + eps > 0 else 0.0
            adv[i], stds[i] = a, std
            tol[i] = 0.0 if rng == 0 else 16 * n * U * rng * (1 + 1 / (std + eps)) * (1 + abs(a))
    return adv, tol, stds


def whiten_oracle(b: Batch, rets, eps, scale):
    """Whiten per-row returns over all valid tokens (population std), with its error bound.

    The returns themselves carry rounding <= 8 * 3 * u * scale (scale = largest row sum of |step
    rewards|) in the code and in the oracle; centring adds <= N u range(G); both are divided by
    (s + eps). tol = 16 (T scale + N range(G)) U / (s + eps) * (1 + |A|) -- the condition number
    of the problem: ~1e-13 for returns with spread O(1), large only when all returns (nearly) tie.
    """
    flat = [g for row in rets for g in row]
    if not flat:
        return torch.zeros_like(b.mask), torch.zeros_like(b.mask), 0.0
    n, ref = len(flat), flat[0]
    mean_d = math.fsum(g - ref for g in flat) / n
    cen = [[(g - ref) - mean_d for g in row] for row in rets]
    s = math.sqrt(math.fsum(c * c for row in cen for c in row) / n)
    den = s + eps
    adv = [[c / den if den > 0 else 0.0 for c in row] for row in cen]
    spread = max(flat) - min(flat)
    t = b.mask.shape[1]
    tol = [
        [0.0 if den == 0 else 16 * (t * scale + n * spread) * U / den * (1 + abs(a)) for a in row]
        for row in adv
    ]
    return scatter_rows(b, adv), scatter_rows(b, tol), s


def oracle(name, b: Batch, **hp):
    """-> (adv [B,T], returns [B,T] or None, tol [B,T]) computed without the module's code."""
    if name in ("gae", "mc"):
        gamma = hp.get("gamma", 1.0)
        lam = hp.get("lam", 0.95)
        advs, rets, values = [], [], b.values.tolist()
        for i, (pos, rs) in enumerate(zip(valid_positions(b.mask), step_rewards(b), strict=True)):
            v = [values[i][t] for t in pos] + [0.0]  # V = 0 after the last valid token
            if name == "gae":
                deltas = [rs[k] + gamma * v[k + 1] - v[k] for k in range(len(rs))]
                a = discounted(deltas, gamma * lam)
                advs.append(a)
                rets.append([a[k] + v[k] for k in range(len(rs))])
            else:
                g = discounted(rs, gamma)
                advs.append([g[k] - v[k] for k in range(len(rs))])
                rets.append(g)
        return scatter_rows(b, advs), scatter_rows(b, rets), torch.full_like(b.mask, TOL_SUM)
    if name in ("reinforce_pp", "reinforce_pp_baseline"):
        steps = step_rewards(b)
        if name == "reinforce_pp_baseline":
            dev, _, _ = group_oracle("dr_grpo", b.rewards, b.group_ids)
            mean = [r - d for r, d in zip(b.rewards.tolist(), dev, strict=True)]
            steps = [row[:-1] + [row[-1] - mean[i]] if row else [] for i, row in enumerate(steps)]
        scale = max([math.fsum(abs(x) for x in row) for row in steps] + [float(b.rewards.abs().max())])
        rets = [discounted(row, hp.get("gamma", 1.0)) for row in steps]
        adv, tol, _ = whiten_oracle(b, rets, hp.get("eps", 1e-8), scale)
        return adv, None, tol
    if name in GROUP_SEQ:
        a, tol, _ = group_oracle(name, b.rewards, b.group_ids, hp.get("eps", 1e-6))
        return broadcast(b, a), None, broadcast(b, tol)
    if name == "reinforce":
        r = [float(x) for x in b.rewards]
        real = [i for i, row in enumerate(b.mask.tolist()) if any(row)]
        base = math.fsum(r[i] for i in real) / len(real) if real else 0.0
        # the code's batch sum errs by <= B u sum|r| <= B u B M; 4 B^2 U M covers it with slack
        tol = 4 * len(r) ** 2 * U * max(1.0, max(abs(x) for x in r))
        return broadcast(b, [x - base for x in r]), None, torch.full_like(b.mask, tol)
    if name == "remax":  # one subtraction, the same IEEE operation: exact
        per = [float(x) - float(y) for x, y in zip(b.rewards, b.baseline_rewards, strict=True)]
        return broadcast(b, per), None, torch.zeros_like(b.mask)
    raise AssertionError(name)


def assert_within(actual, expected, tol, what=""):
    err = (actual - expected).abs()
    bad = err > tol
    assert not bool(bad.any()), (
        f"{what}: max excess {float((err - tol).max()):.3g}; actual {actual[bad].tolist()[:4]} "
        f"expected {expected[bad].tolist()[:4]} tol {tol[bad].tolist()[:4]}"
    )


# ---------------------------------------------------------------------------------------------
# Every estimator: contract, oracle, invariances
# ---------------------------------------------------------------------------------------------


def test_registered_with_contract_signature_and_meta():
    keys = {"level", "needs_groups", "needs_critic", "needs_baseline_rollout", "formula"}
    for name in NAMES:
        entry = registry.lookup("advantage", name)
        assert keys <= set(entry.meta), name
        assert entry.meta["level"] == ("token" if name in TOKEN else "sequence"), name
        assert entry.meta["needs_critic"] is (name in ("gae", "mc")), name
        assert entry.meta["needs_groups"] is (name in GROUP_SEQ + ["reinforce_pp_baseline"]), name
        assert entry.meta["needs_baseline_rollout"] is (name == "remax"), name
        assert entry.meta["formula"].startswith("A_"), name
        params = list(inspect.signature(entry.fn).parameters.values())
        assert [p.name for p in params[:2]] == ["rewards", "mask"], name
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:2]), name
        kw = params[2:]
        assert [p.name for p in kw[:4]] == ["group_ids", "values", "token_rewards", "baseline_rewards"], name
        assert all(p.kind is p.KEYWORD_ONLY and p.default is not p.empty for p in kw), name
        assert all(p.default is None for p in kw[:4]), name
        doc = inspect.getdoc(entry.fn)
        assert "Source:" in doc and "Shapes:" in doc, name


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_matches_oracle_and_contract(name, data):
    """adv (and returns) equal the plain-Python definition; 0 on masked tokens; finite; shapes."""
    b = data.draw(batches(), label="batch")
    hp = data.draw(HPARAMS[name], label="hparams")
    adv, ret = fn(name)(b.rewards, b.mask, **b.kwargs(), **hp)
    exp_adv, exp_ret, tol = oracle(name, b, **hp)
    assert adv.shape == b.mask.shape and adv.dtype == F64
    assert bool(torch.isfinite(adv).all())
    assert bool((adv[b.mask == 0] == 0).all())
    assert_within(adv, exp_adv, tol, f"{name} adv")
    if registry.lookup("advantage", name).meta["needs_critic"]:
        assert ret.shape == b.mask.shape and bool((ret[b.mask == 0] == 0).all())
        assert_within(ret, exp_ret, tol, f"{name} returns")
    else:
        assert ret is None
    if registry.lookup("advantage", name).meta["level"] == "sequence":
        # one number per row, broadcast: every valid token of a row carries the same value exactly
        for row, m in zip(adv, b.mask, strict=True):
            assert len(set(row[m != 0].tolist())) <= 1


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_permuting_rows_and_renaming_groups_changes_nothing(name, data):
    b = data.draw(batches(), label="batch")
    hp = data.draw(HPARAMS[name], label="hparams")
    bsz = b.mask.shape[0]
    perm = torch.tensor(data.draw(st.permutations(range(bsz)), label="perm"))
    old = sorted(set(b.group_ids.tolist()))
    new = data.draw(st.lists(st.integers(0, 10**6), min_size=len(old), max_size=len(old), unique=True))
    rename = dict(zip(old, new, strict=True))
    pb = Batch(
        rewards=b.rewards[perm],
        mask=b.mask[perm],
        group_ids=torch.tensor([rename[g] for g in b.group_ids[perm].tolist()]),
        values=b.values[perm],
        token_rewards=None if b.token_rewards is None else b.token_rewards[perm],
        baseline_rewards=b.baseline_rewards[perm],
    )
    adv, _ = fn(name)(b.rewards, b.mask, **b.kwargs(), **hp)
    padv, _ = fn(name)(pb.rewards, pb.mask, **pb.kwargs(), **hp)
    _, _, tol = oracle(name, b, **hp)
    assert_within(padv, adv[perm], 2 * tol[perm], name)  # each side is within tol of the oracle


@pytest.mark.parametrize("name", NAMES)
@given(data=st.data())
def test_inserting_masked_columns_changes_nothing(name, data):
    """A masked position is not a time step: masked columns with garbage anywhere change nothing."""
    b = data.draw(batches(), label="batch")
    hp = data.draw(HPARAMS[name], label="hparams")
    bsz, t = b.mask.shape
    k = data.draw(st.integers(1, 4), label="k")
    at = sorted(data.draw(st.lists(st.integers(0, t), min_size=k, max_size=k), label="insert before"))
    keep = [j + sum(1 for a in at if a <= j) for j in range(t)]  # new column of old column j
    wide = t + k
    junk = torch.rand(bsz, wide, dtype=F64, generator=torch.Generator().manual_seed(t + k)) * 200 - 100

    def widen(x, fill):
        out = fill.clone()
        out[:, keep] = x
        return out

    wb = replace(
        b,
        mask=widen(b.mask, torch.zeros(bsz, wide, dtype=F64)),
        values=widen(b.values, junk),
        token_rewards=None if b.token_rewards is None else widen(b.token_rewards, -junk),
    )
    adv, ret = fn(name)(b.rewards, b.mask, **b.kwargs(), **hp)
    wadv, wret = fn(name)(wb.rewards, wb.mask, **wb.kwargs(), **hp)
    _, _, tol = oracle(name, b, **hp)
    inserted = [j for j in range(wide) if j not in keep]
    assert bool((wadv[:, inserted] == 0).all())
    assert_within(wadv[:, keep], adv, 2 * tol, f"{name} adv")
    if ret is not None:
        assert bool((wret[:, inserted] == 0).all())
        assert_within(wret[:, keep], ret, 2 * tol, f"{name} returns")


# ---------------------------------------------------------------------------------------------
# Group estimators: identities
# ---------------------------------------------------------------------------------------------


def group_size_per_row(gids):
    sizes = {g: len(rows) for g, rows in group_members(gids).items()}
    return torch.tensor([float(sizes[g]) for g in gids.tolist()], dtype=F64)


@given(b=batches())
def test_rloo_is_g_over_g_minus_1_times_dr_grpo(b):
    # chapter eq. 53/62-63. Both sides are within ~16 n U R_g of the exact value, R_g <= 20,
    # n <= 5: 16 * 5 * 2.2e-16 * 20 * (G/(G-1) <= 2) ~ 7e-13, so 1e-12 is the tight bound here.
    rloo, _ = fn("rloo")(b.rewards, b.mask, group_ids=b.group_ids)
    dr, _ = fn("dr_grpo")(b.rewards, b.mask, group_ids=b.group_ids)
    g = group_size_per_row(b.group_ids)[:, None]
    torch.testing.assert_close(rloo, g / (g - 1) * dr, rtol=0, atol=1e-12)


@given(b=batches(), eps=st.sampled_from([0.0, 1e-6, 0.3]))
def test_grpo_is_dr_grpo_over_group_std_plus_eps(b, eps):
    grpo, _ = fn("grpo")(b.rewards, b.mask, group_ids=b.group_ids, eps=eps)
    dr, _ = fn("dr_grpo")(b.rewards, b.mask, group_ids=b.group_ids)
    _, tol, std = group_oracle("grpo", b.rewards, b.group_ids, eps)  # std: Bessel, from math.fsum
    den = torch.tensor(std, dtype=F64)[:, None] + eps
    expected = torch.where(den > 0, dr / den.clamp_min(1e-300), torch.zeros_like(dr))
    assert_within(grpo, expected, broadcast(b, tol), "grpo vs dr_grpo/(std+eps)")


@pytest.mark.parametrize("name", GROUP_SEQ)
@given(b=batches(), eps=st.sampled_from([0.0, 1e-6]))
def test_group_advantages_sum_to_zero(name, b, eps):
    # Per-sequence values with an all-ones mask (fully masked rows count in their group, so the
    # zero sum is over all rows of a group). The exact sum is 0; the computed terms are each within
    # tol_i of exact values, so |sum| <= sum_i tol_i.
    hp = {"eps": eps} if name == "grpo" else {}
    a, _ = fn(name)(b.rewards, torch.ones(len(b.rewards), 1, dtype=F64), group_ids=b.group_ids, **hp)
    _, tol, _ = group_oracle(name, b.rewards, b.group_ids, eps)
    for rows in group_members(b.group_ids).values():
        total = math.fsum(float(a[i, 0]) for i in rows)
        assert abs(total) <= math.fsum(tol[i] for i in rows), (name, rows, total)


@pytest.mark.parametrize("name", GROUP_SEQ + ["reinforce_pp_baseline"])
@given(b=batches(), shifts=st.lists(st.integers(-80, 80).map(lambda k: k / 8), min_size=4, max_size=4))
def test_adding_a_constant_to_a_group_changes_nothing(name, b, shifts):
    groups = list(group_members(b.group_ids).values())
    shift = torch.zeros_like(b.rewards)
    for rows, c in zip(groups, shifts, strict=False):  # at most 4 groups
        shift[rows] = c
    # the score sits in `rewards` and, when given, on the last valid token of `token_rewards`
    tr = b.token_rewards
    if tr is not None:
        last = [pos[-1] if pos else None for pos in valid_positions(b.mask)]
        tr = tr.clone()
        for i, t in enumerate(last):
            if t is not None:
                tr[i, t] += shift[i]
    sb = replace(b, rewards=b.rewards + shift, token_rewards=tr)
    adv, _ = fn(name)(b.rewards, b.mask, **b.kwargs())
    sadv, _ = fn(name)(sb.rewards, sb.mask, **sb.kwargs())
    if name == "reinforce_pp_baseline":
        # the centred score is the same up to the rounding of r + c (<= u (|r| + |c|) <= 20 u) and
        # of the group mean; the whitening divides it by the batch std: the oracle's bound with
        # the shifted magnitudes covers both sides.
        _, _, tol = oracle(name, sb)
        assert_within(sadv, adv, 2 * tol, name)
        return
    # r + c rounds relative to |r| + |c| <= 20 (not to the group's range): each side errs by
    # <= 16 n U 20 (1 + 1/(std + eps)) (1 + |A|), the group oracle's bound with R_g -> 20.
    _, _, std = group_oracle(name, b.rewards, b.group_ids)
    n = group_size_per_row(b.group_ids)
    tol = 2 * 16 * n * U * 20 * (1 + 1 / (torch.tensor(std, dtype=F64) + 1e-6)) * (1 + adv.abs().amax(1))
    assert_within(sadv, adv, tol[:, None] * b.mask, name)


@given(b=batches(), j=st.integers(-8, 8))
def test_grpo_scale_invariant_exactly_for_powers_of_two(b, j):
    # With eps = 0, GRPO(k r) = GRPO(r) for k > 0. For k = 2^j every step (differences, sums,
    # division by n, squares, sqrt, quotient) is an IEEE operation whose rounding commutes with an
    # exact scaling by 2^j (no overflow or underflow at these magnitudes): bit-for-bit equal.
    a, _ = fn("grpo")(b.rewards, b.mask, group_ids=b.group_ids, eps=0.0)
    ka, _ = fn("grpo")(b.rewards * 2.0**j, b.mask, group_ids=b.group_ids, eps=0.0)
    assert torch.equal(a, ka)
    # and Dr. GRPO, RLOO scale with the rewards, exactly for the same reason
    for name in ("dr_grpo", "rloo"):
        x, _ = fn(name)(b.rewards, b.mask, group_ids=b.group_ids)
        kx, _ = fn(name)(b.rewards * 2.0**j, b.mask, group_ids=b.group_ids)
        assert torch.equal(kx, x * 2.0**j), name


@given(b=batches(), k=st.floats(0.1, 10))
def test_grpo_scale_invariant_up_to_rounding(b, k):
    # eps = 0, any k > 0: k*r rounds relative to |k r| <= 10 k, i.e. a perturbation of
    # u * 10 / std relative to the normalised value; each side errs by <= 16 n U (10 / std + 1)
    # (1 + |A|). A constant group stays constant after scaling and gives exactly 0 on both sides.
    a, _ = fn("grpo")(b.rewards, b.mask, group_ids=b.group_ids, eps=0.0)
    ka, _ = fn("grpo")(b.rewards * k, b.mask, group_ids=b.group_ids, eps=0.0)
    _, _, std = group_oracle("grpo", b.rewards, b.group_ids, 0.0)
    std = torch.tensor(std, dtype=F64)
    n = group_size_per_row(b.group_ids)
    cond = torch.where(std > 0, 10 / std.clamp_min(1e-300) + 1, torch.zeros_like(std))
    tol = 2 * 16 * n * U * cond * (1 + a.abs().amax(1))
    assert_within(ka, a, tol[:, None] * b.mask, "grpo(k r) vs grpo(r)")


# ---------------------------------------------------------------------------------------------
# GAE / MC identities
# ---------------------------------------------------------------------------------------------


def full_token_rewards(b: Batch) -> torch.Tensor:
    return scatter_rows(b, step_rewards(b))


@given(b=batches(), gamma=UNIT, lam=UNIT)
def test_gae_vectorised_equals_loop(b, gamma, lam):
    adv, ret = fn("gae")(
        b.rewards, b.mask, values=b.values, token_rewards=b.token_rewards, gamma=gamma, lam=lam
    )
    ladv, lret = gae_loop(full_token_rewards(b), b.values, b.mask, gamma, lam)
    torch.testing.assert_close(adv, ladv, rtol=0, atol=TOL_SUM)
    torch.testing.assert_close(ret, lret, rtol=0, atol=TOL_SUM)


@pytest.mark.parametrize("t", [1, 2, 3, 10, 257, 1000])
def test_gae_long_sequences_match_loop(t):
    # Long rows exercise the chunked closed form (chunks of ceil(sqrt(L)) steps, a partial last
    # chunk, carries across several chunks). Bound: with S = max_i sum_t (|r| + 2|V|) >= any partial
    # sum of |delta|, each of <= t steps rounds by <= u S in the code and in the loop:
    # tol = 8 t U S (slack 4 over 2 t u S).
    gen = torch.Generator().manual_seed(t)
    bsz = 6
    mask = (torch.rand(bsz, t, generator=gen) < 0.8).to(F64)
    mask[0] = 0.0  # padding row
    mask[1, t // 2 :] = 0.0  # shorter row
    tr = torch.rand(bsz, t, generator=gen, dtype=F64) - 0.5
    v = torch.rand(bsz, t, generator=gen, dtype=F64) * 2 - 1
    tol = 8 * t * U * float((tr.abs() + 2 * v.abs()).sum(1).max())
    for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0), (0.0, 0.7)):
        adv, ret = fn("gae")(
            torch.zeros(bsz, dtype=F64), mask, values=v, token_rewards=tr, gamma=gamma, lam=lam
        )
        ladv, lret = gae_loop(tr, v, mask, gamma, lam)
        torch.testing.assert_close(adv, ladv, rtol=0, atol=tol)
        torch.testing.assert_close(ret, lret, rtol=0, atol=tol)


@given(b=batches(), gamma=UNIT)
def test_gae_lambda_one_is_mc_return_minus_value(b, gamma):
    # sum_l gamma^l delta_{t+l} telescopes to G_t - V_t
    adv, ret = fn("gae")(
        b.rewards, b.mask, values=b.values, token_rewards=b.token_rewards, gamma=gamma, lam=1.0
    )
    madv, mret = fn("mc")(b.rewards, b.mask, values=b.values, token_rewards=b.token_rewards, gamma=gamma)
    g, _, _ = oracle("mc", b, gamma=gamma)  # MC return-to-go G_t minus V_t, by recursion
    torch.testing.assert_close(adv, g, rtol=0, atol=TOL_SUM)
    torch.testing.assert_close(adv, madv, rtol=0, atol=TOL_SUM)
    torch.testing.assert_close(ret, mret, rtol=0, atol=TOL_SUM)


@given(b=batches(), gamma=UNIT)
def test_gae_lambda_zero_is_td_residual(b, gamma):
    adv, _ = fn("gae")(
        b.rewards, b.mask, values=b.values, token_rewards=b.token_rewards, gamma=gamma, lam=0.0
    )
    td, values = [], b.values.tolist()
    for i, (pos, rs) in enumerate(zip(valid_positions(b.mask), step_rewards(b), strict=True)):
        v = [values[i][t] for t in pos] + [0.0]
        td.append([rs[k] + gamma * v[k + 1] - v[k] for k in range(len(rs))])
    # a single delta per token: r + gamma V' - V, 3 roundings of size <= 16 in each: ~1e-14
    torch.testing.assert_close(adv, scatter_rows(b, td), rtol=0, atol=1e-14)


@given(b=batches(), gamma=UNIT, lam=UNIT)
def test_gae_returns_are_adv_plus_values(b, gamma, lam):
    adv, ret = fn("gae")(
        b.rewards, b.mask, values=b.values, token_rewards=b.token_rewards, gamma=gamma, lam=lam
    )
    assert torch.equal(ret, torch.where(b.mask != 0, adv + b.values, torch.zeros_like(adv)))


# ---------------------------------------------------------------------------------------------
# REINFORCE++: whitening
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
@given(b=batches(), gamma=UNIT)
def test_reinforce_pp_whitened_mean_zero_std_one(name, b, gamma):
    adv, _ = fn(name)(
        b.rewards, b.mask, group_ids=b.group_ids, token_rewards=b.token_rewards, gamma=gamma, eps=0.0
    )
    _, _, tol = oracle(name, b, gamma=gamma, eps=0.0)
    vals = adv[b.mask != 0].tolist()
    if not vals or max(vals) == min(vals):
        # no valid token, or all returns tie: whitening gives exactly 0 (not NaN) with eps = 0
        assert all(v == 0 for v in vals)
        return
    n = len(vals)
    mean = math.fsum(vals) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / n)  # population std, like the code
    bound = float(tol.max())  # every entry is within tol of the exactly whitened value
    assert abs(mean) <= bound
    assert abs(std - 1) <= 2 * bound


# ---------------------------------------------------------------------------------------------
# Known values, computed by hand
# ---------------------------------------------------------------------------------------------


def test_group_known_values_with_holes_padding_row_and_mixed_sizes():
    # group 42 (rows 0,1,3,5): rewards [1,0,0,1]; row 5 is fully masked but its reward counts.
    #   mean 0.5, deviations +-0.5, Bessel var = 4 * 0.25 / 3 = 1/3, std = 1/sqrt(3)
    #   dr_grpo = +-0.5; grpo(eps=0) = 0.5 * sqrt(3) = +-sqrt(3)/2; grpo(eps=1e-6) = +-0.5/(1/sqrt(3)+1e-6)
    #   rloo: r=1 -> 1 - (0+0+1)/3 = 2/3; r=0 -> 0 - (1+0+1)/3 = -2/3
    # group -3 (rows 2,4,6): rewards [2,5,5]; mean 4, deviations [-2,1,1], var = 6/2 = 3
    #   dr_grpo = [-2,1,1]; grpo(eps=0) = [-2,1,1]/sqrt(3); rloo = [2-5, 5-3.5, 5-3.5] = [-3,1.5,1.5]
    gids = torch.tensor([42, 42, -3, 42, -3, 42, -3])
    r = torch.tensor([1.0, 0.0, 2.0, 0.0, 5.0, 1.0, 5.0], dtype=F64)
    mask = torch.tensor(
        [[1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0], [0, 0, 1]], dtype=F64
    )
    s3 = math.sqrt(3.0)
    expected = {
        ("dr_grpo", None): [0.5, -0.5, -2.0, -0.5, 1.0, 0.5, 1.0],
        ("grpo", 0.0): [s3 / 2, -s3 / 2, -2 / s3, -s3 / 2, 1 / s3, s3 / 2, 1 / s3],
        ("grpo", 1e-6): [
            0.5 / (1 / s3 + 1e-6),
            -0.5 / (1 / s3 + 1e-6),
            -2 / (s3 + 1e-6),
            -0.5 / (1 / s3 + 1e-6),
            1 / (s3 + 1e-6),
            0.5 / (1 / s3 + 1e-6),
            1 / (s3 + 1e-6),
        ],
        ("rloo", None): [2 / 3, -2 / 3, -3.0, -2 / 3, 1.5, 2 / 3, 1.5],
    }
    for (name, eps), per_seq in expected.items():
        hp = {} if eps is None else {"eps": eps}
        adv, ret = fn(name)(r, mask, group_ids=gids, **hp)
        assert ret is None
        torch.testing.assert_close(adv, torch.tensor(per_seq, dtype=F64)[:, None] * mask, rtol=0, atol=1e-15)
    # the default eps is 1e-6 (verl); the fully masked row 5 gets 0 everywhere
    default, _ = fn("grpo")(r, mask, group_ids=gids)
    torch.testing.assert_close(
        default[0, 0], torch.tensor(0.5 / (1 / s3 + 1e-6), dtype=F64), rtol=0, atol=1e-15
    )
    assert bool((default[5] == 0).all())


def test_grpo_constant_group_is_exactly_zero_even_with_eps_zero():
    # all-correct / all-wrong groups: 0 / (0 + 0) must be 0, not NaN; 0.1 is not a dyadic number,
    # so a naive mean (0.1+0.1+0.1)/3 = 0.10000000000000002 would leave a nonzero deviation.
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0], dtype=F64)
    gids = torch.tensor([5, 5, 5, 9, 9])
    for name, hp in (("grpo", {"eps": 0.0}), ("dr_grpo", {}), ("rloo", {})):
        adv, _ = fn(name)(r, torch.ones(5, 2, dtype=F64), group_ids=gids, **hp)
        assert bool((adv[:3] == 0).all()), name
    adv, _ = fn("grpo")(r, torch.ones(5, 2, dtype=F64), group_ids=gids, eps=0.0)
    # group 9: [1, 0], mean 0.5, Bessel std = sqrt(0.5) -> +-0.5/sqrt(0.5) = +-sqrt(0.5)
    torch.testing.assert_close(
        adv[3:, 0], torch.tensor([0.5**0.5, -(0.5**0.5)], dtype=F64), rtol=0, atol=1e-15
    )


def test_gae_seed_002_worked_example_with_and_without_holes():
    # seed 002, section 5.4: T = 3, gamma = 1, lam = 0.95, token rewards [-0.1, -0.1, 5 - 0.1],
    # V = [2, 3, 4], V after the end = 0.
    #   delta = [-0.1 + 3 - 2, -0.1 + 4 - 3, 4.9 + 0 - 4] = [0.9, 0.9, 0.9]
    #   A_2 = 0.9; A_1 = 0.9 + 0.95 * 0.9 = 1.755; A_0 = 0.9 + 0.95 * 1.755 = 2.56725
    #   returns = A + V = [4.56725, 4.755, 4.9]
    tr = torch.tensor([[-0.1, -0.1, 4.9]], dtype=F64)
    v = torch.tensor([[2.0, 3.0, 4.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    adv, ret = fn("gae")(
        torch.tensor([5.0], dtype=F64), mask, values=v, token_rewards=tr, gamma=1.0, lam=0.95
    )
    torch.testing.assert_close(adv, torch.tensor([[2.56725, 1.755, 0.9]], dtype=F64), rtol=0, atol=1e-14)
    torch.testing.assert_close(ret, torch.tensor([[4.56725, 4.755, 4.9]], dtype=F64), rtol=0, atol=1e-14)
    # the same three tokens at positions 0, 2, 5 of 7, with junk in the holes and the padding
    hmask = torch.tensor([[1, 0, 1, 0, 0, 1, 0]], dtype=F64)
    htr = torch.tensor([[-0.1, 7.0, -0.1, 7.0, 7.0, 4.9, 7.0]], dtype=F64)
    hv = torch.tensor([[2.0, -9.0, 3.0, -9.0, -9.0, 4.0, -9.0]], dtype=F64)
    hadv, hret = fn("gae")(torch.tensor([5.0], dtype=F64), hmask, values=hv, token_rewards=htr, lam=0.95)
    torch.testing.assert_close(hadv[0, [0, 2, 5]], adv[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(hret[0, [0, 2, 5]], ret[0], rtol=0, atol=1e-14)
    assert bool((hadv[0, [1, 3, 4, 6]] == 0).all()) and bool((hret[0, [1, 3, 4, 6]] == 0).all())


def test_gae_dyadic_example_lambda_half_zero_one():
    # gamma = lam = 0.5, r = [0, 1], V = [0.5, 0.25] (all dyadic, so every step is exact):
    #   delta_1 = 1 + 0.5 * 0 - 0.25 = 0.75;  delta_0 = 0 + 0.5 * 0.25 - 0.5 = -0.375
    #   lam = 0.5: A_1 = 0.75, A_0 = -0.375 + 0.25 * 0.75 = -0.1875; returns [0.3125, 1.0]
    #   lam = 0:   A = delta = [-0.375, 0.75]
    #   lam = 1:   G = [0.5, 1], A = G - V = [0, 0.75]  (= -0.375 + 0.5 * 0.75)
    tr = torch.tensor([[0.0, 1.0]], dtype=F64)
    v = torch.tensor([[0.5, 0.25]], dtype=F64)
    m = torch.ones(1, 2, dtype=F64)
    r = torch.tensor([1.0], dtype=F64)
    for lam, exp in ((0.5, [-0.1875, 0.75]), (0.0, [-0.375, 0.75]), (1.0, [0.0, 0.75])):
        adv, ret = fn("gae")(r, m, values=v, token_rewards=tr, gamma=0.5, lam=lam)
        assert adv.tolist() == [exp], lam
        assert ret.tolist() == [[exp[0] + 0.5, exp[1] + 0.25]], lam


def test_mc_known_values_reward_on_last_token_across_a_hole():
    # no token_rewards: r = 1 goes on the last valid token (position 3); position 2 is a hole.
    # gamma = 0.5 over the valid tokens 0, 1, 3: G = [0.25, 0.5, -, 1]
    # V = [0.125, 0.25, 9 (ignored), 0.5] -> A = G - V = [0.125, 0.25, 0, 0.5]; returns = G
    mask = torch.tensor([[1, 1, 0, 1, 0]], dtype=F64)
    v = torch.tensor([[0.125, 0.25, 9.0, 0.5, 9.0]], dtype=F64)
    adv, ret = fn("mc")(torch.tensor([1.0], dtype=F64), mask, values=v, gamma=0.5)
    assert adv.tolist() == [[0.125, 0.25, 0.0, 0.5, 0.0]]
    assert ret.tolist() == [[0.25, 0.5, 0.0, 1.0, 0.0]]


def test_reinforce_pp_known_values():
    # rewards on the last valid token, gamma = 1: row 0 (2 tokens, r = 1) -> G = [1, 1];
    # row 1 (1 token, r = -1) -> G = [-1]; row 2 fully masked (its reward 50 is not a token).
    # valid G = {1, 1, -1}: mean 1/3, deviations [2/3, 2/3, -4/3],
    # population var = (4/9 + 4/9 + 16/9) / 3 = 8/9, std = 2 sqrt(2) / 3
    # A = (2/3) / (2 sqrt(2)/3) = 1/sqrt(2);  (-4/3) / (2 sqrt(2)/3) = -sqrt(2)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]], dtype=F64)
    adv, ret = fn("reinforce_pp")(torch.tensor([1.0, -1.0, 50.0], dtype=F64), mask, eps=0.0)
    h = 1 / math.sqrt(2)
    torch.testing.assert_close(
        adv, torch.tensor([[h, h], [-2 * h, 0], [0, 0]], dtype=F64), rtol=0, atol=1e-15
    )
    assert ret is None


def test_reinforce_pp_tied_returns_are_exactly_zero_even_with_eps_zero():
    # every valid token has return 0.1 (gamma = 1, reward 0.1 on each row's last token): the
    # batch std is 0, so the whitened advantage is 0 -- not NaN, and not +-1 from dividing a
    # rounding residue (0.1 is not dyadic; a naive mean of 0.1s is 0.1 + 1.4e-17) by its own size.
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 0], [0, 0, 0]], dtype=F64)
    for eps in (0.0, 1e-8):
        adv, _ = fn("reinforce_pp")(torch.full((4,), 0.1, dtype=F64), mask, eps=eps)
        assert bool((adv == 0).all()), eps


def test_reinforce_pp_baseline_known_values():
    # groups {0,1}: rewards [1, 0], mean 0.5 -> centred scores [0.5, -0.5]; {2,3}: [2, 2] -> [0, 0]
    # gamma = 0.5, 2 valid tokens each, centred score on the last: G rows [0.25, 0.5], [-0.25, -0.5],
    # [0, 0], [0, 0]. Over the 8 tokens: mean 0, population var = (2*0.0625 + 2*0.25) / 8 = 5/64,
    # std = sqrt(5)/8. A = 0.25 * 8/sqrt(5) = 2/sqrt(5), 0.5 * 8/sqrt(5) = 4/sqrt(5).
    adv, ret = fn("reinforce_pp_baseline")(
        torch.tensor([1.0, 0.0, 2.0, 2.0], dtype=F64),
        torch.ones(4, 2, dtype=F64),
        group_ids=torch.tensor([3, 3, 8, 8]),
        gamma=0.5,
        eps=0.0,
    )
    a, c = 2 / math.sqrt(5), 4 / math.sqrt(5)
    torch.testing.assert_close(
        adv, torch.tensor([[a, c], [-a, -c], [0, 0], [0, 0]], dtype=F64), rtol=0, atol=1e-15
    )
    assert ret is None
    # with token rewards (KL folded in): the group mean of `rewards` comes off the last valid token
    # row 0: tokens [-0.5, 1.0] -> [-0.5, 1.0 - 0.5]; row 1: [0.25, 0.5] -> [0.25, 0.0]; gamma = 1:
    # G = [0, 0.5], [0.25, 0]: mean 0.1875, var = (0.1875^2 + 0.3125^2 + 0.0625^2 + 0.1875^2)/4
    # = (0.03515625 + 0.09765625 + 0.00390625 + 0.03515625)/4 = 0.04296875
    adv, _ = fn("reinforce_pp_baseline")(
        torch.tensor([1.0, 0.0], dtype=F64),
        torch.ones(2, 2, dtype=F64),
        group_ids=torch.tensor([1, 1]),
        token_rewards=torch.tensor([[-0.5, 1.0], [0.25, 0.5]], dtype=F64),
        eps=0.0,
    )
    std = math.sqrt(0.04296875)
    exp = torch.tensor([[-0.1875, 0.3125], [0.0625, -0.1875]], dtype=F64) / std
    torch.testing.assert_close(adv, exp, rtol=0, atol=1e-15)


def test_reinforce_known_values_padding_row_not_in_baseline():
    # real rows 0..3 (row 1 has a hole): b = (1 + 2 + 3 + 6) / 4 = 3 -> A = [-2, -1, 0, 3];
    # row 4 is fully masked padding: its reward 100 does not enter b, and it gets 0.
    r = torch.tensor([1.0, 2.0, 3.0, 6.0, 100.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=F64)
    adv, ret = fn("reinforce")(r, mask)
    assert adv.tolist() == (torch.tensor([-2.0, -1.0, 0.0, 3.0, 0.0], dtype=F64)[:, None] * mask).tolist()
    assert ret is None
    # a batch of padding only: no baseline to take, adv is 0 (not NaN)
    adv, _ = fn("reinforce")(r[:1], torch.zeros(1, 3, dtype=F64))
    assert adv.tolist() == [[0.0, 0.0, 0.0]]


def test_remax_known_values():
    # A = R - R(greedy): [1 - 0.5, 0.25 - 0.5, 0.5 - 0.5] = [0.5, -0.25, 0]
    mask = torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=F64)
    adv, ret = fn("remax")(
        torch.tensor([1.0, 0.25, 0.5], dtype=F64),
        mask,
        baseline_rewards=torch.tensor([0.5, 0.5, 0.5], dtype=F64),
    )
    assert adv.tolist() == [[0.5, 0.5], [0.0, -0.25], [0.0, 0.0]]
    assert ret is None


def test_gin_binding_reaches_the_estimator():
    # advantage.gae.lam is the gin name of the hyperparameter; lam = 1 makes gae equal mc
    r, m = torch.tensor([1.0], dtype=F64), torch.ones(1, 3, dtype=F64)
    v = torch.tensor([[0.5, 0.25, 0.125]], dtype=F64)
    default, _ = fn("gae")(r, m, values=v)
    gin.parse_config("advantage.gae.lam = 1.0")
    bound, _ = fn("gae")(r, m, values=v)
    expected, _ = fn("mc")(r, m, values=v)
    torch.testing.assert_close(bound, expected, rtol=0, atol=1e-15)
    assert not torch.allclose(default, expected)


# ---------------------------------------------------------------------------------------------
# Errors: one line, naming the part, the tensor and the fix
# ---------------------------------------------------------------------------------------------


def own_message(exc: BaseException) -> str:
    """Our message: gin appends "\\n  In call to configurable ..." to exceptions from configurables."""
    msg = str(exc).split("\n  In call to configurable")[0]
    assert "\n" not in msg, msg
    return msg


R2 = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
M2 = torch.ones(3, 2, dtype=F64)
G2 = torch.tensor([4, 4, 4])
V2 = torch.zeros(3, 2, dtype=F64)


@pytest.mark.parametrize("name", GROUP_SEQ + ["reinforce_pp_baseline"])
def test_singleton_group_raises_naming_the_group(name):
    with pytest.raises(ShapeError) as e:
        fn(name)(R2, M2, group_ids=torch.tensor([4, 4, 17]))
    msg = own_message(e.value)
    assert f"advantage.{name}" in msg and "group 17" in msg
    assert "group size must be >= 2" in msg and "Algorithm.group_size" in msg


@pytest.mark.parametrize("name", GROUP_SEQ + ["reinforce_pp_baseline"])
def test_missing_group_ids_raises(name):
    with pytest.raises(ShapeError) as e:
        fn(name)(R2, M2)
    msg = own_message(e.value)
    assert "needs group_ids" in msg and "Algorithm.group_size >= 2" in msg


@pytest.mark.parametrize("name", ["gae", "mc"])
def test_missing_values_raises_asking_for_a_critic(name):
    with pytest.raises(ShapeError) as e:
        fn(name)(R2, M2, group_ids=G2)
    msg = own_message(e.value)
    assert f"advantage.{name} needs values" in msg and "critic" in msg and "Algorithm.value_init" in msg


def test_missing_baseline_rewards_raises_asking_for_the_greedy_rollout():
    with pytest.raises(ShapeError) as e:
        fn("remax")(R2, M2)
    msg = own_message(e.value)
    assert "needs baseline_rewards" in msg and "rollout must produce the greedy baseline" in msg


ALL_INPUTS = dict(group_ids=G2, values=V2, token_rewards=V2, baseline_rewards=R2)


@pytest.mark.parametrize(
    "change, fragments",
    [
        (dict(mask=torch.ones(3, dtype=F64)), ["mask must be a [B,T] tensor", "[3]"]),
        (dict(rewards=torch.ones(4, dtype=F64)), ["rewards must be a [B]=[3] vector", "[4]"]),
        (dict(rewards=torch.ones(3, 1, dtype=F64)), ["rewards must be a [B]=[3] vector"]),
        (dict(values=torch.zeros(3, 3, dtype=F64)), ["values must have the shape of mask [B,T]=[3,2]"]),
        (dict(token_rewards=torch.zeros(2, 2, dtype=F64)), ["token_rewards must have the shape of mask"]),
        (dict(group_ids=torch.tensor([4, 4])), ["group_ids must be a [B]=[3] vector"]),
        (dict(baseline_rewards=torch.ones(2, dtype=F64)), ["baseline_rewards must be a [B]=[3] vector"]),
        (dict(group_ids=torch.tensor([4.0, 4.0, 4.0])), ["group_ids must be an integer tensor"]),
        (dict(rewards=torch.tensor([1, 0, 1])), ["rewards must be a float tensor"]),
        (dict(mask=torch.full((3, 2), 0.5, dtype=F64)), ["mask must hold only 0 and 1"]),
        (dict(rewards=torch.tensor([1.0, float("nan"), 0.0], dtype=F64)), ["rewards must be finite"]),
    ],
)
@pytest.mark.parametrize("name", NAMES)
def test_bad_inputs_raise_one_line_shape_errors(name, change, fragments):
    args = dict(rewards=R2, mask=M2, **ALL_INPUTS)
    args.update(change)
    uses = {  # which optional inputs each estimator reads, so only those are expected to be checked
        "gae": {"values", "token_rewards"},
        "mc": {"values", "token_rewards"},
        "reinforce_pp": {"token_rewards"},
        "reinforce_pp_baseline": {"token_rewards", "group_ids"},
        "grpo": {"group_ids"},
        "dr_grpo": {"group_ids"},
        "rloo": {"group_ids"},
        "reinforce": set(),
        "remax": {"baseline_rewards"},
    }[name]
    (key,) = change
    if key not in {"rewards", "mask"} | uses:
        fn(name)(**args)  # an input the estimator does not read is not its business
        return
    with pytest.raises(ShapeError) as e:
        fn(name)(**args)
    msg = own_message(e.value)
    assert msg.startswith(f"advantage.{name}"), msg
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_non_finite_values_only_matter_on_valid_tokens():
    v = torch.tensor([[0.5, float("inf")], [0.25, 0.0], [1.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 0], [1, 1], [1, 1]], dtype=F64)
    adv, _ = fn("gae")(R2, mask, values=v)  # inf sits in padding: ignored
    assert bool(torch.isfinite(adv).all())
    with pytest.raises(ShapeError) as e:
        fn("gae")(R2, M2, values=v)
    assert "values must be finite on valid tokens" in own_message(e.value)


@pytest.mark.parametrize(
    "name, hp, fragment",
    [
        ("gae", {"lam": 1.5}, "lam must be a number in [0, 1]"),
        ("gae", {"gamma": -0.1}, "gamma must be a number in [0, 1]"),
        ("mc", {"gamma": 2.0}, "gamma must be a number in [0, 1]"),
        ("reinforce_pp", {"eps": -1e-8}, "eps must be a number >= 0"),
        ("grpo", {"eps": float("nan")}, "eps must be a number >= 0"),
        ("reinforce_pp_baseline", {"gamma": "1"}, "gamma must be a number in [0, 1]"),
    ],
)
def test_bad_hyperparameters_raise_config_errors(name, hp, fragment):
    with pytest.raises(ConfigError) as e:
        fn(name)(R2, M2, **ALL_INPUTS, **hp)
    assert fragment in own_message(e.value)
