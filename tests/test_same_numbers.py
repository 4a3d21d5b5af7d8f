"""benchmarks/same_numbers.py: what it calls identical and what it reports as a difference."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import save_file

from benchmarks.same_numbers import CASES, _differences


def _run_dir(path, loss=0.5, weight=1.0, seconds=3.0):
    (path / "final").mkdir(parents=True)
    rows = [
        {
            "step": s,
            "loss": loss * s,
            "time_gen": seconds * s,
            "rollout_wait_s": seconds,
            "peak_mem_mb": seconds,
        }
        for s in (1, 2)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "summary.json").write_text(json.dumps({"eval_accuracy": 0.5, "wall_time_s": seconds}))
    save_file(
        {"w": torch.full((2, 2), weight), "b": torch.zeros(2)}, str(path / "final" / "model.safetensors")
    )
    return path


def test_runs_that_differ_only_in_timing_are_identical(tmp_path):
    assert _differences(_run_dir(tmp_path / "a"), _run_dir(tmp_path / "b", seconds=9.0)) == []


def test_a_metric_a_weight_or_a_missing_file_is_a_difference(tmp_path):
    a = _run_dir(tmp_path / "a")
    metric = _differences(a, _run_dir(tmp_path / "m", loss=0.5 + 2**-40))
    assert metric and metric[0].startswith("metrics step 1 loss:")
    weight = _differences(a, _run_dir(tmp_path / "w", weight=1.0 + 2**-20))
    assert weight == ["final/model.safetensors: 1 of 2 tensors differ (first: w)"]
    gone = _run_dir(tmp_path / "g")
    shutil.rmtree(gone / "final")
    (gone / "final").mkdir()
    assert any(d.startswith("final/ weight files:") for d in _differences(a, gone))


def test_the_six_runs_of_the_acceptance_are_declared():
    assert set(CASES) == {"grpo", "ppo", "lora_ppo", "dpo", "async_grpo", "reward_model_ppo"}
    assert all(spec.startswith("registry/") and "train.steps = 6" in b for spec, b in CASES.values())
