"""How the RL fit moves with the proxy's preference pairs (studies/overoptimization/scaling.py), on
curves whose peaks are known by construction, and the gold-itself runs the analysis takes in."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import write_csv

from polgrad.errors import PolgradError
from studies.overoptimization import fits as oo
from studies.overoptimization import scaling

D = [0.5 * k for k in range(1, 13)]  # 0.5 .. 6


def test_the_best_point_within_the_data_is_the_fitted_curve_s_maximum_over_the_range():
    # RL: d (a - b log d) has slope a - b (log d + 1): for b > 0 it peaks at d* = exp(a / b - 1), R = b d*.
    best = scaling.best_in_range
    e = math.e
    assert best("rl", 1.0, 0.5, 6.0) == pytest.approx((e, 0.5 * e), rel=1e-12)  # d* = e inside the range
    # d* beyond the data: the range's end, R(2) = 2 (1 - 0.5 log 2)
    assert best("rl", 1.0, 0.5, 2.0) == pytest.approx((2.0, 2 - math.log(2)), rel=1e-12)
    # falls and levels off (b < 0, d* = +inf): R(3) = 3 (-0.25 + 0.16 log 3) < 0, so its best is d = 0
    assert best("rl", -0.25, -0.16, 3.0) == (0.0, 0.0)
    # falls from the start after a blip: d* = exp(-3), R = 0.5 exp(-3)
    assert best("rl", -1.0, 0.5, 1.0) == pytest.approx((math.exp(-3), 0.5 * math.exp(-3)), rel=1e-12)
    # best-of-n: d (a - b d) peaks at a / 2b = 1, R = a^2 / 4b = 0.5
    assert best("bon", 1.0, 0.5, 6.0) == pytest.approx((1.0, 0.5), rel=1e-12)
    assert all(math.isnan(x) for x in best("rl", math.nan, math.nan, 1.0) + best("rl", 1.0, 0.5, 0.0))


def test_the_rl_peak_of_a_nearly_linear_fit_is_infinite_not_an_overflow():
    """exp(a / b - 1) overflows past ~709.8: a bootstrap resample that fits a near line must not stop
    the report."""
    assert oo.rl_peak(0.1, 1e-4) == math.inf and oo.rl_peak(7.0, 0.01) == pytest.approx(math.exp(699))


def _family(alpha: float, beta: float, seeds, wobble: float):
    """An RL-form gold curve per seed (start 0), its alpha moved by wobble x (seed - mean)."""
    mid = sum(seeds) / len(seeds)
    pts = [
        {"seed": s, "d": d, "gold": d * (alpha + wobble * (s - mid) - beta * math.log(d)), "proxy": 0.0}
        for s in seeds
        for d in D
    ]
    return pts, {s: {"gold": 0.0, "proxy": 0.0} for s in seeds}


def test_more_pairs_peaking_later_and_higher_is_called_so_and_a_twin_is_not():
    """Three proxies on 10 seeds (d up to 6): 128 pairs (a 0.2, b 0.1: d* = e, R = 0.1 e), 4096 pairs
    (a 0.3: d* = e^2 = 7.39 beyond the data, so its best is at d = 6, R = 6 (0.3 - 0.1 log 6)), and 1024
    pairs with 128's curve (its twin). Each seed's curve is exact, only alpha differs between seeds
    (+-0.0045): every resample gives 4096 the later and higher best, the twin a difference of 0. The
    gold itself comes last, outside the comparisons."""
    seeds = list(range(10))
    small, init = _family(0.2, 0.1, seeds, 0.001)
    big, _ = _family(0.3, 0.1, seeds, 0.001)
    twin, _ = _family(0.2, 0.1, seeds, 0.001)
    gold, _ = _family(0.5, 0.1, seeds, 0.001)
    rows = scaling.scale(
        {"b": (4096, big, init), "a": (128, small, init), "t": (1024, twin, init), "g": (None, gold, init)},
        bootstrap=200,
    )
    assert [r.pairs for r in rows] == [128, 1024, 4096, None]
    first, twin_row, top, ceiling = rows
    assert (first.d_best, first.gold_best) == pytest.approx((math.e, 0.1 * math.e), rel=1e-9)
    r_top = 6 * (0.3 - 0.1 * math.log(6))
    assert top.d_peak == pytest.approx(math.e**2, rel=1e-9)
    assert (top.d_best, top.gold_best) == pytest.approx((6.0, r_top), rel=1e-9)
    assert first.d_best_diff is None and ceiling.d_best_diff is None and ceiling.gold_best_diff is None
    d_diff, g_diff = top.d_best_diff, top.gold_best_diff
    assert d_diff[0] == pytest.approx(6 - math.e, rel=1e-9) and d_diff[1][0] > 0
    assert g_diff[0] == pytest.approx(r_top - 0.1 * math.e, rel=1e-9) and g_diff[1][0] > 0
    assert scaling.verdict(d_diff, "later", "earlier") == "later"
    assert scaling.verdict(g_diff, "higher", "lower") == "higher"
    # the twin: the same points, so 0 up to the fit's rounding
    assert abs(twin_row.gold_best_diff[0]) < 1e-9 and max(map(abs, twin_row.gold_best_diff[1])) < 1e-9
    # alpha and beta: every seed's curve is exact and shares the d grid, so a resample's pooled least
    # squares fit has beta = 0.1 and alpha = the mean of its seeds' alphas, 0.2 + 0.001 (mean of the
    # chosen seeds - 4.5), inside 0.2 +- 0.0045; 4096's alpha is 0.1 above 128's on every seed, so the
    # paired difference is 0.1 in every resample (to the fit's rounding) and beta's is 0
    assert (first.alpha, first.beta) == pytest.approx((0.2, 0.1), abs=1e-9)
    assert 0.2 - 0.0045 - 1e-9 <= first.alpha_ci[0] < 0.2 < first.alpha_ci[1] <= 0.2 + 0.0045 + 1e-9
    assert first.beta_ci == pytest.approx((0.1, 0.1), abs=1e-9)
    assert top.alpha_diff[0] == pytest.approx(0.1, abs=1e-9)
    assert top.alpha_diff[1] == pytest.approx((0.1, 0.1), abs=1e-9)
    assert top.beta_diff[0] == pytest.approx(0.0, abs=1e-9) and max(map(abs, top.beta_diff[1])) < 1e-9
    assert scaling.verdict(top.alpha_diff, "higher", "lower") == "higher"
    assert first.alpha_diff is None and ceiling.beta_diff is None
    # the best point's CIs: every resample has beta 0.1 and alpha in 0.2 +- 0.0045, so d* = exp(alpha /
    # beta - 1) lies in e exp(+-0.045) and R best = beta d* in 0.1 x that (128 pairs, d* inside the data)
    low, high = math.e * math.exp(-0.045) - 1e-9, math.e * math.exp(0.045) + 1e-9
    assert low <= first.d_best_ci[0] <= math.e <= first.d_best_ci[1] <= high
    assert 0.1 * low <= first.gold_best_ci[0] <= 0.1 * math.e <= first.gold_best_ci[1] <= 0.1 * high
    lines = scaling.section(rows, lambda x: f"{x:.3g}")
    assert any(ln.startswith("| b | 4096 | 10 |") and ln.endswith(": higher |") for ln in lines)
    row_b = next(ln for ln in lines if ln.startswith("| b | 4096 | 10 |")).split(" | ")
    assert row_b[3] == f"0.3 [{top.alpha_ci[0]:.3g}, {top.alpha_ci[1]:.3g}]" and row_b[4] == "0.1 [0.1, 0.1]"
    assert row_b[9].startswith("0.1 [0.1, 0.1]: higher"), row_b
    assert any(ln.startswith("| g | the gold itself |") for ln in lines)


def test_a_proxy_that_never_let_the_gold_rise_is_lower_and_earlier():
    """4096 pairs whose gold falls and levels off (a -0.25, b -0.1: below 0 for d < e^2.5 = 12.2, so over
    the data, d <= 6, its best is 0 at d = 0; d* = +inf) against
    128 pairs that rise (best 0.1 e at d = e): lower and earlier, finite, not an infinite 'later'."""
    seeds = list(range(10))
    small, init = _family(0.2, 0.1, seeds, 0.001)
    fall, _ = _family(-0.25, -0.1, seeds, 0.001)
    _, top = scaling.scale({"a": (128, small, init), "b": (4096, fall, init)}, bootstrap=200)
    assert top.d_peak == math.inf and (top.d_best, top.gold_best) == (0.0, 0.0)
    assert scaling.verdict(top.gold_best_diff, "higher", "lower") == "lower"
    assert scaling.verdict(top.d_best_diff, "later", "earlier") == "earlier"
    assert scaling.verdict((math.nan, (math.nan, math.nan)), "higher", "lower") == "undetermined"


def test_the_difference_is_paired_by_seed():
    """Each seed's whole gold curve scaled by its own k (0.5 .. 1.5), and the 4096 family's 1.1 times the
    128 family's on every seed. Scaling a curve scales alpha and beta alike, so d* stays e and its R
    is 1.1 x the other's in every resample of the seeds: the paired difference's CI is above 0.
    Resampled independently, the two families' mean k differ by more than the 10% between them, and
    that CI reaches below 0 (computed here by hand): the pairing is what the test sees."""
    seeds = list(range(10))
    k = {s: 0.5 + s / 9 for s in seeds}
    a = [
        {"seed": s, "d": d, "gold": k[s] * d * (0.2 - 0.1 * math.log(d)), "proxy": 0.0}
        for s in seeds
        for d in D
    ]
    b = [{**p, "gold": 1.1 * p["gold"]} for p in a]
    init = {s: {"gold": 0.0, "proxy": 0.0} for s in seeds}
    _, top = scaling.scale({"a": (128, a, init), "b": (4096, b, init)}, bootstrap=400)
    assert top.gold_best_diff[1][0] > 0 and top.d_best == pytest.approx(math.e, rel=1e-9)
    rng = np.random.default_rng(0)

    def r_best(points, chosen):
        pts = [p for s in chosen for p in points if p["seed"] == s]
        d, y = oo.deltas(pts, init, "gold")
        return scaling.best_in_range("rl", *oo.fit_rl_curve(d, y), max(d))[1]

    unpaired = [
        r_best(b, rng.choice(seeds, size=10).tolist()) - r_best(a, rng.choice(seeds, size=10).tolist())
        for _ in range(400)
    ]
    assert oo._interval(unpaired)[0] < 0


def test_a_family_missing_seeds_is_compared_on_the_seeds_both_have():
    """The 4096 family holds seeds 0-4 only, each with the 128 family's exact curve (alpha spread over
    the seeds): on the shared seeds the two are equal, so the difference and its CI are 0. Resampled
    over all 10 seeds, the 4096 family would lose seeds the other keeps, and the CI would move off 0."""
    seeds = list(range(10))
    a, init = _family(0.3, 0.1, seeds, 0.02)
    b = [p for p in a if p["seed"] < 5]
    _, top = scaling.scale({"a": (128, a, init), "b": (4096, b, init)}, bootstrap=200)
    assert top.seeds == 5 and abs(top.gold_best_diff[0]) < 1e-9
    assert max(map(abs, top.gold_best_diff[1])) < 1e-9 and max(map(abs, top.d_best_diff[1])) < 1e-9


def test_two_families_of_one_size_are_refused():
    pts, init = _family(0.2, 0.1, [0, 1], 0.0)
    with pytest.raises(PolgradError, match=r"one family per train\.rm_pairs value, got \[128, 128\]"):
        scaling.scale({"a": (128, pts, init), "b": (128, pts, init)}, bootstrap=2)


def test_pairs_of_reads_a_rows_reward_source_and_pairs():
    gold = {"train.reward_source": "'task'", "train.rm_pairs": "None"}
    assert scaling.pairs_of(gold) is None and scaling.is_gold(gold)
    proxy_default = {"train.reward_source": "'reward_model'", "train.rm_pairs": "None"}
    assert scaling.pairs_of(proxy_default) == 4096 and not scaling.is_gold(proxy_default)
    assert scaling.pairs_of({"train.rm_pairs": "128"}) == 128 and not scaling.is_gold(
        {"train.rm_pairs": "128"}
    )
    with pytest.raises(
        PolgradError, match=r"^train\.rm_pairs = 'many' in the points: not a number of pairs$"
    ):
        scaling.pairs_of({"train.rm_pairs": "many"})


def test_a_run_on_the_gold_itself_gives_points_whose_gold_is_its_reward(tmp_path):
    """points_stage: a run trained on the task's reward logs no gold_reward_mean (its reward is the
    gold): its points carry its reward as both gold and proxy."""
    from studies.overoptimization.analysis import points_stage

    exp = SimpleNamespace(name="oo", swept_columns=["train.reward_source", "train.rm_pairs"])
    run = tmp_path / "oo" / "runs" / "c0"
    run.mkdir(parents=True)
    rows = [{"step": s, "kl_exact_seq": 0.1 * (s - 1), "reward_mean": 0.1 * s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cell = {
        "cell_id": "c0",
        "spec": "grpo",
        "seed": 3,
        "train.reward_source": "'task'",
        "train.rm_pairs": "None",
    }
    write_csv(tmp_path / "oo" / "oo.csv", [{**cell, "status": "ok", "run_dir": "oo/runs/c0"}])
    pts = points_stage(exp, tmp_path, tmp_path / "oo" / "oo_points.csv")
    assert [p["step"] for p in pts] == [0, 5]
    assert pts[0]["gold"] == pts[0]["proxy"] == pytest.approx(0.1)
    # steps 1-5: reward (0.1 + ... + 0.5) / 5 = 0.3
    assert pts[1]["gold"] == pts[1]["proxy"] == pytest.approx(0.3, abs=1e-12)
    # the same metrics in a run on a reward model: no gold is made up for it, so it gives no points
    cell.update({"train.reward_source": "'reward_model'", "train.rm_pairs": "128"})
    write_csv(tmp_path / "oo" / "oo.csv", [{**cell, "status": "ok", "run_dir": "oo/runs/c0"}])
    assert points_stage(exp, tmp_path, tmp_path / "oo" / "oo_points.csv") == []


def test_the_rl_form_is_the_one_the_scaling_fits():
    """The section's numbers are the RL fit's (Gao et al.'s eq. 2), not best-of-n's."""
    seeds = list(range(4))
    pts, init = _family(0.2, 0.1, seeds, 0.0)
    (row,) = scaling.scale({"a": (128, pts, init)}, bootstrap=10)
    alpha, beta = oo.fit_rl_curve(*oo.deltas(pts, init, "gold"))
    assert (row.alpha, row.beta) == (alpha, beta) and row.alpha == pytest.approx(0.2, rel=1e-9)


def test_best_of_n_ranks_by_every_proxy_and_skips_the_gold_itself(tmp_path, monkeypatch):
    """best_of_n_stage: one best-of-n per seed and proxy configuration; the configuration trained on the
    gold itself has no proxy to rank by and gets none (its start is its runs' first step)."""
    from pathlib import Path

    from polgrad.sweep.experiment import load_experiment
    from studies.overoptimization import analysis
    from studies.overoptimization import best_of_n as bon_module

    repo = Path(__file__).resolve().parents[2]
    gin_file = tmp_path / "oo.gin"
    gin_file.write_text(
        f"include '{repo / 'experiments' / 'base_tiny.gin'}'\n"
        "train.task = @task.sort\n"
        "Sweep.name = 'oo'\nSweep.question = 'q?'\n"
        f"Sweep.specs = ['{repo / 'registry' / 'grpo.gin'}']\n"
        "Sweep.grid = {('train.reward_source', 'train.rm_pairs'): "
        "[('task', None), ('reward_model', 128), ('reward_model', 4096)]}\n"
        "Sweep.seeds = [5]\nSweep.budget = ('sampled_sequences', 64)\n"
    )
    calls = []

    def fake(cfg, algo, task, **kw):
        calls.append((cfg.reward_source, cfg.rm_pairs, kw["seed"]))
        return [{"n": 1, "kl": 0.0, "sqrt_kl": 0.0, "kl_bound": 0.0, "proxy": 0.0, "gold": 0.0}]

    monkeypatch.setattr(bon_module, "best_of_n", fake)
    monkeypatch.setattr(analysis, "environment", lambda ignore: {"git_commit": "x", "cpu": "y"})
    rows = analysis.best_of_n_stage(load_experiment(str(gin_file)), tmp_path, prompts=2, samples=2)
    assert sorted(calls) == [("reward_model", 128, 5), ("reward_model", 4096, 5)]
    assert sorted(r["train.rm_pairs"] for r in rows) == ["128", "4096"]
