"""The statistical sections of a leaderboard md, and the findings sentences generated from them.

Every claim in these sections comes from `polgrad.results.compare` (paired by seed, Holm-corrected,
decided by the rule its section states: t-test, or t-test and sign-flip test where the outcomes
are non-normal, or sign-flip only where the differences have no spread): the leader gets ★ only when
it is significantly better than every other configuration, and a difference to the baseline is
called a finding only when its corrected p-value is below ALPHA. A difference that is not significant
is written "no difference detected (this design detects ≥ X at 80% power)", never as equality:
equality is only claimed by a 'no difference' prediction confirmed by TOST within a margin declared
in the experiment (polgrad.results.predictions). Configurations whose runs failed (collapse, bimodal
outcomes: polgrad.results.health) are named as failures, not as 'no difference'; runs that drifted far
from the reference are flagged. With fewer than 2 seeds paired no test exists, and the text says that
no statistics are possible; where seeds were dropped for runs that are not ok, it names that cause
(`drop_cause`) instead of advising more seeds. Each finding names its Holm family: all comparisons
with the baseline in a metric, or the declared predictions.
The findings end with one **Answer.** sentence (polgrad.results.answer): the question answered, or why it
cannot be and what would answer it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from polgrad.results import gains, health
from polgrad.results.answer import answer as _answer
from polgrad.results.answer import drop_cause
from polgrad.results.answer import span_text as _span
from polgrad.results.compare import (
    ALPHA,
    NORMALITY_ALPHA,
    POWER,
    RULE_BOTH,
    RULE_PERM,
    RULE_T,
    Comparison,
    Key,
    against,
    by_seed,
    dropped_seeds,
    leader,
    missing_values,
    ranking_seeds,
)
from polgrad.results.compare import p_text as _p
from polgrad.results.compare import rule_text as _rule
from polgrad.results.predictions import delta_text as _delta
from polgrad.results.predictions import num as _num
from polgrad.results.predictions import section as predictions_section
from polgrad.results.stats import min_signflip_p
from polgrad.results.tuning import tuned_note, tuned_values

LEADER_HEADING = "## Does the leader differ significantly from every other configuration?"
BASELINE_HEADING = "## Paired differences to the baseline"
RULES_HEADING = "## How the tests decide"
_SEE = f"(see {health.HEADING[3:]})"


def kl_metric(rows: Sequence[dict[str, Any]]) -> str:
    """The exact KL where the runs measured it, else the sampled estimate."""
    return "kl_exact" if any(str(r.get("kl_exact", "")).strip() for r in rows) else "kl"


def _undetected(comps: Sequence[Comparison], cause: str = "") -> str:
    """'no difference detected (this design detects ≥ X at 80% power)' for non-significant tests."""
    reach = [c for c in comps if c.reachable]
    text = "no difference detected"
    if reach:
        span = _span([c.mde for c in reach])
        which = ", depending on the configuration" if " to " in span else ""
        text += f" (this design detects ≥ {span} at {POWER:.0%} power{which})"
    stuck = [c for c in comps if not c.reachable]
    if stuck:
        n = min(c.test.n for c in stuck)
        text += (
            f"; for {len(stuck)} of them the sign-flip test is required and with {n} paired seeds its p "
            f"cannot go below {min_signflip_p(n):.2g} (×{stuck[0].m} after Holm): no verdict is possible "
            + (f"with the seeds left: {cause}" if cause else "without more seeds")
        )
    return text


def rules_lines(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], label, metrics: Sequence[str] = ()
) -> list[str]:
    """The md's statement of the rules, and the seeds dropped from every test (of a metric)."""
    lines = [
        "",
        RULES_HEADING,
        "",
        f"Each comparison pairs two configurations seed by seed and reports the paired t-test and the paired "
        "permutation (sign-flip) test (exact for n ≤ 16, else 65,536 resamples), each Holm-corrected "
        f"within its family (α = {ALPHA}). Which "
        f"decides: the **{RULE_T}** where the paired differences look normal; **{RULE_BOTH}**, both "
        f"corrected p below α, where the outcomes are visibly non-normal (Shapiro-Wilk p < {NORMALITY_ALPHA} "
        f"on the differences, or failed runs in either configuration); **{RULE_PERM}** where the "
        "differences have no spread (the t-test is undefined). With n seeds the sign-flip p cannot go below "
        "2/2^n (0.0625 at n = 5), so where the sign-flip test is required a small design can give no "
        "verdict. 'detectable' = the smallest true difference the t-test finds with "
        f"{POWER:.0%} power at the corrected level (noncentral t, from the observed spread). A configuration "
        "identical to another in every outcome metric, seed by seed, is the same runs: it is named, not "
        "tested, and not counted in Holm's m. Only ok runs are tested, and a seed that is not ok in any "
        "configuration with an ok run is dropped from every comparison, and a seed where a configuration "
        "has no finite value of a metric it has elsewhere (blank, NaN, inf) from every comparison of that "
        "metric, so all tests of a metric use the same seeds (a configuration with no row for a seed, "
        "not run, is compared on the seeds it has).",
    ]
    dropped = dropped_seeds(rows, group_columns)
    if dropped:
        lines += ["", f"Seeds dropped from every comparison ({len(dropped)}):", ""]
        for seed, bad in dropped.items():
            why = "; ".join(
                f"{label(health.config_key(r, group_columns))} {r.get('status')}"
                + (f" ({str(r.get('error'))[:120]})" if r.get("error") else "")
                for r in bad
            )
            lines.append(f"- seed {seed}: {why}")
    for m in dict.fromkeys(metrics):
        gaps = missing_values(rows, group_columns, m)
        if gaps:
            lines += [
                "",
                f"Seeds dropped from every comparison of {m} ({len(gaps)}), for want of a value:",
                "",
            ]
            lines += [
                f"- seed {s}: {'; '.join(label(k) for k in ks)} has no finite {m} (blank, NaN or inf)"
                for s, ks in gaps.items()
            ]
    return lines


def _leader_lines(rows, group_columns, label, primary, higher_is_better, findings, tuned=None):
    best, comps, starred = leader(rows, group_columns, primary, higher_is_better)
    if best is None or not comps:
        return [], best, starred
    direction = "higher" if higher_is_better else "lower"
    seeds = ranking_seeds(by_seed(rows, group_columns, primary))
    over = (
        f"over the {_n(len(seeds), 'seed')} every configuration has" if seeds else "over each one's own seeds"
    )
    members = [c for c in comps if c.identical_to is None and c.test.n >= 2]
    family = f"over the {_n(len(members), 'tested comparison')}" if members else "(no comparison is tested)"
    twins = [label(c.other) for c in comps if c.identical_to == best]
    name = label(best) + (f" (the same runs as {', '.join(twins)})" if twins else "")
    cause = drop_cause(rows, group_columns, label)
    lines = [
        "",
        f"{LEADER_HEADING} ({primary})",
        "",
        f"Leader by mean {over}: **{label(best)}**. Each row: that configuration − the leader, paired by "
        f"seed (mean and 95% CI), paired t-test p, p Holm-corrected {family}, the sign-flip p "
        "Holm-corrected, the rule that decides. ★ requires every deciding "
        f"corrected p < {ALPHA} with the leader {direction}.",
        "",
        "| configuration | Δ vs leader [95% CI] | p | p (Holm) | p sign-flip (Holm) | decided by | seeds |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in comps:
        lines.append(
            f"| {label(c.other)} | {_delta(c)} | {_p(math.nan if c.identical_to else c.test.p)} | "
            f"{_p(c.p_holm)} | {_p(c.p_perm_holm)} | "
            f"{_rule(c, label)} | {c.test.n} |"
        )
    if starred:
        findings.append(
            f"{name} has the {'highest' if higher_is_better else 'lowest'} {primary}: significantly "
            f"{direction} than each other configuration (paired by seed; largest deciding Holm-corrected p = "
            f"{_p(max(c.p_decision for c in members))})."
        )
    elif not members:
        findings.append(_no_statistics(primary, f"the leader {label(best)}", comps, cause))
    else:
        failed = health.failed_keys(rows, group_columns)
        quiet = [c for c in members if not c.significant]
        clean = [c for c in quiet if c.other not in failed and best not in failed]
        text = (
            f"No configuration is significantly {direction} in {primary} than all others: between the leader "
            f"{label(best)} and {len(quiet)} of {len(members)} tested others, "
        )
        text += _undetected(clean, cause) if clean else "no difference was detected"
        if len(clean) < len(quiet):
            text += f"; {len(quiet) - len(clean)} of these comparisons rest on failed runs {_SEE}"
        loud = [c for c in members if c.significant]
        if loud:  # named, each with what it compares (the leader was picked by these same data)
            text += f"; the leader (picked by these data) is significantly {direction} than " + "; ".join(
                f"{label(c.other)} (that − the leader: {_delta(c)}, Holm p = {_p(c.p_decision)}"
                + (f"; each at its own tuned value, {v}" if (v := tuned_values(tuned, c.other, best)) else "")
                + ")"
                for c in loud
            )
        findings.append(text + _untested(sum(c.test.n < 2 for c in comps)))
    return lines, best, starred


def _baseline_lines(rows, group_columns, label, primary, baseline, findings, tuned=None):
    metrics = list(dict.fromkeys([primary, kl_metric(rows), "eval_accuracy"]))
    fams = {m: {c.other: c for c in against(rows, group_columns, m, baseline)} for m in metrics}
    others = list(fams[primary])
    head = ["configuration"]
    for m in metrics:
        head += [f"Δ {m} [95% CI]", "p (Holm)", "p sign-flip (Holm)", "detectable"]
    head.append("decided by")
    lines = [
        "",
        f"{BASELINE_HEADING}: {label(baseline)}",
        "",
        "Each configuration − the baseline, paired by seed; p Holm-corrected within each metric over its "
        "tested comparisons; 'decided by' gives the rule per metric (see How the tests decide).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for k in others:
        cells, rules = [label(k)], []
        for m in metrics:
            c = fams[m].get(k)
            mde = math.nan if c is None or c.identical_to or not c.reachable else c.mde
            cells += [_delta(c), _p(c.p_holm), _p(c.p_perm_holm), _num(mde)] if c else ["–"] * 4
            if c:
                rules.append(f"{m}: {_rule(c, label)}")
        same = {_rule(fams[m][k], label) for m in metrics if k in fams[m]}
        cells.append(same.pop() if len(same) == 1 else "; ".join(rules))
        lines.append("| " + " | ".join(cells) + " |")
    failed = health.failed_keys(rows, group_columns)
    cause = drop_cause(rows, group_columns, label)
    if not any(r.get("status") == "ok" and health.config_key(r, group_columns) == baseline for r in rows):
        cause = (
            f"the baseline {label(baseline)} has no finished run (see Failed cells): runs of it that finish "
            "would decide this, not more seeds"
        )
    identical = [c for c in fams[primary].values() if c.identical_to is not None]
    if identical:
        findings.append(
            "; ".join(f"{label(c.other)} is identical to {label(c.identical_to)}" for c in identical)
            + " in every outcome metric, seed by seed: the same runs (at the values these ran with, the "
            "bindings that differ changed nothing; identical as measured, not by construction), not tested "
            "and not counted in Holm's m."
        )
    for m in metrics:
        comps = [c for c in fams[m].values() if c.identical_to is None]
        members = [c for c in comps if c.test.n >= 2]
        for c in members:
            if c.significant:
                findings.append(
                    f"{label(c.other)}: {m} {'higher' if c.test.mean > 0 else 'lower'} than the baseline by "
                    f"{abs(c.test.mean):.3g} (95% CI [{_num(c.test.low)}, {_num(c.test.high)}]; Holm "
                    f"over {'all ' if c.m > 1 else ''}{_n(c.m, 'comparison')} with the baseline in {m}: "
                    f"p = {_p(c.p_holm)}, sign-flip p = {_p(c.p_perm_holm)}; {_rule(c, label)})"
                    + _normality(c)
                    + tuned_note(tuned, c.other, baseline)
                )
        if comps and not members:
            findings.append(_no_statistics(m, "the baseline", comps, cause))
            continue
        quiet = [c for c in members if not c.significant]
        clean = [c for c in quiet if c.other not in failed and baseline not in failed]
        if clean:
            who = (
                f"No configuration differs significantly from the baseline in {m}"
                if len(quiet) == len(members)
                else f"In {m}, for {len(clean)} of {len(members)} tested configurations "
                f"({'; '.join(label(c.other) for c in clean)})"
            )
            findings.append(f"{who}: {_undetected(clean, cause)}" + _untested(len(comps) - len(members)))
        if len(clean) < len(quiet):
            names = ", ".join(label(c.other) for c in quiet if c not in clean)
            findings.append(
                f"In {m} the comparisons of {names} with the baseline rest on failed runs {_SEE}: "
                "not significant, and not evidence of 'no difference' either."
            )
    return lines


def sections(
    rows: Sequence[dict[str, Any]],
    group_columns: Sequence[str],
    label,
    *,
    primary: str,
    higher_is_better: bool,
    baseline: Key | None,
    predictions: Sequence[tuple[str, Key | None, str, str, float | None]] = (),
    tuned: dict[Key, dict[str, str]] | None = None,
    n_at_edge: int = 0,
    warm_start: bool = True,
) -> tuple[list[str], Key | None, bool]:
    """Markdown lines of the rules, leader, baseline, failed-runs and predictions sections and the
    findings ending in the answer; the leader and its ★."""
    failed_lines, findings = health.section(rows, group_columns, label)
    metrics = [primary, kl_metric(rows), "eval_accuracy", *(p[2] for p in predictions)]
    lines = rules_lines(rows, group_columns, label, metrics if baseline is not None else [primary])
    leader_lines, best, starred = _leader_lines(
        rows, group_columns, label, primary, higher_is_better, findings, tuned
    )
    lines += leader_lines
    if baseline is not None:
        lines += _baseline_lines(rows, group_columns, label, primary, baseline, findings, tuned)
    lines += failed_lines
    gain_lines, gain_findings, clause = ([], [], "")
    if warm_start:  # against the warm start (not in a tuning stage's md)
        gain_lines, gain_findings, clause = gains.section(rows, group_columns, label)
    lines += gain_lines
    findings += gain_findings
    judged = []
    if baseline is not None and predictions:
        pred_lines, judged = predictions_section(
            rows, group_columns, label, baseline, predictions, findings, tuned
        )
        lines += pred_lines
    answer = _answer(
        rows, group_columns, label, primary, higher_is_better, predictions, judged, n_at_edge, baseline
    )
    if not judged and clause:  # what the runs learned, too
        answer = f"{answer.removesuffix('.')}; {clause}."
    findings.append(answer)
    lines += ["", "## Findings", ""] + [f"- {f}" for f in findings]
    return lines, best, starred


def _normality(c: Comparison) -> str:
    """The tail of a significant finding: '.' or that it rests on the t-test's normality alone."""
    if c.rule == RULE_T and not c.p_perm_holm < ALPHA:
        return (
            f". This rests on the t-test's normality assumption: the sign-flip test alone would not reach "
            f"α (Holm p = {_p(c.p_perm_holm)})."
        )
    return "."


def _no_statistics(metric: str, reference: str, comps: Sequence[Comparison], cause: str = "") -> str:
    """With fewer than 2 seeds paired with the reference no test exists: say so, and why (seeds
    dropped for runs that are not ok, or too few seeds)."""
    n = max((c.test.n for c in comps), default=0)
    fix = f"{cause[0].upper()}{cause[1:]}." if cause else "Run more seeds (Sweep.seeds) to test them."
    return (
        f"No statistics are possible in {metric}: no configuration has 2 seeds paired with {reference} "
        f"(n = {n}), and a paired t-test needs at least 2 to estimate the spread of the differences; the "
        f"ranking is by the means alone. {fix}"
    )


def _n(k: int, noun: str) -> str:
    """'1 seed', '3 seeds', '0 seeds'."""
    return f"{k} {noun}{'' if k == 1 else 's'}"


def _untested(k: int) -> str:
    """The tail of a finding: how many configurations had too few paired seeds to be tested."""
    if not k:
        return "."
    return f"; {k} other{'s' if k > 1 else ''} with fewer than 2 paired seeds could not be tested."
