"""The experiment's figures: the forest plot draws the md's paired statistics without the baseline, in
grid order grouped by the outermost factor, filled where the md's Holm-corrected test is significant,
in colours that do not follow the sign, with the equivalence margin shaded, a direction on every
panel, and labels that name only the bindings a cell reads; the learning curves are smoothed as their
legend says, start at step 0 and run against sampled sequences when the runs count them; a figure is
written without run folders and with one configuration only. Figures are inspected through their
matplotlib Axes (Agg), never by pixels."""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.colors import to_rgba
from scipy import stats

from polgrad.results import curves, figures, forest, markdown
from polgrad.results.compare import against
from polgrad.results.findings import BASELINE_HEADING
from polgrad.results.report import write_report
from polgrad.results.stats import t_ppf

BASE = [0.40, 0.50, 0.60]
# configuration -> (eval_accuracy − base per seed, kl_exact per seed or None)
CONFIGS = {
    "base": ([0.0, 0.0, 0.0], [0.10, 0.10, 0.10]),
    "up": ([0.10, 0.20, 0.30], [0.20, 0.30, 0.40]),
    "down": ([-0.05, -0.06, -0.07], [0.11, 0.13, 0.12]),
    "flat": ([0.02, 0.0, 0.01], None),  # no kl_exact: no row in the KL panel
}


def _rows(configs=CONFIGS, run_dirs=True):
    rows = []
    for spec, (deltas, kls) in configs.items():
        for seed, d in enumerate(deltas):
            cid = f"{spec}-s{seed}"
            rows.append(
                {
                    "cell_id": cid,
                    "spec": spec,
                    "seed": str(seed),
                    "status": "ok",
                    "eval_accuracy": str(BASE[seed] + d),
                    "kl_exact": "" if kls is None else str(kls[seed]),
                    "run_dir": f"e/runs/{cid}" if run_dirs else "",
                }
            )
    return rows


def _write_runs(tmp_path, rows):
    """metrics.jsonl: reward_mean 0, 1, 0, 1 at steps 1..4 (+ seed/10); eval.jsonl at steps 0, 2, 4."""
    for r in rows:
        d = tmp_path / r["run_dir"]
        d.mkdir(parents=True)
        s = int(r["seed"])
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": t, "reward_mean": (t + 1) % 2 + s / 10}) + "\n" for t in (1, 2, 3, 4))
        )
        (d / "eval.jsonl").write_text(
            "".join(
                json.dumps({"step": t, "accuracy": 0.3 + t / 100 + s / 100, "n": 8}) + "\n" for t in (0, 2, 4)
            )
        )


def _plot(tmp_path, rows, **kw):
    kw = {"baseline": {"spec": "base"}, **kw}
    return figures.plot(tmp_path / "e.png", "e", rows, swept_columns=[], results_dir=tmp_path, **kw)


def _is_png(path):
    img = matplotlib.image.imread(path)
    return img.ndim == 3 and img.shape[0] > 200 and img[..., :3].std() > 0.01


def test_ema_known_values():
    # span 3: a = 2 / (3 + 1) = 0.5. x = 0, 2, 4, nan, 8:
    # y1 = 0; y2 = .5·2 + .5·0 = 1; y3 = .5·4 + .5·1 = 2.5; y4 = y3 (nan carried); y5 = .5·8 + .5·2.5 = 5.25
    assert figures.ema([0.0, 2.0, 4.0, math.nan, 8.0], span=3) == [0.0, 1.0, 2.5, 2.5, 5.25]
    # span 10 (the figure's): a = 2/11; x = 1, 0: y2 = 9/11
    assert figures.ema([1.0, 0.0])[1] == pytest.approx(9 / 11, abs=1e-12)
    assert figures.ema([3.0, 5.0], span=1) == [3.0, 5.0]  # a = 1: no smoothing
    assert all(math.isnan(y) for y in figures.ema([math.nan, math.nan], span=3))


def test_forest_numbers_are_the_mds_paired_statistics(tmp_path):
    rows = _rows(run_dirs=False)
    figs = _plot(tmp_path, rows)
    drawn = {(r["label"], r["metric"]): r for r in figs.forest}
    assert figs.metrics == ["eval_accuracy", "kl_exact"] and figs.reference == "base"
    # Independently: paired t-test per configuration (scipy), Holm by hand over each metric's family.
    for metric in figs.metrics:
        col = {
            s: [float(r[metric]) for r in rows if r["spec"] == s]
            for s in CONFIGS
            if CONFIGS[s][1] or metric == "eval_accuracy"
        }
        others = [s for s in col if s != "base"]
        diffs = {s: [a - b for a, b in zip(col[s], col["base"], strict=True)] for s in others}
        p = {s: stats.ttest_rel(col[s], col["base"]).pvalue for s in others}
        ranked = sorted(others, key=p.get)
        holm, running = {}, 0.0
        for i, s in enumerate(ranked):  # adjusted p_(i) = max_{j<=i} min(1, (m - j + 1) p_(j))
            running = max(running, min(1.0, (len(ranked) - i) * p[s]))
            holm[s] = running
        for s in others:
            r = drawn[(s, metric)]
            mean = sum(diffs[s]) / 3
            half = stats.t.ppf(0.975, 2) * stats.tstd(diffs[s]) / math.sqrt(3)
            assert r["mean"] == pytest.approx(mean, abs=1e-12)
            assert (r["low"], r["high"]) == pytest.approx((mean - half, mean + half), abs=1e-9)
            assert r["p_holm"] == pytest.approx(holm[s], abs=1e-12)
    # up − base = 0.1, 0.2, 0.3: mean 0.2, sd 0.1, half-width t_{.975,2}·0.1/√3 = 4.302653·0.057735 = 0.248414
    up = drawn[("up", "eval_accuracy")]
    assert (up["mean"], up["high"] - up["mean"]) == pytest.approx((0.2, 0.248414), abs=1e-6)
    assert ("flat", "kl_exact") not in drawn and ("flat", "eval_accuracy") in drawn
    # ...and the md prints the very same numbers in its baseline table.
    md = markdown("e", rows, swept_columns=[], primary_metric="eval_accuracy", baseline={"spec": "base"})
    table = md.split(BASELINE_HEADING)[1].split("## ")[0]
    for s in ("up", "down", "flat"):
        cells = next(ln for ln in table.splitlines() if ln.startswith(f"| {s} |")).split(" | ")
        r = drawn[(s, "eval_accuracy")]
        assert cells[1] == f"{r['mean']:+.3g} [{r['low']:.3g}, {r['high']:.3g}]"
        assert cells[2] == f"{r['p_holm']:.2g}"


def test_forest_without_a_grid_keeps_the_rows_order_and_leaves_out_the_baseline(tmp_path):
    figs = _plot(tmp_path, _rows(run_dirs=False))
    assert figs.order == ["up", "down", "flat"]  # the CSV's order, not Δ (+0.2, −0.06, +0.01)
    assert "base" not in {r["label"] for r in figs.forest}
    assert figs.factor == "" and figs.groups == [("", ["up", "down", "flat"])]  # one factor: no groups
    # no baseline named: the reference is the leader by mean, and it has no row either
    lead = _plot(tmp_path, _rows(run_dirs=False), baseline=None)
    assert (lead.reference, lead.reference_kind) == ("up", "leader")
    assert lead.order == ["base", "down", "flat"]


def test_curves_are_smoothed_as_stated_and_eval_starts_at_step_0(tmp_path):
    rows = _rows()
    _write_runs(tmp_path, rows)
    figs = _plot(tmp_path, rows)
    assert not figs.note and figs.seeds["up"] == 3
    steps, mean, half = figs.curves["up"]["eval accuracy"]
    assert steps == [0, 2, 4]
    # step 0: accuracies 0.30, 0.31, 0.32 -> mean 0.31, sd 0.01, half = 4.302653·0.01/√3 = 0.0248414
    assert (mean[0], half[0]) == pytest.approx((0.31, 0.0248414), abs=1e-6)
    steps, mean, _ = figs.curves["up"]["train reward"]
    assert steps == [1, 2, 3, 4]
    # seed s: x = 0, 1, 0, 1 (+ s/10); EMA span 10, a = 2/11 on x (the offset passes through):
    # y = 0, 2/11, 18/121, 2/11 + (9/11)(18/121) = 404/1331; mean over seeds adds 0.1
    assert mean == pytest.approx([0.1, 2 / 11 + 0.1, 18 / 121 + 0.1, 404 / 1331 + 0.1], abs=1e-12)
    assert all(_is_png(p) for p in figs.paths)


def test_a_reward_model_run_draws_its_gold_beside_its_train_reward(tmp_path):
    """Runs trained on a reward model log gold_reward_mean (the task verifier on the same samples): the
    curves get a 'gold reward' band (EMA as the train reward's) drawn dashed over the train reward; runs
    without it get none."""
    from polgrad.results.curves import GOLD

    rows = _rows()
    _write_runs(tmp_path, rows)
    for r in rows:
        if r["spec"] != "up":
            continue
        path = tmp_path / r["run_dir"] / "metrics.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for row in lines:  # the proxy rises as the gold falls: 0.5 - step/10
            row["gold_reward_mean"] = 0.5 - row["step"] / 10
        path.write_text("".join(json.dumps(row) + "\n" for row in lines))
    figs = _plot(tmp_path, rows)
    steps, mean, _ = figs.curves["up"][GOLD]
    # the same for every seed: EMA (a = 2/11) of 0.4, 0.3, 0.2, 0.1
    ema = [0.4, 0.4 + (2 / 11) * (0.3 - 0.4)]
    ema += [ema[-1] + (2 / 11) * (0.2 - ema[-1])]
    ema += [ema[-1] + (2 / 11) * (0.1 - ema[-1])]
    assert steps == [1, 2, 3, 4] and mean == pytest.approx(ema, abs=1e-12)
    assert GOLD not in figs.curves["base"] and GOLD not in figs.curves["down"]
    assert any(line.get_linestyle() == "--" for ax in figs.curves_figure.axes for line in ax.get_lines())
    assert _is_png(figs.paths[1])


def test_a_figure_without_run_folders_says_so(tmp_path):
    figs = _plot(tmp_path, _rows(run_dirs=False))
    assert "no learning curves" in figs.note
    assert figs.paths == (tmp_path / "e.png", tmp_path / "e_curves.png")
    assert all(_is_png(p) for p in figs.paths)


def test_curves_drawn_earlier_are_kept_when_no_run_folder_is_there_to_redraw_them(tmp_path, capsys):
    """A clone holds an experiment's committed curves PNG but not its run folders (git ignores them):
    regenerating its report keeps the PNG, with a line saying why, instead of overwriting it with the
    'no learning curves' panel (which every committed curves PNG became)."""
    drawn = tmp_path / "e_curves.png"
    drawn.write_bytes(b"\x89PNG drawn from the run folders")
    figs = _plot(tmp_path, _rows(run_dirs=False))
    assert drawn.read_bytes() == b"\x89PNG drawn from the run folders"
    assert figs.paths == (tmp_path / "e.png", drawn) and _is_png(figs.paths[0])
    assert f"{drawn} kept: no learning curves" in capsys.readouterr().err


def test_run_folders_without_metrics_redraw_the_curves_instead_of_keeping_older_ones(tmp_path):
    """The run folders are there but hold no metrics (every cell failed before its first step): the
    curves PNG says so, rather than keep an earlier run's curves beside the new md."""
    rows = _rows()
    for r in rows:
        (tmp_path / r["run_dir"]).mkdir(parents=True)
    old = tmp_path / "e_curves.png"
    old.write_bytes(b"\x89PNG an earlier run's curves")
    figs = _plot(tmp_path, rows)
    assert "no learning curves" in figs.note and _is_png(old)


def test_a_figure_for_one_configuration(tmp_path):
    rows = _rows({"base": CONFIGS["base"]})
    _write_runs(tmp_path, rows)
    figs = _plot(tmp_path, rows)
    assert figs.forest == [] and figs.order == []
    assert list(figs.curves) == ["base"] and figs.curves["base"]["eval accuracy"][0][0] == 0
    assert all(_is_png(p) for p in figs.paths)


def test_write_report_writes_both_figures_and_the_md_shows_them(tmp_path):
    rows = _rows()
    _write_runs(tmp_path, rows)
    cols = list(rows[0])
    (tmp_path / "e").mkdir(exist_ok=True)
    (tmp_path / "e" / "e.csv").write_text(
        ",".join(cols) + "\n" + "".join(",".join(r[c] for c in cols) + "\n" for r in rows)
    )
    meta = {"swept_columns": [], "primary_metric": "eval_accuracy", "baseline": {"spec": "base"}}
    meta["cells"] = [{"id": r["cell_id"]} for r in rows]
    (tmp_path / "e" / "experiment.json").write_text(json.dumps(meta))
    md, png = write_report("e", tmp_path)
    text = md.read_text()
    assert "![e](e.png)" in text and "![e_curves](e_curves.png)" in text
    assert png == tmp_path / "e" / "e.png" and md == tmp_path / "e" / "e.md"
    assert _is_png(png) and _is_png(tmp_path / "e" / "e_curves.png")
    drawn = json.loads((tmp_path / "e" / "figures.json").read_text())
    assert (
        drawn["curves"]["series"] == ["eval accuracy", "train reward"] and drawn["forest"]["png"] == "e.png"
    )
    for torn in ("{half", "[1, 2]"):  # a torn or hand-edited record is rewritten, not trusted
        (tmp_path / "e" / "figures.json").write_text(torn)
        write_report("e", tmp_path)
        assert json.loads((tmp_path / "e" / "figures.json").read_text()) == drawn


# ----------------------------------------------------------------------------- a grid of two factors
STALE = ["0", "1", "2"]  # declared order of the outer factor (deliberately not sorted by Δ below)
FIX = ["@clip.ppo", "@clip.tis"]
SEEDS = range(8)
# Δ eval_accuracy to the baseline (stale 0, ppo) per configuration: grid order is not the order of Δ
SHIFT = {("1", "@clip.ppo"): -0.10, ("1", "@clip.tis"): 0.05, ("2", "@clip.ppo"): 0.20}
SHIFT |= {("2", "@clip.tis"): -0.20, ("0", "@clip.tis"): 0.01}
NOISE = [0.010, -0.020, 0.015, -0.010, 0.000, 0.020, -0.015, 0.005]


def _grid(not_read=lambda stale, fix: ""):
    """(rows, cells): every configuration of STALE × FIX (in that nesting, the sweep's expansion), 8
    seeds; the CSV rows written in REVERSE, so only experiment.json's cells give the grid order."""
    cells, rows = [], []
    for i, (stale, fix) in enumerate((stale, fix) for stale in STALE for fix in FIX):
        for seed in SEEDS:
            cid = f"{stale}-{fix}-s{seed}"
            cells.append({"id": cid, "spec": "grpo", "swept": {"st": stale, "Algorithm.fix": fix}})
            shift = SHIFT.get((stale, fix), 0.0)
            # noise shifted by the configuration (no constant paired difference): a shift of 0.05 or
            # more stands far above it (significant), 0.01 does not (see the test)
            acc = 0.4 + shift + NOISE[(seed + i) % 8]
            kl = 0.1 + 0.01 * (int(stale) + 1) + NOISE[(seed + 3 * i) % 8] / 10
            rows.append(
                {"cell_id": cid, "spec": "grpo", "st": stale, "Algorithm.fix": fix, "seed": str(seed)}
                | {"status": "ok", "eval_accuracy": str(acc), "kl_exact": str(kl), "run_dir": ""}
                | {"not_read": not_read(stale, fix)}
            )
    return rows[::-1], cells


BASE2 = {"spec": "grpo", "st": "0", "Algorithm.fix": "@clip.ppo"}


def _plot_grid(tmp_path, rows, cells, **kw):
    kw = {"baseline": BASE2, "cells": cells, **kw}
    return figures.plot(
        tmp_path / "g.png", "g", rows, swept_columns=["st", "Algorithm.fix"], results_dir=tmp_path, **kw
    )


def _panels(figs):
    """The forest's metric panels (the figure's other Axes are their right-hand twins)."""
    return figs.forest_figure.axes[: len(figs.metrics)]


def _hlines(ax):
    """The y of the lines across the whole panel (axhline: x from 0 to 1 in axes coordinates)."""
    return [
        ln.get_ydata()[0]
        for ln in ax.lines
        if list(ln.get_xdata()) == [0, 1] and len(set(ln.get_ydata())) == 1
    ]


def _vlines(ax):
    """The x of the lines along the whole panel (axvline)."""
    return [
        ln.get_xdata()[0]
        for ln in ax.lines
        if list(ln.get_ydata()) == [0, 1] and len(set(ln.get_xdata())) == 1
    ]


def _ticks(ax):
    """{y: text} of the forest's left tick labels."""
    return {round(y): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels(), strict=True)}


def test_forest_rows_follow_the_grid_grouped_by_the_first_swept_binding_not_the_difference(tmp_path):
    rows, cells = _grid()
    figs = _plot_grid(tmp_path, rows, cells)
    # grid order (stale 0, 1, 2; ppo before tis within each), the baseline (0, ppo) left out
    expected = ["st=0 · fix=@clip.tis", "st=1 · fix=@clip.ppo", "st=1 · fix=@clip.tis"]
    expected += ["st=2 · fix=@clip.ppo", "st=2 · fix=@clip.tis"]
    assert figs.order == expected
    assert figs.factor == "st"
    assert figs.groups == [("st=0", expected[:1]), ("st=1", expected[1:3]), ("st=2", expected[3:])]
    # drawn so: top to bottom, a bold group label above its rows (the factor left out of them), a group
    # of one is one row named whole, and a separator line between groups on every panel
    ax = figs.forest_figure.axes[0]
    ticks = _ticks(ax)
    top_down = [ticks[y] for y in sorted(ticks, reverse=True)]
    assert top_down == ["st=0 · fix=@clip.tis", "st=1", "fix=@clip.ppo", "fix=@clip.tis"] + [
        "st=2",
        "fix=@clip.ppo",
        "fix=@clip.tis",
    ]
    bold = [t.get_text() for t in ax.get_yticklabels() if t.get_fontweight() == "bold"]
    assert sorted(bold) == ["st=1", "st=2"]
    for panel in _panels(figs):
        # y 6 = st=0's one row; 5-3 = st=1's label and rows; 2-0 = st=2's
        assert sorted(_hlines(panel)) == [2.5, 5.5]
    # the order of Δ is another order: sorting would have changed the figure
    deltas = {r["label"]: r["mean"] for r in figs.forest if r["metric"] == "eval_accuracy"}
    assert sorted(expected, key=deltas.get, reverse=True) != expected
    # without experiment.json's cells the rows keep the CSV's order (here reversed), still grouped
    rev = _plot_grid(tmp_path, rows, ())
    assert rev.order == [expected[4], expected[3], expected[2], expected[1], expected[0]]
    assert [g for g, _ in rev.groups] == ["st=2", "st=1", "st=0"]


def test_a_no_difference_prediction_shades_its_margin_and_every_panel_has_the_zero_line(tmp_path):
    rows, cells = _grid()
    equal = {"claim": "tis at 0 matches", "config": {"st": "0", "Algorithm.fix": "@clip.tis"}}
    equal |= {"metric": "eval_accuracy", "expected": "no difference", "margin": 0.03}
    lower = {"claim": "st 1 loses", "config": {"st": "1", "Algorithm.fix": "@clip.ppo"}}
    lower |= {"metric": "kl_exact", "expected": "lower", "margin": None}
    figs = _plot_grid(tmp_path, rows, cells, predictions=[equal, lower])
    assert figs.metrics == ["eval_accuracy", "kl_exact"]
    acc, kl = _panels(figs)
    assert [_xspan(acc, p) for p in acc.patches] == [pytest.approx((-0.03, 0.03), abs=1e-9)]
    assert "±0.03" in acc.get_xlabel() and "tis at 0 matches" in acc.get_xlabel()
    assert list(kl.patches) == []  # a directional prediction has no margin
    assert all(_vlines(ax) == [0.0] for ax in (acc, kl))
    # against the leader (no baseline) the margin, a difference to the baseline, is not drawn
    lead = _plot_grid(tmp_path, rows, cells, predictions=[equal], baseline=None)
    assert lead.reference_kind == "leader" and all(list(ax.patches) == [] for ax in _panels(lead))
    assert all(_vlines(ax) == [0.0] for ax in _panels(lead))


def test_a_margin_panel_draws_the_90_percent_ci_tost_compares_with_the_band(tmp_path):
    """TOST at α = 0.05 confirms exactly when the 90% CI lies within ±margin: that is the bar drawn
    against the band (a 95% CI inside it would claim more than the test; one outside, less)."""
    rows, cells = _grid()
    equal = {"claim": "tis at 0 matches", "config": {"st": "0", "Algorithm.fix": "@clip.tis"}}
    equal |= {"metric": "eval_accuracy", "expected": "no difference", "margin": 0.03}
    figs = _plot_grid(tmp_path, rows, cells, predictions=[equal])
    acc, kl = _panels(figs)
    thick = {ln.get_gid(): ln.get_xdata() for ln in acc.lines if str(ln.get_gid()).startswith("tost|")}
    # only the predicted configuration has an equivalence test, so only its row gets the bar
    (predicted,) = [lab for lab in figs.order if "st=0" in lab and "tis" in lab]
    assert list(thick) == [f"tost|eval_accuracy|{predicted}"]
    assert not any(str(ln.get_gid()).startswith("tost|") for ln in kl.lines)
    for r in (r for r in figs.forest if r["metric"] == "eval_accuracy" and r["label"] == predicted):
        low, high = thick[f"tost|eval_accuracy|{r['label']}"]
        assert r["low"] < low < r["mean"] < high < r["high"]  # inside the 95% CI
        # the 90% t-interval: mean ± t_{0.95, n-1} · sd/√n, while the 95% one uses t_{0.975, n-1}
        ratio = (high - low) / (r["high"] - r["low"])
        assert ratio == pytest.approx(t_ppf(0.95, r["n"] - 1) / t_ppf(0.975, r["n"] - 1), rel=1e-9)
    assert "90% CI" in acc.get_xlabel()
    drawn = figs.drawn()
    assert drawn["forest"]["intervals"] == {
        "eval_accuracy": ["95% CI", "90% CI (TOST)"],
        "kl_exact": ["95% CI"],
    }
    assert drawn["forest"]["margins"] == {"eval_accuracy": [0.03]}


def test_every_committed_prediction_is_about_a_metric_its_forest_plot_draws():
    """Each experiment's figures.json (written with its md) says what its PNGs show; a prediction about
    a metric no panel draws (reasoning_gym's response lengths were in none) fails here."""
    results = Path(__file__).resolve().parents[2] / "results"
    checked = 0
    # every experiment's and tuning stage's (the pilots, drawn before figures.json existed, aside)
    for meta_path in sorted(p for p in results.rglob("experiment.json") if "pilots" not in p.parts):
        meta = json.loads(meta_path.read_text())
        if not meta.get("predictions"):
            continue
        drawn = json.loads((meta_path.parent / "figures.json").read_text())
        missing = {p["metric"] for p in meta["predictions"]} - set(drawn["forest"]["metrics"])
        assert not missing, (meta_path.parent.name, missing)
        margins = {
            p["metric"] for p in meta["predictions"] if p.get("margin") and p["expected"] == "no difference"
        }
        assert {m for m, i in drawn["forest"]["intervals"].items() if "90% CI (TOST)" in i} == margins
        checked += 1
    assert checked >= 8


def _xspan(ax, patch):
    """The patch's x extent in data coordinates (through the display, whatever kind of patch)."""
    box = patch.get_window_extent()
    (x0, _), (x1, _) = ax.transData.inverted().transform([[box.x0, 0], [box.x1, 0]])
    return x0, x1


def _configurations(ax):
    """{y: (st, fix)} read off the left tick labels top to bottom: a bold label opens a group, a row
    under it names the fix, a row of its own names both."""
    group, out = None, {}
    for y, t in sorted(zip(ax.get_yticks(), ax.get_yticklabels(), strict=True), key=lambda yt: -yt[0]):
        parts = dict(p.split("=", 1) for p in t.get_text().split(" · "))
        if t.get_fontweight() == "bold":
            group = parts["st"]
        else:
            out[round(y)] = (parts.get("st", group), parts["fix"])
    return out


def _markers(ax, configurations):
    """{configuration: (edge colour, filled)} of the panel's point estimates, matched by their y."""
    out = {}
    for ln in ax.lines:
        if ln.get_marker() == "o":
            edge, face = to_rgba(ln.get_markeredgecolor()), to_rgba(ln.get_markerfacecolor())
            assert face in (edge, to_rgba("white"))  # filled or hollow, nothing else
            out[configurations[round(ln.get_ydata()[0])]] = (edge, face == edge)
    return out


def test_a_filled_marker_is_a_significant_difference_and_the_colour_is_not_the_sign(tmp_path):
    rows, cells = _grid()
    figs = _plot_grid(tmp_path, rows, cells)
    for ax, metric in zip(_panels(figs), figs.metrics, strict=True):
        drawn = _markers(ax, _configurations(figs.forest_figure.axes[0]))
        comps = against(rows, ["spec", "st", "Algorithm.fix"], metric, ("grpo", "0", "@clip.ppo"))
        # filled exactly where the md's Holm-corrected comparison is significant
        assert {k: filled for k, (_, filled) in drawn.items()} == {c.other[1:]: c.significant for c in comps}
    drawn = _markers(_panels(figs)[0], _configurations(figs.forest_figure.axes[0]))
    # the design: both kinds of marker, and significant differences of both signs
    assert {k: filled for k, (_, filled) in drawn.items()} == {
        ("0", FIX[1]): False,
        ("1", FIX[0]): True,
        ("1", FIX[1]): True,
        ("2", FIX[0]): True,
        ("2", FIX[1]): True,
    }
    # the colour follows the inner factor (recurring in every group), never the sign:
    assert drawn[("2", FIX[0])][0] == drawn[("1", FIX[0])][0]  # +0.2 and −0.1, both ppo
    assert drawn[("2", FIX[1])][0] == drawn[("1", FIX[1])][0]  # −0.2 and +0.05, both tis
    # ...and without groups one neutral colour: up (+0.2) and down (−0.06) alike
    flat = _plot(tmp_path, _rows(run_dirs=False))
    ax = _panels(flat)[0]
    edges = {to_rgba(ln.get_markeredgecolor()) for ln in ax.lines if ln.get_marker() == "o"}
    assert len(edges) == 1


@pytest.mark.parametrize(
    "primary, higher, expected",
    [
        # accuracy ranked higher-is-better; the KL panel says what lower means, not "better"
        ("eval_accuracy", True, ["higher is better →", "← lower = closer to reference"]),
        # a primary metric ranked lower-is-better (Sweep.higher_is_better = False)
        ("eval_accuracy", False, ["← lower is better", "← lower = closer to reference"]),
        # kl_ablation: the KL is the primary metric, and accuracy gets its own panel
        ("kl_exact", False, ["← lower = closer to reference", "higher is better →"]),
    ],
)
def test_every_panel_says_which_way_is_better(tmp_path, primary, higher, expected):
    rows, cells = _grid()
    figs = _plot_grid(tmp_path, rows, cells, primary_metric=primary, higher_is_better=higher)
    assert [ax.get_xlabel().splitlines()[1] for ax in _panels(figs)] == expected


def test_no_label_names_a_binding_the_configuration_does_not_read(tmp_path):
    """clip_rules' design: eps is swept with ppo only, and clip.none / clip.dual do not read it (the
    CSV's not_read): their rows and curve panels do not name it; ppo's, which read it, do."""
    configs = [("@clip.none", "0.2", "eps"), ("@clip.ppo", "0.2", ""), ("@clip.ppo", "0.28", "")]
    configs += [("@clip.dual", "0.2", "eps")]
    rows, cells = [], []
    for i, (clip, eps, unread) in enumerate(configs):
        for seed in range(3):
            cid = f"{clip}-{eps}-s{seed}"
            cells.append({"id": cid})
            rows.append(
                {"cell_id": cid, "spec": "grpo", "Algorithm.clip": clip, "eps": eps, "seed": str(seed)}
                | {"status": "ok", "eval_accuracy": str(0.3 + 0.1 * i + NOISE[seed + i]), "not_read": unread}
                | {"run_dir": f"c/runs/{cid}"}
            )
    _write_runs(tmp_path, rows)
    base = {"Algorithm.clip": "@clip.ppo", "eps": "0.2"}
    figs = figures.plot(
        tmp_path / "c.png",
        "c",
        rows,
        swept_columns=["Algorithm.clip", "eps"],
        results_dir=tmp_path,
        baseline=base,
        cells=cells,
    )
    shown = ["clip=@clip.none", "clip=@clip.ppo · eps=0.28", "clip=@clip.dual"]
    assert figs.order == shown
    # groups of one row each are no groups: no group label, no separator
    assert figs.factor == "" and all(_hlines(ax) == [] for ax in _panels(figs))
    ticks = _ticks(figs.forest_figure.axes[0])
    assert [ticks[y] for y in sorted(ticks, reverse=True)] == shown  # top to bottom
    titles = [a.get_title() for a in figs.curves_figure.axes if a.get_title()]
    assert [t.replace("\xa0", " ").split(" (")[0] for t in titles] == shown  # (a no-break space wraps)


def _write_counted_runs(tmp_path, rows, per_step):
    """_write_runs, and each metrics row's cumulative `sampled_sequences`: per_step(seed) × step."""
    _write_runs(tmp_path, rows)
    for r in rows:
        s = int(r["seed"])
        path = tmp_path / r["run_dir"] / "metrics.jsonl"
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        path.write_text(
            "".join(json.dumps(m | {"sampled_sequences": per_step(s) * m["step"]}) + "\n" for m in lines)
        )


def test_curves_run_against_sampled_sequences_when_the_runs_count_them(tmp_path):
    rows = _rows()
    _write_counted_runs(tmp_path, rows, lambda seed: 64 + 8 * seed)  # a refill samples more on some seeds
    figs = _plot(tmp_path, rows)
    assert figs.x_axis == figures.SEQUENCES
    # seed s reaches step t at (64 + 8 s) t sequences. Grid: the steps every seed evaluated (0, 2, 4) at
    # the mean over seeds of their counts, 72 t = 0, 144, 288, cut at the last count every seed reached
    # (seed 0's 256), which joins the grid: 0, 144, 256. Seed s's accuracy, 0.30 + s/100 + t/100, is
    # linear in its count x = (64 + 8 s) t, so interpolation gives 0.30 + s/100 + x / (100 (64 + 8 s)):
    # at 144: 0.3225, 0.33, 0.338 (mean 0.330167); at 256: 0.34, 0.345556, 0.352 (mean 0.345852).
    x, mean, _ = figs.curves["up"]["eval accuracy"]
    assert x == pytest.approx([0, 144, 256], abs=1e-12)
    assert mean == pytest.approx([0.31, 0.990500 / 3, 1.037556 / 3], abs=1e-6)
    # train reward: steps 1..4 at 72 t, from seed 2's first count (80, which joins the grid) to seed 0's
    # last (256)
    x, _, _ = figs.curves["up"]["train reward"]
    assert x == pytest.approx([80, 144, 216, 256], abs=1e-12)
    bottom = [a for a in figs.curves_figure.axes if a.get_xlabel()]
    assert bottom and all(a.get_xlabel() == "sampled sequences (cumulative)" for a in bottom)


def test_seeds_that_stop_at_other_steps_are_averaged_at_common_sequence_counts(tmp_path):
    """DAPO-like: the seeds sample 64, 80 and 48 sequences a step and stop at a 300-sequence budget
    (steps 5, 4 and 7), evaluating every 2 steps and at their end. By step, the last evaluations
    (steps 5, 6, 7) would be points of one seed each: the curve would zig-zag between seeds. At
    common counts every point is a mean over the three seeds."""
    per_step, last = {0: 64, 1: 80, 2: 48}, {0: 5, 1: 4, 2: 7}
    rows = [r for r in _rows() if r["spec"] in ("base", "up")]
    for r in rows:
        s, d = int(r["seed"]), tmp_path / r["run_dir"]
        d.mkdir(parents=True)
        steps = range(1, last[s] + 1)
        (d / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": t, "reward_mean": 0.5, "sampled_sequences": per_step[s] * t}) + "\n"
                    for t in steps)
        )  # fmt: skip
        evals = sorted({0, *range(2, last[s] + 1, 2), last[s]})
        # accuracy 0.2 + s/10 + x/1000 at x sequences: linear in x, so interpolation is exact
        (d / "eval.jsonl").write_text(
            "".join(json.dumps({"step": t, "accuracy": 0.2 + s / 10 + per_step[s] * t / 1000, "n": 8}) + "\n"
                    for t in evals)
        )  # fmt: skip
    figs = _plot(tmp_path, rows)
    x, mean, half = figs.curves["up"]["eval accuracy"]
    # steps 0, 2, 4 (every seed's) at the mean counts 0, (128 + 160 + 96)/3 = 128, 256; then the last
    # count every seed reached, min(320, 320, 336) = 320. Mean over seeds 0.3 + x/1000; the seeds differ
    # by 0.1 at every x: sd 0.1, half-width t_{0.975,2} 0.1 / sqrt(3) = 0.248414
    assert x == pytest.approx([0, 128, 256, 320], abs=1e-12)
    assert mean == pytest.approx([0.3, 0.428, 0.556, 0.62], abs=1e-12)
    assert half == pytest.approx([0.248414] * 4, abs=1e-6)


def test_curves_run_against_steps_when_a_run_does_not_count_sequences(tmp_path):
    rows = _rows()
    _write_counted_runs(tmp_path, rows, lambda seed: 64)
    first = tmp_path / rows[0]["run_dir"] / "metrics.jsonl"  # one run from before the counter
    first.write_text("".join(json.dumps({"step": t, "reward_mean": 0.5}) + "\n" for t in (1, 2, 3, 4)))
    figs = _plot(tmp_path, rows)
    assert figs.x_axis == figures.STEPS and figs.curves["up"]["eval accuracy"][0] == [0, 2, 4]
    bottom = [a for a in figs.curves_figure.axes if a.get_xlabel()]
    assert bottom and all(a.get_xlabel() == "optimizer step" for a in bottom)


def test_a_list_of_tuples_groups_by_the_binding_it_nests_by(tmp_path):
    """kl_ablation's grid (with one more β), a list of (kl, placement, coef): kl comes first but its
    values do not nest (k1, k1, k2, k3, k1), placement's do (loss ×4, reward): the rows group by
    placement, in grid order (grouping by kl would have moved k1 in the reward up)."""
    grid = [("k1", "loss", "0.0"), ("k1", "loss", "0.5"), ("k1", "loss", "1.0"), ("k2", "loss", "0.5")]
    grid += [("k3", "loss", "0.5"), ("k1", "reward", "0.5")]
    rows, cells = [], []
    for i, (kl, place, coef) in enumerate(grid):
        for seed in range(4):
            cid = f"{kl}-{place}-{coef}-s{seed}"
            cells.append({"id": cid})
            rows.append(
                {"cell_id": cid, "spec": "grpo", "kl": kl, "place": place, "coef": coef, "seed": str(seed)}
                | {"status": "ok", "eval_accuracy": str(0.3 + 0.01 * i + NOISE[(seed + i) % 8])}
            )
    figs = figures.plot(
        tmp_path / "k.png",
        "k",
        rows[::-1],
        swept_columns=["kl", "place", "coef"],
        results_dir=tmp_path,
        baseline={"kl": "k1", "place": "loss", "coef": "0.0"},
        cells=cells,
    )
    assert figs.factor == "place"
    loss = ["kl=k1 · place=loss · coef=0.5", "kl=k1 · place=loss · coef=1.0"]
    loss += ["kl=k2 · place=loss · coef=0.5", "kl=k3 · place=loss · coef=0.5"]
    assert figs.groups == [("place=loss", loss), ("place=reward", ["kl=k1 · place=reward · coef=0.5"])]
    ticks = _ticks(figs.forest_figure.axes[0])
    assert [ticks[y] for y in sorted(ticks, reverse=True)] == [
        "place=loss",
        "kl=k1 · coef=0.5",
        "kl=k1 · coef=1.0",
        "kl=k2 · coef=0.5",
        "kl=k3 · coef=0.5",
        "kl=k1 · place=reward · coef=0.5",
    ]


def test_collapsed_and_identical_comparisons_are_marked_as_in_the_md(tmp_path):
    # 'crash' collapses on seed 1 (accuracy 0); 'twin' repeats the baseline's runs exactly
    configs = {
        "base": ([0.0, 0.0, 0.0], [0.10, 0.10, 0.10]),
        "up": ([0.10, 0.20, 0.30], [0.20, 0.30, 0.40]),
        "crash": ([0.05, -0.50, 0.04], [0.12, 0.90, 0.11]),
        "twin": ([0.0, 0.0, 0.0], [0.10, 0.10, 0.10]),
    }
    figs = _plot(tmp_path, _rows(configs, run_dirs=False))
    panel = _panels(figs)[0]
    shapes = {ln.get_gid().split("|")[1]: ln.get_marker() for ln in panel.lines if ln.get_gid()}
    assert shapes["crash"] == "X" and shapes["up"] == "o"
    right = {t.get_text() for t in figs.forest_figure.axes[len(figs.metrics)].get_yticklabels()}
    assert any(t.endswith("  failed runs") for t in right) and "+0  same runs as the reference" in right
    assert "✕ = involves collapsed runs" in figs.forest_figure._suptitle.get_text()
    assert sum(t.endswith("failed runs") for t in right) == 1  # 'up' and 'twin' rest on no collapse
    # a collapsed baseline: every comparison with it rests on failed runs
    configs["base"] = ([0.0, -0.50, 0.0], [0.10, 0.90, 0.10])
    del configs["twin"]
    figs = _plot(tmp_path, _rows(configs, run_dirs=False))
    right = [t.get_text() for t in figs.forest_figure.axes[len(figs.metrics)].get_yticklabels()]
    assert right and all(t.endswith("failed runs") for t in right if t)
    # a twin of another configuration (not the reference) says which, beside its own Δ; no ✕ legend
    # where nothing collapsed
    configs = {k: v for k, v in configs.items() if k != "crash"}
    configs["base"] = ([0.0, 0.0, 0.0], [0.10, 0.10, 0.10])
    configs["copy"] = configs["up"]
    figs = _plot(tmp_path, _rows(configs, run_dirs=False))
    right = [t.get_text() for t in figs.forest_figure.axes[len(figs.metrics)].get_yticklabels()]
    assert "+0.2  same runs as up" in right
    assert "✕" not in figs.forest_figure._suptitle.get_text()


def test_a_predicted_metric_other_than_accuracy_says_no_side_is_better():
    """reasoning_gym predicts response lengths: a longer wrong response is not 'better'."""
    assert forest.direction("final_len_incorrect", "eval_accuracy", True) == ""
    assert forest.direction("eval_accuracy", "kl_exact", False) == "higher is better →"


def test_a_prediction_about_another_metric_gets_its_own_panel(tmp_path):
    rows, cells = _grid()
    for i, r in enumerate(rows):
        r["len_incorrect_change"] = str(0.5 + 0.1 * (i % 5))
    longer = {"claim": "st 2 grows", "config": {"st": "2", "Algorithm.fix": "@clip.ppo"}}
    longer |= {"metric": "len_incorrect_change", "expected": "higher", "margin": None}
    figs = _plot_grid(tmp_path, rows, cells, predictions=[longer])
    assert figs.metrics == ["eval_accuracy", "kl_exact", "len_incorrect_change"]
    assert figs.drawn()["forest"]["metrics"] == figs.metrics
    assert len(_panels(figs)) == 3 and _panels(figs)[2].get_title() == "len_incorrect_change"


def test_an_accuracy_band_stops_at_0_and_1(tmp_path):
    """Accuracies 0.0, 0.0, 0.3 over 3 seeds: mean 0.1, sd 0.1732, the t-interval's half-width
    4.3027 · 0.1732 / √3 = 0.4303 reaches -0.33, an accuracy no run can have: the band is cut at 0
    (and at 1 above), the mean and the other side unchanged; a reward's band is not cut."""
    lo, hi = curves.band_limits("eval accuracy", [0.1, 0.95], [0.4303, 0.2])
    assert lo == pytest.approx([0.0, 0.75]) and hi == pytest.approx([0.5303, 1.0])
    assert curves.band_limits("train reward", [0.1], [0.4303]) == (
        pytest.approx([-0.3303]),
        pytest.approx([0.5303]),
    )
    rows = _rows({"base": ([0.0] * 3, None), "up": ([0.0] * 3, None)})
    _write_runs(tmp_path, rows)
    for r, acc in zip(rows, [0.0, 0.0, 0.3] * 2, strict=True):  # every step of a seed at that accuracy
        lines = [json.dumps({"step": t, "accuracy": acc, "n": 8}) for t in (0, 2, 4)]
        (tmp_path / r["run_dir"] / "eval.jsonl").write_text("\n".join(lines) + "\n")
    figs = _plot(tmp_path, rows)
    # the held-out accuracy panels: their lines carry markers (one per evaluation), the reward's do not
    eval_axes = [ax for ax in figs.curves_figure.axes if any(ln.get_marker() == "o" for ln in ax.lines)]
    fills = [c for ax in eval_axes for c in ax.collections]
    lows = [min(p.vertices[:, 1].min() for p in c.get_paths()) for c in fills]
    assert lows and min(lows) >= 0.0  # no accuracy band below 0
    assert any(low == pytest.approx(0.0, abs=1e-12) for low in lows)  # and it was cut there


# ------------------------------------------------------------------------------ layout: nothing overprints
LONG = {  # overoptimization's four swept bindings, whose names squeezed its forest panels to slivers
    "Algorithm.kl_coef": ["0.0", "0.1"],
    "Algorithm.kl_controller": ["@kl_controller.fixed", "@kl_controller.adaptive"],
    "train.rm_ensemble": ["1", "4"],
    "train.rm_combine": ["@reward_ensemble.mean", "@reward_ensemble.worst"],
}


def _long_rows(n_configs: int, run_dirs: bool = False):
    import itertools

    combos = list(itertools.product(*LONG.values()))
    combos = (combos * (1 + n_configs // len(combos)))[:n_configs]
    rows = []
    for i, combo in enumerate(combos):
        binds = dict(zip(LONG, combo, strict=True)) | {"Algorithm.kl_coef": f"{0.01 * i:g}"}
        for seed in range(3):
            cid = f"c{i}-s{seed}"
            rows.append(
                {"cell_id": cid, "spec": "grpo", "seed": str(seed), "status": "ok"}
                | binds
                | {
                    "eval_accuracy": str(0.3 + 0.01 * i + NOISE[(seed + i) % 8]),
                    "kl_exact": str(0.1 + 0.01 * i),
                }
                | {"run_dir": f"e/runs/{cid}" if run_dirs else ""}
            )
    return rows


def _px(fig):
    """A renderer of the (closed) figure, laid out as saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _plot_long(tmp_path, rows, name="e"):
    """figures.plot of `_long_rows`, against their first configuration."""
    base = {k: rows[0][k] for k in ("spec", *LONG)}
    return figures.plot(
        tmp_path / f"{name}.png", name, rows, swept_columns=list(LONG), results_dir=tmp_path, baseline=base
    )


def test_long_configuration_names_leave_every_forest_panel_its_width_and_no_text_overprints(tmp_path):
    figs = _plot_long(tmp_path, _long_rows(6))
    fig = figs.forest_figure
    r = _px(fig)
    panels, twins = _panels(figs), fig.axes[len(figs.metrics) :]
    for ax in panels:  # the panel itself, not squeezed by the names beside it
        assert ax.get_window_extent(r).width / fig.dpi >= 0.9 * figures.PANEL_IN
    names = max(t.get_window_extent(r).x1 for t in panels[0].get_yticklabels() if t.get_text())
    assert names <= panels[0].get_window_extent(r).x0  # the names end before the first panel
    for i, tw in enumerate(twins):  # each panel's Δ and p text ends before the next panel (or the edge)
        end = max(t.get_window_extent(r).x1 for t in tw.get_yticklabels() if t.get_text())
        assert end <= (panels[i + 1].get_window_extent(r).x0 if i + 1 < len(panels) else fig.bbox.width)
    assert min(ax.get_tightbbox(r).y1 for ax in fig.axes) < fig._suptitle.get_window_extent(r).y0


def test_a_tall_forest_and_many_curves_panels_keep_their_titles_clear_of_the_figures_title(tmp_path):
    """40 rows make a forest 18 in tall: with a fixed top margin its two-line title overprinted the
    panels' titles; the curves' legend overprinted the first row of panels' titles the same way."""
    figs = _plot_long(tmp_path, _long_rows(40))
    fig = figs.forest_figure
    r = _px(fig)
    assert max(ax.get_tightbbox(r).y1 for ax in fig.axes) < fig._suptitle.get_window_extent(r).y0
    rows = _long_rows(8, run_dirs=True)
    _write_runs(tmp_path, rows)
    figs = _plot_long(tmp_path, rows, "c")  # the same baseline: configuration 0 of either set
    fig = figs.curves_figure
    r = _px(fig)
    above = min(fig._suptitle.get_window_extent(r).y0, *(lg.get_window_extent(r).y0 for lg in fig.legends))
    assert max(ax.get_tightbbox(r).y1 for ax in fig.axes if ax.get_visible()) < above


def test_a_kl_primary_experiment_draws_its_kl_curves_in_a_row_of_their_own(tmp_path):
    """kl_ablation's primary metric is kl_exact (the mean of its last steps' values): its curves show it
    per step under the accuracy and reward rows, smoothed as the reward is; an accuracy-primary
    experiment keeps its two rows."""
    rows = _rows()
    _write_runs(tmp_path, rows)
    for r in rows:  # seed s logs kl_exact = 0.01 t + s/100 at step t
        path = tmp_path / r["run_dir"] / "metrics.jsonl"
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        s = int(r["seed"])
        path.write_text(
            "".join(json.dumps(m | {"kl_exact": 0.01 * m["step"] + s / 100}) + "\n" for m in lines)
        )
    figs = _plot(tmp_path, rows, primary_metric="kl_exact", higher_is_better=False)
    x, mean, _ = figs.curves["up"]["kl_exact"]
    # EMA (a = 2/11) of 0.01 t: 0.01, then (2/11) 0.02 + (9/11) 0.01 = 0.01 + 0.02/11; the seeds' offsets
    # s/100 pass through and average to 0.01
    assert x == [1, 2, 3, 4] and mean[:2] == pytest.approx([0.02, 0.02 + 0.02 / 11], abs=1e-12)
    labels = [a.get_ylabel() for a in figs.curves_figure.axes if a.get_ylabel()]
    assert labels == [
        "eval accuracy",
        f"train reward\n(EMA span {figures.EMA_SPAN})",
        "kl_exact\n(EMA span 10)",
    ]
    assert "kl_exact" in figs.drawn()["curves"]["series"]
    plain = _plot(tmp_path, rows)
    assert (
        "kl_exact" not in plain.curves["up"]
        and len([a for a in plain.curves_figure.axes if a.get_ylabel()]) == 2
    )


def test_an_experiment_about_lengths_draws_wrong_and_right_response_lengths(tmp_path):
    """A prediction about len_incorrect_change (length_bias_checks') gives the curves a row of response
    lengths: the train samples' mean length of wrong responses (solid) and right ones (dashed), each
    smoothed as the reward is; a step without wrong responses is no point of that curve. An experiment
    that asks nothing about lengths keeps its two rows."""
    from polgrad.results.curves import RIGHT_LEN, WRONG_LEN

    rows = _rows()
    _write_runs(tmp_path, rows)
    for r in rows:  # seed s: wrong 40 + 2t + s, right 5 + 20 s; step 3 had no wrong response
        path = tmp_path / r["run_dir"] / "metrics.jsonl"
        lines = [json.loads(ln) for ln in path.read_text().splitlines()]
        s = int(r["seed"])
        out = []
        for m in lines:
            wrong = None if m["step"] == 3 else 40.0 + 2 * m["step"] + s
            lengths = {"response_len_incorrect": wrong, "response_len_correct": 5.0 + 20 * s}
            out.append(m | lengths | {"kl_exact": 0.01 * m["step"]})
        path.write_text("".join(json.dumps(m) + "\n" for m in out))
    about = {"claim": "up's wrong ones grow", "config": {"spec": "up"}, "metric": "len_incorrect_change"}
    about |= {"expected": "higher", "margin": None}
    figs = _plot(tmp_path, rows, predictions=[about])
    x, mean, _ = figs.curves["up"][WRONG_LEN]
    # per seed, the points 42, 44, 48 (+ s) at steps 1, 2, 4; EMA a = 2/11: 42, 42 + 4/11,
    # (42 + 4/11) + (2/11)(48 - 42 - 4/11); the offsets s average to 1
    second = 42 + 4 / 11
    assert x == [1, 2, 4] and mean == pytest.approx([43, second + 1, second + (2 / 11) * (48 - second) + 1])
    x, mean, _ = figs.curves["up"][RIGHT_LEN]
    # right ones 5, 25, 45 over the seeds: mean 25, sd 20, so the t band (half 4.303 x 20 / sqrt 3 =
    # 49.7) would reach below 0 tokens if it were not cut there
    assert x == [1, 2, 3, 4] and mean == pytest.approx([25.0] * 4, abs=1e-12)
    labels = [a.get_ylabel() for a in figs.curves_figure.axes if a.get_ylabel()]
    assert labels[-1] == "response length,\ntokens\n(EMA span 10)", labels
    axes = [a for a in figs.curves_figure.axes if a.get_ylabel() == labels[-1]][0]
    assert sorted(line.get_linestyle() for line in axes.get_lines()) == ["-", "-", "--", "--"]
    # the dashed lines are the right responses' curves, the solid ones the wrong ones'
    for line in axes.get_lines():
        want = RIGHT_LEN if line.get_linestyle() == "--" else WRONG_LEN
        assert list(line.get_ydata()) in [figs.curves[c][want][1] for c in figs.curves], (
            want,
            line.get_ydata(),
        )
    low = min(p.get_paths()[0].vertices[:, 1].min() for p in axes.collections)
    assert low >= 0.0  # a length band stops at 0
    assert "wrong (solid) and right (dashed)" in figs.curves_figure._suptitle.get_text().replace("\n", " ")
    assert {WRONG_LEN, RIGHT_LEN} <= set(figs.drawn()["curves"]["series"])
    # with a per-step KL row too (a KL-primary experiment that asks about lengths), the title names
    # each row in order
    both = _plot(tmp_path, rows, predictions=[about], primary_metric="kl_exact", higher_is_better=False)
    title = both.curves_figure._suptitle.get_text().replace("\n", " ")
    assert "train reward (2nd row), kl_exact (3rd row) and the response lengths" in title, title
    assert "(4th row; all EMA" in title, title
    plain = _plot(tmp_path, rows)
    assert (
        WRONG_LEN not in plain.curves["up"]
        and len([a for a in plain.curves_figure.axes if a.get_ylabel()]) == 2
    )
