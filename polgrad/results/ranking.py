"""The leaderboard of one experiment: its configurations grouped over seeds and ranked by the primary
metric (`leaderboard`), and the md's ranked table of them beside each one's Table-5 row (`ranking_lines`)
and the lists of unstable and failed cells (`cell_lists`), written by polgrad.results.report."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from polgrad.results.stats import format_mean_ci, mean_ci
from polgrad.results.store import METRICS, RUN_COLUMNS, TABLE5_COLUMNS

# The md's Table-5 columns: (CSV column, header). The method is the group's spec (a row may name it
# otherwise in an optional `table5_method` column); the others come from the CSV's table5_* columns.
TABLE5 = tuple((col, col.removeprefix("table5_").replace("_", " ")) for col in TABLE5_COLUMNS)
# The md's columns of how a group's runs were spread, (CSV column, header), before the Table-5 ones.
RUN = tuple(zip(RUN_COLUMNS, ("world size", "ZeRO stage"), strict=True))
# The status of a finished run that skipped too many optimizer steps (train.unstable_skip_frac): its
# row is listed under its own heading, never ranked nor in the statistics (only 'ok' rows are).
UNSTABLE = "unstable"
# The md's table cell of a swept binding that the group's cells do not read (the CSV's not_read).
NOT_READ_CELL = "not read"


def _float(text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def leaderboard(
    rows: Sequence[dict[str, Any]],
    group_columns: Sequence[str],
    primary_metric: str,
    higher_is_better: bool = True,
    metrics: Sequence[str] = METRICS,
) -> list[dict[str, Any]]:
    """One entry per group (same values in `group_columns`), aggregated over its seeds.

    Each entry: `group` (dict column -> text), `n` (ok seeds), `n_failed`, `n_unstable` (seeds whose
    run skipped too many optimizer steps: neither ranked nor in the statistics), `cells` (ids), and per
    metric `(mean, half_width | None, n)` over the ok seeds. Sorted by the primary metric's mean, best
    first; groups with no ok seed go last.
    """
    groups: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = tuple(str(r.get(c, "")) for c in group_columns)
        g = groups.setdefault(
            key,
            {"group": dict(zip(group_columns, key, strict=True)), "ok": [], "n_failed": 0, "cells": []},
        )
        g["cells"].append(r.get("cell_id", ""))
        if r.get("status") == "ok":
            g["ok"].append(r)
        elif r.get("status") == UNSTABLE:
            g["n_unstable"] = g.get("n_unstable", 0) + 1
        else:
            g["n_failed"] += 1
    out = []
    for g in groups.values():
        entry = {"group": g["group"], "n": len(g["ok"]), "n_failed": g["n_failed"], "cells": g["cells"]}
        entry["n_unstable"] = g.get("n_unstable", 0)
        for m in dict.fromkeys([*metrics, primary_metric]):
            entry[m] = mean_ci(_float(r.get(m)) for r in g["ok"])
        out.append(entry)

    def sort_key(e):
        mean = e[primary_metric][0]
        if math.isnan(mean):
            return (1, 0.0)
        return (0, -mean if higher_is_better else mean)

    out.sort(key=sort_key)  # stable: ties keep expansion order
    return out


def _table5_cells(
    rows: Sequence[dict[str, str]], group_columns: Sequence[str]
) -> dict[tuple[str, ...], dict[str, str]]:
    """Table-5 values per group (keyed like `leaderboard`): each column's first non-empty value."""
    out: dict[tuple[str, ...], dict[str, str]] = {}
    for r in rows:
        cells = out.setdefault(tuple(str(r.get(c, "")) for c in group_columns), {})
        for col, _ in TABLE5:
            if r.get(col) and col not in cells:
                cells[col] = str(r[col])
    return out


def _run_cells(
    rows: Sequence[dict[str, str]], group_columns: Sequence[str]
) -> dict[tuple[str, ...], dict[str, str]]:
    """World size and ZeRO stage per group (keyed like `leaderboard`): the distinct values of its rows,
    joined ("1, 2" when they differ), "n/a" when none has one (a CSV from before these columns)."""
    seen: dict[tuple[str, ...], dict[str, set[str]]] = {}
    for r in rows:
        key = tuple(str(r.get(c, "")) for c in group_columns)
        values = seen.setdefault(key, {c: set() for c in RUN_COLUMNS})
        for col in RUN_COLUMNS:
            if r.get(col):
                values[col].add(str(r[col]))
    return {
        key: {c: ", ".join(sorted(v, key=lambda t: (len(t), t))) or "n/a" for c, v in values.items()}
        for key, values in seen.items()
    }


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def ranking_lines(
    rows: Sequence[dict[str, str]],
    board: list[dict[str, Any]],
    swept_columns: Sequence[str],
    primary_metric: str,
    unread: dict[tuple, set[str]],
    label,
    best_key: tuple | None,
) -> list[str]:
    """The ranked table (one line per group; `best_key`'s group starred), and which groups' rows lack
    the Table-5 columns."""
    group_columns = ["spec", *swept_columns]
    table5 = _table5_cells(rows, group_columns)
    spread = _run_cells(rows, group_columns)
    metric_cols = [primary_metric] + [m for m in METRICS if m != primary_metric]
    header = ["rank", "spec", *swept_columns, "seeds ok", *metric_cols, *(h for _, h in RUN)]
    header += [label for _, label in TABLE5]
    lines = ["", "| " + " | ".join(_md_escape(h) for h in header) + " |", "|" + "---|" * len(header)]
    missing: list[str] = []
    for i, e in enumerate(board):
        g = e["group"]
        key = tuple(g[c] for c in group_columns)
        best = best_key is not None and key == best_key
        rank = f"**{i + 1} ★**" if best else str(i + 1)
        notes = [f"{e[k]} {w}" for k, w in (("n_failed", "failed"), ("n_unstable", UNSTABLE)) if e[k]]
        seeds = f"{e['n']}" + (f" ({', '.join(notes)})" if notes else "")
        t5 = table5.get(key, {})
        if any(t5.get(k) for k in TABLE5_COLUMNS):
            t5 = {"table5_method": g["spec"], **t5}
        else:
            missing.append(label(key))
        not_read = unread.get(key, set())
        cells = [
            rank,
            g["spec"],
            *(NOT_READ_CELL if c in not_read else f"`{g[c]}`" if g[c] else "" for c in swept_columns),
            seeds,
            *(format_mean_ci(e[m]) for m in metric_cols),
            *(spread.get(key, {}).get(k, "n/a") for k, _ in RUN),
            *(t5.get(k, "n/a") for k, _ in TABLE5),
        ]
        if best:
            cells[1] = f"**{cells[1]}**"
            cells[len(swept_columns) + 3] = f"**{cells[len(swept_columns) + 3]}**"
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    if missing:
        which = (
            f"all {len(board)} groups"
            if len(missing) == len(board)
            else f"{len(missing)} of {len(board)} groups"
        )
        lines += [
            "",
            f"Table-5 columns unavailable for {which}: their CSV rows have no table5_* columns (runs record "
            "them from summary.json's `table5`)"
            + ("" if len(missing) == len(board) else ": " + "; ".join(missing)),
        ]
    return lines


def cell_lists(rows: Sequence[dict[str, str]]) -> list[str]:
    """The unstable cells (not ranked) and the failed cells, each with its one-line message."""
    lines: list[str] = []
    for title, picked in (
        ("## Unstable cells (not ranked)", [r for r in rows if r.get("status") == UNSTABLE]),
        ("## Failed cells", [r for r in rows if r.get("status") not in ("ok", UNSTABLE)]),
    ):
        if picked:
            lines += ["", title, ""]
            lines += [
                f"- `{r.get('cell_id')}`: {_md_escape(r.get('error', '')) or '(no message)'}" for r in picked
            ]
    return lines
