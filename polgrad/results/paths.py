"""Where an experiment's files live: one folder per experiment.

    results/<name>/
        <name>.csv            one row per cell (the sweep's record; committed)
        <name>.md             the report (committed)
        <name>.png            its forest plot, <name>_curves.png its learning curves (committed)
        experiment.json       the sweep's design: cells, question, predictions (committed)
        figures.json          the figures' drawn series (committed)
        runs/<cell>/          one run folder per cell (ignored by git)
        <name>_tuning/        the tuning stage, an experiment of its own laid out the same way
        <name>_<study>...     a study's own files (studies/: e.g. overoptimization_gao.md)

Every path the sweep, the report and the studies read or write comes from here, so the layout is stated
once. The file names keep the experiment's name, so a file attached to a message or copied elsewhere
still says which experiment it belongs to.
"""

from __future__ import annotations

import os
from pathlib import Path

META = "experiment.json"
TUNING = "_tuning"  # X_tuning: the tuning stage of experiment X, in its folder results/X/X_tuning/
RUNS = "runs"


def folder(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    """results_dir/<experiment>/: everything a sweep of `experiment` writes."""
    return Path(results_dir) / experiment


def output(experiment: str, results_dir: str | os.PathLike, suffix: str) -> Path:
    """results_dir/<experiment>/<experiment><suffix> (suffix: '.csv', '.md', '.png', '_gao.md', ...)."""
    return folder(experiment, results_dir) / f"{experiment}{suffix}"


def csv_path(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    return output(experiment, results_dir, ".csv")


def md_path(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    return output(experiment, results_dir, ".md")


def png_path(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    return output(experiment, results_dir, ".png")


def meta_path(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    """The sweep's experiment.json."""
    return folder(experiment, results_dir) / META


def runs_dir(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    """The folder of the cells' run folders (git-ignored)."""
    return folder(experiment, results_dir) / RUNS


def stage_results(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    """The results folder of `experiment`'s tuning stage (<experiment>_tuning): `experiment`'s own
    folder, so the stage's folder sits inside it."""
    return folder(experiment, results_dir)


def experiments(results_dir: str | os.PathLike = "results") -> list[str]:
    """The experiments with a CSV directly under `results_dir` (their tuning stages, inside them, not
    listed), sorted."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and (d / f"{d.name}.csv").is_file())
