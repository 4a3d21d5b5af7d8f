"""Change from the warm start: does each configuration end above the policy it started from?

Every run measures its held-out accuracy twice on the same eval prompts: at step 0, the warm start's
(`eval_accuracy_init`), and at the end (`eval_accuracy`). Per configuration, over its ok runs that have
both, the md gives the mean change d = eval_accuracy − eval_accuracy_init with its 95% CI, a paired
t-test and an exact sign-flip test of "no change" (polgrad.results.stats.paired with the warm start as
the base), each Holm-corrected over the configurations tested (one family), and the rule that decides
as for every other comparison (polgrad.results.compare.rule_of: both tests where the differences look
non-normal or the configuration has collapsed runs). Words, as everywhere in the md:

- "above" / "below its warm start" only with the deciding corrected p < 0.05;
- a configuration with collapsed runs and no significant change: "not significant; rests on failed
  runs" (not evidence of no change, so no detectable difference is given);
- where the sign-flip test decides and cannot reach 0.05 with these runs (its floor 2/2^n times m):
  "no verdict possible";
- otherwise "no change detected (this design detects ≥ X at 80% power)", X at Holm's strictest level
  α/m, or that it cannot detect any change an accuracy allows (X above max(start, 1 − start));
- a configuration whose runs repeat an earlier one's (compare.twins): identical, not tested, not in m;
  fewer than 2 runs with both accuracies: not tested. Runs that are not ok (unstable, failed cells) are
  counted per configuration beside the verdict, which is over the ok runs only.

A comparison between configurations can only show what the runs learned: a configuration that ends
below its own warm start is losing what the SFT taught, whatever it does relative to another one.

Weak warm starts: seeds whose warm start scores below COLLAPSE_MIN_INIT (0.1, the accuracy under
which polgrad.results.health counts a fall to half as eval-set noise) are named with their mean
change over every configuration beside the other seeds'. Descriptive only: no test, no seed removed
from any test, and the threshold was not declared before the data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from polgrad.collapse import COLLAPSE_MIN_INIT
from polgrad.results.compare import ALPHA, POWER, RULE_T, decide, rule_of, twins
from polgrad.results.health import config_key, failed_keys
from polgrad.results.stats import holm, min_signflip_p, paired

END, START = "eval_accuracy", "eval_accuracy_init"
HEADING = f"## Change from the warm start ({END} − {START})"

Key = tuple[str, ...]


def _value(row: dict[str, Any], col: str) -> float:
    try:
        return float(row.get(col))
    except (TypeError, ValueError):
        return math.nan


def _g(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:+.3g}" if x else "0"


def section(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], label: Callable[[Key], str]
) -> tuple[list[str], list[str], str]:
    """(md lines, findings, the answer's clause) of the change from the warm start; nothing when no ok
    run has both columns."""
    pairs: dict[Key, dict[str, tuple[float, float]]] = {}
    not_ok: dict[Key, int] = {}
    for r in rows:
        key = config_key(r, group_columns)
        if r.get("status") != "ok":
            not_ok[key] = not_ok.get(key, 0) + 1
            continue
        runs = pairs.setdefault(key, {})  # a configuration with ok runs has a row, paired or not
        s, e = _value(r, START), _value(r, END)
        if math.isfinite(s) and math.isfinite(e):
            runs[str(r.get("seed", ""))] = (s, e)
    if not any(pairs.values()):
        return [], [], ""
    same = twins(rows, group_columns)
    tests = {
        k: paired({sd: v[0] for sd, v in p.items()}, {sd: v[1] for sd, v in p.items()})
        for k, p in pairs.items()
    }
    family = [k for k in pairs if k not in same and tests[k].n >= 2]
    m = len(family)
    p_t = dict(zip(family, holm([tests[k].p for k in family], m), strict=True))
    p_perm = dict(zip(family, holm([tests[k].p_perm for k in family], m), strict=True))
    failed = failed_keys(rows, group_columns)
    lines = [
        "",
        HEADING,
        "",
        "Each configuration's held-out accuracy at the end minus its warm start's (step 0, the same "
        "prompts), over its ok runs that have both, paired by run: mean [95% CI], the paired t-test and "
        f"sign-flip test of no change, each Holm-corrected over the {m} configurations tested, and the "
        "rule that decides (as above).",
        "",
        "| configuration | warm start | end | change [95% CI] | p (Holm) | p sign-flip (Holm) | "
        "runs up / down | runs not ok | decided by | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    kinds: dict[str, list[str]] = {}
    detects: list[float] = []  # X of each 'no change detected' that has one
    for k, t in tests.items():
        starts = [v[0] for v in pairs[k].values()]
        start = sum(starts) / len(starts) if starts else math.nan
        end = sum(v[1] for v in pairs[k].values()) / len(starts) if starts else math.nan
        rule, why = rule_of(t, k in failed)
        kind, verdict, mde = _verdict(k, t, rule, p_t, p_perm, m, k in failed, same, start, label)
        detects += [mde] if kind == NONE and math.isfinite(mde) else []
        kinds.setdefault(kind, []).append(f"{label(k)} ({_g(t.mean)} [{_g(t.low)}, {_g(t.high)}])")
        lines.append(
            f"| {label(k)} | {_f(start)} | {_f(end)} | {_g(t.mean)} [{_g(t.low)}, {_g(t.high)}] | "
            f"{_p(p_t.get(k))} | {_p(p_perm.get(k))} | {sum(x > 0 for x in t.diffs)} / "
            f"{sum(x < 0 for x in t.diffs)} | {not_ok.get(k, 0)} | {rule + (f' ({why})' if why else '')} | "
            f"{verdict} |"
        )
    findings = []
    if m:
        parts = [f"{len(kinds.get(w, []))} {w}" for w in (ABOVE, BELOW, NONE)]
        parts += [f"{len(kinds[w])} {w}" for w in (FAILED, NO_VERDICT, NOT_TESTED) if kinds.get(w)]
        text = f"Against its own warm start ({END} − {START}, Holm over {m} configuration(s)): "
        text += ", ".join(parts)
        if kinds.get(BELOW):
            text += "; below it: " + "; ".join(kinds[BELOW])
        findings.append(text + " (see Change from the warm start).")
    weak_lines, weak = _weak_warm_starts(pairs)
    return lines + weak_lines, findings + weak, _clause(kinds, m, detects)


def _clause(kinds: dict[str, list[str]], m: int, detects: list[float]) -> str:
    """The verdicts' counts in words, for the md's answer ('' when nothing was tested)."""
    if not m:
        return ""
    low, high = (min(detects), max(detects)) if detects else (0.0, 0.0)
    span = f"{low:.2g}" + (f"-{high:.2g}" if high > low else "")
    words = {
        ABOVE: "end above their warm starts",
        BELOW: "end below them",
        NONE: "show no change detected" + (f" (this design detects ≥ {span})" if detects else ""),
        FAILED: "are not significant and rest on failed runs",
        NO_VERDICT: "can get no verdict with these runs",
    }
    parts = [f"{len(kinds[w])} {text}" for w, text in words.items() if kinds.get(w)]
    return f"of the {m} configuration(s) tested against their warm starts, " + ", ".join(parts)


ABOVE, BELOW, NONE = "end above it", "end below it", "no change detected"
FAILED, NO_VERDICT = "not significant, resting on failed runs", "no verdict possible"
NOT_TESTED = "not tested (identical to another, or fewer than 2 runs)"


def _verdict(k, t, rule, p_t, p_perm, m, failed, same, start, label) -> tuple[str, str, float]:
    """(kind, the table's verdict text, the detectable change where 'no change detected' has one)."""
    nan = math.nan
    if k in same:
        return NOT_TESTED, f"identical to {label(same[k])}: the same runs, not tested", nan
    if k not in p_t:
        return NOT_TESTED, "not tested (fewer than 2 runs with both accuracies)", nan
    p = decide(rule, p_t[k], p_perm[k])
    if p < ALPHA:
        return (ABOVE, "above its warm start", nan) if t.mean > 0 else (BELOW, "below its warm start", nan)
    if failed:
        return FAILED, "not significant; rests on failed runs (see Failed and flagged runs)", nan
    if rule != RULE_T and m * min_signflip_p(t.n) >= ALPHA:  # the bound compare's `reachable` uses
        floor = min_signflip_p(t.n)
        text = f"no verdict possible: with {t.n} runs the sign-flip p cannot go below {floor:.2g}"
        text += f" (× {m} by Holm)"
        return NO_VERDICT, text, nan
    mde = t.mde(ALPHA / m, POWER)
    if not (math.isfinite(mde) and mde > 0):
        return NONE, "no change detected", nan
    if mde > max(start, 1 - start):
        return NONE, "no change detected (this design cannot detect any change its accuracy allows)", nan
    return NONE, f"no change detected (this design detects ≥ {mde:.3g} at {POWER:.0%} power)", mde


def _f(x: float) -> str:
    return "–" if math.isnan(x) else f"{x:.3g}"


def _p(p: float | None) -> str:
    if p is None or math.isnan(p):
        return "–"
    return "<1e-4" if p < 1e-4 else f"{p:.2g}"


def _weak_warm_starts(pairs: dict[Key, dict[str, tuple[float, float]]]) -> tuple[list[str], list[str]]:
    """Seeds whose warm start scores below COLLAPSE_MIN_INIT, with their mean change beside the others'."""
    change: dict[str, list[float]] = {}
    weak = set()
    for runs in pairs.values():
        for seed, (s, e) in runs.items():
            change.setdefault(seed, []).append(e - s)
            if s < COLLAPSE_MIN_INIT:
                weak.add(seed)
    if not weak or len(weak) == len(change):
        return [], []

    def mean(seeds) -> float:
        xs = [x for sd in seeds for x in change[sd]]
        return sum(xs) / len(xs)

    names = ", ".join(sorted(weak, key=lambda x: (len(x), x)))
    text = (
        f"Seeds {names} start from warm starts below {COLLAPSE_MIN_INIT:g} held-out accuracy: their mean "
        f"change over every configuration is {_g(mean(weak))}, against {_g(mean(set(change) - weak))} on "
        f"the other {len(change) - len(weak)} seeds. A seed that learns in no configuration adds pairs near "
        "0 to every paired difference (toward 'no difference' and 'equivalent'). Descriptive: no seed is "
        "removed from any test for this, and the threshold was not declared before the data."
    )
    return ["", text], [text]
