"""Confidence intervals of a mean over seeds (Student t, from scipy.stats) and their display."""

from __future__ import annotations

import math
from collections.abc import Iterable


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
