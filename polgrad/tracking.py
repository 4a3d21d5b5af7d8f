"""A run's trackers: the `train.loggers` parts (polgrad/components/tracker.py), fed by the loop on rank 0.

`polgrad.trainer.train` makes three calls:

    track = start(cfg, out_dir, spec, state.step, enabled=rank == 0)   after start_or_resume
    track.log(row)                                                     with each metrics.jsonl row
    track.finish(summary)                                              after summary.json

`start` opens every chosen tracker as the config bound it (`cfg.trackers()`: registry parts, so a
user's own registered tracker is chosen the same way, its hyperparameters read at the build) and,
on a fresh start, logs the starting policy's held-out accuracy (eval.jsonl's step 0) as
`eval_accuracy` at step 0. Each row goes out with its "step" (the steps done) and its numbers
only (a string such as `skipped_update` is not sent); the summary's numbers go out as
`summary/<key>` at the last step. A run that stops early (an exception, ^C) closes its trackers at
exit with status failed.

What a tracker run is called: its name is $POLGRAD_CELL_ID, else the run folder's name; its group
(MLflow experiment, W&B group) $POLGRAD_EXPERIMENT, else 'polgrad'; its params the spec's name and
every `train.*` field, updated by the JSON object $POLGRAD_CELL_PARAMS. A sweep sets all three for
each cell (polgrad/sweep/launch.py): the cell id, `Sweep.name`, and the spec, the swept bindings
as written in the experiment file (`{"Algorithm.kl": "@kl.k3", ...}`) and the seed.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
from typing import Any

from polgrad.components.tracker import numbers
from polgrad.run_folder import RunFolder

ENV_NAME, ENV_GROUP, ENV_PARAMS = "POLGRAD_CELL_ID", "POLGRAD_EXPERIMENT", "POLGRAD_CELL_PARAMS"
DEFAULT_GROUP = "polgrad"


class Trackers:
    """The run's open trackers (none on ranks > 0 or without `train.loggers`)."""

    def __init__(self, parts: list[Any], step: int = 0):
        self.parts, self.step = parts, step
        if parts:
            atexit.register(self._abort)

    def log(self, row: dict[str, Any]) -> None:
        """One metrics row (its "step" is the steps done): its numbers to every tracker."""
        self.step = int(row["step"])
        values = {k: v for k, v in numbers(row).items() if k != "step"}
        for part in self.parts:
            part.log(values, self.step)

    def finish(self, summary: dict[str, Any]) -> None:
        """The summary's numbers at the last step, then close every tracker (status ok)."""
        for part in self.parts:
            part.summary(numbers(summary), self.step)
            part.close(True)
        if self.parts:
            atexit.unregister(self._abort)
        self.parts = []

    def _abort(self) -> None:
        for part in self.parts:
            try:
                part.close(False)
            except Exception:  # noqa: BLE001 - exiting anyway; the metrics are on disk
                pass
        self.parts = []


def run_params(cfg: Any, spec: str) -> dict[str, str]:
    """What the run is, as strings: the spec, every `train.*` field, then $POLGRAD_CELL_PARAMS."""
    params = {"spec": spec}
    for field in dataclasses.fields(cfg):
        value = cfg.task_name if field.name == "task" else getattr(cfg, field.name)
        params[f"train.{field.name}"] = value
    extra = json.loads(os.environ.get(ENV_PARAMS) or "{}")
    params.update(extra if isinstance(extra, dict) else {})
    return {k: str(v) for k, v in params.items()}


def start(cfg: Any, out_dir: str, spec: str, resume_step: int, *, enabled: bool) -> Trackers:
    """Open the trackers of `cfg.loggers` for the run in out_dir (`enabled`: this rank logs)."""
    if not enabled or not cfg.loggers:
        return Trackers([])
    name = os.environ.get(ENV_NAME) or os.path.basename(os.path.abspath(out_dir))
    group = os.environ.get(ENV_GROUP) or DEFAULT_GROUP
    params = run_params(cfg, spec)
    parts = [
        tracker(out_dir, name=name, group=group, params=params, resume_step=resume_step)
        for tracker in cfg.trackers().values()
    ]
    track = Trackers(parts, step=resume_step)
    if not resume_step:
        start_eval = _start_accuracy(out_dir)
        if start_eval is not None:
            track.log({"step": 0, "eval_accuracy": start_eval})
    return track


def _start_accuracy(out_dir: str) -> float | None:
    """The starting policy's held-out accuracy: the step-0 record of eval.jsonl (polgrad.evaluation)."""
    try:
        with open(RunFolder(out_dir).eval) as fh:
            for line in fh:
                record = json.loads(line)
                if record.get("step") == 0:
                    return float(record["accuracy"])
    except (OSError, ValueError, KeyError):
        return None
    return None
