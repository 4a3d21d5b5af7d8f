"""The verdicts of an experiment's declared predictions (`Sweep.predictions`), each about a
configuration − the baseline in one metric.

**One family.** The tested predictions are one Holm family of m (directional and equivalence
predictions together; a prediction whose configuration is the baseline's runs again, or with fewer
than 2 paired seeds, is not tested and not counted). A directional prediction is tested by the
paired difference test, a 'no difference' prediction with a margin by TOST within ±margin; the
refuting test of a 'no difference' prediction (the difference lies beyond ±margin) and its
difference test are corrected with the same m, each as one family of all m tested predictions (every
prediction's difference test; every prediction's refuting test: beyond the margin for 'no difference',
the difference itself for a directional one), never with the others padded as p = 1. Each is decided
by the comparison's rule (polgrad.results.compare: t-test, both t-test and sign-flip, or sign-flip only).

**'no difference'**: confirmed when TOST puts the difference within ±margin; refuted only when it is
significantly beyond the margin; otherwise undecided. Differences without spread (one constant,
the sign-flip-only rule) never confirm it: undecided (no spread: a constant difference is an artefact,
not evidence). A significant difference inside the margin is
reported as both (significant, and equivalent within ±margin). Without a declared margin it can
only be refuted (by a significant difference): equality needs a margin declared before the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polgrad.results.compare import ALPHA, POWER, RULE_T, Comparison, Key, against, decide, p_text, rule_text
from polgrad.results.stats import holm, min_signflip_p
from polgrad.results.tuning import tuned_note

NO_DIFFERENCE = "no difference"


@dataclass(frozen=True)
class Judged:
    """One prediction's corrected p-values (within the predictions' family) and its verdict."""

    p_difference: float
    p_equivalence: float
    p_outside: float
    m: int
    verdict: str


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def num(x: float) -> str:
    return "–" if x is None or math.isnan(x) else f"{x:.3g}"


def delta_text(c: Comparison) -> str:
    """Δ [95% CI] of a comparison, or why it has none (identical runs, one pair, no spread)."""
    t = c.test
    if c.identical_to is not None:
        return f"{t.mean:+.3g} (identical)"
    if t.n < 2:
        return f"{t.mean:+.3g} (n={t.n})"
    if t.no_spread:
        return f"{t.mean:+.3g} (no spread)"
    return f"{t.mean:+.3g} [{num(t.low)}, {num(t.high)}]"


def prediction_delta(c: Comparison | None, margin: float | None) -> str:
    """A prediction's Δ: with a margin, the 1 − 2α interval TOST uses; else the 95% CI (`_delta`)."""
    if c is None:
        return "–"
    if margin and c.identical_to is None and not math.isnan(c.test.low):
        low, high = c.test.interval(1 - 2 * ALPHA)
        return f"{c.test.mean:+.3g} [{num(low)}, {num(high)}] {1 - 2 * ALPHA:.0%} CI (TOST)"
    return delta_text(c)


def verdict(
    expected: str,
    c: Comparison | None,
    p_equivalence: float = math.nan,
    margin: float | None = None,
    *,
    p_outside: float = math.nan,
    p_difference: float | None = None,
    detectable: float = math.nan,
) -> str:
    """confirmed / refuted / undecided / not confirmed, from the corrected tests of config − baseline.

    `p_difference` defaults to the comparison's own deciding p. 'no difference' is confirmed only by
    an equivalence test within ±margin (p_equivalence, corrected), refuted only by a difference
    significantly beyond the margin (p_outside) or, without a margin, by a significant difference."""
    if c is not None and c.test.n == 1:
        return "untested (1 paired seed: no test possible)"
    if c is None or c.test.n < 2:
        return "untested (no paired seeds)"
    if c.identical_to == c.reference:
        return "untested (the same runs as the baseline: identical in every outcome metric)"
    p_diff = c.p_decision if p_difference is None else p_difference
    diff = not math.isnan(p_diff) and p_diff < ALPHA
    delta = f"{c.test.mean:+.3g}"
    if expected == NO_DIFFERENCE:
        if margin:
            if not math.isnan(p_equivalence) and p_equivalence < ALPHA:
                both = f"confirmed and different: a significant difference of {delta}, and equivalent"
                return f"{both} within ±{margin:g}" if diff else f"confirmed (equivalent within ±{margin:g})"
            if not math.isnan(p_outside) and p_outside < ALPHA:
                return f"refuted (the difference {delta} lies significantly beyond ±{margin:g})"
            if c.test.no_spread:
                return "undecided (no spread: a constant difference is an artefact, not evidence)"
            neither = f"neither shown within nor beyond ±{margin:g}"
            return (
                f"undecided (a significant difference of {delta}, {neither})"
                if diff
                else f"undecided ({neither})"
            )
        if diff:
            return f"refuted (a significant difference of {delta})"
        return (
            "undecided (no difference detected; equality needs an equivalence margin declared before the "
            "data)"
        )
    went = "lower" if c.test.mean < 0 else "higher"
    if diff:
        return "confirmed" if went == expected else f"refuted (significantly {went})"
    if not math.isnan(detectable):
        return (
            f"not confirmed (no difference detected; this design detects ≥ {_fmt(detectable)} at "
            f"{POWER:.0%} power)"
        )
    return "not confirmed (no difference detected)"


def judge(
    predictions: Sequence[tuple[str, Key | None, str, str, float | None]], comps: Sequence[Comparison | None]
) -> list[Judged]:
    """The verdict of each prediction (claim, configuration, metric, expected, margin) given its
    comparison with the baseline, the predictions corrected as one family."""
    tested = [c is not None and c.test.n >= 2 and c.identical_to != c.reference for c in comps]
    m = sum(tested)

    def keep(xs: list[float]) -> list[float]:
        return [x if ok else math.nan for x, ok in zip(xs, tested, strict=True)]

    def corrected(raw_t: list[float], raw_perm: list[float]) -> tuple[list[float], list[float]]:
        return holm(keep(raw_t), m), holm(keep(raw_perm), m)

    nan = math.nan
    margins = [mg if expected == NO_DIFFERENCE and mg else None for (*_, expected, mg) in predictions]
    diff_t = [c.test.p if c else nan for c in comps]
    diff_perm = [c.test.p_perm if c else nan for c in comps]
    eq_t = [c.test.equivalence_p(mg) if c and mg else nan for c, mg in zip(comps, margins, strict=True)]
    eq_perm = [
        c.test.equivalence_p_perm(mg) if c and mg else nan for c, mg in zip(comps, margins, strict=True)
    ]
    out_t = [c.test.outside_p(mg) if c and mg else nan for c, mg in zip(comps, margins, strict=True)]
    out_perm = [c.test.outside_p_perm(mg) if c and mg else nan for c, mg in zip(comps, margins, strict=True)]
    # the main test of each prediction: TOST where a margin is declared, else the difference
    main_t = [e if mg else d for d, e, mg in zip(diff_t, eq_t, margins, strict=True)]
    main_perm = [e if mg else d for d, e, mg in zip(diff_perm, eq_perm, margins, strict=True)]
    main = corrected(main_t, main_perm)
    # every prediction's difference test, and every prediction's refuting test (beyond the margin for
    # 'no difference', the difference itself for a directional one): each one family of the same m
    sec_diff = corrected(diff_t, diff_perm)
    refute_t = [o if mg else d for d, o, mg in zip(diff_t, out_t, margins, strict=True)]
    refute_perm = [o if mg else d for d, o, mg in zip(diff_perm, out_perm, margins, strict=True)]
    sec_out = corrected(refute_t, refute_perm)
    out = []
    for i, ((_, _, _, expected, margin), c) in enumerate(zip(predictions, comps, strict=True)):
        if c is None:
            out.append(Judged(nan, nan, nan, m, verdict(expected, None)))
            continue
        p_main = decide(c.rule, main[0][i], main[1][i])
        if margins[i]:
            p_diff = decide(c.rule, sec_diff[0][i], sec_diff[1][i])
            p_eq, p_out = p_main, decide(c.rule, sec_out[0][i], sec_out[1][i])
        else:
            p_diff, p_eq, p_out = p_main, nan, nan
        mde = c.test.mde(ALPHA / max(m, 1), POWER) if _reachable(c, m) else nan
        v = verdict(expected, c, p_eq, margin, p_outside=p_out, p_difference=p_diff, detectable=mde)
        # the sign-flip p of the test the verdict rests on: where the t-test alone decided and the
        # sign-flip test would not have, the verdict rests on normality, and says so
        perm = nan
        if v.startswith("confirmed"):
            perm = main[1][i] if not v.startswith("confirmed and") else max(main[1][i], sec_diff[1][i])
        elif v.startswith("refuted"):
            perm = sec_out[1][i] if margins[i] else main[1][i]
        if c.rule == RULE_T and perm >= ALPHA:
            v += f"; this rests on the t-test's normality: the sign-flip p (Holm) is {perm:.2g}"
        if tested[i] and not _reachable(c, m) and not v.startswith(("confirmed", "refuted")):
            v += (
                f"; with {c.test.n} seeds the sign-flip p this rule needs cannot go below "
                f"{min_signflip_p(c.test.n):.2g} (×{m} after Holm), so no verdict is possible"
            )
        out.append(Judged(p_diff, p_eq, p_out, m, v))
    return out


def _reachable(c: Comparison, m: int) -> bool:
    return c.rule == RULE_T or max(m, 1) * min_signflip_p(c.test.n) < ALPHA


def as_run(rows, group_columns: Sequence[str], predictions, label, baseline: Key | None) -> list[str]:
    """What each prediction's configuration, and the baseline, trained with: the loss its spec declares
    (the CSV's `table5_core_loss`, the Table-5 column written from the spec that ran), so a claim's
    words can be read against the configuration they are about (algorithm_comparison's 'REINFORCE
    without a baseline' ran registry/reinforce.gin, whose advantage subtracts the batch-mean reward).
    [] when the rows carry no core loss."""
    loss: dict[Key, str] = {}
    for r in rows:
        key = tuple(str(r.get(c, "")) for c in group_columns)
        if r.get("table5_core_loss") and key not in loss:
            loss[key] = str(r["table5_core_loss"])
    items = []
    for claim, key, *_ in predictions:
        if key is not None and key in loss:
            items.append(f"- {claim}: {label(key)} trained with `{loss[key]}`")
    if not items:
        return []
    if baseline is not None and baseline in loss:
        items.append(f"- the baseline, {label(baseline)}: `{loss[baseline]}`")
    return [
        "",
        "**As run.** The loss each prediction's configuration trained with, from its spec:",
        "",
        *items,
    ]


def margin_bands(predictions: Sequence[dict[str, Any]], reference_kind: str) -> dict[str, list]:
    """{metric: [(margin, claim)]} of the 'no difference' predictions with a margin (distinct margins;
    none unless the reference is the baseline the predictions are stated against)."""
    out: dict[str, list[tuple[float, str]]] = {}
    if reference_kind != "baseline":
        return out
    for p in predictions:
        margin = p.get("margin")
        if p.get("expected") == "no difference" and margin is not None and float(margin) > 0:
            have = out.setdefault(str(p.get("metric")), [])
            if all(m != float(margin) for m, _ in have):
                have.append((float(margin), str(p.get("claim", ""))))
    return out


def tost_rows(predictions, reference_kind: str, keys, group_columns, label) -> dict[str, set[str]]:
    """{metric: labels of the configurations a 'no difference' prediction with a margin is about}: the
    rows whose 90% CI (TOST's) is drawn against the band (none unless the reference is the baseline)."""
    out: dict[str, set[str]] = {}
    for p in predictions if reference_kind == "baseline" else ():
        if p.get("expected") == "no difference" and p.get("margin"):
            for k in keys:
                row = dict(zip(group_columns, k, strict=True))
                if all(row.get(c) == str(v) for c, v in p["config"].items()):
                    out.setdefault(str(p["metric"]), set()).add(label(k))
    return out


def section(rows, group_columns, label, baseline, predictions, findings, tuned=None):
    """The md's Predictions section: one Holm family of the declared predictions against the baseline,
    each judged (`judge`); appends one finding per prediction to `findings`; returns (lines, judged)."""
    fams: dict[str, dict[Key, Comparison]] = {}
    for _, _key, metric, _, _ in predictions:
        if metric not in fams:
            fams[metric] = {c.other: c for c in against(rows, group_columns, metric, baseline)}
    comps = [fams[m].get(k) if k is not None else None for _, k, m, _, _ in predictions]
    judged = judge(predictions, comps)
    m = judged[0].m if judged else 0
    family = f"Holm over the declared predictions, one family of {m}"
    tost = f"{1 - 2 * ALPHA:.0%} CI (TOST)"
    lines = [
        "",
        "## Predictions",
        "",
        f"Each prediction is about a configuration − the baseline ({label(baseline)}), α = {ALPHA}. The "
        f"tested predictions are one Holm family of {m}, the declared predictions only (directional and "
        "equivalence predictions together; not the family of all comparisons with the baseline above). A "
        "'no difference' prediction is confirmed only by an equivalence test (two one-sided tests) within "
        "the margin the experiment declared, refuted only when the difference lies significantly beyond "
        "that margin, and otherwise undecided; a significant difference inside the margin is reported as "
        f"both. Each p below is the deciding one of the comparison's rule. A 'no difference' row shows the "
        f"{tost} that the equivalence test at α = {ALPHA} uses (within ±margin exactly when TOST "
        "confirms); the others the 95% CI.",
        "",
        f"| prediction | configuration | metric | expected | Δ [95% CI; {tost} for 'no difference'] | "
        "p difference (Holm) | "
        "p equivalence (Holm) | p beyond margin (Holm) | decided by | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (claim, key, metric, expected, margin), c, j in zip(predictions, comps, judged, strict=True):
        where = label(key) if key is not None else "(no such configuration)"
        delta, rule = prediction_delta(c, margin), (rule_text(c, label) if c else "–")
        lines.append(
            f"| {claim} | {where} | {metric} | {expected} | {delta} | {p_text(j.p_difference)} | "
            f"{p_text(j.p_equivalence)} | {p_text(j.p_outside)} | {rule} | {j.verdict} |"
        )
        decided = j.verdict.startswith(("confirmed", "refuted"))
        note = tuned_note(tuned, key, baseline) if c and key is not None and decided else ""
        findings.append(
            f"Prediction '{claim}': {j.verdict}"
            + (f" (Δ {metric} = {delta}; {family})." if c else ".")
            + note
        )
    return lines + as_run(rows, group_columns, predictions, label, baseline), judged
