"""Hugging Face datasets on disk as task.file input: each kind read back equals the same rows written
as .jsonl (the reference reader), and a wrong split is a one-line error listing the splits."""

from __future__ import annotations

import json

import datasets
import pytest

import polgrad  # noqa: F401
from polgrad.errors import DataError
from polgrad.registry import get

ROWS = [{"question": f"What is {i} + {i + 1}?", "answer": f"so #### {2 * i + 1}"} for i in range(60)]
TEST_ROWS = [{"question": f"What is {i} times 2?", "answer": f"#### {2 * i}"} for i in range(30)]


def _task(path, **kw):
    return get("task", "file")(path=str(path), prompt_column="question", **kw)


def _pairs(task):
    return [(e.prompt, e.answer) for s in ("train", "eval") for e in task.examples(s, 50, seed=3)]


@pytest.fixture
def reference(tmp_path):
    path = tmp_path / "ref.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return _task(path)


def test_saved_dataset_folder(tmp_path, reference):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    task = _task(tmp_path / "saved")
    assert _pairs(task) == _pairs(reference)
    assert task.train == reference.train and task.eval == reference.eval


def test_saved_dataset_dict_and_its_split(tmp_path, reference):
    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(TEST_ROWS)}
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert _pairs(_task(tmp_path / "dd")) == _pairs(reference)  # 'train' by default
    test = _task(tmp_path / "dd", split="test")
    assert {r.prompt for r in test.train + test.eval} == {r["question"] for r in TEST_ROWS}
    with pytest.raises(DataError) as e:
        _task(tmp_path / "dd", split="validation")
    assert "no split 'validation' (task.file.split); its splits: train, test" in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["parquet", "json", "csv"])
def test_folder_of_data_files(tmp_path, reference, kind):
    folder = tmp_path / f"files_{kind}"
    folder.mkdir()
    ds = datasets.Dataset.from_list(ROWS)
    if kind == "parquet":
        ds.to_parquet(str(folder / "train.parquet"))
    elif kind == "json":
        ds.to_json(str(folder / "train.jsonl"))
    else:
        ds.to_csv(str(folder / "train.csv"), index=False)
    assert _pairs(_task(folder)) == _pairs(reference)


def test_csv_file(tmp_path, reference):
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "rows.csv"), index=False)
    assert _pairs(_task(tmp_path / "rows.csv")) == _pairs(reference)


@pytest.mark.parametrize("folder", [False, True], ids=["csv_file", "folder_of_csv"])
def test_a_csv_that_is_not_utf8_names_its_line_and_byte(tmp_path, folder):
    """datasets' own error ('An error occurred while generating the dataset') names neither."""
    path = tmp_path / "data" / "rows.csv" if folder else tmp_path / "rows.csv"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"question,answer\nWhat is 1 + 1?,#### 2\nCaf\xe9 costs?,#### 3\n")
    with pytest.raises(DataError) as e:
        _task(path.parent if folder else path)
    assert str(e.value).startswith(
        f"{path}: line 3 is not UTF-8 text (byte 0xe9 at byte 4 of the line: invalid continuation byte); "
        "re-encode the file as UTF-8"
    ), str(e.value)
    assert "\n" not in str(e.value)


def test_missing_column_in_a_dataset_names_the_columns(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError) as e:
        get("task", "file")(path=str(tmp_path / "saved"))  # prompt_column defaults to 'prompt'
    assert "no column 'prompt' (task.file.prompt_column); columns present: question, answer" in str(e.value)


def test_split_of_a_splitless_dataset_is_an_error(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "rows.csv"), index=False)
    for path, fragment in (
        (tmp_path / "saved", "one saved Dataset without splits"),
        (tmp_path / "rows.csv", "one file"),
    ):
        with pytest.raises(DataError) as e:
            _task(path, split="test")
        assert fragment in str(e.value) and "task.file.split = 'test'" in str(e.value)


def test_a_dataset_dict_with_an_empty_split_still_reads_its_other_splits(tmp_path, reference):
    empty = datasets.Dataset.from_list(ROWS).select([])
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": empty}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert _pairs(_task(tmp_path / "dd")) == _pairs(reference)
