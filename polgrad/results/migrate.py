"""`python -m polgrad.results.migrate [--results DIR]`: move a results folder written before one folder
per experiment into today's layout (polgrad/results/paths.py).

Before, an experiment X kept its CSV, md and figures beside its folder (results/X.csv, X.md, X.png,
X_curves.png, a study's X_gao.md ...) and its tuning stage was an experiment beside it (results/X_tuning/
and results/X_tuning.csv ...). Now everything of X is in results/X/, its tuning stage in
results/X/X_tuning/. A sweep or a report that finds the old layout refuses in one line naming this
command, so a sweep resumes where it stopped instead of training its cells again.

An experiment is a folder with the sweep's experiment.json; a file beside it belongs to the experiment
with the longest name it starts with (results/kl_ablation_replication.csv is kl_ablation_replication's,
not kl_ablation's). It only moves (os.replace, within one file system), never overwrites: a file already
at its new place is one line and nothing moves. Prints one line per move.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from polgrad.errors import DataError
from polgrad.results.paths import META, TUNING


def _experiments(root: Path) -> list[str]:
    return sorted(d.name for d in root.iterdir() if d.is_dir() and (d / META).is_file())


def _tuning_of(root: Path, name: str) -> str | None:
    """X when results/<name>/ is the old layout's tuning stage of X (<name> = X_tuning, its
    experiment.json's question 'Tuning stage of X: ...'), whether or not X's own folder exists yet (a
    sweep stopped during its tuning stage has none)."""
    if not name.endswith(TUNING):
        return None
    parent = name.removesuffix(TUNING)
    try:
        question = str(json.loads((root / name / META).read_text()).get("question", ""))
    except (OSError, ValueError, AttributeError):
        return None
    return (
        parent
        if question.startswith(f"Tuning stage of {parent}:") or (root / parent / META).is_file()
        else None
    )


def _owner(stem: str, names: list[str]) -> str | None:
    """The experiment a file stem belongs to: the longest name it is or starts with (then '_')."""
    found = [n for n in names if stem == n or stem.startswith(f"{n}_")]
    return max(found, key=len) if found else None


def old_layout(experiment: str, results_dir: str | os.PathLike) -> list[Path]:
    """The files and folders of `experiment` (and its tuning stage) in the old layout under
    `results_dir`: [] when there are none."""
    root = Path(results_dir)
    if not root.is_dir():
        return []
    names = _experiments(root)
    mine = (experiment, f"{experiment}{TUNING}")
    found = [
        p
        for p in sorted(root.iterdir())
        if p.is_file() and p.suffix in (".csv", ".md", ".png") and _owner(p.stem, names) in mine
    ]
    if f"{experiment}{TUNING}" in names and _tuning_of(root, f"{experiment}{TUNING}") == experiment:
        found.append(root / f"{experiment}{TUNING}")
    return found


def flat_path(path: Path) -> Path | None:
    """Where the old layout kept a file that today sits in its experiment's folder
    (results/X/X.md -> results/X.md), or None for a file that is not directly in such a folder."""
    return path.parent.parent / path.name if path.parent.name == path.stem else None


def refuse_old_layout(experiment: str, results_dir: str | os.PathLike) -> None:
    """One line (a DataError) when `experiment`'s results under `results_dir` are in the old layout:
    a sweep would train its cells again beside them, a report would not find them."""
    old = old_layout(experiment, results_dir)
    if old:
        more = f" and {len(old) - 1} more" if len(old) > 1 else ""
        raise DataError(
            f"{old[0]}{more}: {experiment}'s results are in the layout before one folder per experiment; "
            f"move them into {Path(results_dir) / experiment}/ with `python -m polgrad.results.migrate "
            f"--results {results_dir}` (it only moves files), then run this again"
        )


def plan(results_dir: str | os.PathLike) -> list[tuple[Path, Path]]:
    """(from, to) of every move, in order: each file into its experiment's folder, then each tuning
    stage's folder (with its files, moved in the first step) into its experiment's."""
    root = Path(results_dir)
    if not root.is_dir():
        raise DataError(f"--results {root}: no such folder")
    names = _experiments(root)
    moves = []
    for p in sorted(root.iterdir()):
        owner = _owner(p.stem, names) if p.is_file() and p.suffix in (".csv", ".md", ".png") else None
        if owner is not None:
            moves.append((p, root / owner / p.name))
    for name in names:
        parent = _tuning_of(root, name)
        if parent is not None:
            moves.append((root / name, root / parent / name))
    return moves


def migrate(results_dir: str | os.PathLike) -> list[tuple[Path, Path]]:
    """Do `plan`'s moves (refused whole, nothing moved, when any target exists); return them."""
    moves = plan(results_dir)
    targets = [to for _, to in moves]
    taken = [to for to in targets if to.exists()]
    if taken:
        raise DataError(
            f"{taken[0]} already exists: both layouts hold it; keep one (compare them) and run this again "
            f"({len(taken)} such, nothing moved)"
        )
    for src, dst in moves:
        dst.parent.mkdir(exist_ok=True)  # a tuning stage's experiment may have no folder yet
        os.replace(src, dst)
    return moves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m polgrad.results.migrate",
        description="Move a results folder of the old flat layout into one folder per experiment.",
    )
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    args = ap.parse_args(argv)
    try:
        moves = migrate(args.results)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for src, dst in moves:
        print(f"moved {src} -> {dst}")
    print(f"{len(moves)} moved" if moves else f"{args.results}: nothing in the old layout")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
