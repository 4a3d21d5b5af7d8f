"""Small helpers the test files share (their fixtures are in conftest.py); tests/ is on sys.path
(conftest.py's folder), so a test anywhere under tests/ imports them as `from helpers import ...`."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def csv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV as dicts of text."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """`rows` as a CSV at `path` (its folder made), the columns those of the first row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def require(*names: str, env: str | None = None) -> None:
    """Skip the calling test module where a package of `names` is not installed; with `env` set to 1 in
    the environment (CI sets POLGRAD_REQUIRE_VLLM=1, whose set-up installs vLLM), a missing package is
    a collection error instead. Found without importing it (importlib.util.find_spec): each xdist
    worker collects every module, and importing vLLM, MLflow or W&B there (~1-6 CPU-s each) cost
    every worker what only the one that runs the module needs; the tests import them when they run."""
    import importlib.util
    import os

    import pytest

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if not missing:
        return
    if env and os.environ.get(env) == "1":
        raise ImportError(f"{', '.join(missing)} not installed, and {env}=1 requires it")
    pytest.skip(f"{', '.join(missing)} not installed", allow_module_level=True)
