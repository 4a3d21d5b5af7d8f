"""The results CSV of a sweep: its columns, atomic upserts under a lock file, reading it back, and the
per-run metrics.jsonl the curves are drawn from."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import DataError, is_write_failure, write_error
from polgrad.io import atomic_write_text
from polgrad.results.paths import csv_path, experiments
from polgrad.summary import LENGTH_KEYS, REWARD_MODEL_KEYS

# The metrics a trainer's summary.json carries, in the order they appear in the CSV and the table.
METRICS = (
    "final_train_reward",
    "eval_accuracy",
    "eval_accuracy_init",
    "kl",
    "kl_exact",
    "entropy",
    "tokens_per_s",
    "wall_time_s",
    "peak_mem_mb",
)
# Table 5 of the chapter, one row per spec: the trainer records it in summary.json ("table5"), the
# sweep copies it into these CSV columns; they sit after `steps`.
TABLE5_COLUMNS = (
    "table5_method",
    "table5_type",
    "table5_reward_model",
    "table5_value_function",
    "table5_reference_policy",
    "table5_core_loss",
)
# How the run was spread: data-parallel ranks and ZeRO stage (summary.json's world_size and
# zero_stage); they sit after `steps`. An older CSV without them still loads (blank there).
RUN_COLUMNS = ("world_size", "zero_stage")
# The budget (polgrad/sweep/budget.py): what the run sampled, kept and generated in total (summary.json)
# and, from the sweep's dry run, its prompts per step and how it spends a step (experiment.json's cell;
# e.g. "8 prompts × 8 = 64 sequences", or a preference spec's "not sampled: 32 preference pairs per
# step"). They sit after the run columns; rows without them leave them blank.
BUDGET_COLUMNS = (
    "sampled_sequences",
    "kept_sequences",
    "generated_tokens",
    "prompts_per_step",
    "budget_note",
)
# The swept bindings a cell's built config never reads (space-separated; the sweep's dry run finds
# them, polgrad/sweep/reads.py): labels and the md's table leave them out of that cell's group.
NOT_READ = "not_read"
# The policy a run started from (summary.json's warm_start: its SFT cache key, polgrad/build.py): cells of
# one seed share it when pairing holds. An older CSV without it still loads (the md says so).
WARM_START = "warm_start"
# A run trained on a reward model: the gold (task verifier) beside the proxy it trained on
# (polgrad/summary.py); blank, and absent from a CSV none of whose runs had one, otherwise.
REWARD_MODEL_COLUMNS = REWARD_MODEL_KEYS
# The lengths of right and wrong responses (polgrad/summary.py); blank where a run did not record
# them (older runs), and absent from a CSV none of whose runs had them.
LENGTH_COLUMNS = LENGTH_KEYS
# What Sweep.predictions, Sweep.tuning's metric and Sweep.primary_metric may name.
OUTCOME_METRICS = (*METRICS, *REWARD_MODEL_COLUMNS, *LENGTH_COLUMNS)
FRONT_COLUMNS = ("experiment", "cell_id", "spec", "spec_file")
BACK_COLUMNS = (
    "seed",
    WARM_START,
    NOT_READ,
    *METRICS,
    "steps",
    *RUN_COLUMNS,
    *BUDGET_COLUMNS,
    *REWARD_MODEL_COLUMNS,
    *LENGTH_COLUMNS,
    *TABLE5_COLUMNS,
    "status",
    "error",
    "run_dir",
    "git_commit",
    "git_diff",
    "user_modules",
    "python",
    "torch",
    "transformers",
    "deepspeed",
    "hostname",
    "cpu_count",
    "cpu",
    "finished_at",
)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path.lock` (fcntl.flock; each open is its own lock, so threads exclude too)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the os.replace below still keeps the file whole
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(str(path) + ".lock", "a")
    except OSError as e:  # a read-only results folder: one line naming the CSV
        if is_write_failure(e):
            raise write_error(e, path) from e
        raise
    with fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def order_columns(columns: Iterable[str]) -> list[str]:
    """Fixed columns first and last; anything else (the swept bindings) between, in first-seen order."""
    seen: list[str] = []
    for c in columns:
        if c not in seen:
            seen.append(c)
    middle = [c for c in seen if c not in FRONT_COLUMNS and c not in BACK_COLUMNS]
    front = [c for c in FRONT_COLUMNS if c in seen]
    back = [c for c in BACK_COLUMNS if c in seen]
    return front + middle + back


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    if not path.exists():
        return [], []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _cell_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return ""
    return str(value)


def upsert_row(path: str | os.PathLike, row: dict[str, Any], order: Sequence[str] | None = None) -> None:
    """Insert `row` into the CSV at `path`, replacing any row with the same cell_id.

    The whole file is rewritten to a temp file and moved into place with os.replace, under a lock
    file, so a crash or a SIGKILL at any moment leaves either the old or the new file, and parallel
    writers never lose each other's rows. Rows are kept in `order` (a list of cell ids: the sweep's
    expansion order) so the file does not depend on which cell finished first.
    """
    path = Path(path)
    row = {k: _cell_text(v) for k, v in row.items()}
    with _locked(path):
        header, rows = _read_rows(path)
        rows = [r for r in rows if r.get("cell_id") != row["cell_id"]] + [row]
        if order is not None:
            rank = {cid: i for i, cid in enumerate(order)}
            rows.sort(
                key=lambda r: rank.get(r.get("cell_id", ""), len(rank))
            )  # stable: unknown ids keep order
        _write(path, rows, order_columns([*header, *row]))


def read_table(path: str | os.PathLike) -> tuple[list[str], list[dict[str, str]]]:
    """The CSV's header and rows (text), ([], []) if the file does not exist."""
    return _read_rows(Path(path))


def rewrite_rows(
    path: str | os.PathLike, rows: Sequence[dict[str, Any]], columns: Sequence[str], *, lock: bool = True
) -> None:
    """Replace the whole CSV at `path` by `rows` (atomically: old file or new, never half), under the
    CSV's lock unless the caller already holds it (`lock=False` inside `with locked(path)`)."""
    path = Path(path)
    with _locked(path) if lock else contextlib.nullcontext():
        _write(path, [{k: _cell_text(v) for k, v in r.items()} for r in rows], order_columns(columns))


def locked(path: str | os.PathLike):
    """The CSV's lock, for a read-compare-rewrite that no writer may interleave (the lock is not
    re-entrant: inside it, write with `rewrite_rows(..., lock=False)`)."""
    return _locked(Path(path))


def _write(path: Path, rows: Sequence[dict[str, str]], columns: Sequence[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(
        buf, fieldnames=list(columns), restval="", lineterminator="\n", extrasaction="ignore"
    )
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buf.getvalue())


def unread_columns(rows: Iterable[dict[str, Any]], group_columns: Sequence[str]) -> dict[tuple, set[str]]:
    """Per group (the values of `group_columns`, as text): the swept columns its rows do not read."""
    out: dict[tuple, set[str]] = {}
    for r in rows:
        key = tuple(str(r.get(c, "")) for c in group_columns)
        out.setdefault(key, set()).update(str(r.get(NOT_READ) or "").split())
    return out


def read_rows(path: str | os.PathLike) -> list[dict[str, str]]:
    """The CSV's rows as dicts of text (no type guessing), [] if the file does not exist."""
    return _read_rows(Path(path))[1]


def load(experiment: str, results_dir: str | os.PathLike = "results"):
    """The results of `experiment` (results_dir/<experiment>/<experiment>.csv) as a pandas DataFrame."""
    import pandas as pd

    path = csv_path(experiment, results_dir)
    if not path.exists():
        found = experiments(results_dir)
        have = f"; results there: {', '.join(found)}" if found else ""
        raise DataError(
            f"no results for experiment '{experiment}': {path} does not exist "
            f"(run python -m polgrad.sweep experiments/{experiment}.gin){have}"
        )
    return pd.read_csv(path)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line is skipped; a step logged twice keeps its last row."""
    by_step: dict[Any, dict[str, Any]] = {}
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and "step" in row:
                    by_step[row["step"]] = row
    except OSError:
        return []
    return [by_step[s] for s in sorted(by_step)]
