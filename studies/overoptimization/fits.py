"""Reward-model over-optimisation: gold and proxy against sqrt(KL(pi || pi_init)), as Gao et al. plot them.

Gao, Schulman & Hilton 2023, "Scaling Laws for Reward Model Overoptimization" (ICML): as a policy
optimises a learned reward model (the proxy), the proxy keeps rising while the gold reward first
rises, then falls; both are plotted against d = sqrt(KL(pi || pi_init)), and the gold fits
d (alpha - beta d) for best-of-n (their eq. 1; RL fits d (alpha - beta log d)). Here:

    points      one per run and window of WINDOW consecutive steps: the means over the window's
                metrics rows of kl_exact_seq (the exact KL summed along each sampled response, nats;
                the reference is the warm start, pi_init), reward_mean (the proxy the run trains on)
                and gold_reward_mean (the task verifier's score of the same samples)
    deltas      proxy and gold minus the seed's starting values under the family's reward model
                (best-of-1 of the warm start on held-out prompts, best_of_n.py here; without it, the
                runs' step-0 point: their first metrics row, sampled from the warm start)
    fit_curve   least squares of delta = d (alpha - beta d) over a family's pooled points (no intercept:
                delta = 0 at d = 0 by definition): Gao et al.'s best-of-n form (their eq. 1), the one
                the experiment declared for RL too
    fit_rl_curve   least squares of delta = d (alpha - beta log d): Gao et al.'s RL form (their eq. 2),
                also 0 at d = 0; its peak d* = exp(alpha / beta - 1) (beta > 0)
    r_squared   1 - SS_res / SS_tot about the mean of the fitted values' targets (centred), over the
                points the fit used or over their means (a seed's noise stays in the first)
    peak        d* = alpha / (2 beta), the fitted curve's maximum (beta > 0, alpha > 0); +inf when the
                curve never turns down (beta <= 0), 0 when it falls from the start (alpha <= 0)
    bootstrap   seeds resampled with replacement (the seed is the unit: a warm start, a reward model,
                a prompt stream), the fit redone on their pooled points, d*'s 2.5 and 97.5 percentiles

A family is a configuration but its KL control (e.g. PPO with one reward model): its runs at every KL
coefficient and controller are pooled, as Gao et al. pool the runs of one reward model.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from studies.overoptimization import SUFFIX as SUFFIX  # results/<experiment>/<experiment>_gao.md and .png

WINDOW = 5  # steps per point: 60-step runs give 12 points each
BOOTSTRAP = 2000  # resamples of the seeds
LEVEL = 0.95
_MAX_EXP = math.log(sys.float_info.max)  # exp() of more overflows


def run_points(rows: Sequence[Mapping[str, Any]], window: int = WINDOW) -> list[dict[str, float]]:
    """One point per `window` consecutive metrics rows that carry the KL, proxy and gold: their means
    (kl = kl_exact_seq, d = sqrt(max(kl, 0)), proxy = reward_mean, gold = gold_reward_mean) and the
    window's last step. A trailing partial window is dropped."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    keys = ("kl_exact_seq", "reward_mean", "gold_reward_mean")
    usable = [
        r for r in rows if all(isinstance(r.get(k), (int, float)) and math.isfinite(r[k]) for k in keys)
    ]
    out = []
    for i in range(0, len(usable) - window + 1, window):
        chunk = usable[i : i + window]
        kl = sum(r["kl_exact_seq"] for r in chunk) / window
        out.append(
            {
                "step": chunk[-1]["step"],
                "kl": kl,
                "d": math.sqrt(max(kl, 0.0)),
                "proxy": sum(r["reward_mean"] for r in chunk) / window,
                "gold": sum(r["gold_reward_mean"] for r in chunk) / window,
            }
        )
    return out


def fit_curve(d: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(alpha, beta) of y = d (alpha - beta d) = alpha d - beta d^2 by least squares; (nan, nan) when the
    points cannot determine both (fewer than 2 distinct d > 0)."""
    return _fit_through_start("bon", "fit_curve", d, y)


def fit_rl_curve(d: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(alpha, beta) of y = d (alpha - beta log d) = alpha d - beta d log d by least squares (d log d -> 0
    at d = 0, so a point at d = 0 predicts 0); (nan, nan) with fewer than 2 distinct d > 0."""
    return _fit_through_start("rl", "fit_rl_curve", d, y)


def _fit_through_start(form: str, name: str, d: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(alpha, beta) of y = alpha d - beta curve(d) (`form`'s curve, 0 at d = 0) by least squares."""
    d_arr, y_arr = np.asarray(d, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if d_arr.shape != y_arr.shape or d_arr.ndim != 1:
        raise ValueError(f"{name}: d and y must be 1-d of one length, got {d_arr.shape} and {y_arr.shape}")
    if form == "rl" and np.any(d_arr < 0):  # log d
        raise ValueError("fit_rl_curve: d = sqrt(KL) must be >= 0")
    if len(np.unique(d_arr[d_arr > 0])) < 2:
        return math.nan, math.nan
    design = np.stack([d_arr, -_curve(form, d_arr)], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(design, y_arr, rcond=None)
    return float(alpha), float(beta)


def _dlogd(d: np.ndarray) -> np.ndarray:
    """d log d, 0 at d = 0 (its limit)."""
    out = np.zeros_like(d)
    pos = d > 0
    out[pos] = d[pos] * np.log(d[pos])
    return out


def rl_peak(alpha: float, beta: float) -> float:
    """The maximiser over d >= 0 of d (alpha - beta log d). Its slope alpha - beta (log d + 1) is +inf
    at d -> 0+ when beta > 0, so the curve always rises first and peaks where the slope is 0:
    d* = exp(alpha / beta - 1). beta < 0: the slope grows without limit (+inf); beta = 0: a line,
    rising (+inf) if alpha > 0, else never (0); nan if unfitted."""
    if math.isnan(alpha) or math.isnan(beta):
        return math.nan
    if beta < 0 or (beta == 0 and alpha > 0):
        return math.inf
    if beta == 0:
        return 0.0
    exponent = alpha / beta - 1.0
    return math.inf if exponent > _MAX_EXP else math.exp(exponent)  # exp overflows past ~709.8


def predict(form: str, alpha: float, beta: float, d: Sequence[float], c: float = 0.0) -> np.ndarray:
    """The fitted y at `d` of `form` ('bon': d (alpha - beta d); 'rl': d (alpha - beta log d)), plus an
    intercept `c` (the free-intercept sensitivity fits)."""
    d_arr = np.asarray(d, dtype=np.float64)
    return c + alpha * d_arr - beta * _curve(form, d_arr)


def r_squared(y: Sequence[float], fitted: Sequence[float]) -> float:
    """1 - SS_res / SS_tot with SS_tot about the mean of `y` (the centred R^2, comparable between the
    forms and with the free-intercept fits; a fit through the origin can score below 0); nan when `y`
    does not vary."""
    y_arr, f_arr = np.asarray(y, dtype=np.float64), np.asarray(fitted, dtype=np.float64)
    total = float(((y_arr - y_arr.mean()) ** 2).sum())
    if total == 0:
        return math.nan
    return 1.0 - float(((y_arr - f_arr) ** 2).sum()) / total


FITS = {"bon": fit_curve, "rl": fit_rl_curve}
CURVES = {"bon": np.square, "rl": _dlogd}  # the term beta multiplies (with a minus)


def _curve(form: str, d: np.ndarray) -> np.ndarray:
    if form not in CURVES:
        raise ValueError(f"unknown form {form!r}; valid: {', '.join(CURVES)}")
    return CURVES[form](d)


FORMULA = {"bon": "d (alpha − beta d)", "rl": "d (alpha − beta log d)"}


def fit_with_intercept(
    d: Sequence[float], y: Sequence[float], form: str = "bon"
) -> tuple[float, float, float]:
    """(c, alpha, beta) of y = c + alpha d - beta d^2 (form 'bon'; 'rl': c + alpha d - beta d log d) by
    least squares: the fit without its pass through the start, a sensitivity check of where the peak lies
    when the points at d = 0 (a run's first step) sit off the start; (nan, nan, nan) with fewer than 3
    distinct d. Its maximiser over d >= 0 is the form's peak(alpha, beta), as without c."""
    d_arr, y_arr = np.asarray(d, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if d_arr.shape != y_arr.shape or d_arr.ndim != 1:
        raise ValueError(
            f"fit_with_intercept: d and y must be 1-d of one length, got {d_arr.shape}, {y_arr.shape}"
        )
    if len(np.unique(d_arr)) < 3:
        return math.nan, math.nan, math.nan
    design = np.stack([np.ones_like(d_arr), d_arr, -_curve(form, d_arr)], axis=1)
    (c, alpha, beta), *_ = np.linalg.lstsq(design, y_arr, rcond=None)
    return float(c), float(alpha), float(beta)


def over_optimised(gold: float, proxy: float) -> bool:
    """Whether a run (or a configuration's mean) over-optimised its reward model, from gold and proxy
    minus their start at its end: the gold fell below its start while the proxy rose (Gao et al.'s
    failure). A run whose proxy fell too did not optimise the proxy at all: it is not counted."""
    return gold < 0 < proxy


def peak(alpha: float, beta: float) -> float:
    """The maximiser over d >= 0 of d (alpha - beta d): alpha / (2 beta) if both > 0; +inf if the curve
    grows without limit (beta < 0: convex, whatever alpha; beta = 0 < alpha: a rising line); 0 if it
    never rises (alpha <= 0 <= beta); nan if unfitted."""
    if math.isnan(alpha) or math.isnan(beta):
        return math.nan
    if beta < 0 or (beta == 0 and alpha > 0):  # convex, or a rising line: it grows without limit
        return math.inf
    if alpha <= 0:  # falls from d = 0 on (beta > 0), or is flat
        return 0.0
    return alpha / (2.0 * beta)


def shape(alpha: float, beta: float, d_min: float, d_max: float) -> str:
    """In words, how the fitted y = d (alpha - beta d) moves over d >= 0 and where that sits against the
    measured range [d_min, d_max], d_min the smallest d > 0 (a run's first step is at d = 0): a verdict
    of "rises monotonically" (alpha > 0 and no peak inside the data) names what failed.
    y' = alpha - 2 beta d, so with beta < 0 (convex) a fit with alpha < 0 first falls to its minimum
    alpha^2 / (4 beta) (negative) at d = alpha / (2 beta) > 0, then rises."""
    if math.isnan(alpha) or math.isnan(beta):
        return "the fit is undetermined"
    if alpha > 0 or (alpha == 0 and beta < 0):
        top = peak(alpha, beta)
        if top < d_max:
            return f"the fit rises from d = 0 to its peak at d = {top:.3g}, inside the data, then falls"
        return f"the fit rises from d = 0 over the whole measured range (alpha {alpha:.3g}, beta {beta:.3g})"
    if beta < 0:
        low = alpha / (2.0 * beta)
        where = (
            f"below the smallest d > 0 measured ({d_min:.3g}), where no point lies, so from there on it rises"
            if low < d_min
            else f"inside the measured range (smallest d > 0: {d_min:.3g})"
        )
        return (
            f"the fit first falls (alpha {alpha:.3g} <= 0) to {alpha * alpha / (4.0 * beta):.3g} at "
            f"d = {low:.3g}, {where}"
        )
    return f"the fit never rises (alpha {alpha:.3g} <= 0 <= beta {beta:.3g})"


PEAKS = {"bon": peak, "rl": rl_peak}


@dataclass(frozen=True)
class FreeFit:
    """A fit of a form with a free intercept (`fit_with_intercept`): c, alpha, beta, its maximiser over
    d >= 0 (`top`) and whether that lies among the points at d > 0 (`among`: d_min < top < d_max)."""

    c: float
    alpha: float
    beta: float
    top: float
    among: bool


def free_fit(
    points: Sequence[Mapping[str, Any]], init: Mapping[int, Mapping[str, float]], fit: Fit
) -> FreeFit:
    """`fit`'s form refitted to its gold points with a free intercept (the sensitivity of where its peak
    lies when the start sits off the curve)."""
    c, a, b = fit_with_intercept(*deltas(points, init, "gold"), fit.form)
    top = PEAKS[fit.form](a, b)
    return FreeFit(c, a, b, top, fit.d_min < top < fit.d_max)


@dataclass(frozen=True)
class Fit:
    """A family's fitted curve of one quantity (gold or proxy minus its start) against d."""

    alpha: float
    beta: float
    d_peak: float
    d_max: float  # the largest d among the points
    ci: tuple[float, float]  # bootstrap percentiles of d_peak
    seeds: int
    points: int
    form: str = "bon"  # 'bon': d (alpha - beta d); 'rl': d (alpha - beta log d)
    r2: float = math.nan  # over the points the fit used
    d_min: float = math.nan  # the smallest d > 0 among them

    @property
    def interior(self) -> bool:
        """The fitted peak lies strictly inside (0, d_max): the declared test."""
        return 0 < self.d_peak < self.d_max

    @property
    def among_points(self) -> bool:
        """The fitted peak lies among the points at d > 0, (d_min, d_max): where data show a turn (the RL
        form always peaks above 0, below the smallest measured d when alpha < 0)."""
        return self.d_min < self.d_peak < self.d_max


def deltas(points: Sequence[Mapping[str, Any]], init: Mapping[int, Mapping[str, float]], what: str):
    """(d, y) of `points`: each point's d and its `what` ('gold' or 'proxy') minus its seed's start."""
    d = [p["d"] for p in points]
    y = [p[what] - init[p["seed"]][what] for p in points]
    return d, y


def _interval(values: Sequence[float]) -> tuple[float, float]:
    """The central LEVEL interval of bootstrap values (order statistics, no interpolation, so an infinite
    value stays infinite); NaNs (unfitted resamples) left out; (nan, nan) if none is left."""
    arr = np.asarray([x for x in values if not math.isnan(x)], dtype=np.float64)
    if not len(arr):
        return math.nan, math.nan
    tail = (1 - LEVEL) / 2
    lo, hi = np.quantile(arr, tail, method="inverted_cdf"), np.quantile(arr, 1 - tail, method="inverted_cdf")
    return float(lo), float(hi)


def fit_family(
    points: Sequence[Mapping[str, Any]],
    init: Mapping[int, Mapping[str, float]],
    what: str,
    *,
    bootstrap: int = BOOTSTRAP,
    rng_seed: int = 0,
    form: str = "bon",
) -> Fit:
    """Fit `what` ('gold' or 'proxy', minus the seed's start) of a family's pooled points with `form`
    ('bon' or 'rl', FITS); d*'s CI by resampling its seeds (`bootstrap` times, numpy Generator seeded
    `rng_seed`)."""
    fit, top = FITS[form], PEAKS[form]
    seeds = sorted({p["seed"] for p in points})
    d, y = deltas(points, init, what)
    alpha, beta = fit(d, y)
    by_seed = {s: [p for p in points if p["seed"] == s] for s in seeds}
    rng = np.random.default_rng(rng_seed)
    peaks = []
    for _ in range(bootstrap):
        pts = [p for s in rng.choice(seeds, size=len(seeds), replace=True) for p in by_seed[int(s)]]
        peaks.append(top(*fit(*deltas(pts, init, what))))
    ci = _interval(peaks)
    r2 = math.nan if math.isnan(alpha) else r_squared(y, predict(form, alpha, beta, d))
    return Fit(
        alpha,
        beta,
        top(alpha, beta),
        max(d, default=math.nan),
        ci,
        len(seeds),
        len(points),
        form,
        r2,
        min((x for x in d if x > 0), default=math.nan),
    )


def peak_difference(
    points_a: Sequence[Mapping[str, Any]],
    points_b: Sequence[Mapping[str, Any]],
    init_a: Mapping[int, Mapping[str, float]],
    init_b: Mapping[int, Mapping[str, float]],
    *,
    bootstrap: int = BOOTSTRAP,
    rng_seed: int = 0,
) -> tuple[float, tuple[float, float]]:
    """d*(a) - d*(b) of the gold fits (each family's gold minus its own start, `init_a`, `init_b`) and its
    bootstrap CI, the seeds resampled together (paired: the same resampled seeds for both families).
    Infinite peaks make the difference +-inf (kept, so the CI says when a family's curve did not turn
    down)."""
    seeds = sorted({p["seed"] for p in points_a} & {p["seed"] for p in points_b})

    def d_star(points, init, chosen):
        pts = [p for s in chosen for p in points if p["seed"] == s]
        return peak(*fit_curve(*deltas(pts, init, "gold")))

    def diff(chosen):
        a, b = d_star(points_a, init_a, chosen), d_star(points_b, init_b, chosen)
        return math.nan if math.isinf(a) and math.isinf(b) and a == b else a - b

    rng = np.random.default_rng(rng_seed)
    boot = [
        diff([int(s) for s in rng.choice(seeds, size=len(seeds), replace=True)]) for _ in range(bootstrap)
    ]
    ci = _interval(boot)
    return diff(seeds), ci


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties), nan for fewer than 3 points."""
    if len(x) < 3:
        return math.nan
    from scipy.stats import spearmanr

    return float(spearmanr(x, y).statistic)


# --------------------------------------------------------------------------- the figure
def draw(
    path,
    title: str,
    curves: Mapping[str, Sequence[Mapping[str, Any]]],
    family_of: Mapping[str, str],
    fits: Mapping[str, Fit],
    best_of_n: Mapping[str, Sequence[Mapping[str, Any]]],
    rl_fits: Mapping[str, Fit] | None = None,
    bon_fits: Mapping[str, Fit] | None = None,
) -> None:
    """Gold (left) and proxy (right) minus their start against d = sqrt(KL): one line per configuration
    (`curves`: label -> points averaged over seeds, in step order), coloured by family, the family's
    declared gold fit dashed and its fit of Gao's RL form (`rl_fits`) dotted, best-of-n (label -> rows,
    one per reward-model configuration) in black and greys with its fit of Gao's best-of-n form
    (`bon_fits`) dash-dotted; every fit drawn over its own points' d only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from polgrad.results.curves import save_png

    families = sorted(set(family_of.values()))
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink")
    colours = {fam: palette[i % len(palette)] for i, fam in enumerate(families)}
    markers = "osD^v<>ph*"
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, what in zip(axes, ("gold", "proxy"), strict=True):
        per_family: dict[str, int] = {}
        for label, pts in curves.items():
            fam = family_of[label]
            i = per_family.get(fam, 0)
            per_family[fam] = i + 1
            ax.plot(
                [p["d"] for p in pts],
                [p[what] for p in pts],
                marker=markers[i % len(markers)],
                ms=3.5,
                lw=1,
                color=colours.get(fam, "0.3"),
                label=label,
            )
        if what == "gold":
            for style, drawn in (("--", fits), (":", rl_fits or {})):
                for fam, fit in drawn.items():
                    if math.isnan(fit.alpha):
                        continue
                    xs = np.linspace(0, fit.d_max, 100)
                    ax.plot(
                        xs,
                        predict(fit.form, fit.alpha, fit.beta, xs),
                        style,
                        color=colours.get(fam, "0.3"),
                        lw=1.6,
                    )
        for j, (label, rows) in enumerate(best_of_n.items()):
            grey = ("k", "0.45", "0.7")[j % 3]
            xs, ys = [r["sqrt_kl"] for r in rows], [r[what] for r in rows]
            ax.plot(xs, ys, "-o", color=grey, ms=3, lw=1.8, label=label)
            fit = (bon_fits or {}).get(label)
            if what == "gold" and fit is not None and not math.isnan(fit.alpha):
                line = np.linspace(0, fit.d_max, 100)
                ax.plot(line, predict("bon", fit.alpha, fit.beta, line), "-.", color=grey, lw=1.2)
        ax.axhline(0, color="0.6", lw=0.8)
        ax.set_xlabel("d = sqrt(KL(pi || pi_init)), nats^0.5 per response")
        ax.set_ylabel(
            f"{what} minus its start" + (" (task verifier)" if what == "gold" else " (reward model)")
        )
        fitted = ": d(alpha - beta d) dashed (declared), d(alpha - beta log d) dotted, best-of-n's dash-dot"
        ax.set_title(f"{what}" + (fitted if what == "gold" else ""), fontsize=9)
    handles, labels = axes[1].get_legend_handles_labels()  # below the panels: they stay readable
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=7, frameon=False
    )
    fig.suptitle(title, fontsize=10)
    save_png(fig, path)


def answer(verdicts: Mapping[str, Sequence[str]]) -> str:
    """The md's last sentence, from the declared predictions' verdicts ("verdict: family (numbers)" per
    claim): each claim's families grouped by verdict. The fits pool a family's KL controls, so the
    answer says that how a KL penalty or controller moves the peak is not what they test."""

    def grouped(claim: str) -> str:
        by: dict[str, list[str]] = {}
        for v in verdicts.get(claim, ()):
            word, _, what = v.partition(": ")
            by.setdefault(word, []).append(what)
        return "; ".join(f"{word} for {', '.join(whats)}" for word, whats in by.items()) or "not tested"

    return (
        f"**Answer.** The gold peaks at an intermediate KL: {grouped('gold')}. A reward-model ensemble "
        f"moves the peak to a larger KL (d* difference, 95% CI): {grouped('ensemble')}. The proxy's fit "
        f"has no peak inside the data (the gin's test of a proxy rising with KL): {grouped('proxy_gin')}; "
        f"it also rises from d = 0 (the report code's stricter test): {grouped('proxy')}. Whether a KL "
        "penalty or the target-KL controller moves the peak is not answered here: each fit pools its "
        "family's KL controls (the sweep's leaderboard tests how the KL coefficient changes the final KL)."
    )
