"""The figures of one experiment, drawn to answer its question (Agg backend, PNG, written atomically).

- results/<experiment>.png, a forest plot: each configuration's paired difference to the
  experiment's baseline (the leader by mean when the experiment names no baseline) in the primary
  metric and in the KL (kl_exact where the runs measured it), with its 95% CI and Holm-corrected p.
  These are the md's numbers: `polgrad.results.compare.against`, one Holm family per metric, as in
  the md's "Paired differences to the baseline" table. Rows are sorted by the difference in the
  primary metric, best at the top; the baseline has no row (it is the zero line).
- results/<experiment>_curves.png, small multiples: one panel per configuration, that configuration
  against the baseline: train reward (metrics.jsonl `reward_mean`) smoothed per seed by an
  exponential moving average of span `EMA_SPAN` steps, y_1 = x_1, y_t = a x_t + (1 - a) y_{t-1}
  with a = 2 / (span + 1), and held-out accuracy from eval.jsonl (step 0 = the starting policy).
  Line = mean over seeds; band = the 95% CI of that mean over seeds (Student t, n - 1 dof).

`plot` returns the tables it drew (`Figures`), so a test can compare them with the md's statistics.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polgrad.io import atomic_path
from polgrad.results.compare import Key, against, by_seed, leader
from polgrad.results.findings import kl_metric
from polgrad.results.stats import t_ppf
from polgrad.results.store import read_metrics, unread_columns

EMA_SPAN = 10  # steps; a = 2 / 11
ALPHA_MARK = 0.05  # a filled marker: Holm-corrected p below this


def ema(values: Sequence[float], span: int = EMA_SPAN) -> list[float]:
    """Exponential moving average: y_1 = x_1, y_t = a x_t + (1 - a) y_{t-1}, a = 2 / (span + 1).

    [T] -> [T]. A non-finite x_t carries y_{t-1} forward (NaN until the first finite value).
    """
    if span < 1:
        raise ValueError(f"ema span must be >= 1, got {span}")
    a = 2.0 / (span + 1.0)
    out: list[float] = []
    y = math.nan
    for x in values:
        x = float(x)
        if math.isfinite(x):
            y = x if math.isnan(y) else a * x + (1.0 - a) * y
        out.append(y)
    return out


@dataclass
class Figures:
    """What `plot` drew. `forest`: one dict per (configuration, metric) row (label, metric, mean, low,
    high, p_holm, n); `order`: the configurations' labels top to bottom; `curves`: {label: {series:
    (steps, mean, half-width)}}; `note`: the text shown instead of curves (e.g. no run folders)."""

    reference: str
    reference_kind: str  # "baseline" | "leader" | ""
    metrics: list[str]
    forest: list[dict[str, Any]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    curves: dict[str, dict[str, tuple[list, list, list]]] = field(default_factory=dict)
    note: str = ""
    seeds: dict[str, int] = field(default_factory=dict)  # run folders with curves, per label
    paths: tuple[Path, ...] = ()


def _label(key: Key, group_columns: Sequence[str], one_spec: bool, unread: set[str] | None = None) -> str:
    """The configuration's name: its spec (unless all share one) and the swept bindings it reads."""
    parts = [] if one_spec and len(group_columns) > 1 else [key[0]]
    parts += [
        f"{c.removeprefix('Algorithm.')}={v}"
        for c, v in zip(group_columns[1:], key[1:], strict=True)
        if c not in (unread or ())
    ]
    return " · ".join(parts) or str(key[0])


def _reference(rows, group_columns, primary, higher_is_better, baseline) -> tuple[Key | None, str]:
    keys = list(by_seed(rows, group_columns, primary))
    if baseline:
        for k in keys:
            if all(dict(zip(group_columns, k, strict=True)).get(c) == str(v) for c, v in baseline.items()):
                return k, "baseline"
    best, _, _ = leader(rows, group_columns, primary, higher_is_better)
    return best, ("leader" if best is not None else "")


def forest_table(rows, group_columns, primary, metrics, reference, label, higher_is_better=True):
    """The forest plot's rows: `against(reference)` per metric (the md's numbers), and the labels
    sorted by the difference in `primary`, best first (configurations without a paired seed last)."""
    table = []
    order_of: dict[str, float] = {}
    for m in metrics:
        for c in against(rows, group_columns, m, reference):
            t = c.test
            if t.n == 0:
                continue
            lab = label(c.other)
            table.append(
                {"label": lab, "metric": m, "mean": t.mean, "low": t.low, "high": t.high}
                | {"p_holm": c.p_holm, "n": t.n, "significant": c.significant}
            )
            if m == primary:
                order_of[lab] = t.mean if higher_is_better else -t.mean
    labels = list(dict.fromkeys(r["label"] for r in table))
    order = sorted(labels, key=lambda lab: (lab not in order_of, -order_of.get(lab, 0.0)))
    return table, order


def _seed_curves(run_dirs: Sequence[Path]) -> dict[str, list[dict[int, float]]]:
    """Per seed: smoothed train reward {step: EMA} and eval accuracy {step: accuracy} (eval.jsonl)."""
    from polgrad.evaluation import read_evals

    out: dict[str, list[dict[int, float]]] = {"train reward": [], "eval accuracy": []}
    for d in run_dirs:
        m = [r for r in read_metrics(d / "metrics.jsonl") if isinstance(r.get("reward_mean"), (int, float))]
        if m:
            out["train reward"].append(
                dict(zip((r["step"] for r in m), ema([r["reward_mean"] for r in m]), strict=True))
            )
        try:
            evals = read_evals(str(d))
        except ValueError:  # a torn last line of a run still writing
            evals = []
        acc = {int(e["step"]): float(e["accuracy"]) for e in evals if e.get("accuracy") is not None}
        if acc:
            out["eval accuracy"].append(acc)
    return out


def _mean_band(series: list[dict[int, float]]) -> tuple[list, list, list]:
    """(steps, mean over seeds, half-width of its 95% CI: t_{0.975, n-1} s / sqrt(n); NaN where n < 2)."""
    steps = sorted(set().union(*series))
    means, halves = [], []
    for s in steps:
        xs = [d[s] for d in series if s in d and math.isfinite(d[s])]
        n = len(xs)
        mean = sum(xs) / n if n else math.nan
        sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else math.nan
        means.append(mean)
        halves.append(t_ppf(0.975, n - 1) * sd / math.sqrt(n) if n > 1 else math.nan)
    return steps, means, halves


def _save(fig, path: Path) -> None:
    """Write the PNG atomically (polgrad.io.atomic_path: no temp file left behind, a full disk is one
    line naming the file, the PNG readable with the user's umask)."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight")  # long configuration labels stay inside
    finally:
        plt.close(fig)


def curves_path(path: str | os.PathLike) -> Path:
    """results/<experiment>_curves.png beside results/<experiment>.png."""
    p = Path(path)
    return p.with_name(f"{p.stem}_curves{p.suffix}")


def plot(
    path: str | os.PathLike,
    experiment: str,
    rows: Sequence[dict[str, str]],
    *,
    swept_columns: Sequence[str],
    results_dir: str | os.PathLike,
    primary_metric: str = "eval_accuracy",
    higher_is_better: bool = True,
    baseline: dict[str, str] | None = None,
) -> Figures:
    """Write the forest plot to `path` and the learning curves beside it (`curves_path`); return the
    tables drawn."""
    import matplotlib

    matplotlib.use("Agg")
    group_columns = ["spec", *swept_columns]
    ok = [r for r in rows if r.get("status") == "ok"]
    one_spec = len({str(r.get("spec", "")) for r in rows}) == 1

    unread = unread_columns(rows, group_columns)

    def label(k):
        return _label(k, group_columns, one_spec, unread.get(tuple(k)))

    ref, kind = _reference(rows, group_columns, primary_metric, higher_is_better, baseline)
    # the metrics of the md's paired table: the primary metric, the KL and the held-out accuracy
    wanted = [primary_metric, kl_metric(rows), "eval_accuracy"]
    metrics = [
        m
        for m in dict.fromkeys(wanted)
        if m == primary_metric or any(str(r.get(m, "")).strip() for r in rows)
    ]
    figs = Figures(label(ref) if ref is not None else "", kind, metrics)
    if ref is not None:
        figs.forest, figs.order = forest_table(
            rows, group_columns, primary_metric, metrics, ref, label, higher_is_better
        )
    path = Path(path)
    draw_forest(path, experiment, figs, primary_metric, higher_is_better)
    # Learning curves of each configuration (and the reference) from its run folders.
    keys = list(dict.fromkeys(tuple(str(r.get(c, "")) for c in group_columns) for r in ok))
    for k in keys:
        dirs = [
            Path(results_dir) / r["run_dir"]
            for r in ok
            if r.get("run_dir") and tuple(str(r.get(c, "")) for c in group_columns) == k
        ]
        per = _seed_curves([d for d in dirs if d.is_dir()])
        figs.seeds[label(k)] = max((len(s) for s in per.values()), default=0)
        figs.curves[label(k)] = {name: _mean_band(s) for name, s in per.items() if s}
    if not any(figs.curves.values()):
        figs.note = (
            f"no learning curves: no run folder of {experiment} has metrics.jsonl or eval.jsonl "
            f"under {Path(results_dir) / experiment / 'runs'}"
        )
    draw_curves(curves_path(path), experiment, figs, [label(k) for k in keys])
    figs.paths = (path, curves_path(path))
    return figs


def _fmt(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:+.3g}"


def _p(x: float) -> str:
    return "p –" if x is None or math.isnan(x) else ("p<1e-4" if x < 1e-4 else f"p={x:.2g}")


def draw_forest(path: Path, experiment: str, figs: Figures, primary: str, higher_is_better: bool) -> None:
    """One panel per metric, one row per configuration: Δ = configuration − reference, paired by seed,
    95% CI bar, Holm-corrected p on the right; filled marker where p (Holm) < ALPHA_MARK."""
    import matplotlib.pyplot as plt

    n = len(figs.order)
    ncols = len(figs.metrics)
    height = 0.42 * max(n, 2) + 1.9
    fig, axes = plt.subplots(1, ncols, figsize=(5.6 * ncols + 1.6, height), sharey=True, squeeze=False)
    y_of = {lab: n - 1 - i for i, lab in enumerate(figs.order)}
    for ax, m in zip(axes[0], figs.metrics, strict=True):
        rows = {r["label"]: r for r in figs.forest if r["metric"] == m}
        ax.axvline(0.0, color="0.35", lw=1.0, zorder=1)
        for lab, r in rows.items():
            y = y_of[lab]
            # better / worse than the reference in the primary metric; other metrics (KL) neutral
            better = (r["mean"] >= 0) == higher_is_better
            color = ("tab:blue" if better else "tab:red") if m == primary else "0.2"
            if not math.isnan(r["low"]):
                ax.plot([r["low"], r["high"]], [y, y], color=color, lw=2.0, zorder=2)
            ax.plot(
                [r["mean"]],
                [y],
                "o",
                ms=7,
                zorder=3,
                color=color,
                markerfacecolor=color if r["significant"] else "white",
            )
        ax.set_ylim(-0.7, max(n, 1) - 0.3)
        ax.grid(axis="x", alpha=0.3)
        ax.set_xlabel(f"Δ {m} (configuration − {figs.reference_kind or 'reference'})", fontsize=10)
        direction = (
            "" if m != primary else (" (higher is better)" if higher_is_better else " (lower is better)")
        )
        ax.set_title(f"{m}{direction}", fontsize=11)
        right = ax.twinx()
        right.set_ylim(ax.get_ylim())
        right.set_yticks(range(n))
        right.set_yticklabels(
            [
                (f"{_fmt(rows[lab]['mean'])}  {_p(rows[lab]['p_holm'])}" if lab in rows else "– (no values)")
                for lab in reversed(figs.order)
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
    axes[0][0].set_yticks(range(n))
    axes[0][0].set_yticklabels(list(reversed(figs.order)), fontsize=9.5)
    ref = f"the {figs.reference_kind} {figs.reference}" if figs.reference else "no reference"
    fig.suptitle(
        f"{experiment}: each configuration − {ref}, paired by seed (mean, 95% CI)\n"
        f"right: Δ and p Holm-corrected per metric (as in the md); filled = p (Holm) < {ALPHA_MARK}",
        fontsize=11,
    )
    fig.tight_layout()
    fig.subplots_adjust(top=1 - 0.85 / height)
    _save(fig, path)


def draw_curves(path: Path, experiment: str, figs: Figures, labels: Sequence[str]) -> None:
    """Small multiples: per configuration (forest order) a pair of panels, held-out accuracy above and
    train reward below (their scales differ: a reward model's scores are not in [0, 1]), against the
    reference in grey. Panels of one kind share their y axis; all share the step axis."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if figs.note:  # nothing to draw: one panel that says why
        fig, ax = plt.subplots(figsize=(8.0, 2.2))
        ax.axis("off")
        ax.text(0.5, 0.5, textwrap.fill(figs.note, 80), ha="center", va="center", fontsize=10)
        ax.set_title(f"{experiment}: learning curves", fontsize=11)
        fig.tight_layout()
        _save(fig, path)
        return
    ref = figs.reference if figs.reference in figs.curves else ""
    panels = (
        [lab for lab in figs.order if lab in figs.curves] or [lab for lab in labels if lab != ref] or [ref]
    )
    kinds = ("eval accuracy", "train reward")
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    height = 4.4 * nrows + 1.5
    fig, axes = plt.subplots(
        2 * nrows, ncols, figsize=(3.7 * ncols + 0.7, height), sharex=True, squeeze=False
    )
    for row in range(2 * nrows):
        for ax in axes[row]:
            ax.sharey(axes[row % 2, 0]) if ax is not axes[row % 2, 0] else None
    for i in range(len(panels), nrows * ncols):
        for k in range(2):
            axes[2 * (i // ncols) + k, i % ncols].set_visible(False)
    for i, lab in enumerate(panels):
        pair = [axes[2 * (i // ncols) + k, i % ncols] for k in range(2)]
        for ax, kind in zip(pair, kinds, strict=True):
            shown = [(ref, "0.45")] if ref and lab != ref else []
            for who, color in [*shown, (lab, "0.45" if lab == ref else "tab:blue")]:
                if kind not in figs.curves.get(who, {}):
                    continue
                steps, mean, half = figs.curves[who][kind]
                marker = "o" if kind == "eval accuracy" else None
                ax.plot(steps, mean, color=color, marker=marker, ms=3.5, lw=1.5)
                lo = [m - h for m, h in zip(mean, half, strict=True)]
                hi = [m + h for m, h in zip(mean, half, strict=True)]
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8.5)
            if kind not in figs.curves.get(lab, {}):
                ax.text(
                    0.98,
                    0.05,
                    f"no {kind} logged",
                    ha="right",
                    va="bottom",
                    transform=ax.transAxes,
                    fontsize=8,
                    color="tab:blue",
                )
            if i % ncols == 0:
                ax.set_ylabel(
                    kind if kind == "eval accuracy" else f"train reward\n(EMA span {EMA_SPAN})", fontsize=9
                )
        n_seeds = figs.seeds.get(lab, 0)
        title = f"{lab} ({n_seeds} seed{'s' if n_seeds != 1 else ''})" if lab else ""
        # long labels (several swept bindings) wrap inside their panel's width
        pair[0].set_title(textwrap.fill(title.replace(" · ", " ·\u00a0"), width=44), fontsize=9.5)
    for j in range(ncols):
        last = max(r for r in range(2 * nrows) if axes[r, j].get_visible())
        axes[last, j].set_xlabel("optimizer step", fontsize=9)
        axes[last, j].xaxis.set_tick_params(labelbottom=True)
    handles = [
        *([Line2D([], [], color="tab:blue", lw=2, label="this configuration")] if panels != [ref] else []),
        *([Line2D([], [], color="0.45", lw=2, label=f"{figs.reference_kind}: {ref}")] if ref else []),
    ]
    width = 3.7 * ncols + 0.7
    title = textwrap.fill(
        f"{experiment}: per configuration, held-out accuracy (top; step 0 = the start) and train reward "
        f"(bottom; EMA of span {EMA_SPAN} steps, a = 2/{EMA_SPAN + 1}, per seed); line = mean over seeds, "
        "band = 95% CI of that mean over seeds (Student t)",
        width=int(width * 10.5),
    )
    head = 0.2 * (title.count("\n") + 1)  # inches of title
    fig.suptitle(title, fontsize=10.5, y=1 - 0.06 / height)
    fig.legend(
        handles=handles,
        loc="upper center",
        ncol=2,
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 1 - (head + 0.1) / height),
    )
    fig.tight_layout()
    # room for the title, the legend and the panels' own (possibly two-line) titles
    fig.subplots_adjust(top=1 - (head + 0.95) / height)
    _save(fig, path)
