"""The md's words about what the runs learned and what would answer its question: each configuration
against its own warm start (polgrad/results/gains.py), weak warm starts named, a leader described by
the direction of its metric (not "better"), a tuning grid's edge named in the answer, a replication's
answer about the replication, and no machine's folder in a recorded command."""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path

import pytest
from scipy import optimize, stats

from polgrad.results import markdown, portable_command
from polgrad.results.gains import section
from polgrad.results.report import write_report

REPO = Path(__file__).resolve().parents[2]
G = ["spec", "Algorithm.kl"]
INIT = [0.30, 0.25, 0.40, 0.35, 0.20, 0.45, 0.30, 0.28, 0.33, 0.38]  # warm starts of seeds 0-9
UP = [0.05, 0.08, 0.06, 0.09, 0.04, 0.07, 0.05, 0.10, 0.06, 0.08]  # all positive, mean 0.068
# a noisier rise (mean 0.043, 7 up / 2 down / 1 flat, Shapiro p 0.29): its Holm p is a number, not '<1e-4'
RISE = [0.05, -0.02, 0.06, 0.09, 0.0, 0.07, 0.01, 0.10, -0.01, 0.08]
NOISE = [0.010, -0.020, 0.015, -0.010, 0.000, 0.020, -0.015, 0.005, -0.005, 0.0]  # mean 0


def _rows(changes: dict[str, list[float]], init=INIT, **extra) -> list[dict[str, str]]:
    """One ok row per (configuration, seed): eval_accuracy = warm start + change."""
    return [
        {
            "cell_id": f"{name}-s{s}",
            "spec": "grpo",
            "Algorithm.kl": name,
            "seed": str(s),
            "status": "ok",
            "eval_accuracy_init": repr(init[s]),
            "eval_accuracy": repr(init[s] + d[s]),
            **{k: repr(v[name][s]) for k, v in extra.items()},
        }
        for name, d in changes.items()
        for s in range(len(d))
    ]


def _label(key) -> str:
    return key[1]


def _table_row(lines, name):
    return next(line for line in lines if line.startswith(f"| {name} |")).split(" | ")


def test_each_configuration_is_tested_against_its_own_warm_start_holm_over_the_configurations():
    rows = _rows({"up": RISE, "down": [-x for x in RISE], "flat": NOISE})
    lines, findings, _ = section(rows, G, _label)
    # the expected numbers from scipy directly: a paired t-test of end against start per configuration,
    # Holm over the 3 (sorted p: the smallest × 3, the next × 2, capped and made monotone)
    end = {n: [INIT[s] + d[s] for s in range(10)] for n, d in (("up", RISE), ("flat", NOISE))}
    p_up = stats.ttest_rel(end["up"], INIT).pvalue
    p_flat = stats.ttest_rel(end["flat"], INIT).pvalue
    up = _table_row(lines, "up")
    half = stats.t.ppf(0.975, 9) * stats.tstd(RISE) / math.sqrt(10)
    assert up[3] == f"+{0.043:.3g} [+{0.043 - half:.3g}, +{0.043 + half:.3g}]"
    assert float(up[4]) == float(f"{min(1.0, 3 * p_up):.2g}")  # up and down tie: both × 3
    assert up[6] == "7 / 2" and up[-1].startswith("above its warm start")
    # the exact sign-flip p by enumeration of the 2^10 sign patterns (two-sided: |mean| at least the
    # observed), Holm × 3 as the t-test's
    flips = [sum(x if (b >> i) & 1 else -x for i, x in enumerate(RISE)) for b in range(2**10)]
    p_flip = sum(abs(f) >= abs(sum(RISE)) - 1e-12 for f in flips) / 2**10
    assert float(up[5]) == float(f"{min(1.0, 3 * p_flip):.2g}")
    assert _table_row(lines, "down")[-1].startswith("below its warm start")
    flat = _table_row(lines, "flat")
    assert float(flat[4]) == float(f"{min(1.0, p_flat):.2g}")  # the largest p: × 1
    assert findings[0].startswith(
        "Against its own warm start (eval_accuracy − eval_accuracy_init, Holm over 3 configuration(s)): "
        "1 end above it, 1 end below it, 1 no change detected; below it: down (-0.043 ["
    )


def _mde(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The mean difference a two-sided paired t-test at level alpha detects with `power`, from the
    noncentral t (independent of polgrad.results.stats)."""

    def gap(delta):
        nc = delta / (sd / math.sqrt(n))
        crit = stats.t.ppf(1 - alpha / 2, n - 1)
        lower = stats.nct.cdf(-crit, n - 1, nc)  # the wrong-sign tail: ~0, NaN where scipy underflows
        return stats.nct.sf(crit, n - 1, nc) + (0.0 if math.isnan(lower) else lower) - power

    return optimize.brentq(gap, 1e-9, 4 * sd)  # 4 sd over √10: power ~1, the root lies below


def test_no_change_detected_gives_what_the_design_detects_at_holms_strictest_level():
    rows = _rows({"up": RISE, "down": [-x for x in RISE], "flat": NOISE})
    flat = _table_row(section(rows, G, _label)[0], "flat")[-1]
    x = _mde(stats.tstd(NOISE), 10, 0.05 / 3)  # m = 3: alpha / 3
    assert flat == f"no change detected (this design detects ≥ {x:.3g} at 80% power) |"
    # a design whose detectable change exceeds what an accuracy allows says so instead of a number
    tiny = _rows({"a": [0.2, -0.2, 0.0]}, init=[0.5, 0.5, 0.5])  # sd 0.2, 3 runs: X > 0.5
    assert "cannot detect any change its accuracy allows" in _table_row(section(tiny, G, _label)[0], "a")[-1]


def test_where_both_tests_decide_a_significant_t_test_alone_is_no_verdict():
    # one outlier: Shapiro-Wilk rejects normality, so the sign-flip test must agree; t p ~0.004, but
    # with 5 runs the sign-flip p cannot go below 2/2^5 = 0.0625: no verdict, neither above nor 'no change'
    d = [0.100, 0.101, 0.102, 0.103, 0.2]
    row = _table_row(section(_rows({"a": d}, init=INIT[:5]), G, _label)[0], "a")
    assert stats.ttest_1samp(d, 0).pvalue < 0.01 and stats.shapiro(d).pvalue < 0.05
    assert row[-1] == "no verdict possible: with 5 runs the sign-flip p cannot go below 0.062 (× 1 by Holm) |"


def test_collapsed_runs_need_the_sign_flip_test_and_are_never_no_change():
    # seed 4's warm start (0.20) falls to 0: a collapse; the rest rise a little, not significantly
    d = list(NOISE)
    d[4] = -0.20
    lines, findings, _ = section(_rows({"a": d}), G, _label)
    row = _table_row(lines, "a")
    assert "t-test and sign-flip (failed runs)" in row[8]
    assert row[-1] == "not significant; rests on failed runs (see Failed and flagged runs) |"
    assert "1 not significant, resting on failed runs" in findings[0]


def test_identical_single_and_missing_configurations_are_not_tested_nor_in_holms_m():
    rows = _rows({"up": RISE, "twin": RISE})
    rows += _rows({"one": [0.1]})  # one run
    rows += [dict(r, eval_accuracy_init="") for r in _rows({"blank": RISE})]  # no warm-start accuracy
    lines, findings, _ = section(rows, G, _label)
    assert _table_row(lines, "twin")[-1] == "identical to up: the same runs, not tested |"
    assert _table_row(lines, "one")[-1] == "not tested (fewer than 2 runs with both accuracies) |"
    blank = _table_row(lines, "blank")
    assert blank[1:4] == ["–", "–", "– [–, –]"] and blank[-1].startswith("not tested")
    # one configuration tested: its Holm p is its own p
    assert float(_table_row(lines, "up")[4]) == float(f"{stats.ttest_1samp(RISE, 0).pvalue:.2g}")
    assert "Holm over 1 configuration(s)): 1 end above it" in findings[0]
    assert "3 not tested (identical to another, or fewer than 2 runs)" in findings[0]


def test_runs_that_are_not_ok_are_counted_beside_the_verdict():
    rows = _rows({"a": RISE})
    rows[3]["status"] = "unstable"
    rows[7]["status"] = "failed"
    row = _table_row(section(rows, G, _label)[0], "a")
    assert row[7] == "2" and row[6] == "5 / 2"  # 8 ok runs: RISE without seeds 3 (+0.09) and 7 (+0.10)


def test_weak_warm_starts_are_named_with_their_change_beside_the_other_seeds():
    init = [0.05, 0.02, *INIT[2:]]  # seeds 0 and 1 start below 0.1
    changes = {"a": [0.0, 0.01, *UP[2:]], "b": [0.01, 0.0, *UP[2:]]}
    lines, findings, _ = section(_rows(changes, init), G, _label)
    weak = 0.02 / 4  # (0.0 + 0.01 + 0.01 + 0.0) / 4 runs
    other = 2 * sum(UP[2:]) / 16
    assert findings[-1].startswith(
        f"Seeds 0, 1 start from warm starts below 0.1 held-out accuracy: their mean change over every "
        f"configuration is +{weak:.3g}, against +{other:.3g} on the other 8 seeds."
    )
    assert lines[-1] == findings[-1]
    # no line when no seed, or every seed, starts weak (nothing to set beside)
    assert not any(f.startswith("Seeds") for f in section(_rows(changes), G, _label)[1])
    assert not any(f.startswith("Seeds") for f in section(_rows(changes, [0.05] * 10), G, _label)[1])


def test_no_section_without_the_warm_starts_accuracy():
    rows = [{k: v for k, v in r.items() if k != "eval_accuracy_init"} for r in _rows({"a": UP})]
    assert section(rows, G, _label) == ([], [], "")


def _md(rows, name="x", primary="eval_accuracy", higher=True, **kw):
    return markdown(
        name,
        rows,
        swept_columns=["Algorithm.kl"],
        primary_metric=primary,
        higher_is_better=higher,
        baseline={"Algorithm.kl": "base"},
        **kw,
    )


def test_the_md_has_the_section_and_its_finding_before_the_answer():
    md = _md(_rows({"base": UP, "a": [x + 0.001 * i for i, x in enumerate(UP)]})).splitlines()
    assert "## Change from the warm start (eval_accuracy − eval_accuracy_init)" in md
    found = [i for i, line in enumerate(md) if line.startswith("- Against its own warm start")]
    assert len(found) == 1 and md[-1].startswith("- **Answer.**") and found[0] < len(md) - 1


def test_a_leader_is_described_by_its_metrics_direction_not_as_better():
    # kl: base highest, a lowest by 0.1 on every seed (plus noise): a lower-is-better leader with ★
    kl = {"base": [0.3 + x for x in NOISE], "a": [0.2 - x for x in NOISE]}
    md = _md(_rows({"base": UP, "a": UP}, kl=kl), primary="kl", higher=False)
    line = next(x for x in md.splitlines() if "has the lowest kl" in x)
    assert "significantly lower than each other configuration" in line and "better" not in line
    assert md.splitlines()[-1].startswith(
        "- **Answer.** grpo · Algorithm.kl=a has the significantly lowest kl"
    )
    # without ★, neither the finding nor the answer calls anything better
    kl = {"base": [0.3 + x for x in NOISE], "a": [0.3 - x for x in NOISE]}
    md = _md(_rows({"base": UP, "a": UP}, kl=kl), primary="kl", higher=False)
    assert "No configuration is significantly lower in kl than all others" in md
    assert "is not significantly lower than every other" in md.splitlines()[-1]


def test_an_undecided_answer_names_the_tuning_grid_edge_its_configurations_chose():
    rows = _rows({"base": UP, "a": [x + n for x, n in zip(UP, NOISE, strict=True)]})
    preds = [
        {
            "claim": "a is lower",
            "config": {"Algorithm.kl": "a"},
            "metric": "eval_accuracy",
            "expected": "lower",
        }
    ]
    grid = {"train.lr": ["3e-05", "0.0001", "0.0003"]}

    def tuning(lrs):
        configs = [
            {"config": {"spec": "grpo", "Algorithm.kl": k}, "chosen": {"train.lr": v}, "values": []}
            for k, v in lrs
        ]
        return {
            "experiment": "x_tuning",
            "metric": "eval_accuracy",
            "seeds": [100],
            "grid": grid,
            "configurations": configs,
        }

    edge = _md(rows, predictions=preds, tuning=tuning([("base", "3e-05"), ("a", "0.0003")])).splitlines()[-1]
    assert (
        "more paired seeds would decide the rest (2 configuration(s) chose a value at the tuning grid's "
        "edge, so a wider grid may change the tuned values compared)" in edge
    )
    inside = _md(rows, predictions=preds, tuning=tuning([("base", "0.0001"), ("a", "0.0001")])).splitlines()[
        -1
    ]
    assert "more paired seeds would decide the rest" in inside and "edge" not in inside


@pytest.mark.parametrize("named", [True, False], ids=["named", "not_named"])
def test_a_replications_answer_is_about_the_replication(tmp_path, named):
    """With the study named in experiment.json (Sweep.studies), each md has a Replication section and the
    replication's answer says whether the original's verdicts hold; without it, neither md has one."""
    base = {"base": UP, "a": [x - 0.05 + n for x, n in zip(UP, NOISE, strict=True)]}
    preds = [
        {
            "claim": "a is lower",
            "config": {"Algorithm.kl": "a"},
            "metric": "eval_accuracy",
            "expected": "lower",
        }
    ]
    for name, seeds in (("x", range(10)), ("x_replication", range(20, 30))):
        rows = [dict(r, seed=str(int(r["seed"]) + seeds[0])) for r in _rows(base)]
        (tmp_path / name).mkdir()
        with open(tmp_path / name / f"{name}.csv", "w") as f:
            f.write(",".join(rows[0]) + "\n" + "".join(",".join(r.values()) + "\n" for r in rows))
        meta = {
            "swept_columns": ["Algorithm.kl"],
            "primary_metric": "eval_accuracy",
            "baseline": {"Algorithm.kl": "base"},
            "predictions": preds,
            "cells": [{"id": r["cell_id"]} for r in rows],
            "command": f"python -m polgrad.sweep experiments/{name}.gin --results {tmp_path}",
            "studies": ["studies.replication"] if named else [],  # as experiments/kl_ablation.gin names it
        }
        (tmp_path / name / "experiment.json").write_text(json.dumps(meta))
    for name in ("x", "x_replication"):
        write_report(name, tmp_path)
    if not named:
        for name in ("x", "x_replication"):
            md = (tmp_path / name / f"{name}.md").read_text()
            assert "## Replication" not in md and "As a replication of" not in md
        return
    rep = (tmp_path / "x_replication" / "x_replication.md").read_text().splitlines()
    assert rep[-1].startswith("- **Answer.** As a replication of x: Of 1 predictions, 1 replicate.")
    assert "This run alone: Of 1 predictions, confirmed: 'a is lower'" in rep[-1]
    orig = (tmp_path / "x" / "x.md").read_text()
    assert orig.splitlines()[-1].startswith("- **Answer.** Of 1 predictions, confirmed")
    # the recorded command named a folder of this machine: the md shows <dir>/ instead
    assert str(tmp_path) not in orig and f"--results <dir>/{tmp_path.name}`" in orig


def test_a_recorded_command_has_no_machines_folder(tmp_path):
    root = tmp_path / "repo"
    argv = ["python", "-m", "polgrad.sweep", str(root / "experiments" / "e.gin")]
    assert portable_command([*argv, "--results", "/srv/out/results"], root) == (
        "python -m polgrad.sweep experiments/e.gin --results <dir>/results"
    )
    assert portable_command([f"--results={root}/r", "--results=/a b/c d"], root) == (
        "--results=r --results=<dir>/'c d'"
    )
    assert portable_command(["--parallel", "2", "it's"], root) == "--parallel 2 'it'\"'\"'s'"
    # a record already shown so renders the same again (the md regenerates identical)
    shown = portable_command([*argv, "--results", "/srv/out/results", "--x=/a b/c"], root)
    assert portable_command(shlex.split(shown), root) == shown


def test_a_tuning_stages_md_has_no_warm_start_section_and_the_overview_follows_the_metric():
    rows = _rows({"base": UP, "a": RISE})
    assert "## Change from the warm start" not in _md(rows, name="x_tuning")
    md = _md(
        rows,
        name="x",
        primary="kl",
        higher=False,
    )
    assert "★ marks a group significantly lower in kl than every other one" in md


@pytest.mark.parametrize(
    "path", sorted((REPO / "results").glob("**/experiment.json")), ids=lambda p: str(p.parent.name)
)
def test_committed_records_name_no_machines_folder(path):
    """A tracked record reads the same from any machine: its command names no absolute path."""
    args = shlex.split(json.loads(path.read_text()).get("command", ""))
    assert not [a for a in args if os.path.isabs(a.partition("=")[2] if a.startswith("--") else a)]


def test_an_answer_without_predictions_says_what_the_runs_learned():
    rows = _rows({"base": UP, "a": [-x for x in RISE]})
    assert (
        _md(rows)
        .splitlines()[-1]
        .endswith(
            "; of the 2 configuration(s) tested against their warm starts, 1 end above their warm starts, "
            "1 end below them."
        )
    )
    flat = _rows({"base": UP, "a": NOISE})
    x = _mde(stats.tstd(NOISE), 10, 0.05 / 2)  # m = 2
    assert (
        _md(flat)
        .splitlines()[-1]
        .endswith(
            f", 1 end above their warm starts, 1 show no change detected (this design detects ≥ {x:.2g})."
        )
    )
    # collapsed runs are named as such, never as 'no change'
    d = list(NOISE)
    d[4] = -0.20
    crash = _md(_rows({"base": UP, "a": d})).splitlines()[-1]
    assert crash.endswith(", 1 end above their warm starts, 1 are not significant and rest on failed runs.")
    # with declared predictions the answer is about them alone
    preds = [
        {
            "claim": "a is lower",
            "config": {"Algorithm.kl": "a"},
            "metric": "eval_accuracy",
            "expected": "lower",
        }
    ]
    assert "warm starts" not in _md(rows, predictions=preds).splitlines()[-1]
