"""The CSV is checked, never trusted: the run folders are the record, the CSV a copy of them.

A row of a finished cell is a function of its run folder (`results/<X>/runs/<cell>/`: summary.json,
the metrics and Table-5 row; cell.json, where it ran) and of the cell (experiment.json): `cell_row`
builds it, for the sweep as each cell ends and here. `reconcile` compares the CSV with the rows its
run folders give: a missing column, a missing or duplicated row, or a value that differs (a hand edit,
a row written by an older polgrad) makes it rebuild the whole CSV from the folders, atomically; rows
of cells without a finished folder (failed, restarted, not run yet) are kept as they are. Where no
run folder is there (a fresh clone: they are not committed), the CSV is the only record: it must be
complete in itself (`complete`: a row or a finished run folder for every current cell, so a
header-only CSV is refused, the columns the report needs, a primary metric in every ok row), else
a one-line `DataError` says what is missing and how to get it back.

Both the sweep (before it runs the cells left) and `python -m polgrad.results` call `reconcile`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import DataError
from polgrad.results.paths import runs_dir
from polgrad.results.provenance import environment
from polgrad.results.store import (
    BUDGET_COLUMNS,
    LENGTH_COLUMNS,
    METRICS,
    NOT_READ,
    REWARD_MODEL_COLUMNS,
    TABLE5_COLUMNS,
    WARM_START,
    csv_path,
    locked,
    read_table,
    rewrite_rows,
)
from polgrad.run_folder import RunFolder

# The statuses of a run that ended with a result ('unstable': too many skipped optimizer steps, see
# train.unstable_skip_frac; listed in the leaderboard but not ranked). A re-run skips these cells.
FINISHED = ("ok", "unstable")
TABLE5_FIELDS = tuple(c.removeprefix("table5_") for c in TABLE5_COLUMNS)
# Columns whose value is not a function of the run folder: when the row was written.
_UNCHECKED = ("finished_at",)


def cell_row(
    experiment: str, cell: dict[str, Any], run_dir: Path, results_dir: Path, outcome: dict[str, Any]
) -> dict[str, Any]:
    """The CSV row of `cell` (experiment.json's form: id, spec, spec_file, swept, not_read, seed) from its
    `outcome` (status, error, summary, environment, world_size)."""
    summary = outcome.get("summary") or {}
    ok = outcome["status"] in FINISHED  # an unstable run's metrics are recorded too (not ranked)
    row: dict[str, Any] = {
        "experiment": experiment,
        "cell_id": cell["id"],
        "spec": cell["spec"],
        "spec_file": cell["spec_file"],
    }
    row.update(dict(cell["swept"]))
    table5 = summary.get("table5")
    if isinstance(table5, dict):
        row.update({f"table5_{k}": table5.get(k) for k in TABLE5_FIELDS})
    row["seed"] = cell["seed"]
    row[WARM_START] = summary.get(WARM_START)  # the starting policy (blank: a run that did not record it)
    row[NOT_READ] = " ".join(cell.get("not_read", []))  # swept bindings the cell never reads: not in labels
    for m in METRICS:
        row[m] = summary.get(m) if ok else None
    row["steps"] = summary.get("steps") if ok else None
    # What the trainer reports; a failed cell without a summary: the ranks the sweep started.
    row["world_size"] = summary.get("world_size", outcome.get("world_size"))
    row["zero_stage"] = summary.get("zero_stage")
    # The budget's counts (a trainer that writes them) and what the dry run made of the cell (Sweep.budget).
    row.update({k: summary[k] if ok else None for k in BUDGET_COLUMNS[:3] if k in summary})
    row.update({k: cell[k] for k in BUDGET_COLUMNS[3:] if k in cell})
    row.update(
        {k: summary[k] if ok else None for k in (*REWARD_MODEL_COLUMNS, *LENGTH_COLUMNS) if k in summary}
    )
    row["status"] = outcome["status"]
    row["error"] = outcome.get("error", "")
    try:
        row["run_dir"] = str(run_dir.resolve().relative_to(results_dir.resolve()))
    except ValueError:
        row["run_dir"] = str(run_dir)
    row.update(outcome.get("environment") or environment())
    row["finished_at"] = outcome.get("finished_at") or (_summary_time(run_dir) if ok else None) or _now()
    return row


def _summary_time(run_dir: Path) -> str | None:
    """When a finished run wrote its summary.json (UTC, seconds): the time both the sweep's row and a row
    rebuilt from the folder (`finished_outcome`) give it, so the two agree (the clock at recording time
    differed from it by a second under load). None without a summary."""
    try:
        mtime = RunFolder(run_dir).summary.stat().st_mtime
    except OSError:
        return None
    return _dt.datetime.fromtimestamp(mtime, _dt.timezone.utc).isoformat(timespec="seconds")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def finished_outcome(run_dir: Path) -> dict[str, Any] | None:
    """A finished run folder's outcome (what `cell_row` needs), or None if it holds no finished run."""
    summary = _json(RunFolder(run_dir).summary)
    if summary is None or summary.get("status") not in FINISHED:
        return None
    cell = _json(run_dir / "cell.json") or {}
    return {
        "status": summary["status"],
        "error": str(summary.get("unstable", "")),
        "summary": summary,
        "environment": cell.get("environment"),
        "world_size": cell.get("ranks"),
        "finished_at": _summary_time(run_dir),
    }


def _text(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def reconcile(
    experiment: str,
    cells: Sequence[dict[str, Any]],
    results_dir: str | os.PathLike,
    primary_metric: str,
    swept_columns: Sequence[str] = (),
    *,
    check_complete: bool = True,
) -> str | None:
    """Make the experiment's CSV (results_dir/<experiment>/<experiment>.csv) agree with the run folders
    (see the module docstring).

    Returns one line when the CSV was rebuilt (what disagreed), None when it already agreed; raises a
    one-line DataError when the CSV is incomplete and no run folder can complete it (`check_complete`;
    the sweep passes False: it runs the cells without a finished folder and replaces their rows).
    Read, comparison and rewrite happen under the CSV's lock, so a row a running sweep writes
    meanwhile is not lost."""
    results_dir = Path(results_dir)
    path = csv_path(experiment, results_dir)
    with locked(path):
        return _reconcile(experiment, cells, results_dir, path, primary_metric, swept_columns, check_complete)


def _reconcile(
    experiment, cells, results_dir: Path, path: Path, primary_metric, swept_columns, check_complete
) -> str | None:
    header, rows = read_table(path)
    by_id: dict[str, dict[str, str]] = {}
    problems: list[str] = []
    for r in rows:
        cid = r.get("cell_id") or ""
        if cid in by_id:
            problems.append(f"cell {cid} has two rows")
        by_id[cid] = r
    expected: dict[str, dict[str, Any]] = {}
    for c in cells:
        run_dir = runs_dir(experiment, results_dir) / c["id"]
        outcome = finished_outcome(run_dir)
        old = by_id.get(c["id"])
        if outcome is None and old and old.get("run_dir"):  # a restarted cell: its row names the old folder
            run_dir = results_dir / old["run_dir"]
            outcome = finished_outcome(run_dir)
        if outcome is None:
            continue
        if old and old.get("finished_at"):
            outcome["finished_at"] = old["finished_at"]
        expected[c["id"]] = cell_row(experiment, c, run_dir, results_dir, outcome)
    columns = list(dict.fromkeys(k for row in expected.values() for k in row))
    missing = [k for k in columns if k not in header]
    if missing:
        problems.append(f"column{'s' if len(missing) > 1 else ''} {', '.join(missing[:3])} missing")
    for cid, row in expected.items():
        old = by_id.get(cid)
        if old is None:
            problems.append(f"the row of cell {cid} missing")
            continue
        differ = [
            k
            for k, v in row.items()
            if k in header and k not in _UNCHECKED and not _same(old[k] or "", _text(v))
        ]
        if differ:
            problems.append(f"cell {cid}'s {', '.join(differ[:3])} differ{'s' if len(differ) == 1 else ''}")
    if not problems or not expected:
        if check_complete:
            complete(experiment, results_dir, header, rows, cells, primary_metric, swept_columns, expected)
        return None
    ids = [c["id"] for c in cells]
    kept = [r for r in rows if r.get("cell_id") not in expected]
    rebuilt = [expected[i] for i in ids if i in expected] + kept
    rank = {cid: n for n, cid in enumerate(ids)}
    rebuilt.sort(key=lambda r: rank.get(r.get("cell_id", ""), len(rank)))
    new_header = list(dict.fromkeys([*header, *columns]))
    if check_complete:
        complete(experiment, results_dir, new_header, kept, cells, primary_metric, swept_columns, expected)
    rewrite_rows(path, rebuilt, new_header, lock=False)
    more = f" (+{len(problems) - 2} more)" if len(problems) > 2 else ""
    return (
        f"{path} disagreed with the run folders ({'; '.join(problems[:2])}{more}): rebuilt it from "
        f"{runs_dir(experiment, results_dir)} ({len(expected)} finished cells; {len(kept)} other rows kept)"
    )


def complete(
    experiment: str,
    results_dir: Path,
    header: Sequence[str],
    rows: Sequence[dict[str, str]],
    cells: Sequence[dict[str, Any]],
    primary_metric: str,
    swept_columns: Sequence[str] = (),
    backed: Collection[str] = (),
) -> None:
    """The rows no run folder backs must be complete in themselves, and some current cell must have a
    row or a finished run folder (`backed`), else one line naming what is missing (nothing written).
    Current cells with neither (not run yet, running, or their rows lost) are allowed when others have
    results: the md then says how many it lacks (report.markdown's `missing_cells`), so a report made
    while a sweep runs still works and a CSV that lost rows is never reported as if it were whole."""
    path = csv_path(experiment, results_dir)
    where = f"and no finished run folder under {runs_dir(experiment, results_dir)} to rebuild it from"
    fix = f"restore {path} (e.g. git checkout {path}) or re-run the sweep"
    have = {r.get("cell_id") for r in rows} | set(backed)
    lacking = [c["id"] for c in cells if c["id"] not in have]
    if lacking and len(lacking) == len(cells):
        raise DataError(
            f"{path}: {len(lacking)} of {len(cells)} current cells (e.g. {lacking[0]}) have no row {where}; "
            f"{fix} (it runs the missing cells)"
        )
    if not rows:
        return
    needed = ["cell_id", "spec", "seed", "status", primary_metric, *swept_columns]
    absent = [c for c in needed if c not in header]
    if absent:
        what = " (the primary metric)" if absent[0] == primary_metric else ""
        raise DataError(f"{path}: column '{absent[0]}'{what} is missing {where}; {fix}")
    current = {c["id"] for c in cells}
    for r in rows:
        if (
            r.get("cell_id") in current
            and r.get("status") == "ok"
            and not (r.get(primary_metric) or "").strip()
        ):
            raise DataError(
                f"{path}: the ok row of cell {r.get('cell_id')} has no {primary_metric} (the primary metric) "
                f"{where}; {fix}"
            )
