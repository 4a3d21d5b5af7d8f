"""The forest plot of one experiment (results/<experiment>/<experiment>.png), drawn from the tables
`polgrad.results.figures.plot` computed (`Figures`): one panel per metric, one row per configuration in
grid order and grouped, its paired difference to the reference with the 95% CI, the deciding p (Holm)
on the right, a filled marker where significant; a 'no difference' prediction's margin shaded with the
row's 90% CI as a thick bar (polgrad/results/figures.py's docstring says what each mark means).
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from polgrad.results.curves import save_png
from polgrad.results.layout import clear_top, widen_for_labels

# `figs` below is the `Figures` that polgrad.results.figures.plot computed (not imported: figures
# imports this module)
Figures = Any

KL_METRICS = ("kl", "kl_exact")  # lower = closer to the reference policy, not "better"
NEUTRAL = "0.2"  # the markers' colour where no label recurs across groups
# (no green: the equivalence margin's band is green)
PALETTE = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:cyan", "tab:olive")


def direction(metric: str, primary: str, higher_is_better: bool) -> str:
    """The panel's reading direction: a KL is closer to the reference when lower (whatever the
    experiment ranks by); the primary metric follows `higher_is_better`; accuracy is better higher;
    any other metric (a prediction's, e.g. a response length) has no better side: '' ."""
    if metric in KL_METRICS:
        return "← lower = closer to reference"
    if metric == primary:
        return "higher is better →" if higher_is_better else "← lower is better"
    return "higher is better →" if metric == "eval_accuracy" else ""


def _right_text(r: dict[str, Any]) -> str:
    """A row's right-hand text: Δ and the deciding p; for the same runs as another configuration,
    which (not tested); and whether the comparison involves collapsed runs."""
    if r.get("twin"):
        return f"{_fmt(r['mean'])}  same runs as {r['twin']}"
    return f"{_fmt(r['mean'])}  {_p(r['p_holm'])}" + ("  failed runs" if r.get("failed") else "")


def _fmt(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:+.3g}"


def _p(x: float) -> str:
    return "p –" if x is None or math.isnan(x) else ("p<1e-4" if x < 1e-4 else f"p={x:.2g}")


def _layout(figs: Figures) -> tuple[list[tuple[float, str, str]], list[float]]:
    """Top to bottom: (y, text, label) per tick, label "" for a group's header; and the y of the
    separators between groups. A group of one configuration has no header (its row names it whole)."""
    ticks: list[tuple[str, str]] = []
    seps: list[int] = []
    for name, labels in figs.groups:
        if ticks:
            seps.append(len(ticks))
        if name and len(labels) > 1:
            ticks.append((name, ""))
        ticks += [(figs.shown.get(lab, lab), lab) for lab in labels]
    n = len(ticks)
    return [(n - 1 - i, text, lab) for i, (text, lab) in enumerate(ticks)], [n - i - 0.5 for i in seps]


def _colours(figs: Figures) -> dict[str, str]:
    """One colour per row text that recurs in two or more groups (the inner factor, e.g. the
    correction at each staleness); every other row neutral. Never the sign of the difference."""
    counts: dict[str, int] = {}
    for _, labels in figs.groups:
        for text in dict.fromkeys(figs.shown.get(lab, lab) for lab in labels):
            counts[text] = counts.get(text, 0) + 1
    # in the order of the largest group (off_policy: ppo, tis, icepop as declared, though the
    # staleness-0 group lacks the baseline's ppo)
    largest = [figs.shown.get(lab, lab) for lab in max((g for _, g in figs.groups), key=len, default=[])]
    recurring = [t for t, c in counts.items() if c > 1]
    recurring.sort(key=lambda t: largest.index(t) if t in largest else len(largest))
    if len(recurring) > len(PALETTE):
        recurring = []
    colour = dict(zip(recurring, PALETTE, strict=False))
    return {lab: colour.get(figs.shown.get(lab, lab), NEUTRAL) for lab in figs.order}


def draw_forest(path: Path, experiment: str, figs: Figures, primary: str, higher_is_better: bool):
    """One panel per metric, one row per configuration (grid order, grouped): Δ = configuration −
    reference, paired by seed, 95% CI bar, the deciding p (Holm) on the right; filled marker where
    `significant`, hollow otherwise; the zero line, and the equivalence margins as shaded bands.
    Returns the figure (closed)."""
    import matplotlib.pyplot as plt

    ticks, seps = _layout(figs)
    n = len(ticks)
    colour = _colours(figs)
    ncols = len(figs.metrics)
    height = 0.4 * max(n, 2) + 2.3
    fig, axes = plt.subplots(1, ncols, figsize=(5.4 * ncols + 1.6, height), sharey=True, squeeze=False)
    twins = []  # each panel's right axis: its Δ and p text
    for ax, m in zip(axes[0], figs.metrics, strict=True):
        rows = {r["label"]: r for r in figs.forest if r["metric"] == m}
        notes = []
        for margin, claim in figs.margins.get(m, []):
            ax.axvspan(-margin, margin, color="tab:green", alpha=0.13, lw=0, zorder=0)
            notes.append(f"shaded: ±{margin:g} equivalence margin ('{claim}')")
        tost = figs.tost_rows.get(m, set())  # the predicted configurations: the interval TOST uses
        if tost:
            notes.append(
                "thick bar: the 'no difference' prediction's 90% CI, within the band exactly when its TOST "
                "at α = 0.05 confirms before Holm's correction (the md's verdict is after it)"
            )
        ax.axvline(0.0, color="0.35", lw=1.0, zorder=1)
        for y in seps:
            ax.axhline(y, color="0.75", lw=0.8, zorder=1)
        for y, _, lab in ticks:
            r = rows.get(lab)
            if r is None:
                continue
            c = colour.get(lab, NEUTRAL)
            if not math.isnan(r["low"]):
                ax.plot([r["low"], r["high"]], [y, y], color=c, lw=2.0, zorder=2)
            if lab in tost and not math.isnan(r["low_tost"]):
                ax.plot(
                    [r["low_tost"], r["high_tost"]], [y, y], color=c, lw=5.0, zorder=2, gid=f"tost|{m}|{lab}"
                )
            face = c if r["significant"] else "white"
            shape = "X" if r.get("failed") else "o"  # a comparison resting on collapsed runs
            ax.plot([r["mean"]], [y], shape, ms=7, zorder=3, color=c, markerfacecolor=face, gid=f"{m}|{lab}")
        ax.set_ylim(-0.7, max(n, 1) - 0.3)
        ax.grid(axis="x", alpha=0.3)
        ax.locator_params(axis="x", nbins=6)  # a narrow panel's tick labels must not run together
        xlabel = [f"Δ {m} (configuration − {figs.reference_kind or 'reference'})"]
        xlabel += [d for d in [direction(m, primary, higher_is_better)] if d]
        xlabel += [textwrap.fill(t, 60) for t in notes]
        ax.set_xlabel("\n".join(xlabel), fontsize=10)
        ax.set_title(m, fontsize=11)
        right = ax.twinx()
        twins.append(right)
        right.set_ylim(ax.get_ylim())
        right.set_yticks([y for y, _, _ in ticks])
        right.set_yticklabels(
            [
                "" if not lab else (_right_text(rows[lab]) if lab in rows else "– (no values)")
                for _, _, lab in ticks
            ],
            fontsize=8.5,
        )
        right.tick_params(length=0)
        if not n:
            ax.text(
                0.5,
                0.5,
                "nothing to compare: fewer than two configurations",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=10,
            )
    left = axes[0][0]
    left.set_yticks([y for y, _, _ in ticks])
    left.set_yticklabels([text for _, text, _ in ticks], fontsize=9.5)
    for tick, (_, _, lab) in zip(left.get_yticklabels(), ticks, strict=True):
        tick.set_fontweight("normal" if lab else "bold")
        tick.set_color(colour.get(lab, "black") if lab else "black")
    ref = f"the {figs.reference_kind} {figs.reference}" if figs.reference else "no reference"
    grouped = f"; grouped by {figs.factor.removeprefix('Algorithm.')}" if figs.factor else ""
    sup = fig.suptitle(
        f"{experiment}: each configuration − {ref}, paired by seed (mean, 95% CI)\n"
        f"rows in grid order{grouped}; filled = significant after Holm's correction (as in the md), "
        "hollow = not; "
        + ("✕ = involves collapsed runs; " if any(r.get("failed") for r in figs.forest) else "")
        + "right: Δ and the deciding p (Holm)",
        fontsize=11,
    )
    widen_for_labels(fig, twins, left)
    fig.tight_layout()
    fig.subplots_adjust(top=1 - 0.85 / height)
    clear_top(fig, [sup])
    save_png(fig, path)
    return fig
