"""The statistical sections of a leaderboard md, and the findings sentences generated from them.

Every claim in these sections comes from `polgrad.results.compare` (paired by seed, Holm-corrected):
the leader gets ★ only when it is significantly better than every other configuration, a
difference to the baseline is called a finding only when its corrected p-value is below ALPHA,
and otherwise the text says plainly that the configurations are tied at this budget. With fewer
than 2 seeds paired (e.g. one seed) no test exists, and the text says that no statistics are
possible instead of calling the configurations tied.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from polgrad.results.compare import ALPHA, POWER, Comparison, Key, against, leader
from polgrad.results.stats import holm

LEADER_HEADING = "## Is the leader better than every other configuration?"
BASELINE_HEADING = "## Paired differences to the baseline"


def kl_metric(rows: Sequence[dict[str, Any]]) -> str:
    """The exact KL where the runs measured it, else the sampled estimate."""
    return "kl_exact" if any(str(r.get("kl_exact", "")).strip() for r in rows) else "kl"


def _num(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.3g}"


def _p(x: float) -> str:
    return "–" if x is None or math.isnan(x) else (f"{x:.2g}" if x >= 1e-4 else "<1e-4")


def _delta(c: Comparison) -> str:
    t = c.test
    return f"{t.mean:+.3g} [{_num(t.low)}, {_num(t.high)}]" if t.n >= 2 else f"{t.mean:+.3g} (n={t.n})"


def sections(
    rows: Sequence[dict[str, Any]],
    group_columns: Sequence[str],
    label,
    *,
    primary: str,
    higher_is_better: bool,
    baseline: Key | None,
    predictions: Sequence[tuple[str, Key | None, str, str, float | None]] = (),
) -> tuple[list[str], Key | None, bool]:
    """Markdown lines of the leader and baseline sections and the findings; the leader and its ★."""
    best, comps, starred = leader(rows, group_columns, primary, higher_is_better)
    lines: list[str] = []
    findings: list[str] = []
    direction = "higher" if higher_is_better else "lower"
    if best is not None and comps:
        lines += [
            "",
            f"{LEADER_HEADING} ({primary})",
            "",
            f"Leader by mean: **{label(best)}**. Each row: that configuration − the leader, paired by "
            f"seed (mean and 95% CI), paired t-test p, and p Holm-corrected over the {len(comps)} "
            f"comparisons. ★ requires every corrected p < {ALPHA} with the leader {direction}.",
            "",
            "| configuration | Δ vs leader [95% CI] | p | p (Holm) | seeds |",
            "|---|---|---|---|---|",
        ]
        for c in comps:
            lines.append(f"| {label(c.other)} | {_delta(c)} | {_p(c.test.p)} | {_p(c.p_holm)} | {c.test.n} |")
        if starred:
            worst_p = _p(max(c.p_holm for c in comps))
            findings.append(
                f"{label(best)} has the {'highest' if higher_is_better else 'lowest'} {primary}: "
                "significantly better than each other "
                f"configuration (paired by seed; largest Holm-corrected p = {worst_p})."
            )
        else:
            tested = [c for c in comps if c.test.n >= 2]
            tied = [label(c.other) for c in tested if not c.significant]
            if tested:
                findings.append(
                    f"No configuration is significantly better than all others in {primary}: the leader "
                    f"{label(best)} is tied with {len(tied)} of {len(tested)} others at this budget "
                    f"(Holm-corrected p ≥ {ALPHA})" + _untested(len(comps) - len(tested))
                )
            else:
                findings.append(_no_statistics(primary, f"the leader {label(best)}", comps))
    if baseline is not None:
        metrics = list(dict.fromkeys([primary, kl_metric(rows), "eval_accuracy"]))
        fams = {m: {c.other: c for c in against(rows, group_columns, m, baseline)} for m in metrics}
        others = list(fams[primary])
        head = ["configuration"]
        for m in metrics:
            head += [f"Δ {m} [95% CI]", "p (Holm)", "detectable"]
        lines += [
            "",
            f"{BASELINE_HEADING}: {label(baseline)}",
            "",
            "Each configuration − the baseline, paired by seed; p Holm-corrected within each metric; "
            f"'detectable' = the smallest true difference this design finds with {POWER:.0%} power at the "
            "corrected level, from the observed spread of the paired differences.",
            "",
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
        ]
        for k in others:
            cells = [label(k)]
            for m in metrics:
                c = fams[m].get(k)
                cells += [_delta(c), _p(c.p_holm), _num(c.mde)] if c else ["–", "–", "–"]
            lines.append("| " + " | ".join(cells) + " |")
        for m in metrics:
            sig = [c for c in fams[m].values() if c.significant]
            for c in sig:
                word = "higher" if c.test.mean > 0 else "lower"
                findings.append(
                    f"{label(c.other)}: {m} {word} than the baseline by {abs(c.test.mean):.3g} "
                    f"(95% CI [{_num(c.test.low)}, {_num(c.test.high)}], Holm p = {_p(c.p_holm)})."
                )
            if fams[m] and not any(c.test.n >= 2 for c in fams[m].values()):
                findings.append(_no_statistics(m, "the baseline", list(fams[m].values())))
            elif not sig and fams[m]:
                mdes = [c.mde for c in fams[m].values() if not math.isnan(c.mde)]
                span = (
                    f"{_num(min(mdes))}"
                    if mdes and len(set(mdes)) == 1
                    else f"{_num(min(mdes))} to {_num(max(mdes))}, depending on the configuration"
                    if mdes
                    else "–"
                )
                untested = sum(c.test.n < 2 for c in fams[m].values())
                findings.append(
                    f"No configuration differs significantly from the baseline in {m}: they are tied at "
                    f"this budget (the smallest difference these seeds detect at {POWER:.0%} power is "
                    f"{span})" + _untested(untested)
                )
    if baseline is not None and predictions:
        lines += _predictions(rows, group_columns, label, baseline, predictions, findings)
    lines += ["", "## Findings", ""] + [f"- {f}" for f in findings or ["No comparison was possible."]]
    return lines, best, starred


def _no_statistics(metric: str, reference: str, comps: Sequence[Comparison]) -> str:
    """With fewer than 2 seeds paired with the reference no test exists: say so, not 'tied'."""
    n = max((c.test.n for c in comps), default=0)
    return (
        f"No statistics are possible in {metric}: no configuration has 2 seeds paired with {reference} "
        f"(n = {n}), and a paired t-test needs at least 2 to estimate the spread of the differences; the "
        "ranking is by the means alone. Run more seeds (Sweep.seeds) to test them."
    )


def _untested(k: int) -> str:
    """The tail of a 'tied' finding: how many configurations had too few paired seeds to be tested."""
    if not k:
        return "."
    return f"; {k} other{'s' if k > 1 else ''} with fewer than 2 paired seeds could not be tested."


def verdict(expected: str, c: Comparison | None, p_equivalence: float = math.nan, margin=None) -> str:
    """confirmed / refuted / not confirmed / consistent, from the corrected tests of config − baseline.

    'no difference' is confirmed only by an equivalence test within ±margin (p_equivalence, already
    corrected), refuted by a significant difference, and otherwise only 'consistent'."""
    if c is None or c.test.n < 2:
        return "untested (no paired seeds)"
    if expected == "no difference":
        if c.significant:
            return "refuted (a significant difference)"
        if not math.isnan(p_equivalence) and p_equivalence < ALPHA:
            return f"confirmed (equivalent within ±{margin:g})"
        if margin is not None:
            return f"not confirmed (neither different nor shown within ±{margin:g})"
        return "consistent (no significant difference; no equivalence margin declared)"
    went = "lower" if c.test.mean < 0 else "higher"
    if c.significant:
        return "confirmed" if went == expected else f"refuted (significantly {went})"
    return "not confirmed (no significant difference)"


def _predictions(rows, group_columns, label, baseline, predictions, findings) -> list[str]:
    lines = [
        "",
        "## Predictions",
        "",
        f"Each prediction is about a configuration − the baseline ({label(baseline)}), judged by the same "
        f"paired, Holm-corrected test as above (α = {ALPHA}). A 'no difference' prediction is confirmed "
        "only by an equivalence test (two one-sided t-tests, Holm-corrected over the equivalence "
        "predictions) within the margin the experiment declared; a non-significant difference alone "
        "does not prove equality.",
        "",
        "| prediction | configuration | metric | expected | Δ [95% CI] | p (Holm) | p equivalence (Holm) "
        "| verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    fams: dict[str, dict[Key, Comparison]] = {}
    for _, _key, metric, _, _ in predictions:
        if metric not in fams:
            fams[metric] = {c.other: c for c in against(rows, group_columns, metric, baseline)}
    comps = [fams[m].get(k) if k is not None else None for _, k, m, _, _ in predictions]
    raw = [
        c.test.equivalence_p(mg) if c and mg else math.nan
        for c, (*_, mg) in zip(comps, predictions, strict=True)
    ]
    p_eq = holm(raw)
    for (claim, key, metric, expected, margin), c, pe in zip(predictions, comps, p_eq, strict=True):
        v = verdict(expected, c, pe, margin)
        where = label(key) if key is not None else "(no such configuration)"
        delta, p = (_delta(c), _p(c.p_holm)) if c else ("–", "–")
        lines.append(f"| {claim} | {where} | {metric} | {expected} | {delta} | {p} | {_p(pe)} | {v} |")
        findings.append(
            f"Prediction '{claim}': {v}" + (f" (Δ {metric} = {delta}, Holm p = {p})." if c else ".")
        )
    return lines
