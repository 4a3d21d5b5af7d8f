"""The dry run's check of every cell: exactly what the trainer does, before anything trains.

One public entry, `validate(exp, cells, train_module)`, which returns the cells with what each
built cell does not read (`Cell.not_read`, polgrad/sweep/reads.py) and refuses a grid axis that a
cell does not read when varying it gives otherwise identical cells (`reads.check_axes`). For each
cell it clears gin, parses the cell's files and bindings with `polgrad.config.parse_config` (the
parser `python -m polgrad.train` uses) and, when the cell runs polgrad's own trainer, builds the run with
`polgrad.config.build()`: the same `Algorithm` and `TrainConfig` checks the trainer makes at
its start (plus gin's own finalize check, which catches a %gin.REQUIRED nobody overrode even in
a part the run would not call), and `polgrad.config.check_world_size` at the cell's number of
ranks (`Sweep.processes_per_cell`, or one per GPU). The first problem is raised as one ConfigError
line naming the experiment file, the binding (or the cell) and the trainer's own message.

A stand-in train module (`--train-module`, used by the sweep's tests) gets the parse only: its
configurables are its own business.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Sequence

import gin

from polgrad import config
from polgrad.errors import ConfigError, PolgradError
from polgrad.sweep import budget
from polgrad.sweep.axes import _fail
from polgrad.sweep.experiment import DEFAULT_TRAIN_MODULE, TRAIN_MODULE_ENV, Experiment
from polgrad.sweep.grid import Cell, with_budget
from polgrad.sweep.reads import bound_keys, check_axes, reads_of
from polgrad.sweep.recorded import check_predictions, recorded

__all__ = ["validate"]


def import_train_module(train_module: str) -> None:
    """Import the trainer module so that every configurable a cell binds is registered."""
    try:
        importlib.import_module(train_module)
    except Exception as e:
        raise PolgradError(
            f"cannot import the trainer module '{train_module}' ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); set {TRAIN_MODULE_ENV} or install polgrad"
        ) from None


def _labels(exp: Experiment) -> dict[str, str]:
    """Where each binding text a cell gets comes from in the experiment file."""
    labels = {stmt: f"'{stmt}'" for stmt in exp.imports}
    labels.update({b.text: f"line {b.line}: binding '{b.text}'" for b in exp.fixed})
    return labels


def ranks_per_cell(exp: Experiment) -> tuple[int, str]:
    """The data-parallel ranks of each cell and the Sweep parameter that sets them."""
    if exp.num_gpus > 1:
        return int(exp.num_gpus), f"Sweep.num_gpus = {exp.num_gpus:g}"
    return exp.processes_per_cell, f"Sweep.processes_per_cell = {exp.processes_per_cell}"


def validate(
    exp: Experiment, cells: Sequence[Cell], train_module: str, ask: Sequence[str] = ()
) -> list[Cell]:
    """Parse (and, for polgrad's trainer, build) every cell; one ConfigError line on the first problem.

    Returns the cells, each with the bindings its built cell does not read (`Cell.not_read`), the keys
    in `ask` included (the tuning stage asks which of its bindings each configuration reads)."""
    import_train_module(train_module)
    build = train_module == DEFAULT_TRAIN_MODULE
    labels = _labels(exp)
    ranks, ranks_label = ranks_per_cell(exp)
    out = list(cells)
    built: dict[str, budget.Facts] = {}  # what Sweep.budget needs of each built cell
    records: dict[str, tuple[str, ...]] = {}  # the outcome metrics each built cell records
    try:
        for i, cell in enumerate(cells):
            where = f"cell {cell.id} ({cell.spec}; {cell.describe()})"
            grid = {f"{k} = {v}" for k, v in cell.swept}
            gin.clear_config()
            try:
                # The trainer's parse, one binding at a time so that the message names the culprit.
                # polgrad.train parses its default base config first (the launch passes no --base)
                base = config.DEFAULT_BASE if build else None
                config.parse_config(list(cell.config_files), [], base=base)
                for text in cell.bindings:
                    try:
                        config.parse_config([], [text], base=None)
                    except PolgradError as e:
                        label = labels.get(text) or (
                            f"Sweep.grid binding '{text}'" if text in grid else f"Sweep.seed_binding '{text}'"
                        )
                        msg = str(e).removeprefix(f"--bind {text!r}: ")
                        raise _fail(exp.file, label, msg) from None
                try:  # gin's own end-of-parse checks (e.g. a %gin.REQUIRED nobody overrode)
                    gin.finalize()
                except (ValueError, RuntimeError) as e:
                    raise ConfigError(" ".join(str(e).split())) from None
                if build:
                    cfg, algo, _ = config.build()
                    try:
                        config.check_world_size(cfg, ranks)
                    except ConfigError as e:
                        raise ConfigError(f"at {ranks_label}: {e}") from None
                    reads = reads_of(cfg, algo)
                    keys = dict.fromkeys([*bound_keys(), *(k for k, _ in cell.swept), *ask])
                    not_read = ((k, reads.why_unread(k)) for k in keys)
                    out[i] = dataclasses.replace(cell, not_read=tuple((k, w) for k, w in not_read if w))
                    built[cell.id] = budget.facts(cfg, algo)
                    records[cell.id] = recorded(cfg, algo)
            except PolgradError as e:
                if str(e).startswith(f"{exp.file}: "):
                    raise
                raise _fail(exp.file, where, str(e)) from None
    finally:
        gin.clear_config()
    check_axes(exp.file, out, {c.id: dict(c.not_read) for c in out})
    check_predictions(exp, out, records)  # a prediction on a metric its runs do not record
    # Sweep.budget: each cell's prompts per step and stop, or one line for a grid it cannot equalise.
    planned = budget.plan(exp.file, exp.budget, out, built, ranks)
    return [with_budget(exp, c, planned[c.id]) if c.id in planned else c for c in out]
