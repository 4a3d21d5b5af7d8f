"""How Gao et al.'s RL fit moves with the proxy's data: an experiment that sweeps train.rm_pairs.

Gao, Schulman & Hilton 2023 fit the gold of RL runs with R(d) = d (alpha - beta log d) (their eq. 2,
d = sqrt(KL(pi || pi_init))) and follow alpha, beta and the peak as the proxy reward model grows.
Here the proxy's preference pairs are the axis (experiments/overoptimization_scaling.gin). Per family
(a spec and a reward configuration, its KL controls pooled; one family per number of pairs):

    best within the data   the fitted curve's maximum over the measured range 0 <= d <= d max
                (d max: the family's largest d): `d_best` where it is reached and `gold_best`, the
                fitted gold gain there (R(0) = 0, so gold_best >= 0). For beta > 0 the curve rises to
                d* = exp(alpha / beta - 1) (fits.rl_peak), then falls: d_best = min(d*, d max). For
                beta <= 0 it has no interior maximum: the better end of the range. Unlike d* itself,
                this never extrapolates: a curve that falls and levels off (beta < 0) has d* = +inf,
                a proxy that never let the gold rise has gold_best = 0 near d = 0
    CIs         2,000 resamples of the family's own seeds (the unit: a warm start, its reward models,
                a prompt stream), for alpha and beta (the fit of each resample's points) as for the
                best point
    difference  of a family and the family with the fewest pairs, in alpha, beta and both quantities
                of the best point, the seeds the two share resampled together (paired: the same seeds
                for both)

A difference is called higher (lower) only when its 95% CI lies above (below) 0; no difference is
detected when it straddles 0; undetermined when no resample could be fitted. The gold itself
(train.reward_source = 'task') is shown as the ceiling, outside the comparisons.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from polgrad.errors import PolgradError
from polgrad.pretrain.reward_model import RM_PAIRS
from studies.overoptimization import fits as oo

AXIS = "train.rm_pairs"
SOURCE = "train.reward_source"
FORM = "rl"  # the declared form of RL runs (Gao et al.'s eq. 2)

Points = Sequence[Mapping[str, Any]]
Starts = Mapping[int, Mapping[str, float]]


def best_in_range(form: str, alpha: float, beta: float, d_max: float) -> tuple[float, float]:
    """(d, R(d)) of the fitted curve's maximum over 0 <= d <= d_max: the interior peak (fits.PEAKS) when
    it lies inside, else the better end (R(0) = 0); (nan, nan) if unfitted or there is no range."""
    if math.isnan(alpha) or math.isnan(beta) or not d_max > 0:
        return math.nan, math.nan
    top = oo.PEAKS[form](alpha, beta)
    candidates = [0.0, d_max] + ([top] if 0 < top < d_max else [])
    values = oo.predict(form, alpha, beta, candidates)
    i = int(np.argmax(values))
    return float(candidates[i]), float(values[i])


def _fit_best(points: Points, starts: Starts, form: str) -> tuple[float, float, float, float]:
    """(alpha, beta, d best, R best) of the points' fit; NaNs without points."""
    if not points:
        return math.nan, math.nan, math.nan, math.nan
    d, y = oo.deltas(points, starts, "gold")
    alpha, beta = oo.FITS[form](d, y)
    return (alpha, beta, *best_in_range(form, alpha, beta, max(d)))


QUANTITIES = ("alpha", "beta", "d_best", "gold_best")  # _fit_best's, in its order


@dataclass(frozen=True)
class Scaled:
    """One family's place on the axis."""

    family: str
    pairs: int | None  # None: the gold itself (no proxy)
    alpha: float
    alpha_ci: tuple[float, float]
    beta: float
    beta_ci: tuple[float, float]
    d_peak: float  # the unconstrained d* (may lie outside the data, or be +inf)
    d_best: float
    d_best_ci: tuple[float, float]
    gold_best: float
    gold_best_ci: tuple[float, float]
    d_max: float
    seeds: int
    # against the family with the fewest pairs (None for that family and for the gold)
    alpha_diff: tuple[float, tuple[float, float]] | None = None
    beta_diff: tuple[float, tuple[float, float]] | None = None
    d_best_diff: tuple[float, tuple[float, float]] | None = None
    gold_best_diff: tuple[float, tuple[float, float]] | None = None


def _by_seed(points: Points) -> dict[int, list[Mapping[str, Any]]]:
    out: dict[int, list[Mapping[str, Any]]] = {}
    for p in points:
        out.setdefault(int(p["seed"]), []).append(p)
    return out


def _draws(seeds: Sequence[int], bootstrap: int, rng_seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng(rng_seed)
    return [tuple(int(s) for s in rng.choice(seeds, size=len(seeds), replace=True)) for _ in range(bootstrap)]


def scale(
    families: Mapping[str, tuple[int | None, Points, Starts]],
    *,
    bootstrap: int = oo.BOOTSTRAP,
    rng_seed: int = 0,
    form: str = FORM,
) -> list[Scaled]:
    """`families`: label -> (its pairs, None for the gold itself; its points; each seed's start). Rows in
    order of pairs (the gold last), each with its fit, the CIs of its best point within the data and,
    for every proxy family but the smallest, the paired differences to the smallest. Two proxy families
    with the same pairs (another column swept beside them) are refused: which to compare is ambiguous."""
    order = sorted(families, key=lambda f: (families[f][0] is None, families[f][0] or 0, f))
    proxies = [families[f][0] for f in order if families[f][0] is not None]
    if len(set(proxies)) != len(proxies):
        raise PolgradError(
            f"the scaling section needs one family per {AXIS} value, got {proxies} (another swept column "
            "splits them): sweep train.rm_pairs alone beside the KL control"
        )
    smallest = next((f for f in order if families[f][0] is not None), None)
    split = {f: _by_seed(pts) for f, (_, pts, _) in families.items()}

    @functools.cache  # a family's own resamples and its paired ones are the same draws when it has every seed
    def at(f: str, chosen: tuple[int, ...]) -> tuple[float, float, float, float]:
        return _fit_best([p for s in chosen for p in split[f].get(s, [])], families[f][2], form)

    out = []
    for f in order:
        pairs, pts, starts = families[f]
        d, y = oo.deltas(pts, starts, "gold")
        alpha, beta = oo.FITS[form](d, y)
        own = _draws(sorted(split[f]), bootstrap, rng_seed)
        boot = [at(f, c) for c in own]
        best = best_in_range(form, alpha, beta, max(d, default=math.nan))
        diffs: dict[str, tuple[float, tuple[float, float]]] = {}
        if pairs is not None and smallest is not None and f != smallest:
            shared = sorted(set(split[f]) & set(split[smallest]))
            if shared:
                mine, theirs = at(f, tuple(shared)), at(smallest, tuple(shared))
                paired = [(at(f, c), at(smallest, c)) for c in _draws(shared, bootstrap, rng_seed)]
                for i, name in enumerate(QUANTITIES):
                    values = [a[i] - b[i] for a, b in paired]
                    diffs[name] = (mine[i] - theirs[i], oo._interval(values))
        out.append(
            Scaled(
                family=f,
                pairs=pairs,
                alpha=alpha,
                alpha_ci=oo._interval([b[0] for b in boot]),
                beta=beta,
                beta_ci=oo._interval([b[1] for b in boot]),
                d_peak=oo.PEAKS[form](alpha, beta),
                d_best=best[0],
                d_best_ci=oo._interval([b[2] for b in boot]),
                gold_best=best[1],
                gold_best_ci=oo._interval([b[3] for b in boot]),
                d_max=max(d, default=math.nan),
                seeds=len(split[f]),
                alpha_diff=diffs.get("alpha"),
                beta_diff=diffs.get("beta"),
                d_best_diff=diffs.get("d_best"),
                gold_best_diff=diffs.get("gold_best"),
            )
        )
    return out


def verdict(diff: tuple[float, tuple[float, float]] | None, up: str, down: str) -> str:
    """`up` when the difference's CI lies above 0, `down` below, 'no difference detected' when it
    straddles 0, 'undetermined' when no resample was fitted."""
    if diff is None:
        return ""
    low, high = diff[1]
    if math.isnan(low) or math.isnan(high):
        return "undetermined"
    if low > 0:
        return up
    if high < 0:
        return down
    return "no difference detected"


def section(rows: Sequence[Scaled], fmt: Callable[[float], str]) -> list[str]:
    """The md section: per family its fit (alpha, beta) and its best point within the data with CIs, and
    each proxy's paired differences to the proxy with the fewest pairs in all four."""
    if not any(r.pairs is not None for r in rows):
        return []
    smallest = next(r for r in rows if r.pairs is not None)
    lines = [
        "",
        "## Scaling with the proxy's preference pairs (RL form d (alpha − beta log d); each family's KL "
        "controls pooled)",
        "",
        "The best point within the data: the fitted curve's maximum over 0 ≤ d ≤ d max, at d best, "
        "of fitted gold gain R best (0 when the gold never rose; d* is the unconstrained peak, which "
        "may lie beyond the data). A value's bracket is a 95% CI over resamples of the family's seeds "
        "(alpha and beta refitted on each); a difference's resamples the seeds both families have. "
        "Differences are to the proxy with the fewest pairs "
        f"({smallest.pairs}), over the seeds both have, resampled together; called higher or lower "
        "(later or earlier) only when the 95% CI excludes 0. In experiments/overoptimization_scaling.gin "
        "the row with the most pairs carries P1 (R best) and P2 (d best).",
        "",
        "| family | pairs | seeds | alpha | beta | d* | d best | R best | d max "
        "| alpha − fewest | beta − fewest | d best − fewest | R best − fewest |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def diff(d: tuple[float, tuple[float, float]] | None, up: str, down: str) -> str:
        if d is None:
            return "–"
        return f"{fmt(d[0])} [{fmt(d[1][0])}, {fmt(d[1][1])}]: {verdict(d, up, down)}"

    def ci(value: float, interval: tuple[float, float]) -> str:
        return f"{fmt(value)} [{fmt(interval[0])}, {fmt(interval[1])}]"

    for r in rows:
        lines.append(
            f"| {r.family} | {r.pairs if r.pairs is not None else 'the gold itself'} | {r.seeds} "
            f"| {ci(r.alpha, r.alpha_ci)} | {ci(r.beta, r.beta_ci)} | {fmt(r.d_peak)} "
            f"| {ci(r.d_best, r.d_best_ci)} | {ci(r.gold_best, r.gold_best_ci)} | {fmt(r.d_max)} "
            f"| {diff(r.alpha_diff, 'higher', 'lower')} | {diff(r.beta_diff, 'higher', 'lower')} "
            f"| {diff(r.d_best_diff, 'later', 'earlier')} | {diff(r.gold_best_diff, 'higher', 'lower')} |"
        )
    return lines


def _text(value: Any) -> str:
    return str(value).strip().strip("'\"")


def is_gold(row: Mapping[str, Any]) -> bool:
    """A cell trained on the task's own reward: its swept train.reward_source is 'task' (as the CSV
    holds it, quoted or not). A cell whose reward source is not swept is not taken for one."""
    return SOURCE in row and _text(row[SOURCE]) == "task"


def pairs_of(row: Mapping[str, Any]) -> int | None:
    """A family's pairs from one of its rows: None for the gold itself, else train.rm_pairs (unset or
    None: RM_PAIRS, the reward model's default). A value that is no integer is a one-line error."""
    if is_gold(row):
        return None
    text = _text(row.get(AXIS, ""))
    if text in ("", "None"):
        return RM_PAIRS
    try:
        return int(text)
    except ValueError:
        raise PolgradError(f"{AXIS} = {row.get(AXIS)!r} in the points: not a number of pairs") from None
