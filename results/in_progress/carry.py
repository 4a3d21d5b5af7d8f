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

import sys
import tarfile
from pathlib import Path

from polgrad.sweep.launch import is_finished as _finished  # the sweep's own test: what it will skip

HERE = Path(__file__).resolve().parent
SKIP_DIRS = {"checkpoints", "final", "model"}
SKIP_FILES = {".lock", ".sweep.lock", "trainer.pid"}


def _files(exp: Path):
    for path in sorted(exp.rglob("*")):
        rel = path.relative_to(exp)
        if not path.is_file() or path.name in SKIP_FILES or path.name.endswith(".lock"):
            continue
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        if "runs" in rel.parts:  # results/<name>/[<stage>/]runs/<cell>/...
            i = rel.parts.index("runs")
            if len(rel.parts) <= i + 2 or not _finished(exp.joinpath(*rel.parts[: i + 2])):
                continue
        yield path


def pack(clone: Path, name: str) -> None:
    exp = clone / "results" / name
    if not exp.is_dir():
        sys.exit(f"error: {exp} does not exist: give the clone that runs the sweep and the experiment's name")
    out = HERE / f"{name}.tar.xz"
    files = list(_files(exp))
    with tarfile.open(out, "w:xz") as tar:
        for f in files:
            tar.add(f, arcname=str(Path(name) / f.relative_to(exp)), recursive=False)
    cells = sum(1 for f in files if f.name == "summary.json")
    print(f"{out}: {cells} finished cells, {len(files)} files, {out.stat().st_size / 2**20:.1f} MiB")


def unpack(clone: Path, name: str) -> None:
    src = HERE / f"{name}.tar.xz"
    with tarfile.open(src) as tar:
        tar.extractall(clone / "results", filter="data")
    print(f"{src} -> {clone / 'results' / name}")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("pack", "unpack"):
        sys.exit(__doc__)
    {"pack": pack, "unpack": unpack}[sys.argv[1]](Path(sys.argv[2]).resolve(), sys.argv[3])
