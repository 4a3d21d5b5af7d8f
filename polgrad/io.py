"""File writes that a crash cannot leave half done (the bottom layer: any module may use them).

Every write goes to a temp file beside the target, is fsynced and moved into place with os.replace,
so readers see the old file or the new one, never half of one. The file gets the mode a plain
`open(path, "w")` would give it (0o666 minus the umask: e.g. 0o644, readable by others on a shared
machine), not mkstemp's private 0o600. A write that fails for a reason the user fixes outside
polgrad (disk full, read-only folder, permission: `polgrad.errors.WRITE_ERRNOS`) removes the temp
file and raises a one-line `WriteError` naming the file and the reason; the old file is untouched.

A whole folder (a model: final/, an export) is written the same way by `atomic_dir`: into a temp
folder beside it, renamed into place when complete (see its docstring).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from polgrad.errors import is_write_failure, write_error

_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """The process's umask, read without changing it where Linux reports it (/proc/self/status)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    with _UMASK_LOCK:  # elsewhere: set and restore it (under a lock: the sweep writes from threads)
        old = os.umask(0o022)
        os.umask(old)
        return old


def new_file_mode() -> int:
    """The mode `open(path, 'w')` gives a new file: 0o666 minus the umask."""
    return 0o666 & ~umask()


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temp path beside `path` to write; on success move it into place with the mode a new
    file gets (`new_file_mode`); on any failure remove it, and turn a disk-full / read-only /
    permission OSError into a one-line `WriteError` naming `path`. `suffix` keeps writers that pick
    the format by extension (matplotlib's savefig) happy."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    except OSError as e:
        if is_write_failure(e):
            raise write_error(e, path) from e
        raise
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if is_write_failure(e):
            raise write_error(e, path) from e
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` to a temp file beside `path`, fsync, os.replace: readers see old or new, never half."""
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: someone else's live process
        return True
    return True


def _stale_siblings(path: Path) -> list[Path]:
    """Temp and set-aside folders of earlier `atomic_dir` writes of `path` whose writer is dead."""
    found = []
    for p in path.parent.glob(f"{glob_escape(path.name)}.*-*"):
        kind, _, rest = p.name[len(path.name) + 1 :].partition("-")
        pid = rest.split("-")[0]
        if kind in ("tmp", "old") and pid.isdigit() and not _pid_alive(int(pid)) and p.is_dir():
            found.append(p)
    return found


def glob_escape(text: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in text)


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
    for d in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        with contextlib.suppress(OSError):  # not every platform can fsync a directory
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp folder beside `path` (`<name>.tmp-<pid>-<random>`) to write a whole folder
    into; on success fsync it and move it into place: a folder already at `path` is first renamed
    aside (`<name>.old-<pid>-<random>`), the new one renamed in, the old one removed. A crash (even
    SIGKILL) at any moment leaves `path` as it was or complete, never half written, with one window:
    a SIGKILL between the two renames of a swap leaves no `path`, only the old folder (complete) set
    aside, and the next write of `path` first puts it back; the temp and set-aside folders of
    writers that died are removed by the next successful write of `path`. On a
    failure the temp folder is removed, and a disk-full / read-only / permission OSError is a one-line
    `WriteError` naming `path`."""
    path = Path(path)
    tag = f"{os.getpid()}-"
    if not path.exists():  # a writer killed mid-swap: its set-aside old folder goes back first
        aside = [p for p in _stale_siblings(path) if p.name.startswith(f"{path.name}.old-")]
        if aside:
            with contextlib.suppress(OSError):
                os.replace(max(aside, key=lambda p: p.stat().st_mtime), path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{path.name}.tmp-{tag}", dir=path.parent))
        os.chmod(tmp, 0o777 & ~umask())
    except OSError as e:
        if is_write_failure(e):
            raise write_error(e, path) from e
        raise
    old = None
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{path.name}.old-{tag}", dir=path.parent))
            os.replace(path, old)  # rename(2) of a folder onto an empty folder replaces it
        os.replace(tmp, path)
    except BaseException as e:
        if old is not None and not path.exists():  # the new one could not go in: the old one back
            with contextlib.suppress(OSError):
                os.replace(old, path)
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):
            raise write_error(e, path) from e
        raise
    for stale in ([old] if old is not None else []) + _stale_siblings(path):
        shutil.rmtree(stale, ignore_errors=True)
