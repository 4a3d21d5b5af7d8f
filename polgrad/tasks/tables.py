"""A user's data file read into rows: what task.file reads before it knows its columns.

    .jsonl            one JSON object per line (blank lines skipped), read here
    .json             the same (JSON lines, as `Dataset.to_json` writes), or one JSON array of objects
    .parquet          read with pandas
    .csv, a folder    read with Hugging Face `datasets` (polgrad/tasks/datasets_io.py)

Every problem is a one-line DataError naming the file, the line or item, and the binding to fix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from polgrad.errors import DataError
from polgrad.tasks.datasets_io import utf8_lines

SUPPORTED = (".jsonl", ".json", ".parquet")


def _json_array(path: Path) -> bool:
    """Whether a .json file's first non-blank character opens an array (else: JSON lines)."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 byte-order mark too
    return head.startswith(b"[")


def _objects(
    path: Path, labelled: Iterable[tuple[str, Any]], each: str
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The (location, JSON value) pairs checked to be objects, and their columns in order of first
    appearance; `each` words the rule in the one-line error ('each line must be one JSON object')."""
    records: list[tuple[str, dict[str, Any]]] = []
    columns: dict[str, None] = {}
    for where, obj in labelled:
        if not isinstance(obj, dict):
            raise DataError(
                f"{path}: {where} is a JSON {type(obj).__name__}, not an object; "
                f'{each} such as {{"prompt": ..., "answer": ...}}'
            )
        columns.update(dict.fromkeys(obj))
        records.append((where, obj))
    return records, list(columns)


def _array_items(path: Path) -> list[tuple[str, Any]]:
    """The items of a .json file holding one JSON array, each with its location."""
    text = "".join(line for _, line in utf8_lines(path))
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a .json file holds "
            "one array of objects or one object per line (JSON lines)"
        ) from None
    return [(f"item {i} (0-based) of its array", obj) for i, obj in enumerate(data)]


def _lines(path: Path) -> Iterator[tuple[str, Any]]:
    """The JSON value of each non-blank line of a JSON-lines file, with its location."""
    for lineno, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            yield f"line {lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}: line {lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                "each line must be one JSON object"
            ) from None


def _read_records(path: Path) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """[(location label, record)] and the columns present, in order of first appearance.

    A .json file is JSON lines (what `Dataset.to_json` and `df.to_json(..., lines=True)` write) or one
    JSON array of objects (`df.to_json(..., orient='records')`), whichever it holds."""
    if path.suffix == ".json" and _json_array(path):
        return _objects(path, _array_items(path), "each item must be an object")
    if path.suffix in (".jsonl", ".json"):
        return _objects(path, _lines(path), "each line must be one JSON object")
    import pandas as pd

    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"{path}: could not read parquet ({msg}); check it is a valid parquet file") from None
    records = [(f"row {i} (0-based)", rec) for i, rec in enumerate(df.to_dict("records"))]
    return records, [str(c) for c in df.columns]


def read_table(
    p: Path, split: str, path_binding: str, split_binding: str
) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The rows of a .jsonl/.json/.parquet file (read here), or of a .csv file or a dataset folder (read by
    `datasets`, polgrad/tasks/datasets_io.py; `split` chooses a split there); a one-line DataError
    naming the file and the binding (e.g. 'task.file.path') for a missing file or an unsupported kind."""
    from polgrad.tasks.datasets_io import DATASET_SUFFIXES, read_dataset

    kinds = ", ".join((*SUPPORTED, *DATASET_SUFFIXES)) + " or a Hugging Face dataset folder"
    if not p.exists():
        raise DataError(f"{p}: no such file or folder; set {path_binding} to an existing {kinds}")
    if p.is_dir() or p.suffix in DATASET_SUFFIXES:
        return read_dataset(p, split, split_binding)
    if p.suffix not in SUPPORTED:
        raise DataError(
            f"{p}: unsupported extension '{p.suffix}'; supported: {kinds} "
            "(pandas converts others: df.to_json(path, orient='records', lines=True))"
        )
    return _read_records(p)
