"""benchmarks/same_numbers.py: what it calls identical and what it reports as a difference."""

from __future__ import annotations

import json
import re
import shutil

import torch
from safetensors.torch import save_file

from benchmarks.same_numbers import CASES, ROLES, _differences


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
    """The six runs the acceptance names, and one run per optional role they leave out."""
    six = {"grpo", "ppo", "lora_ppo", "dpo", "async_grpo", "reward_model_ppo"}
    assert set(CASES) == six | set(ROLES) and not six & set(ROLES)
    assert set(ROLES) == {"remax", "dapo", "grpo_kl_full", "ppo_warmup", "grpo_tis"}
    assert all(spec.startswith("registry/") and "train.steps = 6" in b for spec, b in CASES.values())


def test_same_reports_masks_the_date_and_reports_a_changed_number(tmp_path, capsys):
    """benchmarks/same_reports.py on one committed report: identical with only the report's date
    changed; a number changed in the committed md is a difference, named with its line."""
    from benchmarks.same_reports import REPO, main

    name = "ppo_on_add_tuning"  # a tuning stage: its folder sits in its experiment's
    shutil.copytree(
        REPO / "results" / "ppo_on_add", tmp_path / "ppo_on_add", ignore=shutil.ignore_patterns("runs")
    )
    md = tmp_path / "ppo_on_add" / name / f"{name}.md"
    dated = md.read_text()
    assert "UTC" in dated
    md.write_text(re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", "1999-01-01 00:00 UTC", dated, count=1))
    assert main(["--results", str(tmp_path), "--only", name]) == 0
    assert "identical (date aside)" in capsys.readouterr().out
    table = next(line for line in dated.splitlines() if line.startswith("|") and re.search(r"\d\.\d", line))
    changed = re.sub(r"(\d)\.(\d)", lambda m: f"{(int(m[1]) + 1) % 10}.{m[2]}", table, count=1)
    md.write_text(dated.replace(table, changed, 1))
    assert main(["--results", str(tmp_path), "--only", name]) == 1
    out = capsys.readouterr().out
    assert "lines differ" in out and changed[:100] in out
