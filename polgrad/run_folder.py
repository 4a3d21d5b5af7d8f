"""The run folder: every file a run writes, named once, with its writer and its reader.

A training run (`python -m polgrad.train ... --out DIR`, or a sweep's cell) writes into one folder:

    config.gin              every binding of the run (written first, atomically, so a crash still has
                            it); a resume whose bindings differ rewrites it
    resume_overrides.jsonl  one line per resume that changed a binding: what changed, and from which step
    metrics.jsonl           one JSON object per step, appended and flushed every step
    eval.jsonl              one record per held-out evaluation (step 0 = the starting policy)
    summary.json            written atomically at the end of the run
    operative_config.gin    the bindings gin actually used, written atomically at the end
    .lock                   the live trainer that owns the folder (polgrad/runlock.py)
    checkpoints/            policy/ (and critic/, sampler/): DeepSpeed's checkpoints, one tag per step
    model/                  the policy's config + tokenizer and the spec's name (what polgrad.export needs)
    final/                  the result as a model (polgrad/export.py)

Nothing else in polgrad spells these names (tests/project/test_layers.py checks it): code that reads or
writes a run's file asks `RunFolder(path)` for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from polgrad.io import atomic_write_text

CONFIG = "config.gin"
RESUME_OVERRIDES = "resume_overrides.jsonl"
METRICS = "metrics.jsonl"
EVAL = "eval.jsonl"
SUMMARY = "summary.json"
OPERATIVE_CONFIG = "operative_config.gin"
CHECKPOINTS = "checkpoints"
MODEL = "model"
FINAL = "final"
LOCK = ".lock"  # the live trainer's claim on the folder (polgrad/runlock.py)

# A folder holding one of these (or a non-empty checkpoints/) had a run (`RunFolder.started`).
RUN_FILES = (METRICS, SUMMARY)
# What a run that starts over from step 0 must not inherit from an earlier attempt in the same folder.
ATTEMPT_FILES = (METRICS, EVAL, SUMMARY, CONFIG)


def _append_line(path: Path, record: dict[str, Any]) -> None:
    """`record` as one JSON line at the end of `path`, flushed when the file closes."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class _File:
    """A file (or folder) of the run folder by name: `RunFolder(d).metrics` is d / METRICS."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, folder: RunFolder | None, owner: type) -> Any:
        return self if folder is None else folder.root / self.name


class RunFolder:
    """One run's folder (`root`): the path of each of its files, and their writers and readers."""

    config = _File(CONFIG)
    resume_overrides = _File(RESUME_OVERRIDES)
    metrics = _File(METRICS)
    eval = _File(EVAL)
    summary = _File(SUMMARY)
    operative_config = _File(OPERATIVE_CONFIG)
    checkpoints = _File(CHECKPOINTS)
    model = _File(MODEL)
    final = _File(FINAL)

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.root)!r})"

    def checkpoints_of(self, role: str) -> Path:
        """checkpoints/<role>/: 'policy', 'critic' (DeepSpeed tags step<N>) or 'sampler' (async versions)."""
        return self.root / CHECKPOINTS / role

    # ------------------------------------------------------------------ writers
    def write_config(self, text: str) -> None:
        """config.gin, atomically (a reader never sees half a file)."""
        atomic_write_text(self.config, text)

    def write_operative_config(self, text: str) -> None:
        atomic_write_text(self.operative_config, text)

    def append_metrics(self, row: dict[str, Any]) -> None:
        """One step's row, appended and flushed (a killed run keeps every finished step)."""
        _append_line(self.metrics, row)

    def append_resume_override(self, record: dict[str, Any]) -> None:
        _append_line(self.resume_overrides, record)

    def write_summary(self, summary: dict[str, Any]) -> None:
        """summary.json, atomically, keys sorted."""
        atomic_write_text(self.summary, json.dumps(summary, indent=2, sort_keys=True))

    def forget_attempt(self) -> None:
        """Remove what an earlier attempt wrote that a run starting at step 0 must not inherit."""
        for name in ATTEMPT_FILES:
            (self.root / name).unlink(missing_ok=True)

    # ------------------------------------------------------------------ readers
    def read_summary(self) -> dict[str, Any]:
        return json.loads(self.summary.read_text())

    def started(self) -> list[str]:
        """What here belongs to a run that started: metrics.jsonl, summary.json, a non-empty checkpoints/."""
        found = [name for name in RUN_FILES if (self.root / name).exists()]
        if self.checkpoints.is_dir() and any(self.checkpoints.iterdir()):
            found.append(CHECKPOINTS + "/")
        return found
