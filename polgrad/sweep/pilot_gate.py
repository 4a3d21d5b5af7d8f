"""Sweep.pilot_gate and Sweep.pilot: the sweep refuses an experiment's evaluation cells until a
committed pilot CSV shows what the gin declares it must (the conditions: polgrad/results/gate.py).

    Sweep.pilot = 'results/pilots/reasoning_gym_pilot/reasoning_gym_pilot.csv'  # the default
    Sweep.pilot_gate = [('len_incorrect_change', {'spec': 'grpo'}, '>=', 3, 'se')]

Read and checked with the experiment file (a one-line error naming the file, the line and the valid
choices); evaluated when the evaluation cells are about to start, and before a tuning stage too
(whose cells are the experiment's own choice of values, not its evaluation, so not gated themselves,
but of no use if the gate fails; polgrad/sweep/cli.py): the pilot CSV must exist, be tracked
by git and unchanged from HEAD (a pilot that is not committed can be rerun until it passes), and
pass every condition, else one line says which condition failed and why. The dry run
prints the gate's state without refusing. A sweep with no cell left to run checks nothing; the record
of the check that let its first evaluation cells start is kept in experiment.json (a resumed sweep
checks again, and keeps it), and the md states it.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.checks import is_real
from polgrad.errors import ConfigError, PolgradError
from polgrad.results import gate as _gate
from polgrad.results.migrate import flat_path
from polgrad.results.paths import csv_path
from polgrad.results.provenance import _git
from polgrad.results.store import read_rows


@dataclasses.dataclass(frozen=True)
class Gate:
    pilot: Path  # the pilot's CSV, resolved
    conditions: list[dict[str, Any]]


def read(file: str, pilot: Any, conditions: Any, name: str, read_config, where) -> Gate | None:
    """The gate of an experiment file (None when it declares none). `read_config(value, where)` reads a
    configuration dict as Sweep.baseline does (its columns and values checked against the grid)."""
    if conditions is None or conditions == []:
        if pilot is not None:
            raise ConfigError(f"{file}: {where('pilot')}: a pilot without Sweep.pilot_gate gates nothing")
        return None
    here = where("pilot_gate")
    form = f"(metric, {{column: value}}, {' | '.join(map(repr, _gate.OPS))}, threshold, 'se' | 'abs')"
    if not isinstance(conditions, (list, tuple)):
        raise ConfigError(f"{file}: {here}: must be a list of {form}")
    out = []
    valid_metrics = (*_results.OUTCOME_METRICS, _gate.CHANGE)
    for i, item in enumerate(conditions):
        at = f"{here}[{i}]"
        if not (isinstance(item, (list, tuple)) and len(item) == 5):
            raise ConfigError(f"{file}: {at}: must be {form}")
        metric, config, op, threshold, unit = item
        if metric not in valid_metrics:
            raise ConfigError(f"{file}: {at}: unknown metric {metric!r}; valid: {', '.join(valid_metrics)}")
        if op not in _gate.OPS or unit not in _gate.UNITS:
            raise ConfigError(
                f"{file}: {at}: the comparison is one of {', '.join(_gate.OPS)} and the unit one of "
                f"{', '.join(_gate.UNITS)}, got {op!r} and {unit!r}"
            )
        if (
            not is_real(threshold)
            or not math.isfinite(threshold)
            or (unit == "se" and threshold < 0)
            or (op == "|>=|" and not threshold > 0)  # |m| >= k <= 0 would always pass
        ):
            raise ConfigError(
                f"{file}: {at}: the threshold must be a number (>= 0 in 'se', > 0 with '|>=|'), "
                f"got {threshold!r}"
            )
        cfg = read_config(config, at)
        out.append({"metric": metric, "config": cfg, "op": op, "threshold": float(threshold), "unit": unit})
    if not isinstance(pilot, (str, type(None))):
        raise ConfigError(f"{file}: {where('pilot')}: must be the path of the pilot's CSV, got {pilot!r}")
    root = _results.repo_root(Path(file).resolve().parent) or Path.cwd()
    path = Path(pilot) if pilot is not None else csv_path(f"{name}_pilot", Path("results") / "pilots")
    return Gate(path if path.is_absolute() else root / path, out)


def _committed(path: Path) -> str:
    """The short sha of the last commit of `path`, or a PolgradError saying why it is not committed."""
    root = _results.repo_root(path.parent)
    if root is None:
        raise PolgradError(f"{path} is not in a git checkout: a pilot gate reads a committed pilot CSV")
    rel = path.resolve().relative_to(root).as_posix()
    tracked = _git(["ls-files", "--error-unmatch", rel], root)
    changed = _git(["diff", "--quiet", "HEAD", "--", rel], root)
    if tracked is None or tracked.returncode != 0:
        raise PolgradError(f"{rel} is not committed: commit the pilot's CSV (and its md) first")
    if changed is None or changed.returncode != 0:
        raise PolgradError(f"{rel} differs from HEAD: commit the pilot's CSV as it is, or restore it")
    # the last commit that changed its content (a move, e.g. into one folder per experiment, is not one)
    log = _git(["log", "-1", "--format=%h", "--follow", "--diff-filter=AM", "--", rel], root)
    return log.stdout.decode().strip() if log is not None else ""


def state(exp) -> tuple[dict[str, Any] | None, str]:
    """(experiment.json's record of the gate, '' when it passes, else the one-line reason it does not)."""
    g: Gate | None = exp.pilot_gate
    if g is None:
        return None, ""
    where = f"{exp.file}: Sweep.pilot_gate"
    flat = flat_path(g.pilot)  # results/pilots/X_pilot.csv before one folder per experiment
    if not g.pilot.is_file() and flat is not None and flat.is_file():
        return None, (
            f"{where}: the pilot {g.pilot} is at {flat}, the layout before one folder per experiment: "
            f"move it with `python -m polgrad.results.migrate --results {flat.parent}` (it only moves files)"
        )
    if not g.pilot.is_file():
        return None, (
            f"{where}: the pilot {g.pilot} does not exist: run the pilot (its own seeds, "
            f">= {_gate.MIN_SEEDS}) and commit its CSV before the evaluation cells"
        )
    try:
        commit = _committed(g.pilot)
    except PolgradError as e:
        return None, f"{where}: {e}"
    outcomes = _gate.evaluate(read_rows(g.pilot), g.conditions, exp.seeds)
    record = _gate.record(
        _results.repo_relative(g.pilot, _results.repo_root(g.pilot.parent)), commit, outcomes
    )
    failed = [o for o in outcomes if not o.passed]
    if failed:
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        return record, f"{where}: the pilot {record['pilot']} at {commit}: {failed[0].text()}{more}"
    return record, ""


def check(exp) -> dict[str, Any] | None:
    """The gate's record when it passes (None without a gate); a one-line PolgradError when it does not."""
    record, why = state(exp)
    if why:
        raise PolgradError(why + "; the evaluation cells did not start")
    return record
