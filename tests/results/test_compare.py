"""Paired statistics of a leaderboard: known values, and no ★ that the md's own p-values do not support."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import pytest

from polgrad.results import markdown
from polgrad.results.compare import against, leader
from polgrad.results.findings import LEADER_HEADING
from polgrad.results.paths import experiments
from polgrad.results.stats import holm, paired

REPO = Path(__file__).resolve().parents[2]


def test_holm_known_values():
    # sorted p: 0.005, 0.01, 0.03, 0.04 (m = 4) -> 4·0.005 = 0.02, 3·0.01 = 0.03, 2·0.03 = 0.06,
    # 1·0.04 = 0.04 raised to the running max 0.06; returned in the input order.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02], abs=1e-15)
    assert holm([0.5, math.nan]) == [0.5, pytest.approx(math.nan, nan_ok=True)]  # NaN not counted
    assert holm([0.9, 0.8]) == [1.0, 1.0]  # capped at 1


def test_paired_known_values():
    # d = (0.02, 0.03, 0.01): mean 0.02, sd 0.01, t = 0.02 / (0.01/√3) = 2√3, df = 2.
    # Student t with 2 df has CDF 1/2 + t / (2 sqrt(2 + t²)), so p = 1 − t / sqrt(2 + t²) = 1 − √(12/14).
    # CI half-width = t_{0.975, 2} · 0.01/√3 with t_{0.975, 2} = 4.302653 (table value).
    r = paired({0: 0.40, 1: 0.50, 2: 0.45}, {0: 0.42, 1: 0.53, 2: 0.46})
    assert r.n == 3 and r.mean == pytest.approx(0.02, abs=1e-12)
    assert r.p == pytest.approx(1 - math.sqrt(12 / 14), abs=1e-9)
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert (r.low, r.high) == (pytest.approx(0.02 - half, abs=1e-6), pytest.approx(0.02 + half, abs=1e-6))
    # pairing uses only the common seeds
    assert paired({0: 1.0, 1: 2.0, 7: 9.0}, {0: 1.5, 1: 2.5}).n == 2
    assert paired({0: 1.0}, {0: 2.0}).p != paired({0: 1.0}, {0: 2.0}).p  # one pair: NaN, no test


def _rows(effects: dict[str, float], seeds: int, noise: float, seed: int = 0) -> list[dict[str, str]]:
    """Cells of configurations with a shared per-seed offset (the paired design) plus noise."""
    rng = random.Random(seed)
    offsets = [rng.gauss(0, 0.1) for _ in range(seeds)]  # seed effects, larger than the noise
    rows = []
    for name, effect in effects.items():
        for s in range(seeds):
            acc = 0.5 + offsets[s] + effect + rng.gauss(0, noise)
            rows.append(
                {
                    "cell_id": f"{name}-{s}",
                    "spec": "grpo",
                    "Algorithm.kl": name,
                    "seed": str(s),
                    "status": "ok",
                    "eval_accuracy": str(acc),
                    "kl": str(0.01 * (s + 1)),
                }
            )
    return rows


def star_is_supported(md: str) -> bool:
    """The md's ★ (if any) is backed by its own leader table: every Holm p < 0.05, the leader ahead."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| rank"))
    board = [ln for ln in lines[start + 2 :] if ln.startswith("|")]
    board = board[: next((i for i, ln in enumerate(board) if "configuration" in ln), len(board))]
    if not any("★" in ln for ln in board):
        return True
    if not any(ln.startswith(LEADER_HEADING) for ln in lines):
        return False
    i = next(i for i, ln in enumerate(lines) if ln.startswith(LEADER_HEADING))
    table = []
    for ln in lines[i:]:
        if ln.startswith("| ") and not ln.startswith("| configuration"):
            table.append(ln)
        elif table:
            break
    # others − leader: negative when higher is better, positive when lower is better
    behind = "+" if "with the leader lower" in "\n".join(lines[i : i + 4]) else "-"

    def num(text):
        return 0.0 if text == "<1e-4" else math.nan if text == "–" else float(text)

    for row in table:
        cells = [c.strip() for c in row.strip("|").split("|")]
        delta, p = cells[1], num(cells[3])
        if len(cells) >= 7:  # the sign-flip p and the rule that decides (older mds have neither)
            perm, rule = num(cells[4]), cells[5]
            p = perm if rule.startswith("sign-flip only") else max(p, perm) if "sign-flip" in rule else p
        if not (p < 0.05 and delta.startswith(behind)):
            return False
    return bool(table)


def _md(rows):
    return markdown(
        "x",
        rows,
        swept_columns=["Algorithm.kl"],
        primary_metric="eval_accuracy",
        baseline={"Algorithm.kl": "@kl.k1"},
    )


def test_a_clear_leader_gets_the_star_and_noise_does_not():
    clear = _rows({"@kl.k1": 0.0, "@kl.k2": 0.0, "@kl.k3": 0.15}, seeds=6, noise=0.01)
    best, comps, starred = leader(clear, ["spec", "Algorithm.kl"], "eval_accuracy")
    assert best == ("grpo", "@kl.k3") and starred and all(c.p_holm < 0.05 for c in comps)
    md = _md(clear)
    assert "| **1 ★** | **grpo** | `@kl.k3` |" in md and star_is_supported(md)

    noise = _rows({"@kl.k1": 0.0, "@kl.k2": 0.0, "@kl.k3": 0.0}, seeds=3, noise=0.05, seed=1)
    _, _, starred = leader(noise, ["spec", "Algorithm.kl"], "eval_accuracy")
    md = _md(noise)
    assert not starred and "★ " not in md.split("| rank")[1].split("\n\n")[0]
    assert "No configuration is significantly higher in eval_accuracy than all others" in md


def test_a_lower_is_better_leader_is_checked_in_its_own_direction():
    rows = _rows({"@kl.k1": 0.0, "@kl.k2": 0.0, "@kl.k3": -0.15}, seeds=6, noise=0.01)
    md = markdown(
        "x",
        rows,
        swept_columns=["Algorithm.kl"],
        primary_metric="eval_accuracy",
        higher_is_better=False,
        baseline={"Algorithm.kl": "@kl.k1"},
    )
    assert "| **1 ★** | **grpo** | `@kl.k3` |" in md and star_is_supported(md)
    assert not star_is_supported(md.replace("with the leader lower", "with the leader higher"))


def test_the_checker_rejects_an_unsupported_star():
    """Non-vacuity: a ★ pasted onto a tied leaderboard is caught."""
    md = _md(_rows({"@kl.k1": 0.0, "@kl.k2": 0.0}, seeds=3, noise=0.05, seed=2))
    lines = md.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("| rank")) + 2
    lines[i] = lines[i].replace("| 1 |", "| **1 ★** |", 1)
    assert not star_is_supported("\n".join(lines))


def test_the_checker_rejects_a_star_the_sign_flip_test_does_not_support():
    """Non-vacuity of the sign-flip part: a clear leader at 6 seeds, its rows marked as needing the
    sign-flip test too with a p above 0.05 (as non-normal differences would), loses its ★."""
    md = _md(_rows({"@kl.k1": 0.0, "@kl.k2": 0.0, "@kl.k3": 0.15}, seeds=6, noise=0.01))
    assert star_is_supported(md) and "| t-test | 6 |" in md
    assert not star_is_supported(md.replace("| t-test | 6 |", "| t-test and sign-flip (failed runs) | 6 |"))
    forged = re.sub(r"\| [0-9.]+ \| t-test \| 6 \|", "| 0.25 | t-test and sign-flip (failed runs) | 6 |", md)
    assert not star_is_supported(forged)


def test_baseline_differences_are_holm_corrected_and_reported_as_findings():
    rows = _rows({"@kl.k1": 0.0, "@kl.k2": 0.2}, seeds=5, noise=0.01, seed=3)
    # k3 = k1 exactly, seed by seed, up to ±0.01 that cancels: no difference to find
    k1 = [r for r in rows if r["Algorithm.kl"] == "@kl.k1"]
    for r, e in zip(k1, (0.01, -0.01, 0.01, -0.01, 0.0), strict=True):
        rows.append(
            {
                **r,
                "cell_id": r["cell_id"] + "k3",
                "Algorithm.kl": "@kl.k3",
                "eval_accuracy": str(float(r["eval_accuracy"]) + e),
            }
        )
    comps = {
        c.other[1]: c for c in against(rows, ["spec", "Algorithm.kl"], "eval_accuracy", ("grpo", "@kl.k1"))
    }
    assert comps["@kl.k2"].significant and not comps["@kl.k3"].significant
    assert comps["@kl.k2"].m == 2 and comps["@kl.k2"].p_holm >= comps["@kl.k2"].test.p
    md = _md(rows)
    assert "grpo · Algorithm.kl=@kl.k2: eval_accuracy higher than the baseline by" in md
    assert "grpo · Algorithm.kl=@kl.k3: eval_accuracy" not in md.split("## Findings")[1]


@pytest.mark.parametrize(
    "path",
    sorted(p for x in experiments(REPO / "results") for p in (REPO / "results" / x).rglob("*.md")),
    ids=lambda p: p.name,
)  # every report: each experiment's, its tuning stage's and its studies' (polgrad/results/paths.py)
def test_committed_leaderboards_star_only_what_their_statistics_support(path):
    assert star_is_supported(path.read_text()), f"{path.name} shows a ★ its own p-values do not support"


def test_no_findings_section_claims_a_winner_without_a_significant_test():
    md = _md(_rows({"@kl.k1": 0.0, "@kl.k2": 0.01}, seeds=3, noise=0.05, seed=4))
    findings = md.split("## Findings")[1]
    assert "significantly higher than each other" not in findings and "has the highest" not in findings
    assert re.search(r"and \d+ of \d+ tested others, no difference detected \(this design detects ≥ ", md)
    assert "tied" not in md


def test_one_seed_says_no_statistics_are_possible_not_tied():
    """With n = 1 no paired test exists: the findings say so (they said 'tied ... Holm-corrected
    p ≥ 0.05', a test that was never run), for the leader and for each metric against the baseline."""
    md = _md(_rows({"@kl.k1": 0.0, "@kl.k2": 0.1, "@kl.k3": 0.2}, seeds=1, noise=0.0))
    findings = md.split("## Findings")[1]
    assert "tied" not in findings and "Holm-corrected p ≥" not in findings
    assert (
        "- No statistics are possible in eval_accuracy: no configuration has 2 seeds paired with the leader "
        "grpo · Algorithm.kl=@kl.k3 (n = 1), and a paired t-test needs at least 2" in findings
    )
    for metric in ("eval_accuracy", "kl"):
        assert (
            f"- No statistics are possible in {metric}: no configuration has 2 seeds paired with the baseline"
            in (findings)
        )


def test_configurations_with_one_paired_seed_are_not_counted_as_undetected():
    """Two configurations with 3 seeds and one with a single (worst) seed: 'no difference detected' is
    counted over the tested ones, and the untested one is named as such (it counted as 'tied' before)."""
    rows = _rows({"@kl.k1": 0.0, "@kl.k2": 0.0}, seeds=3, noise=0.05, seed=1)
    rows.append(rows[0] | {"Algorithm.kl": "@kl.k3", "cell_id": "k3", "eval_accuracy": "0.0"})
    findings = _md(rows).split("## Findings")[1]
    assert "and 1 of 1 tested others, no difference detected (this design detects ≥ " in findings, findings
    assert "; 1 other with fewer than 2 paired seeds could not be tested." in findings
