"""The sweep's progress: the bar over its cells, and what it reads of a running cell's folder (its
last logged step, its planned train.steps, the progress of the warm start its trainer trains first)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from polgrad.run_folder import RunFolder
from polgrad.sweep.grid import Cell


def _tail(path: Path, size: int = 4096) -> str:
    """The last `size` bytes of a file as text ('' when it cannot be read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read().decode(errors="replace")
    except OSError:
        return ""


def warm_start_progress(run_dir: Path) -> str | None:
    """'warm start 150/1000' while the cell's trainer trains its SFT warm start (the lines it prints
    to stdout.log every 50 steps), else None (no warm start to train, or it is done)."""
    for line in reversed(_tail(Path(run_dir) / "stdout.log").splitlines()):
        if line.startswith("warm start: done"):
            return None
        if line.startswith("warm start: step "):
            return "warm start " + line.removeprefix("warm start: step ").split(",")[0]
        if line.startswith("warm start: SFT of "):
            return "warm start 0/" + line.split("up to ")[-1].split()[0] if "up to " in line else "warm start"
    return None


def planned_steps(run_dir: Path) -> int | None:
    """The run's train.steps, from the config.gin its trainer writes first (None before that)."""
    for line in _tail(RunFolder(run_dir).config, 1 << 16).splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "train.steps":
            try:
                return int(value.strip())
            except ValueError:
                return None
    return None


def last_step(run_dir: Path) -> int | None:
    """The step of the last complete line of metrics.jsonl (reads only the file's tail)."""
    for line in reversed(_tail(RunFolder(run_dir).metrics).splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


class Progress:
    """tqdm bar over cells: done / running / failed, and the newest running cell's step (or its warm
    start's, while it trains one). A running cell counts as the fraction of its train.steps it has
    logged, so the bar and its ETA move with steps, not only when a cell ends.

    Workers only mark cells running or stopped; the main thread draws, at most every 0.5 s on a
    terminal and every 30 s into a log file (one `ok`/`FAILED` line per cell goes there anyway).
    """

    def __init__(self, total: int, done: int, name: str):
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.interval = 0.5 if tty else 30.0
        self.bar = tqdm(
            total=total,
            initial=done,
            desc=name,
            unit="cell",
            dynamic_ncols=True,
            mininterval=self.interval,
            file=sys.stderr,
            # a running cell's share makes n fractional: one decimal (tqdm would print 2.9899999999999998)
            bar_format="{l_bar}{bar}| {n:.1f}/{total} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
        )
        self.ok, self.failed = done, 0
        self.running: dict[str, Path] = {}
        self.shown: dict[str, float] = {}  # the fraction of each running cell already on the bar
        self.lock = threading.Lock()
        self.last_draw = 0.0

    def start(self, cell: Cell, run_dir: Path) -> None:
        with self.lock:
            self.running[cell.id] = run_dir

    def stop(self, cell: Cell) -> None:
        with self.lock:
            self.running.pop(cell.id, None)

    def finish(self, cell: Cell, outcome: dict[str, Any]) -> None:
        self.stop(cell)
        if outcome["status"] == "ok":
            self.ok += 1
            self.bar.write(f"ok      {cell.id}", file=sys.stderr)
        elif outcome["status"] == "unstable":  # finished, but listed apart and not ranked
            self.ok += 1
            self.bar.write(f"UNSTABLE {cell.id}: {outcome['error']}", file=sys.stderr)
        else:
            self.failed += 1
            self.bar.write(f"FAILED  {cell.id}: {outcome['error']}", file=sys.stderr)
        with self.lock:
            shown = self.shown.pop(cell.id, 0.0)
        self.bar.update(1 - shown)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_draw < self.interval:
            return
        self.last_draw = now
        with self.lock:
            running = list(self.running.items())
        text = f"ok {self.ok} · failed {self.failed} · running {len(running)}"
        for cid, run_dir in running:  # each running cell's share of the bar: its steps so far
            step, steps = last_step(run_dir), planned_steps(run_dir)
            fraction = min(step / steps, 0.99) if step is not None and steps else 0.0
            with self.lock:
                grow = fraction - self.shown.get(cid, 0.0) if cid in self.running else 0.0
                if grow > 0:
                    self.shown[cid] = fraction
            if grow > 0:
                self.bar.update(grow)
        if running:
            cid, run_dir = running[-1]
            step = last_step(run_dir)
            now = f"step {step}" if step is not None else warm_start_progress(run_dir) or "step -"
            text += f" · {cid} {now}"
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
