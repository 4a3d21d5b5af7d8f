"""Before a sweep starts its cells: is there room on the disk for what they will write?

A cell's run folder holds its curves, evaluations and final weights, and its checkpoints (one every
train.checkpoint_every steps, all kept unless train.keep_checkpoints says how many): on the tiny
default model a 400-step cell that checkpoints every 50 steps writes ~0.25 GiB, nearly all of it
checkpoints. A disk that fills stops the cell writing at that moment (its one line names the file) and
every cell started after it, hours into a sweep. `check` says so before any cell starts: when the cells
to run would write more than the disk has free, estimated as the largest finished run folder of the
experiment times the cells to run. It refuses nothing (the estimate is rough: a grid's cells may train
for different lengths, and a cell writes its checkpoints over hours), and says nothing before a cell of
the experiment has finished (nothing to measure).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from pathlib import Path

GIB = 1024.0**3


def folder_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 where it is gone)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def free_bytes(path: Path) -> int | None:
    """Free bytes on the disk that holds `path` (its nearest existing parent), or None if unknown."""
    here = Path(path).resolve()
    while not here.exists() and here != here.parent:
        here = here.parent
    try:
        return shutil.disk_usage(here).free
    except OSError:
        return None


def check(
    name: str, results_dir: Path, finished: Iterable[Path], to_run: int, free: int | None = None
) -> str | None:
    """The line to print when `to_run` cells, each writing as much as the largest finished run folder
    in `finished`, need more than the disk of `results_dir` has free; None otherwise."""
    if to_run <= 0:
        return None
    per_cell = max((folder_bytes(d) for d in finished), default=0)
    if per_cell <= 0:
        return None
    free = free_bytes(results_dir) if free is None else free
    if free is None or per_cell * to_run <= free:
        return None
    return (
        f"warning: {name}: the {to_run} cells to run may write about {to_run} × {per_cell / GIB:.2f} GiB "
        f"(the largest finished run folder of this sweep), {per_cell * to_run / GIB:.1f} GiB, but the disk "
        f"of {results_dir} has {free / GIB:.1f} GiB free: a cell that finds the disk full fails there. "
        "Make room first: a finished cell's checkpoints (runs/<cell>/checkpoints) serve only to export or "
        "inspect its intermediate steps, and train.keep_checkpoints = 2 keeps only a run's two newest"
    )
