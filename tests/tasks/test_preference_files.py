"""Preference datasets in TRL's formats (task.file.preferences): standard strings and conversational
message lists, read from a dataset built with `datasets`; held-out pairs never trained on; a reward
model and a DPO run train on them."""

from __future__ import annotations

import json
import math

import datasets
import gin
import pytest

import polgrad  # noqa: F401
from polgrad.errors import DataError
from polgrad.registry import get
from polgrad.tasks.synthetic import in_eval_split

# task.add-like rows for the task's prompts and answers, and a preference pair per prompt:
# chosen = the sum, rejected = the sum + 1 (what a reward model can learn to tell apart).
PROBLEMS = [(a, b) for a in range(10) for b in range(10)]
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in PROBLEMS]
STANDARD = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)} for a, b in PROBLEMS]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": r["prompt"]}],
        "chosen": [{"role": "assistant", "content": r["chosen"]}],
        "rejected": [{"role": "assistant", "content": r["rejected"]}],
    }
    for r in STANDARD
]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "add.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _task(prompts, preferences, **kw):
    return get("task", "file")(path=str(prompts), answer_format="exact", preferences=str(preferences), **kw)


@pytest.mark.parametrize("rows", [STANDARD, CONVERSATIONAL], ids=["standard", "conversational"])
def test_pairs_read_back_and_held_out_pairs_are_never_trained_on(tmp_path, prompts, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "prefs"))
    task = _task(prompts, tmp_path / "prefs", eval_fraction=0.2)
    want = {(r["prompt"], r["chosen"], r["rejected"]) for r in STANDARD}
    drawn = task.preference_pairs(500, seed=0)
    held = task.heldout_preference_pairs(1000)
    assert set(drawn) | set(held) == want  # every pair, as strings
    held_prompts = {e.prompt for e in task.eval_examples(None)}
    assert not {p for p, _, _ in drawn} & ({p for p, _, _ in held} | held_prompts)
    assert all(in_eval_split(p, 0.2) or p in held_prompts for p, _, _ in held)
    assert task.preference_pairs(50, seed=1) == task.preference_pairs(50, seed=1)


def test_conversational_parquet(tmp_path, prompts):
    """pandas reads a parquet file's message lists as numpy arrays: they read as the jsonl's lists."""
    import pandas as pd

    pd.DataFrame(CONVERSATIONAL).to_parquet(tmp_path / "conv.parquet")
    task = _task(prompts, tmp_path / "conv.parquet", eval_fraction=0.2)
    every = set(task.preference_pairs(300, seed=0)) | set(task.heldout_preference_pairs(1000))
    assert every == {(r["prompt"], r["chosen"], r["rejected"]) for r in STANDARD}


def test_new_parameters_at_their_defaults_leave_the_cache_key_alone(prompts):
    """task.file's split / preferences / preference_split came after runs were cached: at their defaults
    they are not in the task's configuration (which keys the warm start), set they are."""
    from polgrad.config import build, parse_config

    def kwargs(*extra):
        gin.clear_config()
        try:
            parse_config(
                ["registry/grpo.gin"], ["train.task = @task.file", f"task.file.path = '{prompts}'", *extra]
            )
            return build()[0].task_kwargs()
        finally:
            gin.clear_config()

    plain = kwargs()
    assert not {"split", "preferences", "preference_split"} & set(plain)
    assert set(plain) == {
        "path",
        "prompt_column",
        "answer_column",
        "response_column",
        "eval_fraction",
        "answer_format",
    }
    assert kwargs("task.file.split = 'train2'")["split"] == "train2"


def test_multi_turn_prompts_become_role_lines(tmp_path, prompts):
    rows = [
        {
            "prompt": [{"role": "system", "content": "add"}, {"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in STANDARD
    ]
    path = tmp_path / "multi.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = _task(prompts, path, eval_fraction=0.2)
    every = set(task.preference_pairs(300, seed=0)) | set(task.heldout_preference_pairs(1000))
    assert every == {(f"system: add\nuser: {r['prompt']}", r["chosen"], r["rejected"]) for r in STANDARD}


@pytest.mark.parametrize(
    "row, fragment",
    [
        ({"prompt": "1+1=", "chosen": "2"}, "no column 'rejected' (task.file.preferences in TRL's format"),
        ({"prompt": "1+1=", "chosen": "2", "rejected": 3}, "column 'rejected' (task.file.preferences)"),
        ({"prompt": [{"role": "user"}], "chosen": "2", "rejected": "3"}, "message without string 'role' and"),
        ({"prompt": "1+1=", "chosen": "2", "rejected": "2"}, "the same chosen and rejected response"),
        (
            {
                "prompt": "1+1=",
                "chosen": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
                "rejected": [{"role": "assistant", "content": "3"}],
            },
            "has a 'user' message in column 'chosen'",
        ),
    ],
)
def test_bad_preference_rows_raise_one_line(tmp_path, prompts, row, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        _task(prompts, path)
    assert fragment in str(e.value) and "bad.jsonl" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "row, column",
    [
        ({"prompt": "1+2=", "chosen": "", "rejected": "4"}, "chosen"),
        ({"prompt": "1+2=", "chosen": "3", "rejected": " \n\t"}, "rejected"),
        (
            {
                "prompt": [{"role": "user", "content": "1+2="}],
                "chosen": [{"role": "assistant", "content": "  "}],
                "rejected": [{"role": "assistant", "content": "4"}],
            },
            "chosen",
        ),
    ],
    ids=["empty_chosen", "whitespace_rejected", "empty_assistant_message"],
)
def test_an_empty_response_is_refused_naming_the_file_line_and_field(tmp_path, prompts, row, column):
    """A pair whose chosen or rejected text is empty (or only whitespace) teaches nothing, and would
    otherwise train: refused in one line naming the file, the line and the column."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(STANDARD[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        _task(prompts, path)
    assert str(e.value) == (
        f"{path}: line 2 has an empty '{column}' response (task.file.preferences); every pair needs a "
        "non-empty chosen and rejected response: fill it in or drop the row"
    )


@pytest.mark.slow
@pytest.mark.parametrize("rows", [STANDARD, CONVERSATIONAL], ids=["standard", "conversational"])
def test_reward_model_and_dpo_train_on_a_preference_dataset(tmp_path, prompts, monkeypatch, rows):
    """A reward model trains on the file's pairs and is scored on its held-out ones; a DPO run takes
    two steps on the same pairs (both on a short SFT warm start of the file task)."""
    from polgrad import pretrain
    from polgrad.config import parse_config
    from polgrad.train import run

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "prefs"))
    task = _task(prompts, tmp_path / "prefs", eval_fraction=0.2)
    policy = pretrain.warm_start(
        "file",
        {
            "path": str(prompts),
            "answer_format": "exact",
            "preferences": str(tmp_path / "prefs"),
            "eval_fraction": 0.2,
        },
        None,
        sft_steps=30,
        target_accuracy=None,
        cache_dir=tmp_path / "cache",
        progress=False,
    )
    path, acc = pretrain.train_reward_model(
        policy, task, steps=30, heldout_pairs=64, cache_dir=tmp_path / "cache", progress=False
    )
    info = json.load(open(f"{path}/polgrad.json"))
    assert 0.0 <= acc <= 1.0 and info["stats"]["heldout_pairwise_accuracy"] == acc
    from polgrad.tasks.files import FileTask

    drawn: list = []
    real = FileTask.preference_pairs

    def spy(self, n, seed):
        out = real(self, n, seed)
        drawn.extend(out)
        return out

    monkeypatch.setattr(FileTask, "preference_pairs", spy)
    gin.clear_config()
    try:
        parse_config(
            ["registry/dpo.gin"],
            [
                "train.task = @task.file",
                f"task.file.path = '{prompts}'",
                "task.file.answer_format = 'exact'",
                f"task.file.preferences = '{tmp_path / 'prefs'}'",
                "task.file.eval_fraction = 0.2",
                f"train.policy_path = '{policy}'",
                "train.steps = 2",
                "train.eval_every = 2",
                "train.progress = False",
            ],
        )
        summary = run(str(tmp_path / "dpo"))
    finally:
        gin.clear_config()
    assert summary["status"] == "ok" and summary["steps"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "dpo" / "metrics.jsonl")]
    assert [r["pairs"] for r in rows] == [32.0, 32.0] and all(math.isfinite(r["pref_loss"]) for r in rows)
    file_pairs = {(r["prompt"], r["chosen"], r["rejected"]) for r in STANDARD}
    assert drawn and set(drawn) <= file_pairs  # DPO trained on the file's pairs, none synthetic
    assert not {p for p, _, _ in drawn} & {p for p, _, _ in task.heldout_preference_pairs(1000)}
