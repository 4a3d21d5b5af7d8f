"""One config pipeline: parse gin files and bindings, validate them, explain errors in one line.

Used by `python -m polgrad.train`, the sweep's dry run and the benchmarks, so all three read a
configuration the same way.
"""

from __future__ import annotations

import os

import gin

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_BASE = os.path.join("experiments", "base_tiny.gin")


def _resolve(path: str) -> str:
    """A config path as given, or relative to the repository root."""
    if os.path.exists(path):
        return path
    alt = os.path.join(REPO_ROOT, path)
    return alt if os.path.exists(alt) else path


def parse_config(files: list[str], bindings: list[str], base: str | None = DEFAULT_BASE) -> None:
    """Parse `base` (if any), the files, then the bindings.

    Raises ConfigError naming the file and the binding on any gin error.
    """
    import polgrad  # noqa: F401  (registers every part)
    import polgrad.trainer  # noqa: F401  (registers `train`)
    from polgrad.errors import ConfigError

    gin.add_config_file_search_path(REPO_ROOT)
    paths = [_resolve(f) for f in files]
    for p in paths:
        if not os.path.isfile(p):
            raise ConfigError(f"config file {p} does not exist")
    if base:
        paths = [_resolve(base), *paths]
    for p in paths:
        try:
            gin.parse_config_file(p)
        except (ValueError, TypeError, KeyError, OSError, SyntaxError) as e:
            raise ConfigError(f"{p}: {' '.join(str(e).split())}") from None
    for b in bindings:
        try:
            gin.parse_config(b)
        except (ValueError, TypeError, KeyError, SyntaxError) as e:
            raise ConfigError(f"--bind {b!r}: {' '.join(str(e).split())}") from None
