"""The over-optimisation analysis (Gao et al. 2023): points from metrics rows, the fit d (alpha - beta d),
its peak, and the seed bootstrap, on data whose answer is known by construction."""

from __future__ import annotations

import math

import pytest
from helpers import write_csv

from studies.overoptimization import fits as oo


def test_run_points_averages_windows_of_steps():
    rows = [
        {"step": s, "kl_exact_seq": float(s), "reward_mean": 10.0 * s, "gold_reward_mean": 0.5}
        for s in range(1, 12)
    ]
    rows.insert(3, {"step": 99, "reward_mean": 1.0})  # no KL (e.g. a skipped update): not a point
    pts = oo.run_points(rows, window=5)
    # windows: steps 1..5 (kl mean 3), 6..10 (mean 8); step 11 alone is a partial window, dropped
    assert [p["step"] for p in pts] == [5, 10]
    assert [p["kl"] for p in pts] == [3.0, 8.0] and [p["proxy"] for p in pts] == [30.0, 80.0]
    assert pts[0]["d"] == pytest.approx(math.sqrt(3.0), abs=1e-15) and pts[1]["gold"] == 0.5
    # a negative estimate of the KL (noise near 0) has d = 0
    assert (
        oo.run_points([{"step": 1, "kl_exact_seq": -0.1, "reward_mean": 0, "gold_reward_mean": 0}], 1)[0]["d"]
        == 0
    )


def test_the_fit_recovers_a_noiseless_curve_and_its_peak():
    # y = d (0.3 - 0.1 d): alpha 0.3, beta 0.1, peak d* = 0.3 / 0.2 = 1.5
    d = [0.2, 0.5, 1.0, 1.7, 2.5, 3.0]
    y = [x * (0.3 - 0.1 * x) for x in d]
    alpha, beta = oo.fit_curve(d, y)
    # a 2-parameter least squares of exact data: float64 round-off only (~1e-15 relative)
    assert (alpha, beta) == pytest.approx((0.3, 0.1), abs=1e-12)
    assert oo.peak(alpha, beta) == pytest.approx(1.5, abs=1e-10)
    assert oo.peak(0.3, -0.1) == math.inf and oo.peak(-0.2, 0.1) == 0.0 and math.isnan(oo.peak(math.nan, 1.0))
    # convex (beta < 0) grows without limit even when it first dips (alpha < 0); a rising line too
    assert oo.peak(-0.2, -0.1) == math.inf and oo.peak(0.2, 0.0) == math.inf and oo.peak(0.0, 0.0) == 0.0
    assert all(math.isnan(x) for x in oo.fit_curve([0.0, 1.0, 1.0], [0.0, 1.0, 2.0]))  # one distinct d > 0


def _family(alphas, beta=0.1, ds=(0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0)):
    return [
        {"seed": s, "d": d, "gold": d * (a - beta * d), "proxy": d} for s, a in enumerate(alphas) for d in ds
    ]


def test_the_seed_bootstrap_brackets_the_peak():
    init = {s: {"gold": 0.0, "proxy": 0.0} for s in range(4)}
    same = oo.fit_family(_family([0.4] * 4), init, "gold", bootstrap=200)
    # every seed the same curve: every resample gives d* = 0.4 / 0.2 = 2 exactly
    assert same.d_peak == pytest.approx(2.0, abs=1e-9) and same.ci == pytest.approx((2.0, 2.0), abs=1e-9)
    assert same.interior and same.seeds == 4 and same.points == 28 and same.d_max == 4.0
    spread = oo.fit_family(_family([0.3, 0.4, 0.5, 0.6]), init, "gold", bootstrap=400)
    # pooled: alpha = mean 0.45 (equal designs per seed), d* = 2.25; a resample's d* lies in [1.5, 3]
    assert spread.d_peak == pytest.approx(2.25, abs=1e-9)
    assert 1.5 - 1e-9 <= spread.ci[0] < 2.25 < spread.ci[1] <= 3.0 + 1e-9
    # the start is subtracted per seed
    shifted = [{**p, "gold": p["gold"] + p["seed"]} for p in _family([0.4] * 4)]
    moved = oo.fit_family(
        shifted, {s: {"gold": float(s), "proxy": 0.0} for s in range(4)}, "gold", bootstrap=50
    )
    assert moved.d_peak == pytest.approx(2.0, abs=1e-9)
    rising = oo.fit_family(_family([0.4] * 4), init, "proxy", bootstrap=50)  # proxy = d: no peak
    assert rising.d_peak == math.inf and not rising.interior


def test_the_paired_peak_difference():
    init = {s: {"gold": 0.0, "proxy": 0.0} for s in range(3)}
    late, early = _family([0.6] * 3), _family([0.2] * 3)  # peaks at 3 and 1
    diff, ci = oo.peak_difference(late, early, init, init, bootstrap=100)
    assert diff == pytest.approx(2.0, abs=1e-9) and ci == pytest.approx((2.0, 2.0), abs=1e-9)
    # each family's gold minus its own start: a family whose start (and curve) is shifted by 0.3 keeps
    # its peak; subtracting the other family's start would move it (no intercept in the fit)
    shifted = [{**p, "gold": p["gold"] + 0.3} for p in late]
    moved = {s: {"gold": 0.3, "proxy": 0.0} for s in range(3)}
    diff, _ = oo.peak_difference(shifted, early, moved, init, bootstrap=20)
    assert diff == pytest.approx(2.0, abs=1e-9)
    assert oo.peak_difference(shifted, early, init, init, bootstrap=20)[0] != pytest.approx(2.0, abs=1e-3)


def test_shape_names_where_a_fit_stops_rising():
    """The words behind a "rises monotonically" verdict. y = d (alpha - beta d) has y' = alpha - 2 beta d:
    alpha = -0.4, beta = -1.6 (convex) falls to alpha^2 / (4 beta) = 0.16 / -6.4 = -0.025 at
    d = alpha / (2 beta) = 0.125, then rises; alpha = 0.2, beta = 0.1 peaks at d = 1; alpha = 1,
    beta = -1 rises from d = 0; alpha = -1, beta = 1 never rises."""
    low = oo.shape(-0.4, -1.6, 0.3, 5.0)
    assert (
        "first falls (alpha -0.4 <= 0) to -0.025 at d = 0.125, below the smallest d > 0 measured (0.3)" in low
    )
    assert "inside the measured range (smallest d > 0: 0.1)" in oo.shape(-0.4, -1.6, 0.1, 5.0)
    assert "to its peak at d = 1, inside the data" in oo.shape(0.2, 0.1, 0.3, 5.0)
    assert "over the whole measured range" in oo.shape(0.2, 0.1, 0.3, 0.9)  # the peak lies beyond d max
    assert "over the whole measured range" in oo.shape(1.0, -1.0, 0.3, 5.0)
    assert "never rises" in oo.shape(-1.0, 1.0, 0.3, 5.0)
    assert oo.shape(math.nan, 1.0, 0.3, 5.0) == "the fit is undetermined"


def test_a_run_over_optimised_only_when_its_proxy_rose_as_its_gold_fell():
    """Gold and proxy are changes from the start. Gold down with the proxy up is Gao et al.'s failure;
    gold down with the proxy down too is a run that got worse at everything (it did not optimise the
    proxy), and gold up is no failure whatever the proxy did."""
    assert oo.over_optimised(gold=-0.3, proxy=0.5)
    assert not oo.over_optimised(gold=-0.3, proxy=-0.1)  # both fell
    assert not oo.over_optimised(gold=-0.3, proxy=0.0)  # the proxy did not rise
    assert not oo.over_optimised(gold=0.2, proxy=0.5)
    assert not oo.over_optimised(gold=0.0, proxy=0.5)  # the gold did not fall


def test_the_free_intercept_fit_recovers_an_offset_curve():
    """y = 0.1 + 0.2 d - 0.1 d^2 (noiseless): (c, alpha, beta) = (0.1, 0.2, 0.1) to float rounding of a
    3-column least squares on 6 points (1e-12), its maximiser 0.2 / 0.2 = 1; fewer than 3 distinct d: nan."""
    d = [0.0, 0.5, 1.0, 2.0, 3.0, 4.0]
    c, a, b = oo.fit_with_intercept(d, [0.1 + 0.2 * x - 0.1 * x * x for x in d])
    assert (c, a, b) == pytest.approx((0.1, 0.2, 0.1), abs=1e-12) and oo.peak(a, b) == pytest.approx(1.0)
    assert all(math.isnan(v) for v in oo.fit_with_intercept([0.0, 1.0, 1.0], [0.0, 1.0, 2.0]))


def test_spearman():
    assert oo.spearman([1, 2, 3, 4], [10, 20, 25, 40]) == pytest.approx(1.0)
    assert math.isnan(oo.spearman([1, 2], [1, 2]))


def _curve(spec, ds, *, gold):
    """Point rows of one run per seed (0, 1), cell c<seed>, at kl_coef 0.1: d from `ds` at steps 0, 5,
    10, ..., proxy = d, gold = gold(d)."""
    return [
        {
            "cell_id": f"c{s}",
            "spec": spec,
            "seed": s,
            "Algorithm.kl_coef": "0.1",
            "step": 5 * i,
            "kl": d * d,
            "d": d,
            "proxy": d,
            "gold": gold(d),
        }  # fmt: skip
        for s in (0, 1)
        for i, d in enumerate(ds)
    ]


def test_the_report_is_made_from_the_csvs_alone(tmp_path):
    """python -m studies.overoptimization --report-only: the md and png from the three CSVs. Two
    families whose gold curves are known (peaks at d* = 1 and 3, each seed's start subtracted), a proxy
    that rises with d, best-of-n rows; the md states each fit, each prediction's verdict and the
    ensemble's paired peak difference (3 - 1 = 2)."""
    from types import SimpleNamespace

    from studies.overoptimization.analysis import report

    exp = SimpleNamespace(
        name="oo",
        question="Where does the gold peak?",
        swept_columns=["Algorithm.kl_coef", "train.rm_ensemble"],
    )
    start = {0: 0.2, 1: 0.4}
    points, sweep_rows, bon = [], [], []
    for seed in (0, 1):
        for ens, alpha in (("1", 0.2), ("4", 0.6)):  # beta 0.1: peaks at 1 and 3
            for coef in ("0.0", "0.5"):
                cell = f"ppo-{coef}-{ens}-s{seed}"
                sweep_rows.append(
                    {
                        "cell_id": cell,
                        "seed": seed,
                        "status": "ok",
                        "train.rm_ensemble": ens,
                        "rm_heldout_accuracy": 0.9 if ens == "1" else 0.95 + 0.01 * seed,
                        "git_commit": "abc1234",
                        "cpu": "AMD EPYC · AVX512",
                    }
                )
                for i, d in enumerate((0.5, 1.0, 2.0, 3.0, 4.0, 5.0) if coef == "0.0" else (0.25, 0.75, 1.5)):
                    points.append(
                        {
                            "cell_id": cell,
                            "spec": "ppo",
                            "seed": seed,
                            "Algorithm.kl_coef": coef,
                            "train.rm_ensemble": ens,
                            "step": 5 * (i + 1),
                            "kl": d * d,
                            "d": d,
                            "proxy": (1.0 if ens == "1" else -3.0) + d,  # the ensemble's own scale
                            "gold": start[seed] + d * (alpha - 0.1 * d),
                        }
                    )
        for ens, n in ((e, n) for e in ("1", "4") for n in (1, 4)):  # the same samples under both
            bound = math.log(n) - (n - 1) / n
            bon.append(
                {
                    "seed": seed,
                    "train.rm_ensemble": ens,
                    "n": n,
                    "kl": bound / 2,  # a sampled estimate below the bound
                    "sqrt_kl": math.sqrt(bound / 2),
                    "kl_bound": bound,
                    "proxy": (1.0 if ens == "1" else -3.0) + n / 10,
                    "gold": start[seed] + (0.05 if n == 4 else 0.0),
                    "git_commit": "abc1234",
                }
            )
    write_csv(tmp_path / "oo" / "oo.csv", sweep_rows)
    write_csv(tmp_path / "oo" / "oo_points.csv", points)
    write_csv(tmp_path / "oo" / "oo_best_of_n.csv", bon)
    md = report(exp, tmp_path, bootstrap=50).read_text()
    assert (tmp_path / "oo" / "oo_gao.png").stat().st_size > 10_000
    assert "| ppo · rm_ensemble 1 | 2 | 18 | 0.2 | 0.1 | 1 | 1 | [1, 1] | 5 | yes |" in md
    assert "| ppo · rm_ensemble 4 | 2 | 18 | 0.6 | 0.1 | 3 | 9 | [3, 3] | 5 | yes |" in md
    # each configuration's proxy minus its own start (1.1 single, -2.9 ensemble): both rise as d - 0.1;
    # the single model's start under the ensemble would make it d - 4.1, which does not rise
    assert md.count("proxy rises monotonically with KL — as the gin words the test") == 2
    assert md.count("no peak inside the measured range): holds; as the report code also requires") == 2
    assert md.count("(the fit rising from d = 0, alpha > 0): holds (") == 2
    # the proxy, d - 0.1 after its start, fits a curve rising over the data: the verdict says why
    assert md.count("the fit rises from d = 0 over the whole measured range (alpha ") == 2
    assert md.count("the fitted peak and its 95% CI lie inside (0, d max)") == 2
    assert "the ensemble's gold peaks at a larger KL — supported (d* difference 2," in md
    # best-of-4: the sampled KL 0.318 (half the bound log 4 - 3/4 = 0.636), d = sqrt(0.318) = 0.564
    assert "| rm_ensemble 1 | 4 | 0.318 | 0.636 | 0.564 | 0.3 | 0.05 |" in md
    assert "| rm_ensemble 4 | 4 | 0.318 | 0.636 | 0.564 | 0.3 | 0.05 |" in md
    assert "the start used here: best-of-1 (" in md
    # each reward-model configuration's accuracy apart: the ensemble's members are not the single model
    assert "rm_ensemble 1: seed 0 0.900, seed 1 0.900 (mean 0.900); rm_ensemble 4: seed 0 0.950, " in md
    assert "seed 1 0.960 (mean 0.955)" in md and "commits abc1234" in md
    assert "**Answer.** These 2 seeds cannot answer the question" in md  # a 2-seed design says so
    # a run whose gold ends below its start while its proxy rose is named: the single reward model's
    # unpenalised runs end at d = 5, gold = start + 5 (0.2 - 0.5) = start - 1.5; proxy 1.1 -> 6
    assert "- ppo-0.0-1-s0 (seed 0): gold 0.2 → -1.3 while its proxy rose 1.1 → 6, at KL 25 nats" in md
    assert "- ppo-0.0-1-s1 (seed 1): gold 0.4 → -1.1" in md and "ppo-0.0-4-s0 (seed 0)" not in md


def test_without_best_of_n_the_start_is_the_runs_first_step(tmp_path):
    """No best-of-n rows: each seed's start is its runs' step-0 point (their first step samples the warm
    start), and the md says so; with neither, one line naming the file and what to run."""
    from types import SimpleNamespace

    from polgrad.errors import PolgradError
    from studies.overoptimization.analysis import report

    exp = SimpleNamespace(name="oo", question="q?", swept_columns=["Algorithm.kl_coef"])
    points = _curve("ppo", (0.0, 0.5, 1.0, 2.0, 3.0, 4.0), gold=lambda d: 0.5 + d * (0.4 - 0.1 * d))
    write_csv(
        tmp_path / "oo" / "oo.csv", [{"cell_id": "c0", "seed": 0, "status": "ok", "git_commit": "abc1234"}]
    )
    write_csv(tmp_path / "oo" / "oo_points.csv", points)
    (tmp_path / "oo" / "oo_best_of_n.csv").write_text("seed,n,kl,sqrt_kl,kl_bound,proxy,gold\n")
    md = report(exp, tmp_path, bootstrap=20).read_text()
    # gold start 0.5 (step 0) subtracted: d (0.4 - 0.1 d), peak at 2
    assert "the start used here: first step (" in md and "| ppo | 2 | 12 | 0.4 | 0.1 | 2 | 4 |" in md
    write_csv(tmp_path / "oo" / "oo_points.csv", [p for p in points if p["step"] != 0])
    with pytest.raises(
        PolgradError, match=r"oo_best_of_n\.csv: no best-of-1 row and no step-0 point for seed 0"
    ) as e:
        report(exp, tmp_path, bootstrap=20)
    assert "\n" not in str(e.value)


def test_the_points_of_a_run_start_at_its_first_step(tmp_path):
    """points_stage: each ok cell's metrics.jsonl becomes a step-0 point (its first row: sampled from the
    warm start, KL 0) and then windows of WINDOW steps; a cell that is not ok is left out."""
    import json
    from types import SimpleNamespace

    from studies.overoptimization.analysis import points_stage

    exp = SimpleNamespace(name="oo", swept_columns=["Algorithm.kl_coef"])
    run = tmp_path / "oo" / "runs" / "c0"
    run.mkdir(parents=True)
    rows = [
        {
            "step": s,
            "kl_exact_seq": 0.0 if s == 1 else 0.1 * s,
            "reward_mean": float(s),
            "gold_reward_mean": 0.5,
        }
        for s in range(1, 11)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_csv(
        tmp_path / "oo" / "oo.csv",
        [
            {
                "cell_id": "c0",
                "spec": "ppo",
                "seed": 3,
                "Algorithm.kl_coef": "0.1",
                "status": "ok",
                "run_dir": "oo/runs/c0",
            },
            {
                "cell_id": "c1",
                "spec": "ppo",
                "seed": 4,
                "Algorithm.kl_coef": "0.1",
                "status": "failed",
                "run_dir": "x",
            },
        ],
    )
    pts = points_stage(exp, tmp_path, tmp_path / "oo" / "oo_points.csv")
    assert [p["step"] for p in pts] == [0, 5, 10] and {p["cell_id"] for p in pts} == {"c0"}
    assert (pts[0]["d"], pts[0]["kl"], pts[0]["proxy"], pts[0]["gold"]) == (0.0, 0.0, 1.0, 0.5)
    # steps 1-5: kl (0 + 0.2 + 0.3 + 0.4 + 0.5) / 5 = 0.28, proxy mean 3
    assert pts[1]["kl"] == pytest.approx(0.28, abs=1e-12) and pts[1]["proxy"] == 3.0
    assert (tmp_path / "oo" / "oo_points.csv").read_text().count("\n") == 4  # header + 3 points


def test_with_ten_seeds_the_answer_groups_the_declared_verdicts(tmp_path):
    """Ten seeds: the md's last sentence gives each declared prediction's verdict per family. The gold of
    the single reward model peaks at d* = 0.2 / (2 * 0.1) = 1 and the ensemble's at 0.6 / 0.2 = 3, inside
    d max = 5 (noiseless, so every resample's d* is the same and the CI is [1, 1] or [3, 3]); the ensemble's
    peak is 2 later; the proxy rises as d - 0.1 (single) and as -0.05 d + 0.1 d^2 (the ensemble: the fit
    alpha = -0.05, beta = -0.1 falls first, to 0.0025 / -0.4 = -0.00625 at d = 0.05 / 0.2 = 0.25, between
    the first step's d = 0 and the first trained point, d = 0.5). Its fit has no peak inside the data,
    so it holds as the gin words P1 and not by the report code's stricter test."""
    from types import SimpleNamespace

    from studies.overoptimization.analysis import report

    exp = SimpleNamespace(name="oo", question="q?", swept_columns=["train.rm_ensemble"])
    points, rows, bon = [], [], []
    for seed in range(10):
        for ens, alpha in (("1", 0.2), ("4", 0.6)):
            cell = f"ppo-{ens}-s{seed}"
            rows.append({"cell_id": cell, "seed": seed, "status": "ok", "git_commit": "abc1234"})
            for i, d in enumerate((0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0)):
                proxy = d - 0.1 if ens == "1" else -0.05 * d + 0.1 * d * d
                points.append(
                    {
                        "cell_id": cell,
                        "spec": "ppo",
                        "seed": seed,
                        "train.rm_ensemble": ens,
                        "step": 5 * i,
                        "kl": d * d,
                        "d": d,
                        "proxy": proxy,
                        "gold": d * (alpha - 0.1 * d),
                    }
                )
            bon.append({"seed": seed, "train.rm_ensemble": ens, "n": 1, "kl": 0, "sqrt_kl": 0, "kl_bound": 0,
                        "proxy": 0.0, "gold": 0.0, "git_commit": "abc1234"})  # fmt: skip
    write_csv(tmp_path / "oo" / "oo.csv", rows)
    write_csv(tmp_path / "oo" / "oo_points.csv", points)
    write_csv(tmp_path / "oo" / "oo_best_of_n.csv", bon)
    md = report(exp, tmp_path, bootstrap=20).read_text()
    (answer,) = (ln for ln in md.splitlines() if ln.startswith("**Answer.**"))
    assert (
        "The gold peaks at an intermediate KL: supported for ppo · rm_ensemble 1 (d* 1, CI [1, 1]), "
        "ppo · rm_ensemble 4 (d* 3, CI [3, 3])." in answer
    )
    assert "moves the peak to a larger KL (d* difference, 95% CI): supported for ppo (2 [2, 2])." in answer
    gin = "(the gin's test of a proxy rising with KL): holds for ppo · rm_ensemble 1, ppo · rm_ensemble 4;"
    assert gin in answer
    strict = "(the report code's stricter test): holds for ppo · rm_ensemble 1; does not hold for ppo · "
    strict += "rm_ensemble 4."
    assert strict in answer
    dip = "first falls (alpha -0.05 <= 0) to -0.00625 at d = 0.25, below the smallest d > 0 measured (0.5)"
    assert dip in md
    assert "is not answered here: each fit pools its family's KL controls" in answer
    # the post-hoc free-intercept fit finds the same peaks on curves through the start
    section = md.split("## Sensitivity, added after the data (not declared)")[1].split(
        "## Per configuration"
    )[0]
    rows = {ln.split(" | ")[0]: ln.split(" | ")[1:] for ln in section.splitlines() if ln.startswith("| ppo")}
    # first step (gold 0 at d = 0: the start), c ~ 1e-16, alpha, beta, maximiser, among the points
    assert [rows["| ppo · rm_ensemble 1"][i] for i in (0, 2, 3, 4, 5)] == ["0", "0.2", "0.1", "1", "yes |"]
    assert [rows["| ppo · rm_ensemble 4"][i] for i in (0, 2, 3, 4, 5)] == ["0", "0.6", "0.1", "3", "yes |"]


def test_the_answer_groups_every_verdict_word():
    """oo.answer groups each claim's families by verdict, whatever the words, and says 'not tested' for a
    claim without verdicts (no ensemble family to compare)."""
    text = oo.answer(
        {
            "gold": ["supported: a (d* 1)", "not established: b (d* 2)", "not seen: c (d* inf)"],
            "proxy_gin": ["holds: a", "undetermined: b"],
            "proxy": ["does not hold: a", "undetermined: b"],
        }
    )
    assert (
        "The gold peaks at an intermediate KL: supported for a (d* 1); not established for b (d* 2); " in text
    )
    assert "not seen for c (d* inf)." in text
    assert "(d* difference, 95% CI): not tested." in text
    assert "KL): holds for a; undetermined for b;" in text
    assert "test): does not hold for a; undetermined for b." in text


def test_the_analysis_rewrites_the_sweeps_md_when_the_sweep_has_one(tmp_path, monkeypatch):
    """python -m studies.overoptimization --report-only: after its own md it rewrites the sweep's
    (which quotes its answer), and only where the sweep's experiment.json exists."""
    from types import SimpleNamespace

    import studies.overoptimization.analysis as cli

    calls = []
    exp = SimpleNamespace(name="oo", studies=["studies.overoptimization"], lines={})
    monkeypatch.setattr(cli, "load_experiment", lambda path: exp)
    monkeypatch.setattr(cli, "report", lambda exp, results_dir, bootstrap: results_dir / "oo" / "oo_gao.md")
    monkeypatch.setattr(cli, "write_report", lambda name, results_dir: calls.append((name, results_dir)))
    assert cli.main(["x.gin", "--results", str(tmp_path), "--report-only"]) == 0
    assert calls == []  # no sweep md to rewrite
    (tmp_path / "oo").mkdir()
    (tmp_path / "oo" / "experiment.json").write_text("{}")
    assert cli.main(["x.gin", "--results", str(tmp_path), "--report-only"]) == 0
    assert calls == [("oo", tmp_path)]


def test_the_analysis_of_an_experiment_that_does_not_name_it_is_refused_in_one_line(tmp_path, capsys):
    """Its md would not quote the analysis, and its next sweep would count the analysis's files as another
    experiment's (a dirty tree): refused before any work, naming the file and the binding."""
    from studies.overoptimization.analysis import main

    path = tmp_path / "plain.gin"
    path.write_text(
        "include 'experiments/base_tiny.gin'\nSweep.name = 'plain'\nSweep.specs = ['registry/grpo.gin']\n"
        "Sweep.seeds = [0]\n"
    )
    assert main([str(path), "--results", str(tmp_path), "--report-only"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {path}: Sweep.studies does not name"), err
    assert not (tmp_path / "plain" / "plain_gao.md").exists()


def test_the_sensitivity_fit_places_a_maximum_before_the_first_trained_point_outside_the_points(tmp_path):
    """Gold = 0.05 + 0.04 d - 0.1 d^2 at every point, the first step (d = 0) included, against a start
    of 0 (best-of-1): the free-intercept fit recovers it and its maximiser 0.04 / 0.2 = 0.2 lies below the
    first trained point (d = 0.5), so not among the points; the first step sits 0.05 above the start."""
    from types import SimpleNamespace

    from studies.overoptimization.analysis import report

    exp = SimpleNamespace(name="oo", question="q?", swept_columns=["Algorithm.kl_coef"])
    points = _curve("grpo", (0.0, 0.5, 1.0, 2.0, 3.0), gold=lambda d: 0.05 + 0.04 * d - 0.1 * d * d)
    bon = [
        {"seed": s, "n": 1, "kl": 0, "sqrt_kl": 0, "kl_bound": 0, "proxy": 0.0, "gold": 0.0} for s in (0, 1)
    ]
    write_csv(
        tmp_path / "oo" / "oo.csv", [{"cell_id": "c0", "seed": 0, "status": "ok", "git_commit": "abc1234"}]
    )
    write_csv(tmp_path / "oo" / "oo_points.csv", points)
    write_csv(tmp_path / "oo" / "oo_best_of_n.csv", bon)
    md = report(exp, tmp_path, bootstrap=20).read_text()
    assert "| grpo | 0.05 | 0.05 | 0.04 | 0.1 | 0.2 | no (smallest d > 0: 0.5) |" in md
