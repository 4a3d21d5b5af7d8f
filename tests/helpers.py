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
