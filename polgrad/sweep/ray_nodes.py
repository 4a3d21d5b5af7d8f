"""What a Ray node holds of a sweep: its folder for the copies of the cells it runs (`node_dir`), a
lock on each copy while its task runs (`hold`), and the clean-up of copies no task holds any more
(`sweep_copies` on one node as a task starts, `node_cleanup` from the driver on every live node at
the sweep's end: `sweep_nodes`). Used by
polgrad/sweep/ray_cells.py; a copy's files are synced by polgrad/sweep/ray_sync.py.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

HELD = ".held"  # `<copy>.held`: the lock file of a node's copy of a cell's folder
# What Ray's worker prints to tie its log files to a task (ray_constants.LOG_PREFIX_*): not output.
_RAY_MARKS = (":task_name:", ":actor_name:", ":job_id:")


def node_dir() -> Path:
    """This node's folder for the run folders of the cells it runs: `$POLGRAD_NODE_DIR`, else
    `<tmp>/polgrad-ray/<Ray node id>` (a folder no other node writes, shared disk or not)."""
    env = os.environ.get("POLGRAD_NODE_DIR")
    if env:
        return Path(env)
    import ray

    return Path(tempfile.gettempdir()) / "polgrad-ray" / ray.get_runtime_context().get_node_id()[:16]


def _node_roots(key: str) -> list[Path]:
    """Where this node may hold copies of driver `key`'s cells: `node_dir()/<key>`, and without
    $POLGRAD_NODE_DIR the `<key>` folder under every node id this machine has had (a node that comes
    back after a loss has a new id)."""
    if os.environ.get("POLGRAD_NODE_DIR"):
        return [node_dir() / key]
    return sorted((Path(tempfile.gettempdir()) / "polgrad-ray").glob(f"*/{key}"))


def hold(local: Path):
    """Lock `<local>.held` for as long as the returned file stays open (this process's life at most:
    the lock goes with the process, however it ends)."""
    import fcntl

    path = local.with_name(local.name + HELD)
    while True:
        local.parent.mkdir(parents=True, exist_ok=True)
        fh = open(path, "a")
        fcntl.flock(fh, fcntl.LOCK_EX)  # waits while an earlier task of this copy still runs
        try:
            if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
                return fh
        except FileNotFoundError:
            pass
        fh.close()  # a sweep removed the file while this waited: lock the file that is there now


def sweep_copies(key: str) -> list[str]:
    """Delete every copy of driver `key`'s cells on this node that no running task holds; returns
    their paths. Run by each task as it starts."""
    return node_cleanup(key)[0]


def node_cleanup(key: str) -> tuple[list[str], list[str]]:
    """`sweep_copies(key)` that also says what it left: (the copies removed, the copies a running task
    still holds). Run on every node at the sweep's end."""
    gone: list[str] = []
    held: list[str] = []
    for root in _node_roots(key):
        for lock in sorted(root.rglob(f"*{HELD}")):
            try:
                fd = os.open(lock, os.O_RDONLY)  # never created here: a file another sweep removed is gone
            except FileNotFoundError:
                continue
            try:
                outcome = _remove_if_free(lock, fd)
            finally:
                os.close(fd)
            copy = str(lock.with_name(lock.name.removesuffix(HELD)))
            if outcome == "removed":
                gone.append(copy)
            elif outcome == "held":
                held.append(copy)
    return gone, held


def _remove_if_free(lock: Path, fd: int) -> str | None:
    """Remove the copy of `lock` (opened as `fd`) if no task holds it and `lock` is still the file `fd`
    is (another sweep may have removed it since, and a task made a new one for a new copy): "removed",
    "held" (a task holds it) or None (the lock is another file now, or gone)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its task runs
        return "held"
    try:
        if os.stat(lock).st_ino != os.fstat(fd).st_ino:
            return None
    except FileNotFoundError:
        return None
    copy = lock.with_name(lock.name.removesuffix(HELD))
    shutil.rmtree(copy, ignore_errors=True)
    lock.unlink(missing_ok=True)
    return "removed"


def _copies(n: int) -> str:
    return f"{n} node cop{'y' if n == 1 else 'ies'}"


def _nodes(n: int) -> str:
    return f"{n} node{'' if n == 1 else 's'}"


def _ended(ref: Any) -> Any:
    """What `ray.wait` is ready on once the task of `ref` has ended: a streaming generator's own ref
    is ready at its next item, which a cancelled rank usually still has unread."""
    return ref.completed() if hasattr(ref, "completed") else ref


def sweep_nodes(
    key: str, stopped: list[Any], progress: Any, wait_s: float = 120.0, poll_s: float = 2.0
) -> None:
    """At the end of a sweep that ran its cells to the end: `node_cleanup(key)` on every live node
    (copies of cancelled tasks, of a node that came back). A copy is removed once nobody holds its
    lock, which goes with its task's process however it ends: the sweep waits up to `wait_s` for the
    `stopped` tasks to end, then cleans every node, again every `poll_s` on nodes that still hold a
    copy, for up to `wait_s` more. Best effort: a copy still held then, and a node that does not
    answer or whose clean-up fails, keep their copies for the next run of the sweep (a stopped
    sweep's are cleaned by its resumed run), and the sweep's last line says which."""
    import time

    try:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if stopped:
            ray.wait([_ended(s) for s in stopped], num_returns=len(stopped), timeout=wait_s)
        cleanup = ray.remote(node_cleanup)
        todo = [n["NodeID"] for n in ray.nodes() if n.get("Alive")]
    except Exception as e:  # noqa: BLE001 - the sweep's results stand; say what was not cleaned
        progress.bar.write(f"node copies not cleaned up: {type(e).__name__}: {e}"[:300], file=sys.stderr)
        return
    deadline = time.monotonic() + wait_s
    gone: list[str] = []
    held: dict[str, list[str]] = {}  # node -> the copies still held at its last clean-up
    silent: set[str] = set()
    failed: dict[str, str] = {}
    while todo:
        refs = {
            cleanup.options(
                num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)
            ).remote(key): n
            for n in todo
        }
        ready, late = ray.wait(
            list(refs), num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic())
        )
        silent |= {refs[r] for r in late}
        todo = []
        for ref in ready:
            node = refs[ref]
            try:
                removed, kept = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - this node's; the others' answers stand
                failed[node] = f"{type(e).__name__}: {e}"[:200]
                continue
            gone += removed
            held[node] = kept
            if kept:
                todo.append(node)
        if not todo or time.monotonic() + poll_s >= deadline:
            break
        time.sleep(poll_s)
    if gone:
        progress.bar.write(f"removed {_copies(len(gone))} left by stopped or lost tasks", file=sys.stderr)
    kept = [path for paths in held.values() for path in paths]
    left = []
    if kept:
        more = " among others" if len(kept) > 1 else ""
        left.append(f"{_copies(len(kept))} still held by tasks that had not ended ({kept[0]}{more})")
    if silent:
        left.append(f"the copies on {_nodes(len(silent))} that did not answer")
    if failed:
        left.append(
            f"the copies on {_nodes(len(failed))} whose clean-up failed ({next(iter(failed.values()))})"
        )
    if left:
        progress.bar.write(
            f"left {' and '.join(left)} within {wait_s:g} s: the next run of this sweep removes them",
            file=sys.stderr,
        )


class NodeLog:
    """What a cell's task writes on its node, for the driver: its stdout and stderr (Python warnings
    included) and Ray's own warnings there (the `ray` logger, WARNING and above), which a cluster's
    workers otherwise keep in their node's log files (the driver runs Ray with log_to_driver off, so
    that Ray's chatter stays out of the progress bar). `take()` returns the lines since the last call.
    Ray runs one task at a time in a worker process, so the task may swap the process's streams."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._partial = ""
        self._lock = threading.Lock()
        log = self

        class _Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                log.write(f"ray {record.levelname.lower()}: {record.getMessage()}\n")

        self._handler = _Handler(level=logging.WARNING)

    def write(self, text: str) -> int:
        with self._lock:
            *whole, self._partial = (self._partial + text).split("\n")
            self._lines.extend(line for line in whole if line.strip() and not line.startswith(_RAY_MARKS))
        return len(text)

    def flush(self) -> None:
        pass

    def take(self, final: bool = False) -> list[str]:
        """The lines written since the last call; `final`: the last line too, unfinished or not."""
        with self._lock:
            if final and self._partial.strip():
                self._lines.append(self._partial)
            if final:
                self._partial = ""
            lines, self._lines = self._lines, []
        return lines

    def __enter__(self) -> NodeLog:
        self._streams = (sys.stdout, sys.stderr, warnings.showwarning)
        sys.stdout = sys.stderr = self  # type: ignore[assignment]
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: self.write(
            warnings.formatwarning(message, category, filename, lineno, line)
        )
        logging.getLogger("ray").addHandler(self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("ray").removeHandler(self._handler)
        sys.stdout, sys.stderr, warnings.showwarning = self._streams
        if self._partial.strip():
            self._lines.append(self._partial)
        self._partial = ""
