"""Best-of-n, the non-RL reference curve of over-optimisation: its unbiased estimator of the best-of-n
response's proxy and gold, and the closed-form KL of best-of-n to the policy it samples from."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from polgrad.errors import ConfigError, ShapeError
from studies.overoptimization.best_of_n import best_of_n_means, kl_best_of_n

F64 = torch.float64


def test_known_values():
    # one prompt, N = 3 samples: proxy (3, 1, 2), gold (10, 20, 30).
    #   n = 1: the plain means, proxy 2, gold 20
    #   n = 2: subsets {3,1} -> the proxy-3 sample (gold 10), {3,2} -> 10, {1,2} -> the proxy-2 one (30):
    #          proxy (3 + 3 + 2) / 3 = 8/3, gold (10 + 10 + 30) / 3 = 50/3
    #   n = 3: the proxy-best sample: proxy 3, gold 10
    proxy = torch.tensor([[3.0, 1.0, 2.0]], dtype=F64)
    gold = torch.tensor([[10.0, 20.0, 30.0]], dtype=F64)
    assert best_of_n_means(proxy, gold, 1) == pytest.approx((2.0, 20.0), abs=1e-12)
    assert best_of_n_means(proxy, gold, 2) == pytest.approx((8 / 3, 50 / 3), abs=1e-12)
    assert best_of_n_means(proxy, gold, 3) == pytest.approx((3.0, 10.0), abs=1e-12)
    # two prompts: the mean over prompts
    two = best_of_n_means(torch.cat([proxy, -proxy]), torch.cat([gold, gold]), 3)
    assert two == pytest.approx(((3 - 1) / 2, (10 + 20) / 2), abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 7).flatmap(
        lambda n_samples: st.tuples(
            st.just(n_samples),
            st.integers(1, n_samples),
            st.lists(
                st.floats(-100, 100, allow_nan=False),
                min_size=2 * n_samples,
                max_size=2 * n_samples,
                unique=True,
            ),
            st.lists(st.floats(-100, 100, allow_nan=False), min_size=2 * n_samples, max_size=2 * n_samples),
        )
    )
)
def test_the_estimator_is_the_mean_over_every_n_subset(args):
    # brute force: enumerate every n-subset of each prompt's N samples, take the proxy-best one
    big_n, n, p, g = args
    proxy = torch.tensor(p, dtype=F64).view(2, big_n)
    gold = torch.tensor(g, dtype=F64).view(2, big_n)
    want_p, want_g = [], []
    for row in range(2):
        for subset in itertools.combinations(range(big_n), n):
            best = max(subset, key=lambda i: proxy[row, i])
            want_p.append(float(proxy[row, best]))
            want_g.append(float(gold[row, best]))
    got = best_of_n_means(proxy, gold, n)
    # float64 sums of <= 35 products of O(100) values: exact to ~1e-11 absolute
    assert got == pytest.approx((sum(want_p) / len(want_p), sum(want_g) / len(want_g)), abs=1e-9)


def test_the_kl_of_best_of_n_is_the_limit_of_a_fine_discrete_policy():
    # A policy uniform over M outcomes ranked by a proxy with no ties: best-of-n picks the outcome
    # of rank k with probability (k/M)^n - ((k-1)/M)^n, so KL(bon || pi) = sum_k q_k log(M q_k).
    # As M grows this tends to log n - (n-1)/n (the continuous case); at M = 10^6 the gap is O(log(M)/M).
    m = 10**6
    k = torch.arange(1, m + 1, dtype=F64)
    for n in (1, 2, 4, 16, 64):
        q = (k / m) ** n - ((k - 1) / m) ** n
        kl = float(torch.where(q > 0, q * torch.log(m * q), torch.zeros_like(q)).sum())
        assert kl == pytest.approx(kl_best_of_n(n), abs=1e-4)
    assert kl_best_of_n(1) == 0.0 and kl_best_of_n(2) == pytest.approx(math.log(2) - 0.5, abs=1e-15)


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_bad_n(n):
    with pytest.raises(ConfigError, match="best-of-n needs n >= 1"):
        kl_best_of_n(n)


def test_estimator_errors_are_one_line():
    with pytest.raises(ShapeError, match=r"proxy and gold must both be \[P,N\]"):
        best_of_n_means(torch.zeros(3), torch.zeros(3), 1)
    with pytest.raises(ShapeError, match=r"proxy and gold must both be \[P,N\]"):
        best_of_n_means(torch.zeros(2, 3), torch.zeros(2, 4), 1)
    with pytest.raises(ConfigError, match=r"n = 4 must be in 1\.\.N = 3"):
        best_of_n_means(torch.zeros(2, 3), torch.zeros(2, 3), 4)


def test_the_sampled_kl_of_a_policy_with_atoms():
    # Two equally likely responses (N = 2 samples, distinct scores), n = 2: best-of-2 picks the better
    # one with q = (1/2)^2 ... F: 1/2, 1 -> q = (1/4, 3/4); KL = 1/4 log(1/4 / 1/2) + 3/4 log(3/4 / 1/2)
    # = 1/4 log(1/2) + 3/4 log(3/2) = 0.130812 (the bound log 2 - 1/2 = 0.193 overstates it)
    from studies.overoptimization.best_of_n import kl_best_of_n_sampled

    want = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    assert kl_best_of_n_sampled(torch.tensor([[0.3, 0.9]], dtype=F64), 2) == pytest.approx(want, abs=1e-12)
    # the same two responses sampled 3 and 1 times: p = (3/4, 1/4), F = (3/4, 1)
    # q = (9/16, 7/16); KL = 9/16 log(3/4) + 7/16 log(7/4)
    got = kl_best_of_n_sampled(torch.tensor([[0.3, 0.3, 0.9, 0.3]], dtype=F64), 2)
    assert got == pytest.approx(9 / 16 * math.log(3 / 4) + 7 / 16 * math.log(7 / 4), abs=1e-12)
    # one response every time: best-of-n is the policy itself
    assert kl_best_of_n_sampled(torch.full((3, 8), 1.5, dtype=F64), 8) == 0.0
    # n = 1 is the policy
    assert kl_best_of_n_sampled(torch.randn(4, 16, dtype=F64), 1) == pytest.approx(0.0, abs=1e-15)
    # many distinct samples: the discrete value approaches the no-atom bound from below
    many = torch.arange(20_000, dtype=F64).view(1, -1)
    for n in (2, 16):
        k = kl_best_of_n_sampled(many, n)
        assert k <= kl_best_of_n(n) and k == pytest.approx(kl_best_of_n(n), abs=2e-3)
    # two prompts: the mean of their KLs
    two = torch.tensor([[0.3, 0.9], [1.0, 1.0]], dtype=F64)
    assert kl_best_of_n_sampled(two, 2) == pytest.approx(want / 2, abs=1e-12)
    with pytest.raises(ShapeError, match=r"proxy must be \[P,N\]"):
        kl_best_of_n_sampled(torch.zeros(3), 2)
