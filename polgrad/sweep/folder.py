"""An experiment's results folder (results/<name>/, polgrad/results/paths.py) as the sweep keeps it:
the one sweep that may use it at a time (`sweep_lock`), the experiment file it belongs to
(`check_own_folder`), its experiment.json (`write_experiment_json`), a cell's CSV row (`row`) and the
run folders of restarted cells moved aside (`restart`). polgrad/sweep/cli.py runs the sweep with them.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.errors import PolgradError
from polgrad.results import paths
from polgrad.sweep import borrow, budget, processes, tuning
from polgrad.sweep.experiment import Experiment
from polgrad.sweep.grid import Cell


def check_results_folder(results_dir: str | os.PathLike) -> None:
    """The results folder must be a folder, or not exist yet below one: a file on its path would stop
    the sweep with NotADirectoryError at its first mkdir; one line instead, before any work."""
    path = Path(results_dir)
    for part in (path, *path.parents):
        if part.exists():
            if not part.is_dir():
                raise PolgradError(
                    f"--results {results_dir}: {part} is a file, not a folder; give --results a folder "
                    "(it is created if missing; default: results)"
                )
            return


def recorded_file(exp: Experiment) -> str:
    """The experiment file as experiment.json records it: relative to its repository's root."""
    return _results.repo_relative(exp.file, _results.repo_root(Path(exp.file).resolve().parent))


def check_own_folder(exp: Experiment, results_dir: Path) -> None:
    """results/<name>/ is the sweep of one experiment file. Another file of the same Sweep.name would
    replace experiment.json's cells with its own, record its rows beside the first file's in the CSV
    and train into the same folder: one line instead, before anything is written. The same file
    re-run (a resume, an edited grid: its cells are recorded and the others' rows kept) passes."""
    path = paths.meta_path(exp.name, results_dir)
    try:
        recorded = json.loads(path.read_text()).get("file")
    except (OSError, ValueError, AttributeError):
        return  # no sweep there yet (or no file recorded): nothing to keep apart
    if not recorded or recorded == recorded_file(exp):
        return
    root = _results.repo_root(Path(exp.file).resolve().parent) or Path.cwd()
    if (root / recorded).resolve() == Path(exp.file).resolve():
        return
    raise PolgradError(
        f"{path} is the sweep of {recorded}, not of {exp.file}: both are Sweep.name = '{exp.name}', so "
        f"their cells would mix in one CSV and folder; rename Sweep.name in {exp.file} or give it "
        "another --results folder"
    )


def restart(exp: Experiment, cells: Sequence[Cell], results_dir: Path, ids, failed: bool) -> None:
    """Move the run folder of each cell to restart to runs/<cell>.old-<time> (nothing is deleted) and
    point its CSV row, if any, there: the old result stays in the CSV until the new run replaces it."""
    csv_file = paths.csv_path(exp.name, results_dir)
    rows = {r.get("cell_id"): r for r in _results.read_rows(csv_file)}
    chosen = [c.id for c in cells if c.id in ids or (failed and rows.get(c.id, {}).get("status") == "failed")]
    runs = paths.runs_dir(exp.name, results_dir)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    for cid in chosen:
        run_dir = runs / cid
        if not run_dir.exists():
            print(f"restart {cid}: no run folder yet; it starts from scratch anyway", file=sys.stderr)
            continue
        processes.kill_stale_trainer(run_dir.resolve())  # a trainer left running would recreate it
        old = runs / f"{cid}.old-{stamp}"
        n = 1
        while old.exists():
            n += 1
            old = runs / f"{cid}.old-{stamp}-{n}"
        run_dir.rename(old)
        if cid in rows:
            moved = {**rows[cid], "run_dir": str(old.relative_to(results_dir))}
            _results.upsert_row(csv_file, moved, order=[c.id for c in cells])
        print(f"restart {cid}: moved its run folder to {old}; it starts from scratch", file=sys.stderr)


@contextlib.contextmanager
def sweep_lock(exp_dir: Path):
    """One sweep per experiment folder at a time (released by the OS even on SIGKILL)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(exp_dir / ".sweep.lock", "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            raise PolgradError(
                f"{exp_dir} is in use by another sweep (pid {holder}); wait for it to end or stop it"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def cell_meta(cell: Cell) -> dict[str, Any]:
    """A cell as experiment.json records it (what `polgrad.results.record.cell_row` reads)."""
    return {
        "id": cell.id,
        "spec": cell.spec_name,
        "spec_file": cell.spec,
        "swept": dict(cell.swept),
        "not_read": list(cell.unread),
        "seed": cell.seed,
        # what the dry run built: its prompts per step and how it spends a step (Sweep.budget)
        **(
            {"prompts_per_step": cell.budget.prompts_per_step, "budget_note": cell.budget.note}
            if cell.budget
            else {}
        ),
    }


def row(exp: Experiment, cell: Cell, run_dir: Path, results_dir: Path, outcome: dict[str, Any]) -> dict:
    return _results.cell_row(exp.name, cell_meta(cell), run_dir, results_dir, outcome)


def previous_gate(exp_dir: Path) -> dict[str, Any] | None:
    """The pilot gate's record in the experiment.json of an earlier run of this sweep, if any."""
    try:
        return json.loads((exp_dir / paths.META).read_text()).get("pilot_gate")
    except (OSError, ValueError, AttributeError):
        return None


def write_experiment_json(exp, cells, results_dir: Path, command: str, gate=None) -> dict[str, Any]:
    """results/<name>/experiment.json: what the report reads of the experiment (its cells included).

    It is tracked: its paths are relative to the repository root (the working directory outside
    git), so a run from another checkout path writes the same bytes; the cells keep their absolute
    paths in memory and in the untracked run folders."""
    root = _results.repo_root(Path(exp.file).resolve().parent)
    meta = {
        "name": exp.name,
        "file": recorded_file(exp),
        "command": command,
        "primary_metric": exp.primary_metric,
        "higher_is_better": exp.higher_is_better,
        "swept_columns": exp.swept_columns,
        "baseline": exp.baseline,
        "question": exp.question,
        "predictions": exp.predictions,
        "budget": budget.record(exp.budget, cells),
        "cells": [{**cell_meta(c), "spec_path": _results.repo_relative(c.spec_path, root)} for c in cells],
    }
    if isinstance(exp.tuning, (tuning.Plan, borrow.Borrowed)):  # chosen here, or by Sweep.tuned_by
        meta["tuning"] = exp.tuning.record
    if gate is not None:  # the check that let the cells start (_run); its outcome, for the md
        meta["pilot_gate"] = gate
    if exp.studies:  # the study plug-ins its report loads (polgrad/results/studies.py)
        meta["studies"] = list(exp.studies)
    if _results.module_names(exp.imports):  # each row records their digests (user_modules)
        meta["imports"] = _results.module_names(exp.imports)
    _results.atomic_write_text(paths.meta_path(exp.name, results_dir), json.dumps(meta, indent=2) + "\n")
    return meta
