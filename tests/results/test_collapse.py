"""The collapse rule in the library (polgrad/collapse.py): the trainer reports a collapsed run itself
(summary.json's `collapsed` beside an unchanged status, and the `done:` line), and the sweep's results
name collapsed runs from the same rule (polgrad/results/health.py). The run here is a fabricated eval
history (metrics.jsonl, eval.jsonl), not a training run."""

from __future__ import annotations

import json
import math

import pytest

from polgrad import collapse
from polgrad import train as train_cli
from polgrad.results import health
from polgrad.summary import summarize

RULE = "held-out accuracy ended at 0, or below 0.5 of its warm start's where that is at least 0.1"


@pytest.mark.parametrize(
    "acc, init, why",
    [
        (0.0, 0.34, "held-out accuracy ended at 0 (from 0.34)"),  # the lr = 1000 run
        (0.0, None, "held-out accuracy ended at 0"),  # no step-0 eval recorded
        (0.0, 0.0, "held-out accuracy ended at 0"),
        (0.2, 0.5, "held-out accuracy fell from 0.5 to 0.2"),  # 0.2 < 0.5 x 0.5 = 0.25
        (0.25, 0.5, None),  # exactly half: not below it
        (0.3, 0.5, None),
        (0.01, 0.024, None),  # a warm start under 0.1: a fall to half is the eval set's noise
        (0.04, 0.1, "held-out accuracy fell from 0.1 to 0.04"),  # 0.1 is the smallest warm start judged
        (0.7, 0.5, None),
        (None, 0.5, None),  # never evaluated: unknown, not collapsed
        (math.nan, 0.5, None),
        ("", "0.5", None),  # a blank CSV cell
        ("0", "0.34", "held-out accuracy ended at 0 (from 0.34)"),  # CSV cells are text
    ],
)
def test_the_collapse_rule(acc, init, why):
    assert collapse.collapse_reason(acc, init) == why
    assert collapse.RULE == RULE


def test_the_results_name_collapsed_runs_by_the_librarys_rule(monkeypatch):
    """health has no rule of its own: it asks polgrad.collapse (patched here to say every run collapsed)."""
    rows = [{"status": "ok", "seed": "0", "cell_id": "c0", "spec": "grpo", "eval_accuracy": "0.9"}]
    assert health.run_failures(rows, ["spec"]) == []
    monkeypatch.setattr(health, "collapse_reason", lambda acc, init: f"patched {acc}")
    (failure,) = health.run_failures(rows, ["spec"])
    assert failure.collapsed and failure.why == "patched 0.9"


def _fabricated_run(path, accuracies: list[float]) -> None:
    """A run folder's metrics.jsonl and eval.jsonl: an eval at step 0 and after every step."""
    path.mkdir()
    with open(path / "eval.jsonl", "w") as f:
        for step, acc in enumerate(accuracies):
            f.write(json.dumps({"step": step, "accuracy": acc}) + "\n")
    with open(path / "metrics.jsonl", "w") as f:
        for step, acc in enumerate(accuracies[1:], start=1):
            f.write(json.dumps({"step": step, "reward_mean": 0.5, "eval_accuracy": acc}) + "\n")


def test_the_summary_of_a_collapsed_run_says_so_beside_its_status(tmp_path):
    _fabricated_run(tmp_path / "collapsed", [0.34, 0.1, 0.0])
    summary = summarize(str(tmp_path / "collapsed"), 1.0, unstable_skip_frac=1.0)
    assert summary["status"] == "ok"  # a finished run: the sweep neither reruns it nor drops it
    assert (
        summary["collapsed"]
        == f"collapsed: held-out accuracy ended at 0 (from 0.34) (the collapse rule: {RULE})"
    )
    _fabricated_run(tmp_path / "fine", [0.34, 0.3, 0.4])
    assert "collapsed" not in summarize(str(tmp_path / "fine"), 1.0, unstable_skip_frac=1.0)


def test_the_done_line_of_a_collapsed_run_says_so(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    _fabricated_run(run, [0.34, 0.0])
    monkeypatch.setattr(train_cli, "run", lambda out, **kw: summarize(str(run), 1.0, unstable_skip_frac=1.0))
    code = train_cli.main(["registry/grpo.gin", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 0  # the exit code the sweep reads as finished
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert out == (
        f"done: {tmp_path / 'out'}  eval_accuracy=0.0  final_train_reward=0.5  collapsed: held-out accuracy "
        f"ended at 0 (from 0.34) (the collapse rule: {RULE})"
    )
