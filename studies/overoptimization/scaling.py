"""How Gao et al.'s RL fit moves with the proxy's data: an experiment that sweeps train.rm_pairs.

Gao, Schulman & Hilton 2023 fit the gold of RL runs with R(d) = d (alpha - beta log d) (their eq. 2,
d = sqrt(KL(pi || pi_init))) and follow alpha, beta and the peak as the proxy reward model grows.
Here the proxy's preference pairs are the axis (experiments/overoptimization_scaling.gin). Per family
(a spec and a reward configuration, its KL controls pooled):

    d_peak      the fitted curve's maximiser d* (fits.rl_peak: exp(alpha / beta - 1) for beta > 0)
    peak_gold   the fitted gold gain there, R(d*) = beta d* (for beta > 0: alpha - beta log d* = beta
                at the peak); +inf when the curve never turns down, 0 when it never rises
    CIs         2,000 resamples of the seeds (the unit: a warm start, its reward models, a prompt stream)
    difference  of a family and the family with the fewest pairs, each of the two quantities, with the
                seeds resampled together (paired: the same seeds for both families)

A difference is called higher (lower) only when its 95% CI lies above (below) 0; otherwise no difference
is detected. The gold itself (train.reward_source = 'task') is shown as the ceiling, outside the
comparisons.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from studies.overoptimization import fits as oo

AXIS = "train.rm_pairs"
FORM = "rl"  # the declared form of RL runs (Gao et al.'s eq. 2)


def peak_gold(form: str, alpha: float, beta: float) -> float:
    """The fitted curve's value at its maximiser d* (`fits.PEAKS`): nan if unfitted, +inf if unbounded."""
    top = oo.PEAKS[form](alpha, beta)
    if math.isnan(top) or math.isinf(top):
        return top
    return float(oo.predict(form, alpha, beta, [top])[0])


def _quantities(points: Sequence[Mapping[str, Any]], init: Mapping[int, Mapping[str, float]], form: str):
    alpha, beta = oo.FITS[form](*oo.deltas(points, init, "gold"))
    return oo.PEAKS[form](alpha, beta), peak_gold(form, alpha, beta)


def _minus(a: float, b: float) -> float:
    """a - b, nan when both are the same infinity (no order between two curves that never turn)."""
    return math.nan if math.isinf(a) and math.isinf(b) and a == b else a - b


@dataclass(frozen=True)
class Scaled:
    """One family's place on the axis."""

    family: str
    pairs: int | None  # None: the gold itself (no proxy)
    alpha: float
    beta: float
    d_peak: float
    d_peak_ci: tuple[float, float]
    peak_gold: float
    peak_gold_ci: tuple[float, float]
    d_max: float  # the largest d among its points: a peak beyond it is extrapolated
    seeds: int
    # against the family with the fewest pairs (None for that family and for the gold)
    d_peak_diff: tuple[float, tuple[float, float]] | None = None
    peak_gold_diff: tuple[float, tuple[float, float]] | None = None


def scale(
    families: Mapping[str, tuple[int | None, Sequence[Mapping[str, Any]], Mapping[int, Mapping[str, float]]]],
    *,
    bootstrap: int = oo.BOOTSTRAP,
    rng_seed: int = 0,
    form: str = FORM,
) -> list[Scaled]:
    """`families`: label -> (its pairs, None for the gold; its points; each seed's start). Rows in order
    of pairs (the gold last), each with its fit, the bootstrap CIs of d* and R(d*) and, for every proxy
    family but the smallest, the paired differences to the smallest."""
    order = sorted(families, key=lambda f: (families[f][0] is None, families[f][0] or 0, f))
    proxies = [f for f in order if families[f][0] is not None]
    smallest = proxies[0] if proxies else None
    seeds = sorted({p["seed"] for _, pts, _ in families.values() for p in pts})
    by_seed = {
        f: {s: [p for p in pts if p["seed"] == s] for s in seeds} for f, (_, pts, _) in families.items()
    }
    rng = np.random.default_rng(rng_seed)
    draws = [[int(s) for s in rng.choice(seeds, size=len(seeds), replace=True)] for _ in range(bootstrap)]

    def at(f: str, chosen: Sequence[int]) -> tuple[float, float]:
        return _quantities([p for s in chosen for p in by_seed[f][s]], families[f][2], form)

    boot = {f: [at(f, c) for c in draws] for f in order}
    out = []
    for f in order:
        pairs, pts, init = families[f]
        alpha, beta = oo.FITS[form](*oo.deltas(pts, init, "gold"))
        top, value = oo.PEAKS[form](alpha, beta), peak_gold(form, alpha, beta)
        diffs: dict[str, tuple[float, tuple[float, float]]] = {}
        if pairs is not None and f != smallest and smallest is not None:
            mine = [s for s in seeds if by_seed[f][s] and by_seed[smallest][s]]
            whole_f, whole_s = at(f, mine), at(smallest, mine)
            for i, name in enumerate(("d_peak", "peak_gold")):
                resampled = [_minus(bf[i], bs[i]) for bf, bs in zip(boot[f], boot[smallest], strict=True)]
                diffs[name] = (_minus(whole_f[i], whole_s[i]), oo._interval(resampled))
        out.append(
            Scaled(
                family=f,
                pairs=pairs,
                alpha=alpha,
                beta=beta,
                d_peak=top,
                d_peak_ci=oo._interval([b[0] for b in boot[f]]),
                peak_gold=value,
                peak_gold_ci=oo._interval([b[1] for b in boot[f]]),
                d_max=max((p["d"] for p in pts), default=math.nan),
                seeds=len({p["seed"] for p in pts}),
                d_peak_diff=diffs.get("d_peak"),
                peak_gold_diff=diffs.get("peak_gold"),
            )
        )
    return out


def verdict(diff: tuple[float, tuple[float, float]] | None, up: str, down: str) -> str:
    """'up' when the difference's CI lies above 0, 'down' below, else no difference detected."""
    if diff is None:
        return ""
    low, high = diff[1]
    if low > 0:
        return up
    if high < 0:
        return down
    return "no difference detected"


def section(rows: Sequence[Scaled], fmt: Callable[[float], str]) -> list[str]:
    """The md section: per family its fit and peak with CIs, and each proxy's paired differences to
    the proxy with the fewest pairs."""
    if not any(r.pairs is not None for r in rows):
        return []
    smallest = next(r for r in rows if r.pairs is not None)
    lines = [
        "",
        f"## Scaling with the proxy's preference pairs (RL form d (alpha − beta log d), {FORM}; "
        "each family's KL controls pooled)",
        "",
        "R(d*) is the fitted gold gain at the fitted peak d*; a peak beyond d max is extrapolated. "
        f"Differences are to the proxy with the fewest pairs ({smallest.pairs}), the seeds resampled "
        "together; called higher or lower only when the 95% CI excludes 0.",
        "",
        "| family | pairs | seeds | alpha | beta | d* | 95% CI | R(d*) | 95% CI | d max "
        "| d* − fewest (95% CI) | R(d*) − fewest (95% CI) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def diff(d, up, down):
        if d is None:
            return "–"
        return f"{fmt(d[0])} [{fmt(d[1][0])}, {fmt(d[1][1])}]: {verdict(d, up, down)}"

    for r in rows:
        lines.append(
            f"| {r.family} | {r.pairs if r.pairs is not None else 'the gold itself'} | {r.seeds} "
            f"| {fmt(r.alpha)} | {fmt(r.beta)} | {fmt(r.d_peak)} "
            f"| [{fmt(r.d_peak_ci[0])}, {fmt(r.d_peak_ci[1])}] "
            f"| {fmt(r.peak_gold)} | [{fmt(r.peak_gold_ci[0])}, {fmt(r.peak_gold_ci[1])}] | {fmt(r.d_max)} "
            f"| {diff(r.d_peak_diff, 'later', 'earlier')} | {diff(r.peak_gold_diff, 'higher', 'lower')} |"
        )
    return lines


def pairs_of(value: Any) -> int | None:
    """A family's train.rm_pairs as its CSV cell holds it: an int, or None for a run without a proxy
    (the cell's text 'None' or empty)."""
    text = str(value).strip()
    if text in ("", "None"):
        return None
    return int(text)
