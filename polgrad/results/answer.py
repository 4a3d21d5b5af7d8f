"""The closing **Answer.** sentence of a leaderboard md (`answer`): the question answered, or why it
cannot be and what would answer it; and the two phrases the findings share with it: why seeds were
dropped (`drop_cause`) and the range of a set of numbers (`span_text`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from polgrad.results import health
from polgrad.results.compare import POWER, Key, dropped_seeds, leader
from polgrad.results.predictions import num


def span_text(xs: Sequence[float]) -> str:
    """'a' or 'a to b': the range of the finite values of `xs` ('–' when none)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "–"
    lo, hi = min(xs), max(xs)
    return num(lo) if num(lo) == num(hi) else f"{num(lo)} to {num(hi)}"


def drop_cause(rows: Sequence[dict[str, Any]], group_columns: Sequence[str], label) -> str:
    """'k of n seeds were dropped because configuration X was not ok in them (...)', or ''."""
    dropped = dropped_seeds(rows, group_columns)
    if not dropped:
        return ""
    n = len({str(r.get("seed", "")) for r in rows})
    bad: dict[Key, list[str]] = {}
    for seed, rs in dropped.items():
        for r in rs:
            bad.setdefault(health.config_key(r, group_columns), []).append(seed)
    who = " and ".join(
        f"{label(k)} (seed{'s' if len(ss) > 1 else ''} {', '.join(ss)})" for k, ss in bad.items()
    )
    return (
        f"{len(dropped)} of {n} seeds were dropped because configuration{'s' if len(bad) > 1 else ''} "
        f"{who} {'were' if len(bad) > 1 else 'was'} not ok in them (see Seeds dropped from every "
        "comparison): runs that finish ok in those seeds would decide this, not more seeds of the same runs"
    )


def answer(
    rows, group_columns, label, primary, higher_is_better, predictions, judged, n_at_edge=0, base=None
):
    """One sentence: the question answered, or why not and what would answer it (more seeds; and a
    tuning grid extended past its edge where `n_at_edge` configurations chose an edge value). Of the
    configurations whose runs failed, those a judged prediction compares (its own or the baseline `base`)
    have verdicts on those runs as they ran; for the others it answers nothing."""
    edge = (
        f" ({n_at_edge} configuration(s) chose a value at the tuning grid's edge, so a wider grid may change "
        "the tuned values compared)"
        if n_at_edge
        else ""
    )
    failed = sorted(health.failed_keys(rows, group_columns))
    names = "; ".join(label(k) for k in failed)
    configs = {health.config_key(r, group_columns) for r in rows if r.get("status") == "ok"}
    if failed and set(failed) >= configs:
        what = health.what_would_answer(rows, group_columns)
        return (
            f"**Answer.** This experiment cannot answer its question, because runs of every configuration "
            f"failed ({names}; see {health.HEADING[3:]}), so their differences compare failures: {what}; "
            "more seeds of these runs would only count the collapses."
        )
    compared = {k for p in predictions if p[1] is not None for k in (p[1], base)} if judged else set()
    tail = health.answer_tail(failed, compared, label)
    if judged:
        groups: dict[str, list[str]] = {}
        for (claim, *_), j in zip(predictions, judged, strict=True):
            word = j.verdict.split(" ")[0].removesuffix(";")
            word = "not decided" if word in ("undecided", "not", "untested") else word
            groups.setdefault(word, []).append(f"'{claim}'")
        text = f"**Answer.** Of {len(judged)} predictions, " + "; ".join(
            f"{word}: {', '.join(cs)}" for word, cs in groups.items()
        )
        cause = drop_cause(rows, group_columns, label)
        if "not decided" in groups:
            text += f"; {cause}" if cause else f", and more paired seeds would decide the rest{edge}"
        fragile = sum("rests on the t-test's normality" in j.verdict for j in judged)
        if fragile:
            text += (
                f" ({fragile} of these verdicts rest on the t-test's normality alone: the sign-flip "
                "test does not reach α with these seeds, and only more seeds could let it decide them)"
            )
        return text + tail + "."
    best, comps, starred = leader(rows, group_columns, primary, higher_is_better)
    if best is None:
        return "**Answer.** None: no configuration has a finished run" + tail + "."
    if starred:
        twins = "".join(f" (the same runs as {label(c.other)})" for c in comps if c.identical_to == best)
        word = "highest" if higher_is_better else "lowest"
        return f"**Answer.** {label(best)}{twins} has the significantly {word} {primary}" + tail + "."
    cause = drop_cause(rows, group_columns, label)
    reach = [
        c.mde for c in comps if c.identical_to is None and c.test.n >= 2 and c.reachable and not c.significant
    ]
    now = f" (now it detects differences ≥ {span_text(reach)} at {POWER:.0%} power)" if reach else ""
    seeds = f"more paired seeds would be needed{now}{edge}, the detectable difference shrinking about as 1/√n"
    return (
        f"**Answer.** This design cannot say which configuration is best in {primary}: the leader "
        f"{label(best)} is not significantly {'higher' if higher_is_better else 'lower'} than every "
        f"other, and {cause or seeds}{tail}."
    )
