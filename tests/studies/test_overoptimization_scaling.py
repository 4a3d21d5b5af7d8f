"""How the RL fit moves with the proxy's preference pairs (studies/overoptimization/scaling.py), on
curves whose peaks are known by construction, and the gold-itself runs the analysis takes in."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from helpers import write_csv

from studies.overoptimization import fits as oo
from studies.overoptimization import scaling

D = [0.5 * k for k in range(1, 13)]  # 0.5 .. 6


def test_the_peak_gold_is_the_fitted_curve_at_its_maximiser():
    # RL: d (a - b log d) peaks where a - b (log d + 1) = 0, d* = exp(a / b - 1); there R = d* b.
    # a = 1, b = 0.5: d* = e, R = 0.5 e. Best-of-n: d (a - b d) peaks at a / 2b = 1, R = a^2 / 4b = 0.5.
    assert scaling.peak_gold("rl", 1.0, 0.5) == pytest.approx(0.5 * math.e, abs=1e-12)
    assert scaling.peak_gold("bon", 1.0, 0.5) == pytest.approx(0.5, abs=1e-12)
    assert scaling.peak_gold("rl", 1.0, -0.1) == math.inf  # never turns down
    assert scaling.peak_gold("bon", -1.0, 0.5) == 0.0  # falls from the start: its best is d = 0
    assert math.isnan(scaling.peak_gold("rl", math.nan, math.nan))


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
    """Three proxies on 10 seeds: 128 pairs (a 0.2, b 0.1: d* = e, R 0.27), 4096 pairs (a 0.3: d* = e^2
    = 7.39, R 0.74), and 1024 pairs with 128's curve (its twin): every resample gives the 4096 family the
    later and higher peak (each seed's curve is exact, only alpha differs between seeds by +-0.0045), and
    the twin a difference of exactly 0. The gold itself comes last, outside the comparisons."""
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
    assert first.d_peak == pytest.approx(math.e, rel=1e-9) and first.peak_gold == pytest.approx(0.1 * math.e)
    assert top.d_peak == pytest.approx(math.e**2, rel=1e-9) and top.peak_gold == pytest.approx(
        0.1 * math.e**2
    )
    assert first.d_peak_diff is None and ceiling.d_peak_diff is None and ceiling.peak_gold_diff is None
    d_diff, g_diff = top.d_peak_diff, top.peak_gold_diff
    assert d_diff[0] == pytest.approx(math.e**2 - math.e, rel=1e-9) and d_diff[1][0] > 0
    assert g_diff[0] == pytest.approx(0.1 * (math.e**2 - math.e), rel=1e-9) and g_diff[1][0] > 0
    assert scaling.verdict(d_diff, "later", "earlier") == "later"
    assert scaling.verdict(g_diff, "higher", "lower") == "higher"
    assert twin_row.d_peak_diff[0] == pytest.approx(0.0, abs=1e-9)
    assert scaling.verdict(twin_row.peak_gold_diff, "higher", "lower") == "no difference detected"
    lines = scaling.section(rows, lambda x: f"{x:.3g}")
    assert any(ln.startswith("| b | 4096 | 10 |") and ln.endswith(": higher |") for ln in lines)
    assert any(ln.startswith("| g | the gold itself |") for ln in lines)


def test_the_difference_is_paired_by_seed():
    """Each seed's whole gold curve scaled by its own k (0.5 .. 1.5), and the 4096 family's 1.1 times the
    128 family's on every seed. Scaling a curve scales alpha and beta alike, so d* stays e and
    R(d*) = 1.1 x the other's in every resample of the seeds: the paired difference's CI is above 0.
    Resampled independently, the two families' mean k differ by more than the 10% between them, and
    that CI reaches below 0 (computed here by hand): the pairing is what the test sees."""
    import numpy as np

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
    assert top.peak_gold_diff[1][0] > 0 and top.d_peak == pytest.approx(math.e, rel=1e-9)
    rng = np.random.default_rng(0)

    def r_star(points, chosen):
        pts = [p for s in chosen for p in points if p["seed"] == s]
        return scaling.peak_gold("rl", *oo.fit_rl_curve(*oo.deltas(pts, init, "gold")))

    unpaired = [
        r_star(b, rng.choice(seeds, size=10).tolist()) - r_star(a, rng.choice(seeds, size=10).tolist())
        for _ in range(400)
    ]
    assert oo._interval(unpaired)[0] < 0


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


def test_pairs_of_reads_the_csv_cell():
    assert scaling.pairs_of("4096") == 4096 and scaling.pairs_of(128) == 128
    assert scaling.pairs_of("None") is None and scaling.pairs_of("") is None


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
