"""The driver's record of a cell's starts on a Ray cluster (polgrad/sweep/ray_cells.py): one `Attempt`
per start (its rank tasks, their nodes and outcomes, judged once a rank failed), a line per attempt in
the run folder's ray_attempts.jsonl (`attempt_line`), which of Ray's errors are a lost node rather than
the cell's own failure (`node_lost`: the cell is started again), which nodes Ray reports dead
(`dead_nodes`) and the key that keeps this driver's copies apart on a node (`driver_key`).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from polgrad.sweep.grid import Cell
from polgrad.sweep.launch import _now
from polgrad.sweep.ray_sync import ATTEMPTS


def attempt_line(run_dir: Path, entry: dict[str, Any]) -> None:
    with open(run_dir / ATTEMPTS, "a") as fh:
        fh.write(json.dumps(entry) + "\n")


LOST = (
    "NodeDiedError",
    "WorkerCrashedError",
    "LocalRayletDiedError",
    "ObjectLostError",  # and its OwnerDiedError, ObjectReconstructionFailedError...
    "ObjectFetchTimedOutError",
)


def node_lost(error: BaseException) -> bool:
    """True for Ray's errors of a lost node or worker process (the cell is started again elsewhere);
    False for the task's own exception and Ray's other errors (out of memory, a runtime environment
    that failed to set up...), which are the cell's outcome."""
    import ray.exceptions as rex

    lost = tuple(getattr(rex, name) for name in LOST if hasattr(rex, name))
    return isinstance(error, lost)


def driver_key(results_root: Path) -> str:
    """A folder name that keeps this driver's cells apart on a node from another sweep's of the same
    experiment (another results folder, another machine, another user)."""
    import hashlib

    text = f"{socket.gethostname()}:{results_root.resolve()}"
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


class Attempt:
    """One start of a cell: its rank tasks (one unless it spans nodes), their nodes and outcomes."""

    def __init__(self, cell: Cell, number: int, world: int, pg: Any = None):
        self.cell, self.number, self.world, self.pg = cell, number, world, pg
        self.nodes: list[str | None] = [None] * world
        self.hosts: list[str | None] = [None] * world
        self.outcomes: dict[int, dict[str, Any]] = {}
        self.lost: BaseException | None = None
        self.deadline: float | None = None  # set when a rank failed: judge the attempt then
        self.started = _now()

    def judge(self, dead: list[str], now: float) -> bool:
        """After a rank failed (`deadline` set): True when the attempt is over. A node of the attempt
        that Ray reports dead makes it a lost node (the failed rank's error was its consequence); past
        the deadline with every node alive it is the cell's failure."""
        if dead:
            self.lost = RuntimeError(f"node {dead[0]} died (Ray reports it dead)")
            return True
        return self.deadline is not None and now > self.deadline

    def outcome(self) -> dict[str, Any]:
        """Rank 0's outcome when every rank ended well; else the first failed rank's error (a rank
        cancelled because another failed counts as not ended)."""
        first = self.outcomes.get(0)
        if self.world == 1:
            return first
        failed = [(r, o) for r, o in sorted(self.outcomes.items()) if o["status"] == "failed"]
        missing = [r for r in range(self.world) if r not in self.outcomes]
        if not failed and not missing:
            return first
        rank, o = failed[0] if failed else (missing[0], None)
        error = o["error"] if o else "did not end"
        base = first or o or {"summary": None}
        out = {**base, "cell_id": self.cell.id, "status": "failed", "error": f"rank {rank}: {error}"}
        return {**out, "world_size": self.world}


def dead_nodes(nodes: list[str | None]) -> list[str]:
    import ray

    alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
    return [n for n in nodes if n is not None and n not in alive]
