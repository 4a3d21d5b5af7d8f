"""The sweep's progress bar (polgrad/sweep/progress.py): a running cell shows its warm start's progress
while its trainer trains one (the bar showed `step -` for minutes), then its step; and it counts as the
fraction of its train.steps it has logged, so the bar and its ETA move with steps, not only when a
cell ends."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from polgrad.sweep.progress import Progress, planned_steps, warm_start_progress


def _cell_dir(tmp_path, name, *, steps=None, logged=(), stdout=""):
    d = tmp_path / name
    d.mkdir()
    if steps is not None:
        (d / "config.gin").write_text(f"train.lr = 1e-4\ntrain.steps = {steps}\ntrain.seed = 0\n")
    if logged:
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in logged))
    (d / "stdout.log").write_text(stdout)
    return d


def test_a_cells_folder_says_its_warm_start_progress_and_its_planned_steps(tmp_path):
    started = "warm start: SFT of task.add, up to 1000 steps (stops at 0.30 accuracy)\n"
    at_150 = started + "warm start: step 150/1000, loss 0.812, probe accuracy 0.12, 9 s\n"
    done = at_150 + "warm start: done, 180 steps in 11 s, held-out greedy accuracy 0.31\n"
    assert warm_start_progress(_cell_dir(tmp_path, "a", stdout=started)) == "warm start 0/1000"
    assert warm_start_progress(_cell_dir(tmp_path, "b", stdout=at_150)) == "warm start 150/1000"
    assert warm_start_progress(_cell_dir(tmp_path, "c", stdout=done)) is None
    assert warm_start_progress(_cell_dir(tmp_path, "d")) is None  # a cached warm start prints nothing
    assert planned_steps(_cell_dir(tmp_path, "e", steps=60)) == 60
    assert planned_steps(_cell_dir(tmp_path, "f")) is None  # before the trainer wrote config.gin


def test_the_bar_moves_with_each_running_cells_steps_and_shows_its_warm_start(tmp_path):
    progress = Progress(total=4, done=1, name="exp")
    halfway = SimpleNamespace(id="c1")
    warming = SimpleNamespace(id="c2")
    progress.start(halfway, _cell_dir(tmp_path, "c1", steps=10, logged=range(1, 6)))
    progress.refresh(force=True)
    assert progress.bar.n == pytest.approx(1.5)  # one done, and half of c1's 10 steps
    assert "c1 step 5" in progress.bar.postfix
    at_150 = "warm start: SFT of task.add, up to 1000 steps\nwarm start: step 150/1000, loss 0.8, 9 s\n"
    progress.start(warming, _cell_dir(tmp_path, "c2", steps=10, stdout=at_150))
    progress.refresh(force=True)
    assert "c2 warm start 150/1000" in progress.bar.postfix and progress.bar.n == pytest.approx(1.5)
    assert " 1.5/4 [" in str(progress.bar)  # one decimal, not 1.4999999999999998
    progress.finish(halfway, {"status": "ok"})
    assert progress.bar.n == pytest.approx(2.0)  # c1 counts whole once, its half not twice
    progress.close()
