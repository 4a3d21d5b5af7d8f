"""Before cells run side by side on this machine: do that many of them fit in its memory?

N cells that together need more memory than the machine has do not fail with a message: the kernel's
out-of-memory killer SIGKILLs one of them (recorded as such, polgrad/sweep/launch.py), often after
minutes of training. `fit` compares N × a cell's peak with what the kernel says it can give
(/proc/meminfo's MemAvailable) and lowers N to what fits, never below 1, with one line saying so; it
refuses nothing (the estimate is rough, and one cell at a time is always tried).

A cell's peak is measured where the experiment has one: the largest `peak_mem_mb` (a rank's peak
RSS, polgrad/distributed.py) in the summary.json of its finished cells, times the cell's ranks. Before
any cell has finished it is `CELL_MB` per rank, a conservative figure for the tiny default model every
experiment of experiments/ trains: its cells' recorded peaks in results/*/*.csv are 0.69-1.15 GiB
(reasoning_gym's the largest). A cell of a larger model (`train.policy_path`) gets its own measure
from the first cells that finish (a re-run resumes with it).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from polgrad.run_folder import RunFolder

# MiB per rank before any cell of the experiment has finished: the largest recorded peak of the tiny
# default model, 1146 MiB, rounded up to 1.5 GiB for a margin.
CELL_MB = 1536.0


def available_mb(meminfo: str | Path = "/proc/meminfo") -> float | None:
    """MemAvailable in MiB (the kernel's estimate of what can be given without swapping), or None
    where it cannot be read (not Linux): then nothing is lowered."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def measured_mb(run_dirs: Iterable[Path]) -> float | None:
    """The largest peak_mem_mb the finished cells' summary.json recorded (one rank's), or None."""
    peaks = []
    for run_dir in run_dirs:
        try:
            summary = RunFolder(run_dir).read_summary()
            peaks.append(float(summary["peak_mem_mb"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max((p for p in peaks if p > 0), default=None)


def fit(
    name: str, parallel: int, run_dirs: Iterable[Path], ranks: int = 1, available: float | None = None
) -> tuple[int, str | None]:
    """(cells to run at a time, the line saying why it is fewer than `parallel`, or None)."""
    available = available_mb() if available is None else available
    if parallel <= 1 or available is None:
        return parallel, None
    measured = measured_mb(run_dirs)
    per_cell = (measured if measured is not None else CELL_MB) * max(1, ranks)
    fits = max(1, int(available // per_cell))
    if fits >= parallel:
        return parallel, None
    source = "the largest peak of its finished cells" if measured is not None else "the tiny default model's"
    return fits, (
        f"{name}: {parallel} cells at a time would need about {parallel} × {per_cell / 1024:.1f} GiB "
        f"({source}), but {available / 1024:.1f} GiB is available (MemAvailable): running {fits} at a time"
    )
