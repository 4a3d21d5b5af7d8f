"""Sweep cells on a Ray cluster whose nodes share no disk, surviving the loss of a node.

A cell runs as one Ray task (a streaming generator) on whichever node Ray picks. The task never
touches the driver's run folder: it trains into a folder of its own node (`node_dir()`: the
node's `$POLGRAD_NODE_DIR`, else `<tmp>/polgrad-ray/<node id>`) and every `Sweep.ray['sync_s']`
seconds yields what changed there (files written, files deleted: a checkpoint tag the trainer prunes
under train.keep_checkpoints is deleted on the driver too), which the driver writes into its run
folder. So the driver holds, while the cell runs, its metrics, log and checkpoints, and at the end
the whole folder; the task then deletes its node's copy.

A node's copy is held (a lock file beside it, `<copy>.held`, locked while its task runs) and any copy
of this driver's whose lock nobody holds is deleted: by every task that starts on the node, and on
every live node when the sweep has run all its cells (a stopped sweep's, by its resumed run). So a
copy left behind by a task that was cancelled (its cell's other rank failed, ^C) or died with its
node is removed, on a node that comes back too (under the default node folder also the copies
under the node's previous id).

A cell of several ranks (Sweep.processes_per_cell on CPU; Sweep.num_gpus = k > 1, k ranks of one GPU
each) is a placement group of one bundle per rank (Sweep.placement) and one task per rank, which Ray
may put on different nodes; the ranks meet at rank 0's node (torch.distributed's env://).

A cell starts from the driver's copy of its folder (sent with the task through Ray's object store):
a cell whose node died is started again on a surviving node with the checkpoints that had reached
the driver, and resumes from the newest intact one (tags cut short by the loss are set aside
first: `ray_sync.usable_checkpoints`). A lost node is an error of Ray's own (the task's worker or
node died), not of the cell: the cell is started again up to `Sweep.ray['retries']` times, each
attempt a line of the run folder's `ray_attempts.jsonl` (node, start, end, how it ended); an error
of the trainer is the cell's outcome, as with the local executor, and is not retried.

Code and configuration files are not shipped: every node needs polgrad (and the experiment's files)
at the same paths, e.g. one image or one checkout per node (docs/scaling.md).
"""

from __future__ import annotations

import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.errors import PolgradError
from polgrad.sweep.grid import Cell
from polgrad.sweep.launch import _failed, _now, run_cell
from polgrad.sweep.ray_attempts import Attempt, attempt_line, dead_nodes, driver_key, node_lost
from polgrad.sweep.ray_checks import RaySettings, check_address, check_resources
from polgrad.sweep.ray_nodes import NodeLog, hold, node_dir, sweep_copies, sweep_nodes
from polgrad.sweep.ray_sync import (  # noqa: F401 - ATTEMPTS and read_tree are this module's too
    ATTEMPTS,
    NODE_LOG,
    Mirror,
    rank_name,
    rank_snapshot,
    read_tree,
    usable_checkpoints,
    write_tree,
)
from polgrad.sweep.slots import GpuSlot
from polgrad.sweep.validation import ranks_per_cell

SYNC_S = RaySettings.sync_s  # the default, for a task started without the driver's settings


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
    driver_dir: str = "",
) -> Iterator[dict[str, Any]]:
    """Body of the Ray task: yields {"node", "host"} first, then {"files", "deleted"} as the run
    folder changes, and {"outcome"} last. `rel` is the folder's path under this node's
    `node_dir()`; `snapshot` the driver's copy of it; `run` run_cell's keyword arguments. With
    `world` > 1 it is rank `rank` of a cell spanning nodes: one trainer process joining rank 0 at
    `master` (torch.distributed's env:// variables), its folder `<rel>.rank<r>` on this node.
    `driver_dir` is the driver's run folder, which this folder must not be (it is deleted at the end).
    The trainer dies (SIGKILL) with the task: a cancelled or lost task's step never reaches the driver,
    whose copy holds the last checkpoint that did."""
    import ray

    from polgrad.results.provenance import machine

    where = {"ray_node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname()}
    yield {"node": where["ray_node"], "host": where["host"]}
    local = node_dir() / (rel if world == 1 else f"{rel}.rank{rank}")
    if driver_dir and local.resolve() == Path(driver_dir).resolve():
        raise PolgradError(
            f"POLGRAD_NODE_DIR puts the node's copy of a cell at the driver's run folder {driver_dir}: "
            "point it elsewhere (a folder of the node's own)"
        )
    held = hold(local)  # before the sweep: this copy is not left for another task to delete
    # Who closes `held`: this task as it ends, or, when it ends before its trainer, the trainer's thread
    # as that ends (else the lock stayed with the Ray worker, reused by later tasks, and no sweep could
    # ever remove the copy).
    handoff = threading.Lock()
    done: dict[str, Any] = {}
    log = NodeLog().__enter__()  # what the task writes here goes to the driver as {"log": lines}
    worker: threading.Thread | None = None  # the thread that runs the trainer, once started
    try:
        for path in sweep_copies(rel.split("/", 1)[0]):  # copies an earlier task of this driver left here
            print(f"removed the node copy {path}, left by a stopped or lost task")
        # the commit is the driver's (its code runs here), the machine this node's
        run = {**run, "environment": {**run["environment"], **machine()}}
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
            }

        def body() -> None:
            try:
                train()
            finally:  # the task ended first (an error of its own): the lock goes now, not with the worker
                with handoff:
                    done["ended"] = True
                    if done.get("abandoned"):
                        held.close()

        def train() -> None:
            try:
                # a launcher (a GPU cell of several GPUs) passes SIGTERM on to its ranks, not SIGKILL
                launcher = slot is not None and len(slot.devices) > 1
                kwargs = {"die_with_parent": signal.SIGTERM if launcher else signal.SIGKILL, **run, **extra}
                outcome = run_cell(cell, local, slot=slot, where=where, **kwargs)
                if rank and outcome.get("returncode") == 0:  # rank 0 alone writes summary.json
                    outcome = {**outcome, "status": "ok", "error": ""}
                if world > 1:  # each rank is one process; the cell had `world`
                    outcome = {**outcome, "world_size": world}
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
            if lines := log.take():
                yield {"log": lines}
        if lines := log.take(final=True):
            yield {"log": lines}
        yield {"outcome": done["outcome"]}
        shutil.rmtree(local, ignore_errors=True)  # the driver has it all now
        Path(held.name).unlink(missing_ok=True)
    finally:  # an error of this task's own: the copy goes with a later sweep once the trainer is gone
        log.__exit__()
        with handoff:  # no sweep removes a live trainer's folder: its thread closes the lock as it ends
            if worker is None or done.get("ended"):
                held.close()
            else:
                done["abandoned"] = True


# --------------------------------------------------------------------------------------------
# The driver
# --------------------------------------------------------------------------------------------


def _init_ray(ray_address: str | None) -> None:
    """ray.init: the cluster at `ray_address` once it answers (`ray_checks.check_address`), else a local
    Ray (a cluster Ray cannot find is one line). ray.init replaces the driver's SIGTERM handler by its
    own (which exits at once); the sweep's (polgrad/sweep/cli.py: a SIGTERM stops the cells like ^C,
    then says how to resume) is put back."""
    import logging

    import ray

    check_address(ray_address)
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
    try:
        if ray_address:
            ray.init(address=ray_address, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)
    except ConnectionError as e:  # e.g. 'auto' with no cluster on this machine: Ray's first sentence
        raise PolgradError(
            f"--ray-address {ray_address}: {str(e).split('. ')[0].strip()}; start the cluster first "
            "(`ray start --head`), give its address, or drop --executor ray to run the cells on this machine"
        ) from None
    finally:
        if sigterm is not None:
            signal.signal(signal.SIGTERM, sigterm)


def run(exp, todo, run_dirs, record, progress, *, parallel, train_module, ray_address=None) -> None:
    """Cells as Ray tasks on a local Ray, or on the cluster at `ray_address` (see the module doc).
    A cell of `Sweep.processes_per_cell` = k > 1 ranks gets a placement group of k bundles
    (`Sweep.placement`: PACK, SPREAD, STRICT_PACK or STRICT_SPREAD) and one task per rank in it; the
    ranks wait for the group (the driver does not: it goes on syncing and recording other cells)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    started_here = not ray.is_initialized()
    if started_here:
        _init_ray(ray_address)
    settings: RaySettings = getattr(exp, "ray", None) or RaySettings()
    # the cell's ranks: processes_per_cell on CPU; a GPU cell of k > 1 GPUs, k ranks of one GPU each
    world = ranks_per_cell(exp)[0]
    per_rank = {"num_cpus": exp.num_cpus / world, "num_gpus": exp.num_gpus / world}
    remote = ray.remote(cell_task)

    def task(**options: Any) -> Any:  # Ray's own retry is off: a lost cell is started again here
        return remote.options(max_retries=0, num_returns="streaming", **options)

    results_root = Path(run_dirs[todo[0].id]).parent.parent.parent if todo else Path(".")
    key = driver_key(results_root)
    limit = parallel or len(todo)
    queue_: list[tuple[Cell, int]] = [(c, 1) for c in todo]
    inflight: dict[Any, tuple[Attempt, int]] = {}  # rank task -> (its attempt, its rank)
    attempts: list[Attempt] = []  # the attempts not ended yet
    cancelled: list[Any] = []  # rank tasks stopped by the driver: their node copies stay behind

    def submit(cell: Cell, number: int) -> None:
        run_dir = Path(run_dirs[cell.id])
        run_dir.mkdir(parents=True, exist_ok=True)
        aside = usable_checkpoints(run_dir, ranks_per_cell(exp)[0])  # the trainer's ranks, GPU cells too
        if aside:
            names = ", ".join(Path(a).name for a in aside)
            progress.bar.write(f"{cell.id}: checkpoints set aside as incomplete: {names}", file=sys.stderr)
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
        rel = f"{key}/{run_dir.resolve().relative_to(results_root.resolve()).as_posix()}"
        snapshot = ray.put(read_tree(run_dir))
        pg, refs = None, []
        try:
            if world == 1:
                refs.append(
                    task(**per_rank).remote(
                        cell, rel, snapshot, run_kwargs, settings.sync_s, driver_dir=str(run_dir)
                    )
                )
            else:
                bundles = [{"CPU": per_rank["num_cpus"], **({"GPU": 1.0} if exp.num_gpus else {})}] * world
                pg = placement_group(bundles, strategy=exp.placement)
                at = [
                    PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=r) for r in range(world)
                ]
                # rank 0's address, found once the group is placed; each rank task waits for it (an
                # ObjectRef argument), so nothing here waits for the group
                where = ray.remote(rendezvous).options(num_cpus=0, max_retries=0, scheduling_strategy=at[0])
                master = where.remote()
                for r in range(world):
                    refs.append(
                        task(**per_rank, scheduling_strategy=at[r]).remote(
                            cell, rel, snapshot, run_kwargs, settings.sync_s, r, world, master, str(run_dir)
                        )
                    )
        except BaseException:  # nothing of this attempt may stay behind
            for ref in refs:
                ray.cancel(ref, force=True)
            if pg is not None:
                remove_placement_group(pg)
            raise
        att = Attempt(cell, number, world, pg)
        attempts.append(att)
        for r, ref in enumerate(refs):
            inflight[ref] = (att, r)
        progress.start(cell, run_dir)

    def end(att: Attempt) -> None:
        """`att` is over (every rank ended, one was lost, or its grace ran out): record it, or start
        the cell again after a loss."""
        cell, run_dir = att.cell, Path(run_dirs[att.cell.id])
        for ref, (other, _r) in list(inflight.items()):
            if other is att:  # a rank still running when another failed or was lost
                ray.cancel(ref, force=True)
                cancelled.append(ref)
                del inflight[ref]
        attempts.remove(att)
        if att.pg is not None:
            remove_placement_group(att.pg)
        nodes = att.nodes[0] if att.world == 1 else att.nodes
        entry = {"attempt": att.number, "node": nodes, "started": att.started, "ended": _now()}
        if att.lost is not None and att.number <= settings.retries:
            why = " ".join(f"{type(att.lost).__name__}: {att.lost}".split())[:300]
            attempt_line(run_dir, {**entry, "status": "node lost", "error": why})
            progress.stop(cell)
            progress.bar.write(f"LOST    {cell.id} on node {nodes}: starting it again", file=sys.stderr)
            queue_.insert(0, (cell, att.number + 1))
            return
        if att.lost is not None:
            outcome = _failed(cell, f"ray (node lost {att.number} times)", att.lost, limit=300)
            outcome["world_size"] = ranks_per_cell(exp)[0]
        else:
            outcome = att.outcome()
        attempt_line(run_dir, {**entry, "status": outcome["status"]})
        outcome = {**outcome, "ray_node": nodes, "attempts": att.number}
        record(cell, outcome)
        progress.finish(cell, outcome)

    def take(ref: Any) -> None:
        """The next item of rank task `ref`: its node, a change of its folder, or how it ended."""
        att, rank = inflight[ref]
        try:
            item = ray.get(next(ref))
        except StopIteration:
            item = {"lost": RuntimeError("the task ended without an outcome")}
        except Exception as e:  # noqa: BLE001 - Ray's error for this rank task
            item = {"lost": e} if node_lost(e) else {"outcome": _failed(att.cell, "ray", e, limit=300)}
        if "node" in item:
            att.nodes[rank] = item["node"]
            att.hosts[rank] = item.get("host", item["node"])
            return
        if "log" in item:  # the task's own output on its node, and Ray's warnings there
            who = f"{att.cell.id}{f' rank {rank}' if att.world > 1 else ''} on {att.hosts[rank]}"
            with open(Path(run_dirs[att.cell.id]) / NODE_LOG, "a") as fh:
                fh.writelines(f"{who}: {line}\n" for line in item["log"])
            for line in item["log"]:
                progress.bar.write(f"{who}: {line}", file=sys.stderr)
            return
        if "files" in item:
            write_tree(Path(run_dirs[att.cell.id]), item["files"], item["deleted"])
            return
        del inflight[ref]
        if "lost" in item:
            att.lost = item["lost"]
            return end(att)
        att.outcomes[rank] = item["outcome"]
        if len(att.outcomes) == att.world:
            return end(att)
        if item["outcome"]["status"] == "failed" and att.deadline is None:
            att.deadline = time.monotonic() + settings.grace_s  # the others may be about to say why

    try:
        if todo:  # every cell asks alike: one that no node can hold would wait for ever
            check_resources(exp, todo[0].id, world, ray.nodes())
        while queue_ or inflight:
            while queue_ and len(attempts) < limit:
                cell, number = queue_.pop(0)
                try:
                    submit(cell, number)
                except Exception as e:  # noqa: BLE001 - Ray refused the cell: its outcome, not a traceback
                    outcome = {**_failed(cell, "ray", e, limit=300), "world_size": ranks_per_cell(exp)[0]}
                    record(cell, outcome)
                    progress.finish(cell, outcome)
            ready, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for ref in ready:
                if ref in inflight:  # not cancelled meanwhile with its attempt
                    take(ref)
            for att in list(attempts):
                if att.deadline is not None and att.judge(dead_nodes(att.nodes), time.monotonic()):
                    end(att)
            progress.refresh()
        if todo:  # ended, not stopped (^C, an error): a stopped sweep's copies go with its resumed run
            sweep_nodes(key, cancelled, progress)
    finally:
        for ref in inflight:
            ray.cancel(ref, force=True)
        for att in attempts:
            if att.pg is not None:
                try:
                    remove_placement_group(att.pg)
                except Exception:  # noqa: BLE001 - Ray may be gone already; the job's end frees it
                    pass
        if started_here:
            ray.shutdown()
