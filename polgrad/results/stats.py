"""Statistics of a leaderboard (scipy.stats): CIs of means over seeds, paired differences, Holm.

A paired comparison (`paired`) reports two tests of the same differences d_i = other_i − base_i:

- the paired t-test (scipy.stats.ttest_rel) with its 95% CI, and
- the exact paired permutation (sign-flip) test (scipy.stats.permutation_test, permutation_type=
  'samples': every one of the 2^n sign vectors for n <= 16, else 2^16 resamples with a fixed seed).
  Its two-sided p can never go below 2 / 2^n: 0.5 at n = 2, 0.0625 at n = 5, 0.002 at n = 10.

**No spread.** When the standard deviation of the differences is below SPREAD_RTOL (1e-9) times the
scale of the values (max |value|), the differences are one constant up to float rounding (float64
rounds a difference of values of size s by ~1e-16·s; an fp32 metric cannot differ by less than
~6e-8·s): the t statistic is then a rounding artefact (two seeds at +0.01 gave p = 1.8e-15), so the
t-test is undefined (p, CI, TOST and detectable difference NaN, `no_spread`) and only the
sign-flip p stands (2 / 2^n for a non-zero constant, 1 for zero).

**Equivalence** (TOST, Schuirmann 1987) within ±margin: the larger of two one-sided t-tests, and the
same two one-sided tests by sign flips of d + margin and d − margin (`equivalence_p_perm`). Zero
spread never proves equivalence: both TOSTs are NaN there (the sign-flip TOST of a constant inside
the margin would be 1/2^n, below 0.05 from n = 5, from the constant alone), so under the sign-flip-only
rule a 'no difference' prediction is undecided (polgrad.results.predictions). **Outside the margin**
(`outside_p`): the test that the difference lies beyond the margin on the side of the observed
mean, doubled (two-sided level: below 0.05 exactly when the 95% CI lies wholly beyond the margin).

**Detectable difference** (`mde`): the smallest true difference a two-sided paired t-test at level
alpha detects with the given power, from the noncentral t (scipy.stats.nct) solved for the effect
(brentq); NaN without spread.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# sd of the differences below this fraction of the values' scale counts as no spread (see above)
SPREAD_RTOL = 1e-9
# exact enumeration of the 2^n sign flips up to this many resamples (n <= 16), else random ones
PERMUTATIONS = 2**16


def t_cdf(t: float, df: float) -> float:
    """CDF of Student's t with `df` degrees of freedom."""
    from scipy import stats

    return float(stats.t.cdf(t, df))


@functools.lru_cache(maxsize=1024)
def t_ppf(q: float, df: float) -> float:
    """Quantile of Student's t with `df` degrees of freedom (cached: a report asks for the same few
    quantiles at every point of every curve, and scipy's call costs ~1 ms)."""
    from scipy import stats

    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    return float(stats.t.ppf(q, df))


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float | None, int]:
    """(mean, half-width of the `confidence` CI of the mean, n) over the finite values.

    Half-width = t_{(1+confidence)/2, n-1} · s / sqrt(n) with s the sample standard deviation;
    None when n < 2 (one seed gives no interval). Mean is NaN when there is no finite value.
    """
    import numpy as np

    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, None, 0
    mean = sum(xs) / n
    if n < 2:
        return mean, None, 1
    # scipy.stats.sem's own formula (std with ddof 1 over n**0.5, scipy 1.17), without its ~1 ms per call
    sem = float(np.std(np.asarray(xs), ddof=1) / n**0.5)
    return mean, t_ppf(0.5 + confidence / 2.0, n - 1) * sem, n


def format_mean_ci(stat: tuple[float, float | None, int]) -> str:
    mean, half, n = stat
    if n == 0 or math.isnan(mean):
        return "–"
    if half is None:
        return f"{mean:.4g} (n=1)"
    return f"{mean:.4g} ± {half:.2g}"


# ------------------------------------------------------------------------ paired comparisons
def holm(pvalues: Sequence[float], m: int | None = None) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given.

    Sort ascending p_(1) <= ... <= p_(k); adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)).
    Rejecting where the adjusted p < alpha controls the family-wise error rate at alpha. NaN
    p-values stay NaN; m defaults to the number of finite ones, and a larger `m` counts the NaN
    members of the family as tests that reject nothing (p = 1)."""
    idx = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    m = len(idx) if m is None else m
    if m < len(idx):
        raise ValueError(f"a family of m = {m} tests cannot hold {len(idx)} p-values")
    out = [math.nan] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def signflip_p(d: Sequence[float], alternative: str = "two-sided") -> float:
    """Exact paired permutation p of the mean of `d` (sign flips; symmetric about 0 under H0)."""
    import numpy as np
    from scipy import stats

    if len(d) == 0:
        return math.nan
    res = stats.permutation_test(
        (np.asarray(d, dtype=float),),
        lambda x, axis: np.mean(x, axis=axis),
        permutation_type="samples",
        vectorized=True,
        n_resamples=PERMUTATIONS,
        alternative=alternative,
        rng=np.random.default_rng(0),
    )
    return float(res.pvalue)


def min_signflip_p(n: int) -> float:
    """The smallest two-sided sign-flip p with n pairs: 2 / 2^n (all differences of one sign)."""
    return min(1.0, 2.0 / 2**n) if n >= 1 else math.nan


@dataclass(frozen=True)
class Paired:
    """other − base, paired by seed: n pairs, mean difference, its 95% CI, two-sided p (paired t),
    the sd of the differences, the exact sign-flip p, the Shapiro-Wilk p of the differences, and the
    differences themselves. p, CI and Shapiro p are NaN when the differences have no spread."""

    n: int
    mean: float
    low: float
    high: float
    p: float
    sd: float  # standard deviation of the paired differences (0 when below SPREAD_RTOL of the scale)
    p_perm: float = math.nan
    shapiro_p: float = math.nan
    diffs: tuple[float, ...] = field(default=(), repr=False)

    @property
    def no_spread(self) -> bool:
        """Two or more pairs whose differences are one constant (up to float rounding)."""
        return self.n >= 2 and self.sd == 0.0

    @property
    def _se(self) -> float:
        return self.sd / math.sqrt(self.n)

    def interval(self, confidence: float) -> tuple[float, float]:
        """The `confidence` t-interval of the mean difference (NaN without spread or with n < 2); at
        1 − 2α it is the interval TOST at level α uses: within ±margin exactly when TOST confirms."""
        if self.n < 2 or math.isnan(self.sd) or self.no_spread:
            return math.nan, math.nan
        half = t_ppf(0.5 + confidence / 2, self.n - 1) * self._se
        return self.mean - half, self.mean + half

    def equivalence_p(self, margin: float) -> float:
        """Two one-sided t-tests (Schuirmann 1987) of |true difference| >= margin: the larger one-sided
        p; below alpha, the difference is within ±margin at level alpha. NaN without spread."""
        from scipy import stats

        if self.n < 2 or math.isnan(self.sd) or self.no_spread or not margin > 0:
            return math.nan
        p_low = float(stats.t.sf((self.mean + margin) / self._se, self.n - 1))  # H0: difference <= -margin
        p_high = float(stats.t.cdf((self.mean - margin) / self._se, self.n - 1))  # H0: difference >= +margin
        return max(p_low, p_high)

    def equivalence_p_perm(self, margin: float) -> float:
        """The same two one-sided tests by sign flips of d + margin and d − margin; NaN without spread
        (a constant's 1/2^n is an artefact of the constant, not evidence of equivalence)."""
        if self.n < 2 or len(self.diffs) != self.n or not margin > 0 or self.no_spread:
            return math.nan
        return max(
            signflip_p([x + margin for x in self.diffs], "greater"),
            signflip_p([x - margin for x in self.diffs], "less"),
        )

    def outside_p(self, margin: float) -> float:
        """t-test that the difference lies beyond ±margin on the observed side, doubled; NaN without
        spread."""
        from scipy import stats

        if self.n < 2 or math.isnan(self.sd) or self.no_spread or not margin > 0:
            return math.nan
        return min(1.0, 2 * float(stats.t.sf((abs(self.mean) - margin) / self._se, self.n - 1)))

    def outside_p_perm(self, margin: float) -> float:
        """The same by sign flips of d ∓ margin (exact), one-sided on the observed side, doubled."""
        if self.n < 2 or len(self.diffs) != self.n or not margin > 0:
            return math.nan
        if self.mean >= 0:
            p = signflip_p([x - margin for x in self.diffs], "greater")
        else:
            p = signflip_p([x + margin for x in self.diffs], "less")
        return min(1.0, 2 * p)

    def mde(self, alpha: float, power: float = 0.8) -> float:
        """Smallest true difference a two-sided paired t-test at level `alpha` detects with `power`,
        given this SD of the differences: the δ where the noncentral-t power
        P(|T'| > t_{1-alpha/2, n-1}), T' ~ nct(n − 1, δ√n / sd), equals `power`. NaN without spread."""
        from scipy import optimize, stats

        if self.n < 2 or math.isnan(self.sd) or self.no_spread:
            return math.nan
        df = self.n - 1
        crit = t_ppf(1 - alpha / 2, df)

        def gap(delta: float) -> float:
            nc = delta * math.sqrt(self.n) / self.sd
            # the far tail P(T' < -crit) <= Phi(-nc): scipy returns NaN once it underflows
            far = float(stats.nct.cdf(-crit, df, nc))
            return float(stats.nct.sf(crit, df, nc)) + (far if math.isfinite(far) else 0.0) - power

        hi = self.sd
        while gap(hi) < 0:
            hi *= 2
        return float(optimize.brentq(gap, 0.0, hi, xtol=1e-12 * self.sd, rtol=1e-10))


def paired(base: Mapping[Any, float], other: Mapping[Any, float], confidence: float = 0.95) -> Paired:
    """Paired t-test (scipy.stats.ttest_rel) and exact sign-flip test of `other` against `base` over
    their common keys (seeds) with finite values in both."""
    from scipy import stats

    keys = [k for k in base if k in other and _finite(base[k]) and _finite(other[k])]
    d = tuple(float(other[k]) - float(base[k]) for k in keys)
    n = len(d)
    if n == 0:
        return Paired(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    mean = sum(d) / n
    if n < 2:
        return Paired(1, mean, math.nan, math.nan, math.nan, math.nan, diffs=d)
    p_perm = signflip_p(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))  # scipy's tstd warns on a constant
    scale = max(max(abs(float(base[k])), abs(float(other[k]))) for k in keys)
    if sd <= SPREAD_RTOL * scale:  # one constant difference up to rounding: the t-test is undefined
        return Paired(n, mean, math.nan, math.nan, math.nan, 0.0, p_perm, math.nan, d)
    half = t_ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    p = float(stats.ttest_rel([float(other[k]) for k in keys], [float(base[k]) for k in keys]).pvalue)
    shapiro = float(stats.shapiro(d).pvalue) if n >= 3 else math.nan
    return Paired(n, mean, mean - half, mean + half, p, sd, p_perm, shapiro, d)


def _finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
