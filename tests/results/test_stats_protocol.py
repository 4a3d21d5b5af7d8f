"""The statistics defects of issue 22, each on hand-made rows (no training): near-constant differences,
TOST and the detectable difference without spread, noncentral-t power, the sign-flip test beside
the t-test, comparisons identical to the baseline, one family for the predictions, 'no difference'
verdicts against the margin, the seeds dropped, duplicate rows, the leader's seeds, the words, the
failed runs and the closing answer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from scipy import integrate, stats

from polgrad.errors import DataError
from polgrad.results import markdown
from polgrad.results.compare import RULE_BOTH, RULE_PERM, against, leader
from polgrad.results.paths import experiments
from polgrad.results.predictions import judge
from polgrad.results.stats import Paired, paired, signflip_p

REPO = Path(__file__).resolve().parents[2]
G = ["spec", "Algorithm.kl"]
BASE = ("grpo", "base")


def _rows(configs: dict[str, dict[str, list[float]]], status: dict | None = None) -> list[dict[str, str]]:
    """One row per (configuration, seed): configs = {name: {metric: [value per seed]}}; `status` maps
    (name, seed) to a non-ok status."""
    rows = []
    for name, metrics in configs.items():
        n = len(next(iter(metrics.values())))
        for s in range(n):
            row = {
                "cell_id": f"{name}-s{s}",
                "spec": "grpo",
                "Algorithm.kl": name,
                "seed": str(s),
                "status": (status or {}).get((name, s), "ok"),
                "tokens_per_s": str(1000 + 37 * s + len(name)),  # timings always differ
            }
            if row["status"] != "ok":
                row["error"] = "skipped 40% of the optimizer steps"
            row.update({m: str(v[s]) for m, v in metrics.items()})
            rows.append(row)
    return rows


def _md(rows, predictions=(), baseline="base", primary="eval_accuracy", tuning=None):
    """The md of `rows`; predictions as (claim, (spec, name), metric, expected, margin), as `judge` takes."""
    predictions = [
        {"claim": c, "config": {"Algorithm.kl": k[1]}, "metric": m, "expected": e, "margin": mg}
        for c, k, m, e, mg in predictions
    ]
    return markdown(
        "x",
        rows,
        swept_columns=["Algorithm.kl"],
        primary_metric=primary,
        baseline={"Algorithm.kl": baseline},
        predictions=predictions,
        tuning=tuning,
    )


# ----------------------------------------------------------------- 1. near-constant differences
def test_a_constant_difference_has_no_t_test_and_an_exact_sign_flip_p():
    """+0.01 at two seeds, constant up to float rounding (0.41 − 0.40 and 0.51 − 0.50 differ in the
    last bits): the t-test gave p = 1.8e-15. The t-test is undefined; the exact sign-flip p is 2/2^n."""
    r = paired({0: 0.40, 1: 0.50}, {0: 0.41, 1: 0.51})
    assert r.no_spread and math.isnan(r.p) and math.isnan(r.low)
    assert r.p_perm == pytest.approx(2 / 2**2, abs=1e-12)  # 0.5: cannot be 0 with 2 seeds
    five = paired(dict.fromkeys(range(5), 0.3), dict.fromkeys(range(5), 0.35))
    assert five.p_perm == pytest.approx(2 / 2**5, abs=1e-12) and math.isnan(five.p)
    assert paired({0: 0.3, 1: 0.4}, {0: 0.3, 1: 0.4}).p_perm == 1.0  # no difference at all
    # in the md's family: not significant, decided by the sign-flip test alone
    rows = _rows({"base": {"eval_accuracy": [0.40, 0.50]}, "up": {"eval_accuracy": [0.41, 0.51]}})
    (c,) = against(rows, G, "eval_accuracy", BASE)
    assert c.rule == RULE_PERM and not c.significant and c.p_perm_holm == pytest.approx(0.5)


def test_the_sign_flip_p_at_ten_seeds_enumerates_all_1024_sign_vectors():
    """Exact, not resampled (n <= 16). Nine differences +1 and one -1 (n = 10, mean 0.8): a sign
    vector with k minus signs gives the mean (10 - 2k)/10, as large in size as 0.8 for k = 0, 1, 9, 10:
    C(10,0) + C(10,1) + C(10,9) + C(10,10) = 22 of the 2^10 = 1024 vectors, so p = 22/1024 two-sided and
    (k <= 1) 11/1024 one-sided 'greater'. Random resamples give (hits + 1)/(resamples + 1) instead
    (1,000 of them: 22/1001 or 23/1001 near 22/1024, 4e-4 away or more). The differences are ±1, so
    every mean is exact in float64 and 1e-12 only absorbs scipy's division."""
    ten = [1.0] * 9 + [-1.0]
    assert signflip_p(ten) == pytest.approx(22 / 1024, abs=1e-12)
    assert signflip_p(ten, "greater") == pytest.approx(11 / 1024, abs=1e-12)


# ----------------------------------------------------------------- 2. TOST without spread
def test_zero_spread_never_proves_equivalence():
    """Two identical seeds (d = +0.001 both times, margin 0.03) 'proved' equivalence (p = 0)."""
    t = Paired(2, 0.001, math.nan, math.nan, math.nan, 0.0, 0.5, math.nan, (0.001, 0.001))
    assert math.isnan(t.equivalence_p(0.03))
    # the sign-flip TOST of a constant (1/2^n: only the all-plus flips reach it) is no evidence either
    assert math.isnan(t.equivalence_p_perm(0.03))
    rows = _rows({"base": {"kl_exact": [0.10, 0.20]}, "same": {"kl_exact": [0.101, 0.201]}})
    md = _md(rows, [("no change", ("grpo", "same"), "kl_exact", "no difference", 0.03)], primary="kl_exact")
    row = next(ln for ln in md.splitlines() if ln.startswith("| no change |"))
    assert row.split(" | ")[-1].startswith(
        "undecided (no spread: a constant difference is an artefact, not evidence); with 2 seeds"
    )


# ----------------------------------------------------------------- 3. detectable difference
def _power(delta: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided one-sample t-test, integrated over V ~ chi2(n-1) by quadrature (not nct):
    P(|Z + nc| > crit·sqrt(V/df)), nc = delta·sqrt(n)/sd."""
    df, nc = n - 1, delta * math.sqrt(n) / sd
    crit = stats.t.ppf(1 - alpha / 2, df)

    def given(v):
        c = crit * math.sqrt(v / df)
        return (stats.norm.sf(c - nc) + stats.norm.cdf(-c - nc)) * stats.chi2.pdf(v, df)

    return integrate.quad(given, 0, math.inf, limit=200)[0]


@pytest.mark.parametrize("n, alpha", [(3, 0.05 / 4), (5, 0.05 / 11), (10, 0.05)])
def test_the_detectable_difference_has_80_percent_power_under_the_noncentral_t(n, alpha):
    """The central-t formula (t_{1-a/2} + t_{0.8})·sd/√n is optimistic: at n = 3, α = 0.05/4 its
    power is 0.71. The returned difference has power 0.8 by an independent quadrature."""
    t = Paired(n, 0.0, -1.0, 1.0, 0.5, 0.02)
    assert _power(t.mde(alpha), 0.02, n, alpha) == pytest.approx(0.8, abs=1e-4)
    assert math.isnan(Paired(n, 0.01, math.nan, math.nan, math.nan, 0.0).mde(alpha))  # no spread: undefined


# ----------------------------------------------------------------- 4. sign-flip beside the t-test
def test_non_normal_differences_need_the_sign_flip_test_too():
    """Five seeds all improved, one by far more (Shapiro-Wilk rejects normality): the t-test alone was
    significant; the exact sign-flip p is 2/2^5 = 0.0625, so no verdict, and the md says why."""
    base = [0.40, 0.45, 0.50, 0.42, 0.47]
    up = [b + d for b, d in zip(base, [0.100, 0.101, 0.099, 0.1005, 0.300], strict=True)]
    rows = _rows({"base": {"eval_accuracy": base}, "up": {"eval_accuracy": up}})
    (c,) = against(rows, G, "eval_accuracy", BASE)
    assert c.test.shapiro_p < 0.05 and c.p_holm < 0.05  # the t-test alone would call it
    assert c.rule == RULE_BOTH and c.p_perm_holm == pytest.approx(0.0625) and not c.significant
    md = _md(rows)
    assert "t-test and sign-flip (Shapiro-Wilk p = " in md and "p sign-flip (Holm)" in md
    assert "grpo · Algorithm.kl=up: eval_accuracy higher" not in md
    assert "its p cannot go below 0.062 (×1 after Holm): no verdict is possible without more seeds" in md


# ----------------------------------------------------------------- 5. identical to the baseline
def test_a_configuration_identical_to_the_baseline_is_out_of_holms_m():
    """'same' is the baseline's runs again (every outcome metric equal seed by seed; the sampled kl off by
    fp32 rounding, the timings different): it counted in m and doubled the real comparison's p."""
    base = {"eval_accuracy": [0.40, 0.45, 0.50, 0.42], "kl": [0.09380645368446602, 0.05, 0.07, 0.06]}
    same = {"eval_accuracy": base["eval_accuracy"], "kl": [0.0938064547666271, 0.05, 0.07, 0.06]}
    up = {"eval_accuracy": [0.45, 0.49, 0.56, 0.46], "kl": [0.1, 0.06, 0.08, 0.07]}
    rows = _rows({"base": base, "same": same, "up": up})
    comps = {c.other[1]: c for c in against(rows, G, "eval_accuracy", BASE)}
    assert comps["same"].identical_to == BASE and math.isnan(comps["same"].p_holm)
    raw = stats.ttest_rel(up["eval_accuracy"], base["eval_accuracy"]).pvalue
    assert comps["up"].m == 1 and comps["up"].p_holm == pytest.approx(raw, abs=1e-12)
    md = _md(rows)
    assert "grpo · Algorithm.kl=same is identical to grpo · Algorithm.kl=base in every outcome metric" in md


# ----------------------------------------------------------------- 6. one family for the predictions
def test_the_predictions_are_one_holm_family_directional_and_equivalence_together():
    """A directional prediction was corrected over all 4 comparisons, an equivalence one over the
    equivalence predictions only (m = 1). Now both over the 2 predictions, by hand below."""
    base = [0.40, 0.45, 0.50, 0.42, 0.47, 0.44]
    down = [b + d for b, d in zip(base, [-0.03, -0.05, -0.02, -0.04, -0.06, -0.035], strict=True)]
    flat = [b + d for b, d in zip(base, [0.004, -0.006, 0.002, 0.008, -0.003, 0.001], strict=True)]
    other = {f"x{i}": [b + 0.01 * (i - s % 2) for s, b in enumerate(base)] for i in range(2)}
    rows = _rows(
        {k: {"eval_accuracy": v} for k, v in ({"base": base, "down": down, "flat": flat} | other).items()}
    )
    preds = [
        ("down loses", ("grpo", "down"), "eval_accuracy", "lower", None),
        ("flat matches", ("grpo", "flat"), "eval_accuracy", "no difference", 0.03),
    ]
    fam = {c.other: c for c in against(rows, G, "eval_accuracy", BASE)}
    judged = judge(preds, [fam[("grpo", "down")], fam[("grpo", "flat")]])
    p_dir = stats.ttest_rel(down, base).pvalue
    d = [f - b for f, b in zip(flat, base, strict=True)]
    se = stats.tstd(d) / math.sqrt(6)
    p_eq = max(stats.t.sf((sum(d) / 6 + 0.03) / se, 5), stats.t.cdf((sum(d) / 6 - 0.03) / se, 5))
    lo, hi = sorted([p_dir, p_eq])
    holm = {lo: 2 * lo, hi: max(2 * lo, hi)}  # Holm over m = 2
    assert judged[0].m == judged[1].m == 2
    assert judged[0].p_difference == pytest.approx(holm[p_dir], rel=1e-9)
    assert judged[1].p_equivalence == pytest.approx(holm[p_eq], rel=1e-9)
    assert "The tested predictions are one Holm family" in _md(rows, preds)


# ----------------------------------------------------------------- 7. 'no difference' verdicts
def _kl_rows(deltas):
    base = [0.10 + 0.01 * s for s in range(len(deltas))]
    return _rows(
        {"base": {"kl_exact": base}, "k1": {"kl_exact": [b + d for b, d in zip(base, deltas, strict=True)]}}
    )


PRED = [("k1 as loss does not regularise", ("grpo", "k1"), "kl_exact", "no difference", 0.03)]


def _verdict(deltas):
    md = _md(_kl_rows(deltas), PRED, primary="kl_exact")
    return next(ln for ln in md.splitlines() if ln.startswith("| k1 as loss")).split(" | ")[-1]


def test_a_significant_difference_inside_the_margin_is_reported_as_both():
    """The other machine's kl_ablation: Δ +0.0165 [0.0016, 0.0314], inside ±0.03 by TOST: it was
    'refuted'. Ten seeds, mean +0.0165, sd 0.0066."""
    deltas = [0.0165 + e for e in (0.008, -0.008, 0.006, -0.006, 0.004, -0.004, 0.002, -0.002, 0.01, -0.01)]
    v = _verdict(deltas)
    assert v.startswith(
        "confirmed and different: a significant difference of +0.0165, and equivalent within ±0.03"
    )


def test_no_difference_is_refuted_only_beyond_the_margin_and_otherwise_undecided():
    beyond = [0.08 + e for e in (0.004, -0.004, 0.003, -0.003, 0.002, -0.002)]
    assert _verdict(beyond).startswith("refuted (the difference +0.08 lies significantly beyond ±0.03)")
    # significant but the CI reaches past the margin: neither within nor beyond
    straddle = [0.03 + e for e in (0.01, -0.01, 0.012, -0.012, 0.008, -0.008)]
    assert _verdict(straddle).startswith("undecided (a significant difference of +0.03, neither shown")
    noisy = [0.0 + e for e in (0.05, -0.05, 0.04, -0.04)]
    assert _verdict(noisy).startswith("undecided (neither shown within nor beyond ±0.03)")


def test_a_difference_beyond_the_margin_below_zero_is_refuted_as_one_above():
    """The test beyond the margin is on the side of the observed mean: Δ = -0.08 (the mirror image of
    the +0.08 above) is refuted too. Its t and sign-flip p-values equal the +0.08's: with the base at 0
    the differences are exactly ±x, so t and every sign-flipped mean mirror bit for bit (1e-12 only
    absorbs scipy's arithmetic)."""
    eps = (0.004, -0.004, 0.003, -0.003, 0.002, -0.002)
    below = [-0.08 + e for e in eps]
    assert _verdict(below).startswith("refuted (the difference -0.08 lies significantly beyond ±0.03)")
    up = paired(dict.fromkeys(range(6), 0.0), {s: 0.08 + e for s, e in enumerate(eps)})
    down = paired(dict.fromkeys(range(6), 0.0), {s: -(0.08 + e) for s, e in enumerate(eps)})
    assert up.outside_p(0.03) < 0.05 and up.outside_p_perm(0.03) < 0.05
    assert down.outside_p(0.03) == pytest.approx(up.outside_p(0.03), abs=1e-12)
    assert down.outside_p_perm(0.03) == pytest.approx(up.outside_p_perm(0.03), abs=1e-12)


# ----------------------------------------------------------------- 8. seeds dropped
def test_a_seed_not_ok_in_any_configuration_is_dropped_from_every_comparison():
    """Seed 2 is unstable in 'down' only: 'up' was tested on 4 seeds and 'down' on 3."""
    base = [0.40, 0.45, 0.50, 0.42]
    configs = {
        "base": {"eval_accuracy": base},
        "up": {"eval_accuracy": [b + 0.05 + 0.01 * (s % 2) for s, b in enumerate(base)]},
        "down": {"eval_accuracy": [b - 0.05 - 0.01 * (s % 2) for s, b in enumerate(base)]},
    }
    rows = _rows(configs, status={("down", 2): "unstable"})
    assert {c.other[1]: c.test.n for c in against(rows, G, "eval_accuracy", BASE)} == {"up": 3, "down": 3}
    md = _md(rows)
    assert "Seeds dropped from every comparison (1):" in md
    assert "- seed 2: grpo · Algorithm.kl=down unstable (skipped 40% of the optimizer steps)" in md


# ----------------------------------------------------------------- 9. duplicates
def test_a_duplicate_configuration_and_seed_is_an_error_naming_both_cells():
    rows = _rows({"base": {"eval_accuracy": [0.4, 0.5]}, "up": {"eval_accuracy": [0.5, 0.6]}})
    rows.append(rows[1] | {"cell_id": "base-s1-again", "eval_accuracy": "0.9"})
    with pytest.raises(
        DataError, match=r"Algorithm.kl=base has two rows for seed 1: cells 'base-s1' and 'base-s1-again'"
    ):
        _md(rows)


# ----------------------------------------------------------------- 10. the leader's seeds
def test_the_leader_is_ranked_on_the_seeds_every_configuration_has():
    """'b' has a fourth seed far ahead; over the 3 seeds both have, 'a' leads (it led by 'b''s mean)."""
    rows = _rows(
        {"a": {"eval_accuracy": [0.50, 0.52, 0.54]}, "b": {"eval_accuracy": [0.45, 0.47, 0.49, 0.99]}}
    )
    best, _, _ = leader(rows, G, "eval_accuracy")
    assert best == ("grpo", "a")
    assert "Leader by mean over the 3 seeds every configuration has: **grpo · Algorithm.kl=a**" in _md(
        rows, baseline="a"
    )


# ----------------------------------------------------------------- 11. words
def _noise_rows():
    """A configuration 'x' within ±0.03 of the baseline, seed by seed, around no difference."""
    base = [0.40, 0.45, 0.50, 0.42, 0.47]
    x = [b + e for b, e in zip(base, (0.02, -0.03, 0.01, 0.0, -0.01), strict=True)]
    return _rows({"base": {"eval_accuracy": base}, "x": {"eval_accuracy": x}})


def test_a_non_significant_difference_is_no_difference_detected_never_tied():
    rows = _noise_rows()
    md = _md(rows)
    assert "tied" not in md
    no_difference = (
        "No configuration differs significantly from the baseline in eval_accuracy: no difference detected"
    )
    assert no_difference + " (this design detects ≥ " in md
    assert "at 80% power" in md


# ----------------------------------------------------------------- 12. failed runs
def test_collapsed_and_bimodal_runs_are_named_as_failures_not_as_no_difference():
    """value_init's shape: held-out accuracy 0.024 at the warm start, 0 at the end in most runs, the
    reward model's score highest where it collapsed, kl_exact above 1 nat per token (a flag: drifted
    far from the reference, not a failure); 0.024 -> 0.01 is eval noise, not a collapse."""
    cols = ("eval_accuracy", "eval_accuracy_init", "final_train_reward", "kl_exact")
    rm = ([0.01, 0, 0, 0, 0], [0.024] * 5, [1.6, 5.1, 3.9, 4.4, 4.0], [2.6, 2.3, 2.7, 2.1, 2.4])
    policy = ([0.104, 0.302, 0, 0, 0], [0.024] * 5, [-1.5, 0.5, 3.8, -2.6, 4.0], [0.3, 0.4, 2.6, 1.9, 2.5])
    rows = _rows({"rm": dict(zip(cols, rm, strict=True)), "policy": dict(zip(cols, policy, strict=True))})
    md = _md(rows, baseline="rm")
    assert "## Failed and flagged runs" in md
    assert (
        "**grpo · Algorithm.kl=rm**: 4 of 5 runs collapsed; 5 of 5 runs drifted far from the reference" in md
    )
    assert "held-out accuracy ended at 0 (from 0.024)" in md and "fell from 0.024 to 0.01" not in md
    assert "bimodal outcomes: seeds 2, 3, 4 collapsed while seeds 0, 1 did not" in md
    assert "bimodal outcomes: seeds 1, 2, 3, 4 collapsed while seed 0 did not" in md
    assert "The reward trained on disagrees with the held-out accuracy" in md
    assert "drifted far from the reference: kl_exact 2.6 nats per token (> 1)" in md
    findings = md.split("## Findings")[1]
    assert "no difference detected" not in findings and "rest on failed runs" in findings
    assert (
        findings.rstrip()
        .splitlines()[-1]
        .startswith("- **Answer.** This experiment cannot answer its question")
    )


def test_an_answer_with_a_verdict_on_failed_runs_does_not_also_say_it_answers_nothing():
    """Two configurations whose runs collapsed (held-out accuracy 0.4 -> 0), and a declared prediction
    about x's kl_exact: the verdict on x stands on those runs as they ran, so the answer says so for x;
    for y, which no prediction compares, it answers nothing. Without a prediction: nothing for both."""
    cols = ("eval_accuracy", "eval_accuracy_init", "kl_exact")
    # six seeds: with failed runs the sign-flip test decides too, and its floor 2/2^6 = 0.031 is below α
    base = ([0.45, 0.5, 0.42, 0.48, 0.46, 0.44], [0.4] * 6, [0.30, 0.32, 0.29, 0.31, 0.33, 0.30])
    ok = ([0.46, 0.52, 0.41, 0.5, 0.45, 0.47], [0.4] * 6, [0.31, 0.30, 0.30, 0.32, 0.34, 0.29])
    x = ([0.0] * 6, [0.4] * 6, [0.10, 0.12, 0.09, 0.11, 0.13, 0.10])  # kl_exact lower by ~0.2 at every seed
    y = ([0.0] * 6, [0.4] * 6, [0.5] * 6)
    configs = (("base", base), ("ok", ok), ("x", x), ("y", y))
    rows = _rows({n: dict(zip(cols, v, strict=True)) for n, v in configs})
    md = _md(rows, predictions=[("x ends nearer its reference", ("grpo", "x"), "kl_exact", "lower", None)])
    answer = md.rstrip().splitlines()[-1]
    assert answer.startswith("- **Answer.** Of 1 predictions, confirmed: 'x ends nearer its reference'")
    assert answer.endswith(
        "; its verdicts on the configuration whose runs failed (grpo · Algorithm.kl=x) describe those runs, "
        "collapses included, and for the configuration whose runs failed (grpo · Algorithm.kl=y) it answers "
        "nothing until runs that do not collapse are compared."
    )
    plain = _md(rows).rstrip().splitlines()[-1]
    assert (
        ", and for the configurations whose runs failed (grpo · Algorithm.kl=x; grpo · Algorithm.kl=y) it "
        "answers nothing until runs that do not collapse are compared" in plain
    )


# ----------------------------------------------------------------- 13. the answer
def test_the_md_ends_with_one_answer():
    rows = _noise_rows()
    last = _md(rows).rstrip().splitlines()[-1]
    assert last.startswith(
        "- **Answer.** This design cannot say which configuration is best in eval_accuracy"
    )


# ----------------------------------------------------------------- the committed CSVs
# The over-optimisation analysis's own CSVs (python -m studies.overoptimization) are no sweep's
ANALYSIS = ("_best_of_n", "_points")
# The campaign's results, the pilots that planned them and the results it has not rerun yet
# (each in its experiment's folder, a tuning stage's inside it: polgrad/results/paths.py)
COMMITTED = [
    p
    for root in (REPO / "results", REPO / "results" / "pilots")
    for name in experiments(root)
    for p in (root / name).rglob("*.csv")
]
SWEEP_CSVS = sorted(p for p in COMMITTED if not p.stem.endswith(ANALYSIS))


def test_the_committed_csvs_are_found_in_their_experiments_folders():
    names = {p.stem for p in SWEEP_CSVS}
    assert {"kl_ablation", "algorithm_comparison_tuning", "overoptimization_pilot"} <= names, names
    assert all(
        p.stem == p.parent.name for p in SWEEP_CSVS
    )  # results/X/X.csv, results/X/X_tuning/X_tuning.csv


def test_the_analysis_csvs_sit_beside_their_sweeps_csv():
    for p in COMMITTED:
        if p.stem.endswith(ANALYSIS):
            sweep_csv = p.with_name(p.stem.removesuffix("_best_of_n").removesuffix("_points") + ".csv")
            assert sweep_csv in SWEEP_CSVS, p


@pytest.mark.parametrize("csv", SWEEP_CSVS, ids=lambda p: p.stem)
def test_the_committed_csvs_give_mds_without_tied_and_name_their_collapses(csv):
    """The md each committed CSV gives with today's code (written nowhere): no 'tied'; collapsed runs
    named as failures; every md ends with its answer."""
    from polgrad.results.store import read_rows

    meta = json.loads((csv.parent / "experiment.json").read_text())
    cells = {c["id"] for c in meta["cells"]}
    rows = [r for r in read_rows(csv) if r.get("cell_id") in cells]
    md = markdown(
        csv.stem,
        rows,
        swept_columns=meta["swept_columns"],
        primary_metric=meta["primary_metric"],
        higher_is_better=meta.get("higher_is_better", True),
        baseline=meta.get("baseline"),
        question=meta.get("question", ""),
        predictions=meta.get("predictions", ()),
    )
    assert "tied" not in md
    assert md.rstrip().splitlines()[-1].startswith("- **Answer.** ")
    # a configuration whose runs collapsed is named as a failure in the findings, whichever CSV it is in
    # (value_init's first design collapsed in 10 of 15 runs)
    from polgrad.results import health

    failed = health.failed_keys(rows, ["spec", *meta["swept_columns"]])
    if failed:
        assert health.HEADING in md and " failed: " in md.split("## Findings")[1], csv.stem


def _shifted(a: float, b: float) -> list[dict[str, str]]:
    """'base' (accuracy rising with the seed), 'a' = base + a + noise, 'b' = base + b - noise: 10 seeds."""
    noise = [0.01, -0.02, 0.015, -0.01, 0.0, 0.02, -0.015, 0.005, -0.005, 0.0]
    base = [0.3 + 0.01 * i for i in range(10)]
    return _rows(
        {
            "base": {"eval_accuracy": base},
            "a": {"eval_accuracy": [x + a + n for x, n in zip(base, noise, strict=True)]},
            "b": {"eval_accuracy": [x + b - n for x, n in zip(base, noise, strict=True)]},
        }
    )


def test_a_difference_between_configurations_at_different_tuned_values_says_so():
    """A tuning stage chose lr 3e-5 for 'a' and 1e-4 for the baseline and for 'b': a significant
    difference (or a decided prediction) of 'a' says it compares each at its own tuned value; 'b''s
    does not."""
    rows = _shifted(a=-0.1, b=-0.1)
    chosen = {"base": "0.0001", "a": "3e-05", "b": "0.0001"}
    configurations = [
        {"config": {"spec": "grpo", "Algorithm.kl": k}, "chosen": {"train.lr": v}, "values": []}
        for k, v in chosen.items()
    ]
    tuning = {"experiment": "x_tuning", "grid": {"train.lr": ["3e-05", "0.0001"]}, "seeds": [100]}
    tuning["metric"] = "eval_accuracy"
    tuning["configurations"] = configurations
    md = _md(rows, [("a is lower", ("grpo", "a"), "eval_accuracy", "lower", None)], tuning=tuning)
    findings = md.split("## Findings")[1].splitlines()
    note = "The two ran at different tuned values (train.lr = 3e-05 against 0.0001)"
    assert sum(note in line for line in findings) == 2  # 'a' against the baseline, and its prediction
    assert all("tuned values" not in line for line in findings if line.startswith("- grpo · Algorithm.kl=b"))
    assert any(line.startswith("- grpo · Algorithm.kl=b: eval_accuracy lower") for line in findings)


def test_a_leader_not_better_than_all_names_those_it_is_significantly_better_than():
    """The leader beats 'b' significantly but not 'a': the finding says so, naming 'b' with its Δ."""
    rows = _shifted(a=-0.001, b=-0.1)
    head = "- No configuration is significantly higher"
    line = next(x for x in _md(rows).splitlines() if x.startswith(head))
    assert "between the leader grpo · Algorithm.kl=base and 1 of 2 tested others, no difference" in line
    assert (
        "; the leader (picked by these data) is significantly higher than grpo · Algorithm.kl=b "
        "(that − the leader: -0.1 " in line
    )
