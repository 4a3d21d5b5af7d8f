"""Sweep cells on a Ray cluster whose nodes share no disk, surviving the loss of a node.

A cell runs as one Ray task (a streaming generator) on whichever node Ray picks. The task never
touches the driver's run folder: it trains into a folder of its own node (`node_dir()`: the
node's `$POLGRAD_NODE_DIR`, else `<tmp>/polgrad-ray/<node id>`) and every `SYNC_S` seconds yields
what changed there (files written, files deleted), which the driver writes into its run folder. So
the driver holds, while the cell runs, its metrics, log and checkpoints, and at the end the whole
folder; the task then deletes its node's copy.

A cell starts from the driver's copy of its folder (sent with the task through Ray's object store):
a cell whose node died is started again on a surviving node with the checkpoints that had reached
the driver, and resumes from the newest intact one (polgrad/checkpoints.py skips one caught half
copied). A lost node is an error of Ray's own (the task's worker or node died), not of the cell: the
cell is started again up to `NODE_LOSS_RETRIES` times, each attempt a line of the run folder's
`ray_attempts.jsonl` (node, start, end, how it ended); an error of the trainer is the cell's outcome,
as with the local executor, and is not retried.

Code and configuration files are not shipped: every node needs polgrad (and the experiment's files)
at the same paths, e.g. one image or one checkout per node (docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.errors import PolgradError
from polgrad.sweep.grid import Cell
from polgrad.sweep.launch import _failed, _now, run_cell
from polgrad.sweep.slots import GpuSlot

# How often a running cell sends what changed in its folder to the driver (seconds).
SYNC_S = 1.0
# How many times a cell whose node (or worker process) died is started again elsewhere.
NODE_LOSS_RETRIES = 3
# The driver's record of a cell's attempts (node, start, end, how each ended); the driver's own.
ATTEMPTS = "ray_attempts.jsonl"
# Never copied between nodes: the trainer's lock and pid are facts of one machine's processes.
NOT_SYNCED = frozenset({".lock", "trainer.pid", ATTEMPTS})


def node_dir() -> Path:
    """This node's folder for the run folders of the cells it runs: `$POLGRAD_NODE_DIR`, else
    `<tmp>/polgrad-ray/<Ray node id>` (a folder no other node writes, shared disk or not)."""
    env = os.environ.get("POLGRAD_NODE_DIR")
    if env:
        return Path(env)
    import ray

    return Path(tempfile.gettempdir()) / "polgrad-ray" / ray.get_runtime_context().get_node_id()[:16]


# --------------------------------------------------------------------------------------------
# A folder's files as {relative path: bytes}, and what changed since the last look
# --------------------------------------------------------------------------------------------


def _files(root: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if name not in NOT_SYNCED and not name.endswith(".tmp"):
                yield rel, path


def read_tree(root: Path) -> dict[str, bytes]:
    """Every file under `root` (but those never synced) as {relative path: bytes}; {} if no folder."""
    out = {}
    if root.is_dir():
        for rel, path in _files(root):
            try:
                out[rel] = path.read_bytes()
            except OSError:  # deleted meanwhile
                pass
    return out


class Mirror:
    """What changed under `root` since the previous `delta()`: (files written, with their bytes;
    files deleted). A file is sent again whenever its size or modification time changes, so a file
    read while being written is sent whole once it is done."""

    def __init__(self, root: Path, known: dict[str, bytes] | None = None):
        self.root = root
        self.seen: dict[str, tuple[int, int]] = {}
        for rel in known or {}:  # what the driver already has: its stat here, after write_tree
            try:
                st = (root / rel).stat()
                self.seen[rel] = (st.st_size, st.st_mtime_ns)
            except OSError:
                pass

    def delta(self) -> tuple[dict[str, bytes], list[str]]:
        now: dict[str, tuple[int, int]] = {}
        changed: dict[str, bytes] = {}
        if not self.root.is_dir():  # the folder itself gone (a wiped disk): that is no deletion to copy
            return {}, []
        for rel, path in _files(self.root):
            try:
                st = path.stat()
                key = (st.st_size, st.st_mtime_ns)
                if self.seen.get(rel) != key:
                    changed[rel] = path.read_bytes()
                now[rel] = key
            except OSError:  # deleted between the walk and the read: gone
                pass
        deleted = sorted(set(self.seen) - set(now))
        self.seen = now
        return changed, deleted


def _inside(root: Path, rel: str) -> Path:
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise PolgradError(f"{root}: a synced file's path {rel!r} leaves the run folder")
    return path


def write_tree(root: Path, files: dict[str, bytes], deleted: list[str] = ()) -> None:
    """Write `files` under `root` (each atomically: a reader never sees half a file) and delete
    `deleted` (missing ones are fine)."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = _inside(root, rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    for rel in deleted:
        _inside(root, rel).unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# The task: one attempt of one cell on one node
# --------------------------------------------------------------------------------------------


def cell_task(
    cell: Cell,
    rel: str,
    snapshot: dict[str, bytes],
    run: dict[str, Any],
    sync_s: float = SYNC_S,
) -> Iterator[dict[str, Any]]:
    """Body of the Ray task: yields {"node", "host"} first, then {"files", "deleted"} as the run
    folder changes, and {"outcome"} last. `rel` is the folder's path under this node's
    `node_dir()`; `snapshot` the driver's copy of it; `run` run_cell's keyword arguments."""
    import ray

    where = {"ray_node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    yield {"node": where["ray_node"], "host": where["host"]}
    local = node_dir() / rel
    if local.exists():  # an earlier attempt on this node: the driver's copy is the truth
        shutil.rmtree(local)
    write_tree(local, snapshot)
    mirror = Mirror(local, snapshot)
    slot = None
    gpu_ids = ray.get_gpu_ids()
    if gpu_ids:
        slot = GpuSlot(0, tuple(int(g) for g in gpu_ids))
    done: dict[str, Any] = {}

    def body() -> None:
        try:
            done["outcome"] = run_cell(cell, local, slot=slot, where=where, die_with_parent=True, **run)
        except BaseException as e:  # noqa: BLE001 - reported as the cell's outcome below
            done["outcome"] = _failed(cell, "ray task", e)

    worker = threading.Thread(target=body, daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(timeout=sync_s)
        files, deleted = mirror.delta()
        if files or deleted:
            yield {"files": files, "deleted": deleted}
    yield {"outcome": done["outcome"]}
    shutil.rmtree(local, ignore_errors=True)  # the driver has it all now


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------


def _attempt_line(run_dir: Path, entry: dict[str, Any]) -> None:
    with open(run_dir / ATTEMPTS, "a") as fh:
        fh.write(json.dumps(entry) + "\n")


def _node_lost(error: BaseException) -> bool:
    """True for Ray's errors of the machinery (a worker or node died, an object was lost), false
    for an exception raised by the task's own code (RayTaskError)."""
    import ray.exceptions as rex

    return not isinstance(error, rex.RayTaskError)


class _Attempt:
    def __init__(self, cell: Cell, number: int, gen: Any):
        self.cell, self.number, self.gen = cell, number, gen
        self.node: str | None = None
        self.started = _now()


def run(exp, todo, run_dirs, record, progress, *, parallel, train_module, ray_address=None) -> None:
    """Cells as Ray tasks on a local Ray, or on the cluster at `ray_address` (see the module doc)."""
    import logging

    import ray

    started_here = not ray.is_initialized()
    if started_here:
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if ray_address:
            ray.init(address=ray_address, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)
    remote = ray.remote(cell_task).options(
        num_cpus=exp.num_cpus, num_gpus=exp.num_gpus, max_retries=0, num_returns="streaming"
    )
    results_root = Path(run_dirs[todo[0].id]).parent.parent.parent if todo else Path(".")
    limit = parallel or len(todo)
    queue_: list[tuple[Cell, int]] = [(c, 1) for c in todo]
    inflight: dict[Any, _Attempt] = {}

    def submit(cell: Cell, number: int) -> None:
        run_dir = Path(run_dirs[cell.id])
        run_dir.mkdir(parents=True, exist_ok=True)
        # Where and with which code the cell runs is the driver's: its nodes run the same code.
        environment = _results.cell_environment(run_dir, exp.name)
        run_kwargs = {
            "train_module": train_module,
            "threads": max(1, int(exp.num_cpus)),
            "launcher": exp.launcher,
            "timeout_s": exp.timeout_s,
            "experiment": exp.name,
            "processes": exp.processes_per_cell,
            "environment": environment,
        }
        rel = run_dir.resolve().relative_to(results_root.resolve()).as_posix()
        gen = remote.remote(cell, rel, read_tree(run_dir), run_kwargs)
        inflight[gen] = _Attempt(cell, number, gen)
        progress.start(cell, run_dir)

    try:
        while queue_ or inflight:
            while queue_ and len(inflight) < limit:
                submit(*queue_.pop(0))
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for gen in ready:
                att = inflight[gen]
                cell, run_dir = att.cell, Path(run_dirs[att.cell.id])
                outcome, lost = None, None
                try:
                    item = ray.get(next(gen))
                except StopIteration:
                    lost = RuntimeError("the task ended without an outcome")
                except Exception as e:  # noqa: BLE001 - Ray's error for this attempt
                    if not _node_lost(e):
                        outcome = _failed(cell, "ray", e, limit=300)
                    else:
                        lost = e
                else:
                    if "node" in item:
                        att.node = item["node"]
                        continue
                    if "files" in item:
                        write_tree(run_dir, item["files"], item["deleted"])
                        continue
                    outcome = item["outcome"]
                del inflight[gen]
                entry = {"attempt": att.number, "node": att.node, "started": att.started, "ended": _now()}
                if lost is not None and att.number <= NODE_LOSS_RETRIES:
                    why = " ".join(f"{type(lost).__name__}: {lost}".split())[:300]
                    _attempt_line(run_dir, {**entry, "status": "node lost", "error": why})
                    progress.stop(cell)
                    msg = f"LOST    {cell.id} on node {att.node}: starting it again"
                    progress.bar.write(msg, file=sys.stderr)
                    queue_.insert(0, (cell, att.number + 1))
                    continue
                if lost is not None:
                    outcome = _failed(cell, f"ray (node lost {att.number} times)", lost, limit=300)
                _attempt_line(run_dir, {**entry, "status": outcome["status"]})
                outcome = {**outcome, "ray_node": att.node, "attempts": att.number}
                record(cell, outcome)
                progress.finish(cell, outcome)
            progress.refresh()
    finally:
        for gen in inflight:
            ray.cancel(gen, force=True)
        if started_here:
            ray.shutdown()
