"""Reading a Hugging Face dataset on disk into rows: what `task.file` and preference files accept
besides .jsonl and .parquet (the extra `tasks` installs `datasets`).

    task.file.path = 'data/gsm8k'             # a folder written by Dataset(Dict).save_to_disk
    task.file.path = 'data/my_json_files'     # a folder of .json/.jsonl/.parquet/.csv data files
    task.file.path = 'data/train.csv'         # a .csv file
    task.file.split = 'test'                  # which split of a DatasetDict or a folder (default 'train')

A folder that `datasets.load_from_disk` reads (a saved Dataset, or a DatasetDict with the split
chosen) is read so; any other folder is a local dataset whose builder `datasets.load_dataset(folder)`
infers from its files (json, parquet, csv, ...), and its `split`; a .csv file through the csv
builder. .jsonl and .parquet files are read by polgrad itself (tasks/files.py: json line by line
with the line number in every error, parquet with pandas), so the core install reads them without
`datasets`. Rows are plain dicts, as `Dataset.to_list()` gives them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polgrad.errors import ConfigError, DataError

DATASET_SUFFIXES = (".csv",)  # single files read through `datasets`
TEXT_SUFFIXES = (".csv", ".json", ".jsonl")  # the text files of a folder of data files


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "reading a Hugging Face dataset folder or a .csv file needs the datasets package: "
            "pip install 'polgrad[tasks]' (or pip install datasets)"
        ) from None
    return datasets


def utf8_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each line of `path` decoded as UTF-8; a byte that is not UTF-8 is
    a one-line DataError naming the line, the byte and the fix. Each line is decoded alone (no UTF-8
    character contains the newline byte 0x0a), so the error knows its line: a text-mode reader's
    error gives only an offset into its read buffer, not into the file."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: line {lineno} is not UTF-8 text (byte 0x{raw[e.start]:02x} at byte "
                    f"{e.start + 1} of the line: {e.reason}); re-encode the file as UTF-8, e.g. "
                    f"iconv -f <its encoding> -t UTF-8 {path.name} > {path.stem}.utf8{path.suffix}"
                ) from None


def _check_utf8(path: Path) -> None:
    """`utf8_lines`' one line for the first text file at `path` (a file, or a folder's data files)
    that is not UTF-8; nothing when all are (then datasets failed for another reason)."""
    found = path.rglob("*") if path.is_dir() else [path]
    for f in sorted(f for f in found if f.suffix in TEXT_SUFFIXES and f.is_file()):
        for _ in utf8_lines(f):
            pass


def _saved(path: Path) -> bool:
    """Whether `path` is a folder written by save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def read_dataset(path: Path, split: str, setting: str) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """[(location label, row)] and the columns of the dataset at `path` (a folder or a .csv file),
    split `split`; `setting` (e.g. 'task.file.split') names the split's binding in errors."""
    ds_lib = _datasets()
    try:
        if path.is_dir() and (path / "dataset_dict.json").is_file():  # a DatasetDict: load one split
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            if split not in splits:
                raise DataError(
                    f"{path}: no split '{split}' ({setting}); its splits: {', '.join(splits) or '(none)'}"
                )
            data = ds_lib.load_from_disk(str(path / split))
        elif path.is_dir() and _saved(path):  # one saved Dataset: it has no splits
            if split != "train":
                raise DataError(
                    f"{path} is one saved Dataset without splits, so {setting} = '{split}' names nothing; "
                    "unset it (or save a DatasetDict)"
                )
            data = ds_lib.load_from_disk(str(path))
        elif path.is_dir():
            found = ds_lib.load_dataset(str(path))
            if split not in found:
                raise DataError(
                    f"{path}: no split '{split}' ({setting}); its splits: {', '.join(found) or '(none)'}"
                )
            data = found[split]
        else:
            if split != "train":
                raise DataError(f"{path} is one file without splits, so {setting} = '{split}' names nothing")
            data = ds_lib.load_dataset(path.suffix.lstrip("."), data_files=str(path), split="train")
    except DataError:
        raise
    except Exception as e:  # datasets raises many types for an unreadable folder or file
        _check_utf8(path)  # a file that is not UTF-8: its line and byte (datasets' error names neither)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"{path}: datasets could not read it ({type(e).__name__}: {msg[:160]}); it must be a folder "
            "written by save_to_disk, a folder of data files (.json/.jsonl/.parquet/.csv) or a .csv file"
        ) from None
    rows = data.to_list()
    return [(f"row {i} (0-based)", row) for i, row in enumerate(rows)], list(data.column_names)
