"""The figures of one experiment, drawn to answer its question (Agg backend, PNG, written atomically).

- results/<experiment>/<experiment>.png, a forest plot (drawn by polgrad.results.forest): each
  configuration's paired difference to the experiment's baseline (the leader by mean when the experiment
  names no baseline) in the primary metric and in the KL (kl_exact where the runs measured it), with its
  95% CI and its deciding p (Holm-corrected, of the test the comparison's rule decides by:
  `Comparison.p_decision`). These are the md's numbers: `polgrad.results.compare.against`, one Holm
  family per metric, as in the md's "Paired differences to the baseline" table. Rows are in grid order
  (the order of the sweep's cells in experiment.json: the swept values as declared), never sorted by the
  difference, grouped (`grouping`) by the first column (spec, then the swept bindings) whose values nest
  the grid (one contiguous run per value: off_policy's staleness, the outer loop of a product;
  kl_ablation's placement in its list of tuples) under a bold group label and a separator line, unless
  every group would be one row; the baseline has no row (it is the zero line, drawn on every panel). A
  marker is filled when the difference is significant after the md's Holm correction
  (`Comparison.significant`), hollow otherwise; its colour never encodes the sign (one neutral colour, or
  one colour per within-group label that recurs in several groups, e.g. off_policy's correction at each
  staleness). A label names only the swept bindings the configuration reads (the CSV's `not_read` leaves
  the others out). Every panel says which way is better: the primary metric by the experiment's
  `higher_is_better`, a KL "lower = closer to reference", held-out accuracy "higher is better". A 'no
  difference' prediction's equivalence margin (experiment.json `predictions`, `margin`) is a shaded band
  ±margin on its metric's panel (against the baseline only: the margin is a difference to the baseline),
  and the prediction's own row also carries its 90% CI as a thick bar inside the thin 95% one: the
  interval TOST at α = 0.05 compares with the band (inside it exactly when TOST confirms, before Holm's
  correction), where the 95% CI would show equivalence too rarely.
- results/<experiment>/<experiment>_curves.png (drawn by polgrad.results.curves), small multiples: one
  panel per configuration, that configuration against the baseline: train reward (metrics.jsonl
  `reward_mean`) smoothed per seed by an exponential moving average of span `EMA_SPAN` steps, and
  held-out accuracy from eval.jsonl (step 0 = the starting policy); line = mean over seeds, band =
  the 95% CI of that mean over seeds. The x axis is the cumulative number of sampled sequences when
  every run's metrics.jsonl rows have `sampled_sequences` (seeds averaged at common counts, each
  interpolated between its own points), else the optimizer step; its label says which.

`plot` returns the tables it drew (`Figures`, with the matplotlib figures, closed, for inspection), so
a test can compare them with the md's statistics.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polgrad.results.compare import ALPHA, Key, against, by_seed, leader
from polgrad.results.curves import (  # noqa: F401 (ema, EMA_SPAN: the curves' smoothing, re-exported)
    EMA_SPAN,
    SEQUENCES,
    STEP_METRICS,
    STEPS,
    draw_curves,
    ema,
    mean_band,
    seed_curves,
    sequences_band,
)
from polgrad.results.findings import kl_metric
from polgrad.results.forest import draw_forest
from polgrad.results.health import failed_keys
from polgrad.results.layout import PANEL_IN  # noqa: F401 (re-exported: the figures' panel width)
from polgrad.results.paths import runs_dir
from polgrad.results.predictions import margin_bands, tost_rows
from polgrad.results.store import LENGTH_COLUMNS, unread_columns

FIGURES_JSON = "figures.json"  # results/<experiment>/figures.json: what each PNG shows (Figures.drawn)


@dataclass
class Figures:
    """What `plot` drew. `forest`: one dict per (configuration, metric) row (label, metric, mean, low,
    high, p_holm, n, significant); `order`: the configurations' labels top to bottom (grid order);
    `factor`: the grouping column ("" when not grouped); `groups`: [(group label, [labels])] top to
    bottom; `shown`: the text of each label's row (without the factor under a group label);
    `margins`: {metric: [(margin, claim)]} drawn as bands; `x_axis`: the curves' x axis (`SEQUENCES`
    or `STEPS`); `curves`: {label: {series: (x, mean, half-width)}}; `note`: the text
    shown instead of curves (e.g. no run folders); `forest_figure`, `curves_figure`: the matplotlib
    figures (closed after saving; their Axes stay inspectable)."""

    reference: str
    reference_kind: str  # "baseline" | "leader" | ""
    metrics: list[str]
    forest: list[dict[str, Any]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)
    factor: str = ""
    groups: list[tuple[str, list[str]]] = field(default_factory=list)
    shown: dict[str, str] = field(default_factory=dict)  # label -> the text of its row
    margins: dict[str, list[tuple[float, str]]] = field(default_factory=dict)
    tost_rows: dict[str, set[str]] = field(default_factory=dict)  # metric -> labels of 'no difference' rows
    x_axis: str = STEPS
    curves: dict[str, dict[str, tuple[list, list, list]]] = field(default_factory=dict)
    note: str = ""
    seeds: dict[str, int] = field(default_factory=dict)  # run folders with curves, per label
    paths: tuple[Path, ...] = ()
    forest_figure: Any = field(default=None, repr=False)
    curves_figure: Any = field(default=None, repr=False)

    def drawn(self, previous: dict[str, Any] | None = None) -> dict[str, Any]:
        """What each PNG shows, machine-readable (the report writes it as results/<experiment>/
        figures.json): the forest plot's metric panels and the interval each draws (the 95% CI, and the
        90% CI TOST uses on the 'no difference' prediction's row); the curves' series and x axis, or,
        when the curves PNG was kept from an earlier report (no run folders here), the entry that
        report wrote."""
        forest = {
            "png": self.paths[0].name if self.paths else "",
            "metrics": list(self.metrics),
            "intervals": {
                m: ["95% CI", *(["90% CI (TOST)"] if self.tost_rows.get(m) else [])] for m in self.metrics
            },
            "margins": {m: [margin for margin, _ in v] for m, v in self.margins.items()},
        }
        series = sorted({name for per in self.curves.values() for name in per})
        curves = {
            "png": self.paths[1].name if len(self.paths) > 1 else "",
            "series": series,
            "x_axis": self.x_axis,
        }
        kept = {
            "png": curves["png"],
            "series": None,
            "note": "kept from an earlier report (no run folders here)",
        }
        if self.curves_figure is None and previous is not None:  # kept: what the earlier report wrote
            return {"forest": forest, "curves": previous.get("curves") or kept}
        return {"forest": forest, "curves": curves if self.curves_figure is not None else kept}


def _binding(column: str, value: str) -> str:
    return f"{column.removeprefix('Algorithm.')}={value}"


def _label(
    key: Key,
    group_columns: Sequence[str],
    one_spec: bool,
    unread: set[str] | None = None,
    leave_out: str = "",
) -> str:
    """The configuration's name: its spec (unless all share one) and the swept bindings it reads
    (but `leave_out`, the group's factor, which its group label shows)."""
    parts = [] if one_spec and len(group_columns) > 1 else [key[0]]
    parts = [p for p in parts if leave_out != group_columns[0]]
    parts += [
        _binding(c, v)
        for c, v in zip(group_columns[1:], key[1:], strict=True)
        if c not in (unread or ()) and c != leave_out
    ]
    return " · ".join(parts)


def grid_order(rows, group_columns: Sequence[str], cells: Sequence[dict[str, Any]] = ()) -> list[Key]:
    """The configurations in grid order: by the first position of one of their cells in `cells`
    (experiment.json's list, the expansion order of the swept values as declared); configurations of
    no listed cell follow in the rows' order."""
    index = {str(c.get("id")): i for i, c in enumerate(cells)}
    first: dict[Key, float] = {}
    for r in rows:
        key = tuple(str(r.get(c, "")) for c in group_columns)
        at = index.get(str(r.get("cell_id")), math.inf)
        first[key] = min(first.get(key, math.inf), at)
    seen = list(first)  # insertion order = the rows' order
    return sorted(seen, key=lambda k: (first[k], seen.index(k)))


def _value(key: Key, i: int, column: str, unread: dict) -> str:
    """The configuration's value of group column i, "not read" where it does not read the binding."""
    return "not read" if column in unread.get(tuple(key), ()) else key[i]


def grouping(keys: Sequence[Key], group_columns: Sequence[str], unread: dict) -> str:
    """The grid's outer factor: the first group column whose values along `keys` (grid order) are two
    or more contiguous runs, one per value, and not all single configurations ("" when no column is:
    no groups). In a product of axes that is the first varying one (the outermost loop: off_policy's
    staleness); in a list of tuples the first binding the list nests by (kl_ablation's placement), so
    grouping never reorders the grid."""
    for i, c in enumerate(group_columns):
        values = [_value(k, i, c, unread) for k in keys]
        runs = [v for j, v in enumerate(values) if j == 0 or v != values[j - 1]]
        if 2 <= len(runs) < len(values) and len(set(runs)) == len(runs):
            return c
    return ""


def _reference(rows, group_columns, primary, higher_is_better, baseline) -> tuple[Key | None, str]:
    keys = list(by_seed(rows, group_columns, primary))
    if baseline:
        for k in keys:
            if all(dict(zip(group_columns, k, strict=True)).get(c) == str(v) for c, v in baseline.items()):
                return k, "baseline"
    best, _, _ = leader(rows, group_columns, primary, higher_is_better)
    return best, ("leader" if best is not None else "")


def forest_table(rows, group_columns, metrics, reference, label, keys) -> tuple[list, list[str]]:
    """The forest plot's rows: `against(reference)` per metric (the md's numbers, its
    `significant`), and the labels of `keys` (grid order) but the reference's, in that order."""
    table = []
    failed = failed_keys(rows, group_columns)
    for m in metrics:
        for c in against(rows, group_columns, m, reference):
            t = c.test
            if t.n == 0:
                continue
            table.append(
                {"label": label(c.other), "metric": m, "mean": t.mean, "low": t.low, "high": t.high}
                | dict(zip(("low_tost", "high_tost"), t.interval(1 - 2 * ALPHA), strict=True))
                | {"p_holm": c.p_decision, "n": t.n, "significant": c.significant}  # the deciding p
                | {"failed": bool({c.other, c.reference} & failed), "twin": _twin(c, label)}
            )
    return table, [label(k) for k in keys if tuple(k) != tuple(reference)]


def curves_path(path: str | os.PathLike) -> Path:
    """<experiment>_curves.png beside <experiment>.png."""
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
    cells: Sequence[dict[str, Any]] = (),
    predictions: Sequence[dict[str, Any]] = (),
) -> Figures:
    """Write the forest plot to `path` and the learning curves beside it (`curves_path`); return the
    tables drawn. `cells` (experiment.json's) give the grid order, `predictions` the margins."""
    import matplotlib

    matplotlib.use("Agg")
    group_columns = ["spec", *swept_columns]
    ok = [r for r in rows if r.get("status") == "ok"]
    one_spec = len({str(r.get("spec", "")) for r in rows}) == 1
    unread = unread_columns(rows, group_columns)

    def label(k, leave_out=""):
        return _label(k, group_columns, one_spec, unread.get(tuple(k)), leave_out) or str(k[0])

    ref, kind = _reference(rows, group_columns, primary_metric, higher_is_better, baseline)
    # the metrics of the md's paired table: the primary metric, the KL and the held-out accuracy
    # and every metric a prediction is about (reasoning_gym's response lengths were in no panel)
    wanted = [primary_metric, kl_metric(rows), "eval_accuracy", *(str(p["metric"]) for p in predictions)]
    metrics = [
        m
        for m in dict.fromkeys(wanted)
        if m == primary_metric or any(str(r.get(m, "")).strip() for r in rows)
    ]
    figs = Figures(label(ref) if ref is not None else "", kind, metrics)
    keys = grid_order(ok, group_columns, cells)
    if ref is not None:
        figs.forest, figs.order = forest_table(rows, group_columns, metrics, ref, label, keys)
        shown = [k for k in keys if tuple(k) != tuple(ref)]
        figs.factor = grouping(shown, group_columns, unread)
        for name, members in _groups(shown, group_columns, figs.factor, unread):
            figs.groups.append((name, [label(k) for k in members]))
            # a row under its group's label leaves the factor out; a group of one is one row, named whole
            figs.shown |= {label(k): label(k, figs.factor) if len(members) > 1 else label(k) for k in members}
        figs.order = [lab for _, labels in figs.groups for lab in labels]  # grid order, grouped
        figs.margins = margin_bands(predictions, kind)
        figs.tost_rows = tost_rows(predictions, kind, keys, group_columns, label)
    path = Path(path)
    figs.forest_figure = draw_forest(path, experiment, figs, primary_metric, higher_is_better)
    # Learning curves of each configuration (and the reference) from its run folders; a per-step primary
    # metric (kl_exact) gets its own row
    per_config = {}
    extra = [primary_metric] if primary_metric in STEP_METRICS else []
    # an experiment that asks about response lengths gets their curves (wrong and right responses)
    lengths = any(str(m) in LENGTH_COLUMNS for m in [primary_metric, *(p["metric"] for p in predictions)])
    for k in keys:
        dirs = [
            Path(results_dir) / r["run_dir"]
            for r in ok
            if r.get("run_dir") and tuple(str(r.get(c, "")) for c in group_columns) == k
        ]
        per_config[label(k)] = seed_curves([d for d in dirs if d.is_dir()], extra, lengths)
    # against sampled sequences only when every seed of every configuration with curves counted them
    seeds = [q for per in per_config.values() for c in per.values() for _, q in c]
    counted = bool(seeds) and all(q is not None for q in seeds)
    figs.x_axis = SEQUENCES if counted else STEPS
    for lab, per in per_config.items():
        figs.seeds[lab] = max((len(c) for c in per.values()), default=0)
        band = sequences_band if counted else (lambda c: mean_band([v for v, _ in c]))
        figs.curves[lab] = {name: band(c) for name, c in per.items() if c}
    if not any(figs.curves.values()):
        figs.note = (
            f"no learning curves: no run folder of {experiment} has metrics.jsonl or eval.jsonl "
            f"under {runs_dir(experiment, results_dir)}"
        )
        absent = not any((Path(results_dir) / r["run_dir"]).is_dir() for r in ok if r.get("run_dir"))
        if absent and curves_path(path).exists():  # drawn earlier from run folders this checkout lacks: kept
            print(f"{curves_path(path)} kept: {figs.note}", file=sys.stderr)
            figs.paths = (path, curves_path(path))
            return figs
    figs.curves_figure = draw_curves(curves_path(path), experiment, figs, [label(k) for k in keys])
    figs.paths = (path, curves_path(path))
    return figs


def _groups(keys, group_columns, factor, unread) -> list[tuple[str, list[Key]]]:
    """[(group label, [configurations])] in grid order: one group per value of `factor` (the
    configurations that do not read it form a group of their own), or one unnamed group of all."""
    if not factor:
        return [("", list(keys))]
    i = group_columns.index(factor)
    out: dict[str, list[Key]] = {}
    for k in keys:
        value = _value(k, i, factor, unread)
        if value == "not read":
            name = f"{factor.removeprefix('Algorithm.')} not read"
        else:
            name = value if factor == "spec" else _binding(factor, value)
        out.setdefault(name, []).append(k)
    return list(out.items())


def _twin(c, label) -> str:
    """'' unless the configuration repeats another's runs: then which ('the reference' or its label)."""
    if c.identical_to is None:
        return ""
    return "the reference" if c.identical_to == c.reference else label(c.identical_to)
