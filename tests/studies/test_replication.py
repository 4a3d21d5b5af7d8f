"""An experiment and its replication side by side (studies/replication.py): the md of X and of
X_replication each get a Replication section, per declared prediction the verdict in each and whether
they agree; its summary opens the findings and the answer stays the md's last line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from polgrad.results import verdicts
from polgrad.results.report import markdown
from studies import replication

# Paired noise per seed (fixed, so the verdicts are known): sd ~0.012, mean 0
NOISE = [0.010, -0.020, 0.015, -0.010, 0.000, 0.020, -0.015, 0.005, -0.005, 0.0]
PREDICTIONS = [
    {"claim": "a is lower", "config": {"Algorithm.kl": "a"}, "metric": "eval_accuracy", "expected": "lower"},
    {"claim": "b is lower", "config": {"Algorithm.kl": "b"}, "metric": "eval_accuracy", "expected": "lower"},
]


def _experiment(
    tmp: Path, name: str, seeds: range, effects: dict[str, float], predictions=PREDICTIONS, **declared
) -> list[dict[str, str]]:
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
    (tmp / name).mkdir()
    with open(tmp / name / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {
        "swept_columns": ["Algorithm.kl"],
        "primary_metric": "eval_accuracy",
        "baseline": {"Algorithm.kl": "base"},
        "predictions": predictions,
        "cells": [{"id": r["cell_id"]} for r in rows],
        **declared,
    }
    (tmp / name / "experiment.json").write_text(json.dumps(meta))
    return rows


def _md(rows, predictions, **kw) -> str:
    """The md of experiment 'x' (configurations of Algorithm.kl against 'base')."""
    return markdown(
        "x",
        rows,
        swept_columns=["Algorithm.kl"],
        primary_metric="eval_accuracy",
        baseline={"Algorithm.kl": "base"},
        predictions=predictions,
        **kw,
    )


def _row(lines: list[str], claim: str) -> str:
    return next(line for line in lines if line.startswith(f"| {claim} |"))


def test_the_section_says_which_predictions_replicate_and_which_do_not(tmp_path):
    # 'a' is 0.1 lower in both (confirmed twice); 'b' moves only in the replication (decided in one)
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": 0.0})
    _experiment(tmp_path, "x_replication", range(20, 30), {"a": -0.1, "b": -0.12})
    for name in ("x", "x_replication"):
        lines = replication.section(name, tmp_path)
        assert lines[1] == "## Replication"
        assert "x: seeds 0-9; x_replication: seeds 20-29" in lines[3]
        row_a, row_b = _row(lines, "a is lower"), _row(lines, "b is lower")
        assert row_a.count("| confirmed |") == 2 and row_a.endswith("| yes |")
        assert "| not confirmed (no difference detected" in row_b and row_b.endswith("| no |")
        assert lines[-1].startswith(
            "Of 2 predictions, 1 replicate (a is lower); decided differently: b is lower. "
        )
        # the comparisons with the baseline side by side, predicted or not
        assert _row(lines, "grpo · a").endswith("| lower | yes |")
        row_b = _row(lines, "grpo · b")
        assert "| no difference detected | -0.12 [" in row_b and row_b.endswith("| lower | no |")
        assert lines[-1].endswith(
            "Of 2 comparisons with the baseline, 1 show the same significant difference in both, 0 none "
            "in either, and 1 differ: grpo · b in eval_accuracy (x: no difference detected; "
            "x_replication: lower)."
        )


def test_two_verdicts_that_decide_nothing_are_not_agreement(tmp_path):
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": 0.0})
    _experiment(tmp_path, "x_replication", range(20, 30), {"a": -0.1, "b": 0.0})
    lines = replication.section("x", tmp_path)
    assert _row(lines, "b is lower").endswith("| neither decides |")
    assert lines[-1].startswith(
        "Of 2 predictions, 1 replicate (a is lower); decided in neither: b is lower. "
    )
    assert _row(lines, "grpo · b").endswith("| neither detects |")


def test_a_confirmation_resting_on_the_t_test_alone_is_still_a_confirmation(tmp_path):
    """With 5 seeds the sign-flip test cannot reach α (its smallest two-sided p is 1/16), so the
    replication's verdict reads 'confirmed; this rests on the t-test's normality: ...'."""
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": -0.1})
    _experiment(tmp_path, "x_replication", range(20, 25), {"a": -0.1, "b": -0.1})
    lines = replication.section("x_replication", tmp_path)
    row_a = _row(lines, "a is lower")
    assert "| confirmed; this rests on the t-test's normality" in row_a and row_a.endswith("| yes |")
    assert lines[-1].startswith("Of 2 predictions, 2 replicate. ")
    assert verdicts.verdict_class("confirmed and different: a significant difference of +0.01") == "confirmed"


def test_predictions_declared_differently_or_in_one_only_are_not_compared(tmp_path):
    other = [dict(PREDICTIONS[0], margin=0.05, expected="no difference"), dict(PREDICTIONS[0], claim="c")]
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": 0.0})
    _experiment(tmp_path, "x_replication", range(20, 30), {"a": -0.1, "b": 0.0}, [other[0], other[1]])
    lines = replication.section("x", tmp_path)
    assert _row(lines, "a is lower").endswith("| declared differently |")
    assert _row(lines, "b is lower").endswith("| declared in one only |")
    assert _row(lines, "c").endswith("| declared in one only |")
    assert lines[-1].startswith(
        "Of 3 predictions, 0 replicate; declared differently: a is lower; "
        "declared in one only: b is lower; c. "
    )


def test_a_different_baseline_is_said(tmp_path):
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": 0.0}, baseline={"Algorithm.kl": "base"})
    _experiment(
        tmp_path, "x_replication", range(20, 30), {"a": -0.1, "b": 0.0}, baseline={"Algorithm.kl": "a"}
    )
    lines = replication.section("x", tmp_path)
    assert "The two declare different baseline: their verdicts answer different designs." in lines


def test_the_section_judges_as_the_mds_own_predictions_section_does(tmp_path):
    equal = {"claim": "b equals", "config": {"Algorithm.kl": "b"}, "metric": "eval_accuracy"}
    predictions = [*PREDICTIONS, dict(equal, expected="no difference", margin=0.05)]
    rows = _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": -0.004}, predictions)
    md = _md(rows, predictions)
    own = md.split("## Predictions")[1].split("\n## ")[0]
    meta = {
        "swept_columns": ["Algorithm.kl"],
        "baseline": {"Algorithm.kl": "base"},
        "predictions": predictions,
    }
    meta["cells"] = [{"id": r["cell_id"]} for r in rows]
    judged = replication.verdicts(rows, meta)
    assert len(judged) == 3 and "90% CI (TOST)" in judged[2][2]
    for claim, _, delta, n, verdict in judged:
        assert n == 10
        row = _row(own.splitlines(), claim)
        assert row.endswith(f"| {verdict} |") and f"| {delta} |" in row


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
    assert section[-1].startswith(
        "Of 2 predictions, 1 replicate (a is lower); decided in neither: b is lower."
    )
    md = _md(rows, PREDICTIONS, study_sections=[(replication.STUDY, section)]).splitlines()
    assert md.index("## Replication") < md.index("## Findings")
    assert md[md.index("## Findings") + 2] == f"- Replication: {section[-1]}"
    assert md[-1].startswith("- **Answer.**") and md.count("## Findings") == 1


def test_comparisons_that_are_not_tests_are_counted_as_not_compared(tmp_path):
    """'b' gives the same runs as 'a' (same effect, same noise) in both: not a test, so not compared, and
    the sentence's parts add up to its total."""
    _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": -0.1})
    _experiment(tmp_path, "x_replication", range(20, 30), {"a": -0.1, "b": -0.1})
    lines = replication.section("x", tmp_path)
    assert _row(lines, "grpo · b").endswith("| identical | not compared |")
    assert lines[-1].endswith(
        "Of 2 comparisons with the baseline, 1 show the same significant difference in both, 0 none "
        "in either, 1 not compared."
    )


def test_the_predictions_say_what_each_configuration_trained_with(tmp_path):
    """A claim's words ('REINFORCE without a baseline') are read against the loss its configuration's
    spec declares (the CSV's table5_core_loss): the md lists it under the Predictions table."""
    rows = _experiment(tmp_path, "x", range(10), {"a": -0.1, "b": -0.1})
    loss = {"base": "A_i = (r_i - mean_G r) / std_G r", "a": "A_i = R_i - mean_B R", "b": "A_i = R_i"}
    for r in rows:
        r["table5_core_loss"] = loss[r["Algorithm.kl"]]
    lines = _md(rows, PREDICTIONS).splitlines()
    start = lines.index("**As run.** The loss each prediction's configuration trained with, from its spec:")
    assert start > lines.index("## Predictions")
    got = lines[start + 2 : start + 5]
    assert got[0].startswith(f"- {PREDICTIONS[0]['claim']}: ") and got[0].endswith("`A_i = R_i - mean_B R`")
    assert got[1].startswith(f"- {PREDICTIONS[1]['claim']}: ") and got[1].endswith("`A_i = R_i`")
    assert got[2].startswith("- the baseline, ") and got[2].endswith("`A_i = (r_i - mean_G r) / std_G r`")
    assert "**As run.**" not in _md(
        [{k: v for k, v in r.items() if k != "table5_core_loss"} for r in rows], PREDICTIONS
    )
