"""Where a results row ran: git commit, package versions, hostname, CPU count (no heavy imports)."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import socket
import subprocess
from typing import Any


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """Short sha of HEAD (with `-dirty` if tracked files changed), or 'unknown' outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0 or not sha.stdout.strip():
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask where there is one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """git commit, python/torch/transformers/deepspeed versions, hostname, cpu count (no heavy imports)."""
    return {
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "deepspeed": _version("deepspeed"),
        "hostname": socket.gethostname(),
        "cpu_count": cpu_count(),
    }
