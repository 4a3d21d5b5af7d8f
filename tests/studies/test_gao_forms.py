"""Gao et al.'s two forms of the gold against d = sqrt(KL) (best-of-n: d (alpha - beta d); RL:
d (alpha - beta log d)), their R^2 and the report's section and Answer built from them, on data whose
answer is known by construction (studies/overoptimization/fits.py, gao_md.py)."""

from __future__ import annotations

import math

import pytest
from helpers import write_csv

from studies.overoptimization import fits as oo


def test_gaos_rl_form_recovers_a_noiseless_curve_and_its_peak():
    # y = d (0.3 - 0.1 log d): alpha 0.3, beta 0.1; slope 0.3 - 0.1 (log d + 1) = 0 at log d = 2,
    # d* = e^2 = 7.389...; a point at d = 0 predicts 0 (d log d -> 0)
    d = [0.0, 0.2, 0.5, 1.0, 2.0, 4.0, 9.0]
    y = [0.0 if x == 0 else x * (0.3 - 0.1 * math.log(x)) for x in d]
    alpha, beta = oo.fit_rl_curve(d, y)
    # a 2-parameter least squares of exact data: float64 round-off only (~1e-15 relative)
    assert (alpha, beta) == pytest.approx((0.3, 0.1), abs=1e-12)
    assert oo.rl_peak(alpha, beta) == pytest.approx(math.exp(2.0), rel=1e-12)
    # beta > 0 always rises first (slope +inf at 0+), even with alpha < 0: exp(-0.2 / 0.1 - 1) = e^-3
    assert oo.rl_peak(-0.2, 0.1) == pytest.approx(math.exp(-3.0), rel=1e-15)
    assert oo.rl_peak(0.3, -0.1) == math.inf and oo.rl_peak(0.2, 0.0) == math.inf
    assert oo.rl_peak(-0.2, 0.0) == 0.0 and math.isnan(oo.rl_peak(math.nan, 0.1))
    assert all(math.isnan(x) for x in oo.fit_rl_curve([0.0, 1.0, 1.0], [0.0, 1.0, 2.0]))  # one d > 0
    assert oo.predict("rl", 0.3, 0.1, [math.exp(2.0)])[0] == pytest.approx(0.1 * math.exp(2.0), rel=1e-12)
    # with a free intercept: c + alpha d - beta d log d recovered exactly, the same maximiser
    c, a, b = oo.fit_with_intercept(d, [0.05 + v for v in y], form="rl")
    assert (c, a, b) == pytest.approx((0.05, 0.3, 0.1), abs=1e-12)


def test_r_squared_is_centred():
    assert oo.r_squared([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) == 1.0
    assert oo.r_squared([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == 0.0  # the mean: SS_res = SS_tot
    # worse than the mean: SS_res (1 + 4 + 9 = 14) / SS_tot (2): 1 - 7 = -6
    assert oo.r_squared([1.0, 2.0, 3.0], [0.0, 0.0, 0.0]) == pytest.approx(-6.0, abs=1e-12)
    assert math.isnan(oo.r_squared([2.0, 2.0], [1.0, 3.0]))


def test_the_report_fits_gaos_two_forms_and_answers_from_them(tmp_path):
    """Ten seeds whose RL gold is d (alpha - 0.1 d) exactly (alpha 0.2 and 0.6) and whose best-of-n gold
    is d (0.3 - 0.1 d) (peak 1.5, inside the measured d up to 2.5) for one reward model and rises over
    the whole range, d (0.3 + 0.1 d), for the other. The declared form recovers the RL curves (R² 1 over
    the points and over the means); best-of-n's fit recovers its curve; a free intercept keeps each
    declared peak among the trained points (the data pass through the start)."""
    from types import SimpleNamespace

    from studies.overoptimization.analysis import report

    exp = SimpleNamespace(name="oo", question="q?", swept_columns=["train.rm_ensemble"])
    points, rows, bon = [], [], []
    for seed in range(10):
        for ens, alpha in (("1", 0.2), ("4", 0.6)):
            cell = f"ppo-{ens}-s{seed}"
            rows.append({"cell_id": cell, "seed": seed, "status": "ok", "git_commit": "abc1234"})
            for i, d in enumerate((0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0)):
                gold = d * (alpha - 0.1 * d)
                points.append({"cell_id": cell, "spec": "ppo", "seed": seed, "train.rm_ensemble": ens,
                               "step": 5 * i, "kl": d * d, "d": d, "proxy": d, "gold": gold})  # fmt: skip
            bon_beta = 0.1 if ens == "1" else -0.1
            for n, d in ((1, 0.0), (2, 0.5), (4, 1.0), (8, 2.0), (16, 2.5)):
                bon.append({"seed": seed, "train.rm_ensemble": ens, "n": n, "kl": d * d, "sqrt_kl": d,
                            "kl_bound": d * d, "proxy": d, "gold": d * (0.3 - bon_beta * d),
                            "git_commit": "abc1234"})  # fmt: skip
    write_csv(tmp_path / "oo" / "oo.csv", rows)
    write_csv(tmp_path / "oo" / "oo_points.csv", points)
    write_csv(tmp_path / "oo" / "oo_best_of_n.csv", bon)
    md = report(exp, tmp_path, bootstrap=20).read_text()
    section = md.split("## Gao et al.'s two forms")[1].split("## Sensitivity")[0]
    table = {
        tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[3:-1]]
        for ln in section.splitlines()
        if ln.startswith("| ") and " | d (alpha" in ln
    }
    # seeds, points, alpha, beta, R² points, R² means, d*, CI, measured d, inside
    assert table[("best-of-n · rm_ensemble 1", "d (alpha − beta d)")] == [
        "10", "50", "0.3", "0.1", "1", "1", "1.5", "[1.5, 1.5]", "0.5 – 2.5", "yes"
    ]  # fmt: skip
    assert table[("best-of-n · rm_ensemble 4", "d (alpha − beta d)")][3:8] == [
        "-0.1",
        "1",
        "1",
        "∞",
        "[∞, ∞]",
    ]
    assert table[("ppo · rm_ensemble 1", "d (alpha − beta d) (declared)")] == [
        "10", "70", "0.2", "0.1", "1", "1", "1", "[1, 1]", "0.5 – 5", "yes"
    ]  # fmt: skip
    rl = table[("ppo · rm_ensemble 1", "d (alpha − beta log d)")]
    assert float(rl[4]) < 1  # another form: it cannot fit these curves exactly
    (answer,) = (ln for ln in md.splitlines() if ln.startswith("**Answer.**"))
    assert (
        "best-of-n's gold, under d (alpha − beta d), turns down among its measured points, CI included, "
        "for rm_ensemble 1; not for rm_ensemble 4 (" in answer
    )
    # the RL form with a free intercept, counted from the fit itself on each family's pooled points
    kept_rl = 0
    for alpha in (0.2, 0.6):
        d = [x for _ in range(10) for x in (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0)]
        _, a, b = oo.fit_with_intercept(d, [x * (alpha - 0.1 * x) for x in d], form="rl")
        kept_rl += 0.5 < oo.rl_peak(a, b) < 5.0
    assert (
        "a maximum stays among the trained points for 2 of 2 families under the declared form and "
        f"{kept_rl} of 2 under the RL form" in answer
    )
    assert "rest on the fit's pass through the start" not in answer


def test_an_unknown_form_is_refused():
    with pytest.raises(ValueError, match="unknown form 'RL'; valid: bon, rl"):
        oo.predict("RL", 0.3, 0.1, [1.0])
    with pytest.raises(ValueError, match="unknown form"):
        oo.fit_with_intercept([0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 1.5, 1.6], form="log")


def test_an_rl_peak_below_the_smallest_measured_d_is_not_among_the_points():
    """beta > 0 puts the RL form's peak above 0 always; with alpha < 0 it lies below the points (d* =
    exp(-0.2/0.1 - 1) = e^-3 ~ 0.05 < 0.5): inside (0, d max), the declared test, but not among them."""
    d = [0.5, 1.0, 2.0, 3.0]
    pts = [{"seed": 0, "d": x, "gold": x * (-0.2 - 0.1 * math.log(x)), "proxy": x} for x in d]
    fit = oo.fit_family(pts, {0: {"gold": 0.0, "proxy": 0.0}}, "gold", bootstrap=5, form="rl")
    assert fit.d_peak == pytest.approx(math.exp(-3.0), rel=1e-9)
    assert fit.interior and not fit.among_points and fit.d_min == 0.5
