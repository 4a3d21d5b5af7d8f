"""Carry an unfinished campaign from one machine to the next through git.

A sweep resumes from its run folders (results/<name>/runs/, git-ignored), and a machine here may not
outlive its session. `pack` writes results/in_progress/<name>.tar.xz from the experiment's folder in
the clone that runs it: experiment.json, the CSVs and the run folders of the cells that finished (the
sweep's own test; a failed cell runs again on a resume anyway), without their checkpoints and weights
(checkpoints/, final/, model/), which neither the resume nor the report reads; an unfinished cell is
left out and trains again from its start. `unpack` puts them back under a clone's results/, where the
same sweep command then resumes. Nothing here is a result: the committed results are what the
finished sweep writes, from the commit its cells ran at.

    .venv/bin/python results/in_progress/carry.py pack   CLONE NAME   # -> results/in_progress/NAME.tar.xz
    .venv/bin/python results/in_progress/carry.py unpack CLONE NAME   # -> CLONE/results/NAME/
"""

from __future__ import annotations

import os
import sys
import tarfile
from pathlib import Path

from polgrad.sweep.launch import is_finished as _finished  # the sweep's own test: what it will skip

HERE = Path(__file__).resolve().parent
SKIP_DIRS = {"checkpoints", "final", "model"}
SKIP_FILES = {".lock", ".sweep.lock", "trainer.pid"}


def _cells(exp: Path) -> list[Path]:
    """The finished run folders under results/<name>/[<stage>/]runs/, decided once per folder before
    any of its files is listed (a cell that finishes while packing is left out whole)."""
    return [run for runs in sorted(exp.rglob("runs")) if runs.is_dir() for run in sorted(runs.iterdir())
            if run.is_dir() and _finished(run)]  # fmt: skip


def _files(exp: Path):
    cells = _cells(exp)
    for path in sorted(exp.rglob("*")):
        rel = path.relative_to(exp)
        if not path.is_file() or path.name in SKIP_FILES or path.name.endswith(".lock"):
            continue
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        if "runs" in rel.parts:  # results/<name>/[<stage>/]runs/<cell>/...
            i = rel.parts.index("runs")
            if len(rel.parts) <= i + 2 or exp.joinpath(*rel.parts[: i + 2]) not in cells:
                continue
        yield path


def _packed_cells(tarball: Path) -> set[str]:
    if not tarball.exists():
        return set()
    with tarfile.open(tarball) as tar:
        return {str(Path(n).parent) for n in tar.getnames() if n.endswith("/summary.json")}


def pack(clone: Path, name: str) -> None:
    exp = clone / "results" / name
    if not exp.is_dir():
        sys.exit(f"error: {exp} does not exist: give the clone that runs the sweep and the experiment's name")
    if clone == HERE.parent.parent:
        sys.exit(
            f"error: {clone} is this script's own clone: the tarball written into it would mark every cell "
            "started later as run from a dirty tree; run this script from another clone (e.g. main)"
        )
    out = HERE / f"{name}.tar.xz"
    files = list(_files(exp))
    new = {str(Path(name) / f.parent.relative_to(exp)) for f in files if f.name == "summary.json"}
    lost = _packed_cells(out) - new
    if lost:
        sys.exit(
            f"error: {out} holds {len(lost)} finished cells that {exp} lacks (e.g. {sorted(lost)[0]}): "
            f"unpack it into {clone} first; nothing written"
        )
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz") as tar:
        for f in files:
            tar.add(f, arcname=str(Path(name) / f.relative_to(exp)), recursive=False)
    os.replace(tmp, out)
    print(f"{out}: {len(new)} finished cells, {len(files)} files, {out.stat().st_size / 2**20:.1f} MiB")


def unpack(clone: Path, name: str) -> None:
    src = HERE / f"{name}.tar.xz"
    target = clone / "results" / name
    if target.exists() and any(target.iterdir()):
        sys.exit(f"error: {target} is not empty: unpack into a fresh clone (nothing written)")
    with tarfile.open(src) as tar:
        tar.extractall(clone / "results", filter="data")
    print(f"{src} -> {target}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        sys.exit(__doc__)
    {"pack": pack, "unpack": unpack}[sys.argv[1]](Path(sys.argv[2]).resolve(), sys.argv[3])
