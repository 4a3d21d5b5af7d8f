"""The review of the results statistics (issue 22): each defect on hand-made rows (no training), with
expected values from scipy or from the rows themselves, never from the code under test."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats
from test_stats_protocol import BASE, G, _md, _rows

from polgrad.results.compare import RULE_BOTH, against, leader
from polgrad.results.figures import forest_table
from polgrad.results.health import failed_keys, run_failures
from polgrad.results.warm_starts import warm_start_paragraph

# a paired difference of +0.0165 [0.0015, 0.0315] over 10 seeds: raw t-test p 0.035, raw TOST p 0.036
BASE_KL = [0.10 + 0.01 * s for s in range(10)]
NOISE = [0.024, -0.024, 0.018, -0.018, 0.012, -0.012, 0.006, -0.006, 0.03, -0.03]


def _down(c: float) -> list[float]:
    """A clear decrease of the baseline by c (p ~ 1e-10): a strong directional prediction."""
    return [b - c + 0.002 * (s % 3) for s, b in enumerate(BASE_KL)]


def _four_predictions(shift: float, margin: float):
    k1 = [b + shift + e for b, e in zip(BASE_KL, NOISE, strict=True)]
    rows = _rows(
        {
            "base": {"kl_exact": BASE_KL},
            "k1": {"kl_exact": k1},
            "k2": {"kl_exact": _down(0.07)},
            "k3": {"kl_exact": _down(0.075)},
            "rw": {"kl_exact": _down(0.09)},
        }
    )
    predictions = [
        ("k1 no reg", ("grpo", "k1"), "kl_exact", "no difference", margin),
        ("k2", ("grpo", "k2"), "kl_exact", "lower", None),
        ("k3", ("grpo", "k3"), "kl_exact", "lower", None),
        ("rw", ("grpo", "rw"), "kl_exact", "lower", None),
    ]
    return rows, predictions, np.array(k1) - np.array(BASE_KL)


def _row(md: str, start: str) -> str:
    return next(ln for ln in md.splitlines() if ln.startswith(start))


# ------------------------------------------------------------------ 1. the predictions' family
def test_a_difference_inside_the_margin_beside_strong_predictions_is_reported_as_both():
    """Δ +0.0165 [0.0015, 0.0315], margin 0.03, three strong directional predictions: in one family of
    4 the difference test (raw p 0.035, the largest of the four) keeps p 0.035 and is significant; with
    the others padded as p = 1 it was 4 x 0.035 = 0.14."""
    rows, predictions, d = _four_predictions(0.0165, 0.03)
    assert stats.ttest_1samp(d, 0).pvalue == pytest.approx(0.0346, abs=5e-4)
    verdict = _row(_md(rows, predictions, primary="kl_exact"), "| k1 no reg").split(" | ")[-1]
    assert verdict.startswith("confirmed and different: a significant difference of +0.0165, and equivalent")


def test_a_difference_beyond_the_margin_beside_strong_predictions_is_refuted():
    """The same noise shifted by margin + 0.0165 (margin 0.005): the refuting test (beyond ±margin, raw p
    0.035) is the largest of a family of 4 (the three directional predictions' difference tests), so
    Holm keeps 0.035: refuted. Padded with p = 1 it was 0.14: undecided."""
    rows, predictions, d = _four_predictions(0.0215, 0.005)
    assert 2 * stats.ttest_1samp(d - 0.005, 0, alternative="greater").pvalue == pytest.approx(
        0.0346, abs=5e-4
    )
    verdict = _row(_md(rows, predictions, primary="kl_exact"), "| k1 no reg").split(" | ")[-1]
    assert verdict.startswith("refuted (the difference +0.0215 lies significantly beyond ±0.005)"), verdict


# ------------------------------------------------------------------ 2. non-finite and missing values
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_a_non_finite_value_is_no_value_and_does_not_pick_the_leader(bad):
    r = _rows(
        {
            "base": {"eval_accuracy": [0.3, 0.32, 0.31, 0.29, 0.30]},
            "a": {"eval_accuracy": [0.5, 0.53, 0.52, 0.51, 0.49]},
            "b": {"eval_accuracy": [0.4, 0.41, 0.42, 0.39, 0.40]},
        }
    )
    next(x for x in r if x["cell_id"] == "b-s1")["eval_accuracy"] = bad
    assert leader(r, G, "eval_accuracy")[0] == ("grpo", "a")


def test_a_seed_without_a_value_is_dropped_from_every_comparison_of_the_metric_and_named():
    """a's seed-1 cell is blank: every comparison of eval_accuracy uses seeds 0, 2, 3, 4 (b was tested
    on 5 seeds, a on 4), and the md names the seed, the configuration and why."""
    r = _rows(
        {
            "base": {"eval_accuracy": [0.3, 0.32, 0.31, 0.29, 0.30]},
            "a": {"eval_accuracy": [0.5, 0.53, 0.52, 0.51, 0.49]},
            "b": {"eval_accuracy": [0.4, 0.41, 0.42, 0.39, 0.40]},
        }
    )
    next(x for x in r if x["cell_id"] == "a-s1")["eval_accuracy"] = ""
    assert {c.other[1]: c.test.n for c in against(r, G, "eval_accuracy", BASE)} == {"a": 4, "b": 4}
    md = _md(r)
    assert "Seeds dropped from every comparison of eval_accuracy (1), for want of a value:" in md
    assert "- seed 1: grpo · Algorithm.kl=a has no finite eval_accuracy (blank, NaN or inf)" in md


# ------------------------------------------------------------------ 3. the leader's identical twin
def test_a_leader_with_an_identical_twin_gets_its_star_and_names_the_twin():
    base = [0.50, 0.52, 0.55, 0.51, 0.53, 0.50]
    worse = [b - 0.1 - 0.01 * (i % 2) for i, b in enumerate(base)]
    r = _rows(
        {
            "base": {"eval_accuracy": base},
            "twin": {"eval_accuracy": list(base)},
            "worse": {"eval_accuracy": worse},
        }
    )
    assert leader(r, G, "eval_accuracy")[2]
    findings = _md(r).split("## Findings")[1]
    assert (
        "grpo · Algorithm.kl=base (the same runs as grpo · Algorithm.kl=twin) has the highest eval_accuracy"
        in findings
    )
    assert "more paired seeds" not in findings and "0 of 1 tested others" not in findings


# ------------------------------------------------------------------ 4. families named, the TOST interval
def test_the_predictions_show_the_90_percent_interval_tost_uses_and_each_family_is_named():
    rows, predictions, d = _four_predictions(0.0165, 0.03)
    md = _md(rows, predictions, primary="kl_exact")
    low, high = stats.t.interval(0.90, len(d) - 1, loc=d.mean(), scale=stats.sem(d))
    cell = _row(md, "| k1 no reg").split(" | ")[4]
    assert cell == f"+0.0165 [{low:.3g}, {high:.3g}] 90% CI (TOST)"
    assert "| Δ [95% CI; 90% CI (TOST) for 'no difference'] |" in md
    findings = md.split("## Findings")[1]
    assert "Holm over the declared predictions, one family of 4)." in findings
    assert "Holm over all 4 comparisons with the baseline in kl_exact: p = " in findings


# ------------------------------------------------------------------ 5. no spread never proves equivalence
def test_a_constant_difference_inside_the_margin_is_undecided_at_any_n():
    """Six seeds at exactly +0.001, margin 0.03: the sign-flip TOST of a constant is 1/2^6 = 0.016 < 0.05,
    an artefact of the constant."""
    base = [0.10 + 0.01 * s for s in range(6)]
    r = _rows({"base": {"kl_exact": base}, "k1": {"kl_exact": [b + 0.001 for b in base]}})
    (c,) = against(r, G, "kl_exact", BASE)
    assert c.test.no_spread and math.isnan(c.test.equivalence_p_perm(0.03))
    md = _md(r, [("same", ("grpo", "k1"), "kl_exact", "no difference", 0.03)], primary="kl_exact")
    verdict = _row(md, "| same").split(" | ")[-1]
    assert verdict.startswith("undecided (no spread: a constant difference is an artefact, not evidence)")


# ------------------------------------------------------------------ 6, 10. failed and flagged runs
def _health_rows(acc, init, kl):
    cols = ("eval_accuracy", "eval_accuracy_init", "kl_exact")
    return _rows(
        {
            "base": dict(zip(cols, ([0.3] * 3, [0.3] * 3, [0.1] * 3), strict=True)),
            "a": dict(zip(cols, (acc, init, kl), strict=True)),
        }
    )


def test_an_infinite_kl_is_flagged_as_drifted():
    r = _health_rows([0.3, 0.33, 0.30], [0.3] * 3, [0.2, float("inf"), 0.3])
    (f,) = run_failures(r, G)
    assert (f.seed, f.kl_exploded, f.collapsed) == ("1", True, False)


def test_drift_is_a_flag_and_a_fall_within_eval_noise_is_no_collapse():
    """0.024 -> 0.443 with KL 1.5: drifted far, not failed; 0.024 -> 0.01: noise of a tiny warm start;
    0.3 -> 0.1: collapsed (below half of a warm start of at least 0.1); 0.024 -> 0: collapsed."""
    r = _health_rows([0.443, 0.01, 0.1], [0.024, 0.024, 0.3], [1.5, 0.2, 0.2])
    got = {f.seed: (f.collapsed, f.kl_exploded) for f in run_failures(r, G)}
    assert got == {"0": (False, True), "2": (True, False)}
    assert failed_keys(r, G) == {("grpo", "a")}
    drift_only = _health_rows([0.443, 0.5, 0.4], [0.024] * 3, [1.5, 0.2, 0.2])
    assert failed_keys(drift_only, G) == set()
    md = _md(drift_only)
    assert "## Failed and flagged runs" in md and "6 cells (6 finished, 0 failed)" in md
    assert "**grpo · Algorithm.kl=a**: 1 of 3 runs drifted far from the reference" in md
    assert "grpo · Algorithm.kl=a flagged: 1 of 3 runs drifted far" in md and "runs failed" not in md
    assert run_failures(_health_rows([0.0, 0.5, 0.4], [0.024] * 3, [0.2] * 3), G)[0].collapsed


# ------------------------------------------------------------ 8. seeds dropped: the cause, not 'more seeds'
def test_seeds_dropped_for_one_unstable_configuration_are_named_as_the_cause():
    base = [0.40, 0.45, 0.50, 0.42, 0.47]
    r = _rows(
        {
            "base": {"eval_accuracy": base},
            "up": {"eval_accuracy": [b + 0.1 + 0.01 * (i % 2) for i, b in enumerate(base)]},
            "flaky": {"eval_accuracy": base},
        },
        status={("flaky", i): "unstable" for i in range(4)},
    )
    findings = _md(r).split("## Findings")[1]
    cause = (
        "4 of 5 seeds were dropped because configuration grpo · Algorithm.kl=flaky (seeds 0, 1, 2, 3) was "
        "not ok in them (see Seeds dropped from every comparison)"
    )
    assert cause in findings
    assert "Run more seeds" not in findings and "more paired seeds" not in findings


# ------------------------------------------------------------------ 9. the forest's p is the deciding one
def test_the_forest_prints_the_deciding_p():
    """One outlier seed: Shapiro rejects normality, so t-test and sign-flip both decide; the sign-flip p
    of 5 seeds cannot go below 2/2^5 = 0.0625, so the deciding p is 0.0625 and the marker hollow."""
    base = [0.40, 0.45, 0.50, 0.42, 0.47]
    up = [b + d for b, d in zip(base, [0.100, 0.101, 0.099, 0.1005, 0.300], strict=True)]
    rows = _rows({"base": {"eval_accuracy": base}, "up": {"eval_accuracy": up}})
    (c,) = against(rows, G, "eval_accuracy", BASE)
    assert c.rule == RULE_BOTH and c.p_holm < 0.05
    table, _ = forest_table(rows, G, ["eval_accuracy"], BASE, lambda k: k[1], [BASE, ("grpo", "up")])
    assert table[0]["p_holm"] == pytest.approx(2 / 2**5) and not table[0]["significant"]


# ------------------------------------------------------------------ 11. words
def test_the_words_count_and_name():
    # one seed common to all: 'over the 1 seed'; one pair: 'untested (1 paired seed ...)'
    r = _rows({"base": {"eval_accuracy": [0.3, 0.32, 0.31]}, "a": {"eval_accuracy": [0.5, 0.51, 0.52]}})
    r = [x for x in r if not (x["Algorithm.kl"] == "a" and x["seed"] != "0")]
    md = _md(r, [("a up", ("grpo", "a"), "eval_accuracy", "higher", None)])
    assert "over the 1 seed every configuration has" in md and "1 seeds" not in md
    assert "untested (1 paired seed: no test possible)" in md
    assert "(no comparison is tested)" in md and "over the 0 tested" not in md
    assert "(exact for n ≤ 16, else 65,536 resamples)" in md
    # 'for 1 of 2 tested configurations' names it
    noisy = [0.30, 0.35, 0.28, 0.33, 0.31]
    r = _rows(
        {
            "base": {"eval_accuracy": [0.3, 0.32, 0.31, 0.29, 0.30]},
            "up": {"eval_accuracy": [0.5, 0.53, 0.52, 0.51, 0.49]},
            "same": {"eval_accuracy": noisy},
        }
    )
    findings = _md(r).split("## Findings")[1]
    assert (
        "In eval_accuracy, for 1 of 2 tested configurations (grpo · Algorithm.kl=same): no difference"
        in findings
    )
    # warm start accuracy to 4 significant digits
    rows = [
        {"status": "ok", "seed": str(s), "spec": "a", "eval_accuracy_init": "0.34424603174603174"}
        for s in (0, 1)
    ]
    assert "(eval_accuracy_init = 0.3442)" in warm_start_paragraph(rows)[0]


def test_a_baseline_without_a_finished_run_is_named_as_the_cause():
    r = _rows(
        {
            "base": {"eval_accuracy": [0.3, 0.3, 0.3]},
            "a": {"eval_accuracy": [0.5, 0.52, 0.51]},
            "b": {"eval_accuracy": [0.4, 0.43, 0.41]},
        },
        status={("base", s): "failed" for s in range(3)},
    )
    findings = _md(r).split("## Findings")[1]
    assert "The baseline grpo · Algorithm.kl=base has no finished run (see Failed cells)" in findings
    assert "Run more seeds" not in findings


def test_when_every_configuration_collapsed_the_answer_counts_the_others_below_their_warm_start():
    """value_init's Answer said 'runs that do not collapse would answer it' while 19 of its 26 runs that
    did not collapse also ended below their warm start. Two configurations of 4 seeds, warm start 0.4:
    seed 0 of each collapses (0.1 < half of 0.4); of the 6 others, 4 end below 0.4 (0.35, 0.3, 0.38,
    0.39) and 2 above."""
    rows = _rows(
        {
            "base": {"eval_accuracy": [0.1, 0.35, 0.3, 0.45], "eval_accuracy_init": [0.4] * 4},
            "b": {"eval_accuracy": [0.1, 0.38, 0.39, 0.5], "eval_accuracy_init": [0.4] * 4},
        }
    )
    (answer,) = (ln for ln in _md(rows).splitlines() if "**Answer.**" in ln)
    assert "cannot answer its question, because runs of every configuration failed" in answer
    assert (
        "of the 6 runs that did not collapse, 4 also ended below their warm start, so avoiding collapse "
        in answer
    )
    assert "runs that do not collapse would answer it" not in answer
    fine = _rows(
        {
            "base": {"eval_accuracy": [0.1, 0.45, 0.5, 0.45], "eval_accuracy_init": [0.4] * 4},
            "b": {"eval_accuracy": [0.1, 0.48, 0.49, 0.5], "eval_accuracy_init": [0.4] * 4},
        }
    )
    (answer,) = (ln for ln in _md(fine).splitlines() if "**Answer.**" in ln)
    assert "runs that do not collapse would answer it; more seeds" in answer
    few = _rows(  # 1 of the 6 that did not collapse ended below: not most of them
        {
            "base": {"eval_accuracy": [0.1, 0.35, 0.5, 0.45], "eval_accuracy_init": [0.4] * 4},
            "b": {"eval_accuracy": [0.1, 0.48, 0.49, 0.5], "eval_accuracy_init": [0.4] * 4},
        }
    )
    (answer,) = (ln for ln in _md(few).splitlines() if "**Answer.**" in ln)
    assert "runs that do not collapse would answer it; more seeds" in answer
