"""The processes of the cells a sweep runs: the running ones (`RUNNING`), stopping them all on ^C or
SIGTERM (`stop_trainers`: each finishes its step and checkpoints it, killed after STOP_GRACE_S), and
finding and killing every process of a cell by its `--out <run dir>` (`cell_pids`, `kill_pids`,
`kill_stale_trainer`: ranks a launcher did not pass a signal on to, or a cell a killed sweep left
running). polgrad/sweep/launch.py starts the cells and records them here.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Running:
    """A running cell: its first process (the trainer or the launcher), run folder, own group or not."""

    proc: subprocess.Popen
    run_dir: Path
    own_group: bool

    def signal(self, sig: int) -> None:
        """`sig` to the cell's process group when it has one, else to its one process."""
        try:
            if self.own_group:
                os.killpg(self.proc.pid, sig)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float) -> None:
        """SIGTERM, SIGKILL after `grace` s; then whatever is left of the cell (see `end`)."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()
        self.end()

    def end(self) -> None:
        """No process of a several-rank cell outlives it: its group, then ranks in sessions of their own."""
        if self.own_group:
            self.signal(signal.SIGKILL)
            kill_pids(cell_pids(self.run_dir), grace=5.0)


RUNNING: dict[str, Running] = {}
RUNNING_LOCK = threading.Lock()
STOPPING = threading.Event()  # set on ^C / SIGTERM: no new trainer may start


def allow_trainers() -> None:
    """A sweep starts: trainers may be launched again (clears the stop of an earlier interrupt)."""
    STOPPING.clear()


# How long a stopped cell may take to end its step and checkpoint it (polgrad/stopping.py) before
# it is killed (its last periodic checkpoint then stays the one it resumes from).
STOP_GRACE_S = 60.0


def stop_trainers() -> None:
    """^C / SIGTERM: no new trainer may start; terminate the running ones (each finishes its step and
    checkpoints it), kill those still running after STOP_GRACE_S."""
    with RUNNING_LOCK:
        STOPPING.set()
        running = list(RUNNING.values())
    for r in running:
        r.signal(signal.SIGTERM)
    for r in running:
        r.stop(grace=STOP_GRACE_S)


def cell_pids(run_dir: Path) -> list[int]:
    """Live processes whose command line has `--out <run_dir>`: the cell's trainer, ranks, launcher."""
    target, me = str(run_dir), os.getpid()
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit() and int(n) != me]
    except OSError:  # no /proc: nothing to find
        return []
    pids = []
    for name in names:
        try:
            args = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        out = any(a == "--out" and b == target for a, b in zip(args, args[1:], strict=False))
        if out and alive(int(name)):
            pids.append(int(name))
    return pids


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")  # a zombie has ended


def kill_pids(pids: Sequence[int], grace: float) -> None:
    """SIGTERM to `pids`, up to `grace` s for them to end, then SIGKILL to those left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            time.sleep(0.1)
        if not pids:
            return


def kill_stale_trainer(run_dir: Path) -> None:
    """A cell's processes left running by a sweep that was killed alone (not its process group):
    every process whose command line has `--out <run_dir>`; stop them before the cell starts again."""
    kill_pids(cell_pids(run_dir), grace=10.0)


def parent_death_signal(sig: int):
    """A preexec_fn: in the child before exec (Linux), ask for `sig` when the thread that started it
    dies, e.g. when Ray kills the worker running a cancelled task. prctl is looked up here, in the
    parent (no dlopen in a child forked from a threaded process); a parent already gone by the time
    the child asks gets the signal at once."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(sig))  # PR_SET_PDEATHSIG = 1
        if os.getppid() != parent:  # the parent died before prctl: nothing would send the signal
            os.kill(os.getpid(), int(sig))

    return preexec
