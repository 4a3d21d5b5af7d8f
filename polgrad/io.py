"""File writes that a crash cannot leave half done (the bottom layer: any module may use them).

Every write goes to a temp file beside the target, is fsynced and moved into place with os.replace,
so readers see the old file or the new one, never half of one. The file gets the mode a plain
`open(path, "w")` would give it (0o666 minus the umask: e.g. 0o644, readable by others on a shared
machine), not mkstemp's private 0o600. A write that fails for a reason the user fixes outside
polgrad (disk full, read-only folder, permission: `polgrad.errors.WRITE_ERRNOS`) removes the temp
file and raises a one-line `WriteError` naming the file and the reason; the old file is untouched.
"""

from __future__ import annotations

import contextlib
import os
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
