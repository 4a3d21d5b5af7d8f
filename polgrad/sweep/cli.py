"""The sweep's entry points: `main` (the command line), `prepare` (read, expand, validate) and `run`.

`run` takes the experiment folder's lock, writes experiment.json, skips finished cells, hands the
rest to the chosen executor (see `polgrad.sweep.executors.EXECUTORS`), records each cell's CSV row
(`folder.row`: the cell, its metrics, its status, where it ran, its Table-5 row) as it ends and writes the
report. Exit codes: 0 every cell finished (ok, or unstable: listed in the md, not ranked), 1 some
failed or a write failed (disk full, read-only folder: one line naming the file), 2 a bad experiment
file or restart id, 130 interrupted (running cells checkpoint their current step first).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.errors import PolgradError, WriteError, did_you_mean, is_write_failure, write_error
from polgrad.results import paths
from polgrad.results.migrate import refuse_old_layout
from polgrad.sweep import borrow, disk, folder, memory, pilot_gate, processes, tuning
from polgrad.sweep.executors import EXECUTORS, PREFLIGHT
from polgrad.sweep.experiment import DEFAULT_TRAIN_MODULE, TRAIN_MODULE_ENV, Experiment, load_experiment
from polgrad.sweep.grid import Cell, expand
from polgrad.sweep.launch import FINISHED, is_finished
from polgrad.sweep.progress import Progress
from polgrad.sweep.validation import validate


def _no_preflight(ray_address: str | None = None) -> None:
    pass


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(
    exp: Experiment,
    cells: Sequence[Cell],
    *,
    results_dir: str | os.PathLike = "results",
    parallel: int | None = None,
    executor: str = "local",
    train_module: str = DEFAULT_TRAIN_MODULE,
    ray_address: str | None = None,
    command: str = "",
    restart: Sequence[str] = (),
    restart_failed: bool = False,
) -> int:
    """Run the cells not yet finished, record each in the CSV, write the report; 0 iff no cell failed.

    `restart` (cell ids) and `restart_failed` (every cell the CSV records as failed) start cells over
    from scratch: their run folders are moved aside (`folder.restart`), their CSV rows replaced when they end.
    With a tuning stage (`exp.tuning`, a `tuning.Plan`) its experiment runs first, then the evaluation
    cells with the chosen values bound (`tuning.bind`); with `exp.tuned_by`, the values another
    experiment's tuning stage chose (`borrow.borrow`)."""
    if executor not in EXECUTORS:
        raise PolgradError(f"unknown executor '{executor}'; valid: {', '.join(EXECUTORS)}")
    folder.check_results_folder(results_dir)
    refuse_old_layout(exp.name, results_dir)  # else its cells would train again beside the old files
    folder.check_own_folder(exp, Path(results_dir))
    stage = exp.tuning if isinstance(exp.tuning, tuning.Plan) else None
    _check_cell_ids(exp, [*cells, *(stage.cells if stage else ())], restart)
    code = 0
    runs = paths.runs_dir(exp.name, results_dir)
    if stage and exp.pilot_gate is not None and any(not is_finished(runs / c.id) for c in cells):
        pilot_gate.check(exp)  # before the tuning stage too: its cells are of no use if the gate fails
    if stage:  # stage 1, a sweep of its own; its failed cells count as worst in the choice
        ids = {c.id for c in stage.cells}
        code = run(
            stage.experiment,
            stage.cells,
            results_dir=paths.stage_results(exp.name, results_dir),
            parallel=parallel,
            executor=executor,
            train_module=train_module,
            ray_address=ray_address,
            command=command,
            restart=[i for i in restart if i in ids],
            restart_failed=restart_failed,
        )
        if code == 130:
            return code
        restart = [i for i in restart if i not in ids]
        exp, cells = tuning.bind(exp, cells, Path(results_dir), restart)
        if restart or any(not is_finished(runs / c.id) for c in cells):
            tuning.check_edges(exp)  # an edge choice blocks the evaluation unless the gin says why
    elif exp.tuned_by is not None:  # another experiment's tuning stage chose: its record binds
        exp, cells = borrow.borrow(exp, cells, Path(results_dir), restart)
    exp_dir = paths.folder(exp.name, results_dir)
    exp_dir.mkdir(parents=True, exist_ok=True)
    with folder.sweep_lock(exp_dir):
        if restart or restart_failed:
            folder.restart(exp, cells, Path(results_dir), restart, restart_failed)
        done = _run(
            exp,
            cells,
            results_dir=Path(results_dir),
            parallel=parallel,
            executor=executor,
            train_module=train_module,
            ray_address=ray_address,
            command=command,
        )
    return max(code, done)


def _check_cell_ids(exp: Experiment, cells: Sequence[Cell], ids: Sequence[str]) -> None:
    valid = [c.id for c in cells]
    for cid in ids:
        if cid not in valid:
            listed = f"valid: {', '.join(valid)}" if len(valid) <= 12 else f"--dry-run lists its {len(valid)}"
            raise PolgradError(
                f"--restart: {exp.file} has no cell '{cid}'{did_you_mean(cid, valid)} ({listed})"
            )


def _run(exp, cells, *, results_dir, parallel, executor, train_module, ray_address, command) -> int:
    """Run the cells not finished yet, recording each in the CSV, then write the report; exit code."""
    processes.allow_trainers()
    runs = paths.runs_dir(exp.name, results_dir)
    # the evaluation cells start only on a committed pilot that passes (a sweep with none left to run
    # checks nothing); the record of the check that let the first of them start is kept
    gate = None
    if exp.pilot_gate is not None:
        gate = folder.previous_gate(paths.folder(exp.name, results_dir))
        if any(not is_finished(runs / c.id) for c in cells):
            checked = pilot_gate.check(exp)
            gate = gate or checked
    runs.mkdir(parents=True, exist_ok=True)
    order = [c.id for c in cells]
    meta = folder.write_experiment_json(exp, cells, results_dir, command, gate)
    csv_file = paths.csv_path(exp.name, results_dir)
    run_dirs = {c.id: runs / c.id for c in cells}

    def record(cell: Cell, outcome: dict[str, Any]) -> None:
        _results.upsert_row(
            csv_file, folder.row(exp, cell, run_dirs[cell.id], results_dir, outcome), order=order
        )

    # The CSV is checked against the run folders (the record) and rebuilt whole if they disagree: a
    # kill between summary.json and the CSV, a hand edit (polgrad/results/record.py). Finished cells
    # are skipped.
    rebuilt = _results.reconcile(
        exp.name, meta["cells"], results_dir, exp.primary_metric, exp.swept_columns, check_complete=False
    )
    if rebuilt:
        print(rebuilt, file=sys.stderr)
    done = {c.id for c in cells if is_finished(run_dirs[c.id])}
    todo = [cell for cell in cells if cell.id not in done]
    skipped = len(cells) - len(todo)
    if parallel and todo:  # no more at a time than there are cells to run, nor than fit in memory here
        parallel = min(parallel, len(todo))
        if executor == "local" and exp.num_gpus == 0:
            parallel, lowered = memory.fit(exp.name, parallel, run_dirs.values(), exp.processes_per_cell)
            if lowered:
                print(lowered, file=sys.stderr)
    # warns, refuses nothing
    short = disk.check(exp.name, Path(results_dir), [run_dirs[i] for i in done], len(todo))
    if short:
        print(short, file=sys.stderr)
    at_a_time = f", {parallel} at a time" if parallel and todo else ""
    print(
        f"{exp.name}: {len(cells)} cells, {skipped} already finished, {len(todo)} to run "
        f"({executor}{at_a_time}); results in {paths.folder(exp.name, results_dir)}/",
        file=sys.stderr,
    )
    progress = Progress(len(cells), skipped, exp.name)

    def run_cells() -> None:
        if todo:
            EXECUTORS[executor](
                exp,
                todo,
                run_dirs,
                record,
                progress,
                parallel=parallel,
                train_module=train_module,
                ray_address=ray_address,
            )

    if not _execute(exp, run_cells, progress):
        return 130
    try:
        md, png = _results.write_report(exp.name, results_dir)
    except WriteError as e:
        raise WriteError(
            f"{e}; every cell is recorded in {csv_file}: free space, then write the report with "
            f"python -m polgrad.results {exp.name} --results {results_dir}"
        ) from e
    return _final_lines(exp, cells, csv_file, run_dirs, md, png)


def _execute(exp, run_cells, progress) -> bool:
    """run_cells() under the sweep's SIGTERM handler; False when ^C / SIGTERM stopped it (the running
    cells checkpoint their step). Any other failure stops every trainer: no cell may run unrecorded."""
    old_term = (
        signal.signal(signal.SIGTERM, _interrupt)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        run_cells()
    except KeyboardInterrupt:
        progress.close()  # before the messages, so the bar does not overwrite them
        print(
            f"{exp.name}: stopping; running cells checkpoint their current step (on Ray: they stop, and "
            "keep the last checkpoint that reached this machine)",
            file=sys.stderr,
        )
        processes.stop_trainers()
        print(f"{exp.name}: interrupted; re-run the same command to resume", file=sys.stderr)
        return False
    except BaseException:  # e.g. the CSV could not be written: no cell may run on unrecorded
        processes.stop_trainers()
        raise
    finally:
        progress.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    return True


def _final_lines(exp, cells, csv_file, run_dirs, md, png) -> int:
    """The closing lines (ok / unstable / failed counts, each unstable and failed cell); exit code."""
    final = {r.get("cell_id"): r for r in _results.read_rows(csv_file)}
    failed = [c for c in cells if final.get(c.id, {}).get("status") not in FINISHED]
    unstable = [c for c in cells if final.get(c.id, {}).get("status") == "unstable"]
    n_ok = len(cells) - len(failed) - len(unstable)
    print(
        f"{exp.name}: {n_ok} ok, "
        + (f"{len(unstable)} unstable (listed, not ranked), " if unstable else "")
        + f"{len(failed)} failed of {len(cells)} cells; {csv_file}, {md}, {png}",
        file=sys.stderr,
    )
    for c in unstable:
        print(f"  unstable {c.id}: {final[c.id].get('error')}", file=sys.stderr)
    for c in failed:
        err = final.get(c.id, {}).get("error") or "not run"
        print(f"  failed {c.id}: {err}  (log: {run_dirs[c.id] / 'stdout.log'})", file=sys.stderr)
    return 1 if failed else 0


def prepare(path: str, train_module: str | None = None) -> tuple[Experiment, list[Cell]]:
    """Read, expand and validate an experiment file; raise one line on any problem."""
    exp = load_experiment(path)
    train_module = train_module or os.environ.get(TRAIN_MODULE_ENV) or DEFAULT_TRAIN_MODULE
    declared = tuning.declared(exp)
    cells = validate(exp, expand(exp), train_module, ask=declared.keys if declared else ())
    return tuning.plan(exp, declared, cells, train_module)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m polgrad.sweep",
        description="Run a grid of training runs "
        "declared in an experiment gin file (see the polgrad.sweep package docstring).",
    )
    ap.add_argument("experiment", help="experiment gin file, e.g. experiments/kl_ablation.gin")
    ap.add_argument("--dry-run", action="store_true", help="validate, print the cells, run nothing")
    ap.add_argument("--parallel", type=int, default=None, metavar="N", help="cells at a time (default 1)")
    ap.add_argument("--executor", choices=tuple(EXECUTORS), default="local")
    ap.add_argument("--ray-address", default=None, help="Ray cluster address (default: start a local Ray)")
    ap.add_argument("--results", default="results", metavar="DIR", help="results folder (default: results)")
    ap.add_argument(
        "--restart",
        nargs="+",
        default=[],
        metavar="CELL_ID",
        help="start these cells over from scratch (e.g. after 'no intact checkpoint'): their run folders "
        "move to runs/<cell>.old-<time>, nothing is deleted; a CSV row stays until the new run replaces it",
    )
    ap.add_argument(
        "--restart-failed",
        action="store_true",
        help="start every cell the CSV records as failed over, as --restart",
    )
    ap.add_argument("--train-module", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.parallel is not None and args.parallel < 1:
        ap.error("--parallel must be >= 1")
    train_module = args.train_module or os.environ.get(TRAIN_MODULE_ENV) or DEFAULT_TRAIN_MODULE
    try:
        PREFLIGHT.get(args.executor, _no_preflight)(args.ray_address)
        if not args.dry_run:
            folder.check_results_folder(args.results)
        exp, cells = prepare(args.experiment, train_module)
        if args.dry_run:
            if exp.tuned_by is not None:
                print(borrow.format_stages(exp, cells, args.results))
            else:
                print(tuning.format_stages(exp, cells))
            if exp.pilot_gate is not None:
                record, why = pilot_gate.state(exp)
                passed = "; ".join(c["metric"] for c in record["conditions"]) if record else ""
                print(
                    f"pilot gate: {why} (the sweep would refuse its evaluation cells)"
                    if why
                    else f"pilot gate: {record['pilot']} passes ({passed})"
                )
            return 0
        root = _results.repo_root(Path(args.experiment).resolve().parent)
        command = _results.portable_command(["python", "-m", "polgrad.sweep", *argv], root)
        return run(
            exp,
            cells,
            results_dir=args.results,
            parallel=args.parallel,
            executor=args.executor,
            train_module=train_module,
            ray_address=args.ray_address,
            command=command,
            restart=args.restart,
            restart_failed=args.restart_failed,
        )
    except WriteError as e:
        print(f"error: {_kept(e)}", file=sys.stderr)
        return 1
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. a read-only results folder: mkdir or the lock file
        if not is_write_failure(e):
            raise
        print(f"error: {_kept(write_error(e, None))}", file=sys.stderr)
        return 1


def _kept(e: WriteError) -> str:
    """A failed write of the sweep, with what to do and what is safe: the CSV is written atomically,
    and a re-run records the finished cells from their run folders."""
    if "python -m polgrad.results" in str(e):  # the report step says what to do itself
        return str(e)
    return (
        f"{e}; free space (or make the folder writable) and re-run the same command: finished cells are kept"
    )
