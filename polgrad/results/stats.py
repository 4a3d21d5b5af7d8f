"""Statistics of a leaderboard (scipy.stats): CIs of means over seeds, paired differences, Holm."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def t_cdf(t: float, df: float) -> float:
    """CDF of Student's t with `df` degrees of freedom."""
    from scipy import stats

    return float(stats.t.cdf(t, df))


def t_ppf(q: float, df: float) -> float:
    """Quantile of Student's t with `df` degrees of freedom."""
    from scipy import stats

    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    return float(stats.t.ppf(q, df))


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float | None, int]:
    """(mean, half-width of the `confidence` CI of the mean, n) over the finite values.

    Half-width = t_{(1+confidence)/2, n-1} · s / sqrt(n) with s the sample standard deviation;
    None when n < 2 (one seed gives no interval). Mean is NaN when there is no finite value.
    """
    from scipy import stats

    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, None, 0
    mean = sum(xs) / n
    if n < 2:
        return mean, None, 1
    return mean, t_ppf(0.5 + confidence / 2.0, n - 1) * float(stats.sem(xs)), n


def format_mean_ci(stat: tuple[float, float | None, int]) -> str:
    mean, half, n = stat
    if n == 0 or math.isnan(mean):
        return "–"
    if half is None:
        return f"{mean:.4g} (n=1)"
    return f"{mean:.4g} ± {half:.2g}"


# ------------------------------------------------------------------------ paired comparisons
def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the order given.

    Sort ascending p_(1) <= ... <= p_(m); adjusted p_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)).
    Rejecting where the adjusted p < alpha controls the family-wise error rate at alpha. NaN
    p-values (no test possible) stay NaN and do not count in m.
    """
    idx = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    m = len(idx)
    out = [math.nan] * len(pvalues)
    running = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


@dataclass(frozen=True)
class Paired:
    """other − base, paired by seed: n pairs, mean difference, its 95% CI, two-sided p (paired t)."""

    n: int
    mean: float
    low: float
    high: float
    p: float
    sd: float  # standard deviation of the paired differences

    def equivalence_p(self, margin: float) -> float:
        """Two one-sided tests (Schuirmann 1987) of |true difference| >= margin: the larger one-sided
        p; below alpha, the difference is within ±margin at level alpha."""
        from scipy import stats

        if self.n < 2 or math.isnan(self.sd) or not margin > 0:
            return math.nan
        if self.sd == 0.0:
            return 0.0 if abs(self.mean) < margin else 1.0
        se = self.sd / math.sqrt(self.n)
        p_low = float(stats.t.sf((self.mean + margin) / se, self.n - 1))  # H0: difference <= -margin
        p_high = float(stats.t.cdf((self.mean - margin) / se, self.n - 1))  # H0: difference >= +margin
        return max(p_low, p_high)

    def mde(self, alpha: float, power: float = 0.8) -> float:
        """Smallest true difference a paired t-test at two-sided level `alpha` detects with `power`,
        given this SD of the differences: (t_{1-alpha/2, n-1} + t_{power, n-1}) · sd / sqrt(n)."""
        if self.n < 2 or math.isnan(self.sd):
            return math.nan
        return (t_ppf(1 - alpha / 2, self.n - 1) + t_ppf(power, self.n - 1)) * self.sd / math.sqrt(self.n)


def paired(base: Mapping[Any, float], other: Mapping[Any, float], confidence: float = 0.95) -> Paired:
    """Paired t-test (scipy.stats.ttest_rel) of `other` against `base` over their common keys (seeds)."""
    from scipy import stats

    keys = [k for k in base if k in other and _finite(base[k]) and _finite(other[k])]
    d = [float(other[k]) - float(base[k]) for k in keys]
    n = len(d)
    if n == 0:
        return Paired(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    mean = sum(d) / n
    if n < 2:
        return Paired(1, mean, math.nan, math.nan, math.nan, math.nan)
    sd = float(stats.tstd(d))
    if sd == 0.0:  # every pair differs by the same amount: no spread to test against
        return Paired(n, mean, mean, mean, 1.0 if mean == 0 else 0.0, 0.0)
    half = t_ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n)
    p = float(stats.ttest_rel([float(other[k]) for k in keys], [float(base[k]) for k in keys]).pvalue)
    return Paired(n, mean, mean - half, mean + half, p, sd)


def _finite(v: Any) -> bool:
    try:
        return v is not None and math.isfinite(float(v))
    except (TypeError, ValueError):
        return False
