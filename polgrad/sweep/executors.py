"""Executors: how the cells still to run get run, and the progress bar over them.

An executor is a function `(exp, todo, run_dirs, record, progress, *, parallel, train_module,
ray_address)` that runs every cell of `todo`, calling `record(cell, outcome)` and
`progress.finish(cell, outcome)` as each one ends. `EXECUTORS` maps the `--executor` names to
them; `PREFLIGHT` holds the checks an executor needs before anything is validated or started.

- local: a thread pool of `--parallel N` workers, each running one cell at a time in a fresh
  process with cores // N threads (split between its ranks); on a GPU node each worker owns a
  GPU slot.
- ray: one Ray task per cell asking for `Sweep.num_cpus` / `Sweep.num_gpus`, on a local Ray or a
  cluster whose nodes need not share a disk (polgrad/sweep/ray_cells.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
from collections.abc import Callable

from polgrad import results as _results
from polgrad.errors import PolgradError
from polgrad.sweep import ray_cells, ray_checks
from polgrad.sweep.grid import Cell
from polgrad.sweep.launch import _failed, run_cell
from polgrad.sweep.slots import GpuSlot, assign_gpu_slots, visible_gpus


def _run_local(exp, todo, run_dirs, record, progress, *, parallel, train_module, ray_address=None) -> None:
    """Cells in a thread pool, `parallel` at a time (default 1), each in its own process."""
    slots: list[GpuSlot | None]
    if exp.num_gpus > 0:
        gpus = visible_gpus()
        try:
            slots = list(assign_gpu_slots(len(gpus), exp.num_gpus, len(todo), devices=gpus))
        except ValueError as e:
            raise PolgradError(f"{exp.file}: Sweep.num_gpus = {exp.num_gpus:g}: {e}") from None
        if not slots:
            raise PolgradError(f"{exp.file}: Sweep.num_gpus = {exp.num_gpus:g} but no GPU is visible")
        workers = min(parallel or len(slots), len(slots))
        slots = slots[:workers]
    else:
        workers = max(1, parallel or 1)
        slots = [None] * workers
    workers = min(workers, max(1, len(todo)))
    threads = max(1, _results.cpu_count() // workers)
    free: queue.Queue = queue.Queue()
    for s in slots[:workers]:
        free.put(s)

    def work(cell: Cell):
        slot = free.get()
        try:
            progress.start(cell, run_dirs[cell.id])
            try:
                return run_cell(
                    cell,
                    run_dirs[cell.id],
                    train_module=train_module,
                    threads=threads,
                    slot=slot,
                    launcher=exp.launcher,
                    timeout_s=exp.timeout_s,
                    experiment=exp.name,
                    processes=exp.processes_per_cell,
                )
            finally:
                progress.stop(cell)
        finally:
            free.put(slot)

    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cell")
    futures = {pool.submit(work, c): c for c in todo}
    try:
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                cell = futures[fut]
                try:
                    outcome = fut.result()
                except Exception as e:  # the runner's own bug or an OS error: record, go on
                    outcome = _failed(cell, "sweep runner", e)
                record(cell, outcome)
                progress.finish(cell, outcome)
            progress.refresh()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _require_ray(ray_address: str | None = None) -> None:
    """Ray is installed and the cluster at `ray_address` answers (else ray.init would wait minutes)."""
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise PolgradError(f"--executor ray needs Ray: pip install 'polgrad[ray]' ({e})") from None
    ray_checks.check_address(ray_address)


# --executor name -> executor; the CLI offers exactly these names.
EXECUTORS: dict[str, Callable[..., None]] = {"local": _run_local, "ray": ray_cells.run}
# --executor name -> a check of (--ray-address) to run before the experiment is validated (raises
# PolgradError).
PREFLIGHT: dict[str, Callable[[str | None], None]] = {"ray": _require_ray}
