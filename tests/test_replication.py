"""An experiment and its replication side by side (polgrad/results/replication.py): the md of X and of
X_replication each get a Replication section, per declared prediction the verdict in each and whether
they agree; its summary opens the findings and the answer stays the md's last line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from polgrad.results import replication
from polgrad.results.report import markdown

# Paired noise per seed (fixed, so the verdicts are known): sd ~0.012, mean 0
NOISE = [0.010, -0.020, 0.015, -0.010, 0.000, 0.020, -0.015, 0.005, -0.005, 0.0]
PREDICTIONS = [
    {"claim": "a is lower", "config": {"Algorithm.kl": "a"}, "metric": "eval_accuracy", "expected": "lower"},
    {"claim": "b is lower", "config": {"Algorithm.kl": "b"}, "metric": "eval_accuracy", "expected": "lower"},
]


def _experiment(tmp: Path, name: str, seeds: range, effects: dict[str, float]) -> list[dict[str, str]]:
    """results tmp/<name>.csv and tmp/<name>/experiment.json: configuration 'base' and `effects` (Δ to
    base in eval_accuracy), one row per seed; the base's accuracy varies with the seed (warm starts)."""
    rows = []
    for name_kl, effect in {"base": 0.0, **effects}.items():
        for i, s in enumerate(seeds):
            noise = NOISE[i] if name_kl != "base" else 0.0
            rows.append(
                {
                    "cell_id": f"{name_kl}-s{s}",
                    "spec": "grpo",
                    "Algorithm.kl": name_kl,
                    "seed": str(s),
                    "status": "ok",
                    "eval_accuracy": repr(0.3 + 0.01 * i + effect + noise),
                }
            )
    with open(tmp / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (tmp / name).mkdir()
    meta = {
        "swept_columns": ["Algorithm.kl"],
        "primary_metric": "eval_accuracy",
        "baseline": {"Algorithm.kl": "base"},
        "predictions": PREDICTIONS,
        "cells": [{"id": r["cell_id"]} for r in rows],
    }
    (tmp / name / "experiment.json").write_text(json.dumps(meta))
    return rows


def test_the_section_says_where_the_two_agree_and_where_not(tmp_path):
    # 'a' is 0.1 lower in both (confirmed twice); 'b' moves only in the replication (verdicts differ)
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": 0.0})
    _experiment(tmp_path, "x_replication", range(20, 30), {"a": -0.1, "b": -0.1})
    for name in ("x", "x_replication"):
        lines = replication.section(name, tmp_path)
        assert lines[1] == "## Replication"
        assert "x: seeds 0-9; x_replication: seeds 20-29" in lines[3]
        row_a = next(line for line in lines if line.startswith("| a is lower"))
        row_b = next(line for line in lines if line.startswith("| b is lower"))
        assert row_a.count("| confirmed |") == 2 and row_a.endswith("| yes |")
        assert "| not confirmed (no difference detected" in row_b and row_b.endswith("| no |")
        assert lines[-1] == "The two agree on 1 of 2 predictions (a is lower); they differ on b is lower."


def test_an_original_without_its_replication_has_no_section_and_a_replication_says_what_is_missing(
    tmp_path,
):
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": 0.0})
    assert replication.section("x", tmp_path) == []
    _experiment(tmp_path, "y_replication", range(20, 30), {"a": -0.1, "b": 0.0})
    assert replication.section("y_replication", tmp_path)[-1] == (
        "The experiment this replicates, y, has no results yet."
    )


def test_the_summary_opens_the_findings_and_the_answer_stays_last(tmp_path):
    rows = _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": 0.0})
    _experiment(tmp_path, "x_replication", range(20, 30), {"a": -0.1, "b": 0.0})
    section = replication.section("x", tmp_path)
    assert section[-1] == "The two agree on 2 of 2 predictions."
    md = markdown(
        "x",
        rows,
        swept_columns=["Algorithm.kl"],
        primary_metric="eval_accuracy",
        baseline={"Algorithm.kl": "base"},
        predictions=PREDICTIONS,
        replication=section,
    ).splitlines()
    assert md.index("## Replication") < md.index("## Findings")
    assert md[md.index("## Findings") + 2] == "- Replication: The two agree on 2 of 2 predictions."
    assert md[-1].startswith("- **Answer.**") and md.count("## Findings") == 1
