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
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
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
    files deleted), each under the name `name(rel)` gives it on the driver (None: not sent). A file is
    sent again whenever its size or modification time changes, so a file read while being written is
    sent whole once it is done."""

    def __init__(self, root: Path, known: Iterable[str] = (), name: Callable[[str], str | None] = str):
        self.root, self.name = root, name
        self.seen: dict[str, tuple[int, int]] = {}
        for rel in known:  # what the driver already has: its stat here, after write_tree
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
            if self.name(rel) is None:
                continue
            try:
                st = path.stat()
                key = (st.st_size, st.st_mtime_ns)
                if self.seen.get(rel) != key:
                    changed[self.name(rel)] = path.read_bytes()
                now[rel] = key
            except OSError:  # deleted between the walk and the read: gone
                pass
        deleted = sorted(self.name(rel) for rel in set(self.seen) - set(now) if self.name(rel) is not None)
        self.seen = now
        return changed, deleted


def rank_name(rank: int) -> Callable[[str], str | None]:
    """Local file name -> the driver's, for the files of a rank > 0 of a cell spanning nodes: its
    checkpoint files (its shards) as they are, its log and cell.json as `stdout.rank<r>.log` and
    `cell.rank<r>.json`; rank 0 writes everything else (metrics, summary)."""
    own = {"stdout.log": f"stdout.rank{rank}.log", "cell.json": f"cell.rank{rank}.json"}

    def name(rel: str) -> str | None:
        return own.get(rel, rel if rel.startswith("checkpoints/") else None)

    return name


def rank_snapshot(snapshot: dict[str, bytes], rank: int) -> dict[str, bytes]:
    """The driver's copy of a cell's folder as rank `rank` starts from it (its own log and cell.json
    under their local names; rank 0 gets the folder as it is, without the other ranks' logs)."""
    ours = {f"stdout.rank{rank}.log": "stdout.log", f"cell.rank{rank}.json": "cell.json"} if rank else {}
    out = {}
    for rel, data in snapshot.items():
        if rel in ours:
            out[ours[rel]] = data
        elif not rel.startswith(("stdout.rank", "cell.rank")) and not (
            rank and rel in ("stdout.log", "cell.json")
        ):
            out[rel] = data
    return out


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


def rendezvous() -> tuple[str, int]:
    """(this node's address, a TCP port free on it now): rank 0's MASTER_ADDR / MASTER_PORT."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        return ray.util.get_node_ip_address(), sock.getsockname()[1]


def cell_task(
    cell: Cell,
    rel: str,
    snapshot: dict[str, bytes],
    run: dict[str, Any],
    sync_s: float = SYNC_S,
    rank: int = 0,
    world: int = 1,
    master: tuple[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Body of the Ray task: yields {"node", "host"} first, then {"files", "deleted"} as the run
    folder changes, and {"outcome"} last. `rel` is the folder's path under this node's
    `node_dir()`; `snapshot` the driver's copy of it; `run` run_cell's keyword arguments. With
    `world` > 1 it is rank `rank` of a cell spanning nodes: one trainer process joining rank 0 at
    `master` (torch.distributed's env:// variables), its folder `<rel>.rank<r>` on this node."""
    import ray

    where = {"ray_node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    yield {"node": where["ray_node"], "host": where["host"]}
    local = node_dir() / (rel if world == 1 else f"{rel}.rank{rank}")
    if local.exists():  # an earlier attempt on this node: the driver's copy is the truth
        shutil.rmtree(local)
    mine = rank_snapshot(snapshot, rank)
    write_tree(local, mine)
    mirror = Mirror(local, mine, rank_name(rank) if rank else str)
    slot = None
    gpu_ids = ray.get_gpu_ids()
    if gpu_ids:
        slot = GpuSlot(0, tuple(int(g) for g in gpu_ids))
    extra: dict[str, Any] = {}
    if world > 1:
        assert master is not None
        where["rank"] = rank
        extra = {
            "processes": 1,
            "extra_env": {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": "0",
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": master[0],
                "MASTER_PORT": str(master[1]),
            },
            # a rank whose peer is gone cannot finish its step: it dies with its task
            "die_with_parent": signal.SIGKILL,
        }
    done: dict[str, Any] = {}

    def body() -> None:
        try:
            kwargs = {"die_with_parent": signal.SIGTERM, **run, **extra}
            outcome = run_cell(cell, local, slot=slot, where=where, **kwargs)
            if rank and outcome.get("returncode") == 0:  # rank 0 alone writes summary.json
                outcome = {**outcome, "status": "ok", "error": ""}
            done["outcome"] = outcome
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
    """One start of a cell: its rank tasks (one unless it spans nodes), their nodes and outcomes."""

    def __init__(self, cell: Cell, number: int, world: int, pg: Any = None):
        self.cell, self.number, self.world, self.pg = cell, number, world, pg
        self.nodes: list[str | None] = [None] * world
        self.outcomes: dict[int, dict[str, Any]] = {}
        self.lost: BaseException | None = None
        self.started = _now()

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
        return {**base, "cell_id": self.cell.id, "status": "failed", "error": f"rank {rank}: {error}"}


def run(exp, todo, run_dirs, record, progress, *, parallel, train_module, ray_address=None) -> None:
    """Cells as Ray tasks on a local Ray, or on the cluster at `ray_address` (see the module doc).
    A cell of `Sweep.processes_per_cell` = k > 1 ranks gets a placement group of k bundles
    (`Sweep.placement`: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD) and one task per rank in it."""
    import logging

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_here = not ray.is_initialized()
    if started_here:
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if ray_address:
            ray.init(address=ray_address, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)
    world = exp.processes_per_cell if exp.num_gpus == 0 else 1
    per_rank = {"num_cpus": exp.num_cpus / world, "num_gpus": exp.num_gpus}
    remote = ray.remote(cell_task)

    def task(**options: Any) -> Any:  # Ray's own retry is off: a lost cell is started again here
        return remote.options(max_retries=0, num_returns="streaming", **options)

    results_root = Path(run_dirs[todo[0].id]).parent.parent.parent if todo else Path(".")
    limit = parallel or len(todo)
    queue_: list[tuple[Cell, int]] = [(c, 1) for c in todo]
    inflight: dict[Any, tuple[_Attempt, int]] = {}  # rank task -> (its attempt, its rank)

    def submit(cell: Cell, number: int) -> None:
        run_dir = Path(run_dirs[cell.id])
        run_dir.mkdir(parents=True, exist_ok=True)
        # Where and with which code the cell runs is the driver's: its nodes run the same code.
        environment = _results.cell_environment(run_dir, exp.name)
        run_kwargs = {
            "train_module": train_module,
            "threads": max(1, int(per_rank["num_cpus"]) if world > 1 else int(exp.num_cpus)),
            "launcher": exp.launcher,
            "timeout_s": exp.timeout_s,
            "experiment": exp.name,
            "processes": exp.processes_per_cell,
            "environment": environment,
        }
        rel = run_dir.resolve().relative_to(results_root.resolve()).as_posix()
        snapshot = ray.put(read_tree(run_dir))
        if world == 1:
            att = _Attempt(cell, number, 1)
            inflight[task(**per_rank).remote(cell, rel, snapshot, run_kwargs)] = (att, 0)
        else:
            bundles = [{"CPU": per_rank["num_cpus"]} for _ in range(world)]
            pg = placement_group(bundles, strategy=exp.placement)
            ray.get(pg.ready())  # waits for the resources of every rank at once
            att = _Attempt(cell, number, world, pg)
            at = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r) for r in range(world)]
            master = ray.get(ray.remote(rendezvous).options(num_cpus=0, scheduling_strategy=at[0]).remote())
            for r in range(world):
                ref = task(**per_rank, scheduling_strategy=at[r]).remote(
                    cell, rel, snapshot, run_kwargs, SYNC_S, r, world, master
                )
                inflight[ref] = (att, r)
        progress.start(cell, run_dir)

    def end(att: _Attempt) -> None:
        """Every rank of `att` has ended (or was lost): record it, or start it again after a loss."""
        cell, run_dir = att.cell, Path(run_dirs[att.cell.id])
        for ref, (other, _r) in list(inflight.items()):
            if other is att:  # a rank still running when another failed or was lost
                ray.cancel(ref, force=True)
                del inflight[ref]
        if att.pg is not None:
            remove_placement_group(att.pg)
        nodes = att.nodes[0] if att.world == 1 else att.nodes
        entry = {"attempt": att.number, "node": nodes, "started": att.started, "ended": _now()}
        if att.lost is not None and att.number <= NODE_LOSS_RETRIES:
            why = " ".join(f"{type(att.lost).__name__}: {att.lost}".split())[:300]
            _attempt_line(run_dir, {**entry, "status": "node lost", "error": why})
            progress.stop(cell)
            progress.bar.write(f"LOST    {cell.id} on node {nodes}: starting it again", file=sys.stderr)
            queue_.insert(0, (cell, att.number + 1))
            return
        if att.lost is not None:
            outcome = _failed(cell, f"ray (node lost {att.number} times)", att.lost, limit=300)
        else:
            outcome = att.outcome()
        _attempt_line(run_dir, {**entry, "status": outcome["status"]})
        outcome = {**outcome, "ray_node": nodes, "attempts": att.number}
        record(cell, outcome)
        progress.finish(cell, outcome)

    try:
        while queue_ or inflight:
            while queue_ and len({id(a) for a, _ in inflight.values()}) < limit:
                submit(*queue_.pop(0))
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for ref in ready:
                if ref not in inflight:  # cancelled meanwhile with its attempt
                    continue
                att, rank = inflight[ref]
                try:
                    item = ray.get(next(ref))
                except StopIteration:
                    item = {"lost": RuntimeError("the task ended without an outcome")}
                except Exception as e:  # noqa: BLE001 - Ray's error for this attempt
                    if _node_lost(e):
                        item = {"lost": e}
                    else:
                        item = {"outcome": _failed(att.cell, "ray", e, limit=300)}
                if "node" in item:
                    att.nodes[rank] = item["node"]
                elif "files" in item:
                    write_tree(Path(run_dirs[att.cell.id]), item["files"], item["deleted"])
                else:
                    del inflight[ref]
                    if "lost" in item:
                        att.lost = item["lost"]
                    else:
                        att.outcomes[rank] = item["outcome"]
                    alive = any(a is att for a, _ in inflight.values())
                    if not alive or att.lost is not None or item.get("outcome", {}).get("status") == "failed":
                        end(att)
            progress.refresh()
    finally:
        for ref in inflight:
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()
