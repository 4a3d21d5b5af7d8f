"""A run folder has one owner: the trainer's lock on `--out`, and no silent overwrite of a run.

`acquire(run_dir)` creates the folder if needed and takes an exclusive lock on it: the file
`<run_dir>/.lock`, holding the owner's pid, host and start time (JSON), under `fcntl.flock`. The
kernel's flock is what excludes a second owner (it is released when the process ends, however it
ends, ``kill -9`` included); the file's contents only name the holder. A second `acquire` while
the holder lives is a one-line `RunLocked` naming it (pid, host, since when). A lock file left by
a process that died without releasing it (its flock is gone) is taken over with one warning line;
one written on another host is refused (polgrad cannot see that host's processes, and flock over
a network file system is not always shared), naming the file to delete once that process has
ended. Releasing (the context manager's exit, on success, error or ^C) removes the file.

Opening an existing lock file and locking it are two steps, so a releaser may unlink the file in
between: after locking, `acquire` checks that the path still names the file it locked, else it
starts over on the new file (no two owners of two different files).

`existing_run(run_dir)` lists what makes a folder an existing run (metrics.jsonl, summary.json, a
non-empty checkpoints/): the trainer refuses to start such a folder afresh without `--resume`.

A folder that cannot be made or written (`--out` below a regular file, a read-only location) is a
one-line `RunFolderError` saying to choose another `--out`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from polgrad import run_folder
from polgrad.errors import PolgradError, is_write_failure

LOCK_NAME = run_folder.LOCK


class RunFolderError(PolgradError):
    """`--out` cannot be this run's folder: it is a file, cannot be written, or holds another run."""


class RunLocked(RunFolderError):
    """The run folder is owned by another live trainer."""


def existing_run(run_dir: str | os.PathLike) -> list[str]:
    """What in `run_dir` belongs to a run that started: metrics.jsonl, summary.json, checkpoints/."""
    return run_folder.RunFolder(run_dir).started()


def check_not_a_run(run_dir: str | os.PathLike) -> None:
    """A fresh start into a folder holding a run is an error naming both ways on."""
    found = existing_run(run_dir)
    if found:
        raise RunFolderError(
            f"{run_dir} already holds a run ({', '.join(found)}); add --resume to continue it, or choose a "
            "new --out to start another (nothing was overwritten)"
        )


def _holder_text(holder: dict) -> str:
    pid, host, since = holder.get("pid", "?"), holder.get("host", "?"), holder.get("since", "?")
    return f"pid {pid} on host {host} since {since}"


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        holder = json.loads(os.read(fd, 4096).decode(errors="replace") or "{}")
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _alive(pid) -> bool:
    """Whether process `pid` exists on this host (another user's counts)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return isinstance(pid, int)
    return True


def _folder(run_dir: str) -> None:
    """Make `run_dir` (and its parents); a path that cannot be a folder is one line, before any work."""
    existed = os.path.isdir(run_dir)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        p = Path(run_dir)
        blocker = next((q for q in (p, *p.parents) if q.exists() and not q.is_dir()), p)
        raise RunFolderError(
            f"--out {run_dir}: {blocker} is a file, not a folder; choose another --out"
        ) from None
    except OSError as e:
        if not is_write_failure(e):
            raise
        raise _unwritable(run_dir, e, existed) from None


def _unwritable(run_dir: str, e: OSError, existed: bool) -> RunFolderError:
    reason = os.strerror(e.errno) if e.errno else str(e)
    reason = reason[:1].lower() + reason[1:]
    if existed:
        return RunFolderError(
            f"cannot write the run folder {run_dir} ({reason}); make it writable, or choose another --out"
        )
    return RunFolderError(f"cannot create the run folder {run_dir} ({reason}); choose another --out")


class RunLock:
    """The held lock of one run folder; `release()` (or leaving the `with` block) gives it up."""

    def __init__(self, path: str, fd: int, created: bool = False):
        self.path, self.fd, self.created = path, fd, created

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)  # before the flock goes: the next owner creates a new file
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None
        if self.created:  # a run refused before it wrote anything leaves no empty folder behind
            with contextlib.suppress(OSError):  # not empty (it ran, or a new owner's lock): kept
                os.rmdir(os.path.dirname(self.path))

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(run_dir: str | os.PathLike, *, warn=None) -> RunLock:
    """Make `run_dir` and lock it for this process (see the module docstring); `warn(line)` prints."""
    run_dir = str(run_dir)
    warn = warn or (lambda line: print(line, file=sys.stderr))
    existed = os.path.isdir(run_dir)
    _folder(run_dir)
    path = os.path.join(run_dir, LOCK_NAME)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            if not is_write_failure(e):
                raise
            raise _unwritable(run_dir, e, existed) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                os.close(fd)
                raise
            holder = _read_holder(fd)
            for _ in range(20):  # the holder writes its name just after locking
                if holder:
                    break
                time.sleep(0.05)
                holder = _read_holder(fd)
            os.close(fd)
            raise RunLocked(
                f"the run folder {run_dir} is in use by another trainer ({_holder_text(holder)}; lock file "
                f"{path}); wait for it to end, or choose another --out"
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # released (unlinked) between our open and our flock: lock the new file
            os.close(fd)
            continue
        try:
            _take(fd, path, run_dir, warn)
        except BaseException:
            os.close(fd)
            raise
        return RunLock(path, fd, created=not existed)


def _take(fd: int, path: str, run_dir: str, warn) -> None:
    """Write our name into the locked file, after checking who left it there (if anyone)."""
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    previous = _read_holder(fd)
    if previous:
        if previous.get("host") != me["host"]:
            raise RunLocked(
                f"the run folder {run_dir} is locked by {_holder_text(previous)}, another host, whose "
                f"processes polgrad cannot check; once that trainer has ended, delete {path} and re-run"
            )
        state = "no longer running" if not _alive(previous.get("pid")) else "no longer holding it"
        warn(f"warning: taking over the stale lock {path} of {_holder_text(previous)} ({state})")
    me["since"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    os.fsync(fd)
