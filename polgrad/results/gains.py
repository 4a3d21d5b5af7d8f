"""Change from the warm start: does each configuration end above the policy it started from?

Every run measures its held-out accuracy twice on the same eval prompts: at step 0, the warm start's
(`eval_accuracy_init`), and at the end (`eval_accuracy`). Per configuration, over its ok runs, the md
gives the mean change d = eval_accuracy − eval_accuracy_init with its 95% CI, a paired t-test and an
exact sign-flip test of "no change" (polgrad.results.stats.paired with the warm start as the base),
each Holm-corrected over the configurations (one family), and the rule that decides as for every
other comparison (polgrad.results.compare.rule_of: both tests where the differences look non-normal
or the configuration has collapsed runs). Words: "above" / "below its warm start" only with the
deciding corrected p < 0.05, otherwise "no change detected (this design detects ≥ X)".

A comparison between configurations can only show what the runs learned: a configuration that ends
below its own warm start is losing what the SFT taught, whatever it does relative to another one.

Weak warm starts: seeds whose warm start scores below COLLAPSE_MIN_INIT (0.1, the accuracy under
which polgrad.results.health counts a fall to half as eval-set noise) are named with their mean
change over every configuration beside the other seeds'. A seed that learns in no configuration adds
pairs near 0 to every paired difference, pulling a difference toward 0 and an equivalence test
toward "equivalent". Descriptive only: no test, and the seeds stay in every comparison (the
threshold was not declared before the data).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from polgrad.results.compare import ALPHA, POWER, RULE_T, decide, rule_of
from polgrad.results.health import COLLAPSE_MIN_INIT, config_key, failed_keys
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
) -> tuple[list[str], list[str]]:
    """(md lines, findings) of the change from the warm start; nothing when the CSV lacks either column."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not any(math.isfinite(_value(r, START)) and math.isfinite(_value(r, END)) for r in ok):
        return [], []
    start: dict[Key, dict[str, float]] = {}
    end: dict[Key, dict[str, float]] = {}
    for r in ok:
        key, seed = config_key(r, group_columns), str(r.get("seed", ""))
        start.setdefault(key, {})[seed] = _value(r, START)
        end.setdefault(key, {})[seed] = _value(r, END)
    keys = list(start)
    tests = [paired(start[k], end[k]) for k in keys]
    testable = [i for i, t in enumerate(tests) if t.n >= 2]
    m = len(testable)
    p_t = dict(zip(testable, holm([tests[i].p for i in testable], m), strict=True))
    p_perm = dict(zip(testable, holm([tests[i].p_perm for i in testable], m), strict=True))
    failed = failed_keys(rows, group_columns)

    lines = [
        "",
        HEADING,
        "",
        f"Each configuration's held-out accuracy at the end minus its warm start's (step 0, the same "
        f"prompts), paired by run: mean [95% CI], the paired t-test and sign-flip test of no change, "
        f"each Holm-corrected over the {m} configurations, and the rule that decides (as above).",
        "",
        "| configuration | warm start | end | change [95% CI] | p (Holm) | p sign-flip (Holm) | "
        "seeds up / down | decided by | verdict |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    above, below, none = [], [], []
    for i, (k, t) in enumerate(zip(keys, tests, strict=True)):
        rule, why = rule_of(t, k in failed)
        p = decide(rule, p_t.get(i, math.nan), p_perm.get(i, math.nan))
        if i not in p_t:
            verdict = "not tested (fewer than 2 runs)"
        elif p < ALPHA:
            verdict = "above its warm start" if t.mean > 0 else "below its warm start"
            (above if t.mean > 0 else below).append(f"{label(k)} ({_g(t.mean)} [{_g(t.low)}, {_g(t.high)}])")
        else:
            reachable = rule == RULE_T or m * min_signflip_p(t.n) < ALPHA
            mde = t.mde(ALPHA / max(m, 1), POWER) if reachable else math.nan
            verdict = "no change detected" + (f" (detects ≥ {mde:.3g})" if math.isfinite(mde) else "")
            none.append(label(k))
        s = [v for v in start[k].values() if math.isfinite(v)]
        e = [v for v in end[k].values() if math.isfinite(v)]
        up = sum(x > 0 for x in t.diffs)
        down = sum(x < 0 for x in t.diffs)
        lines.append(
            f"| {label(k)} | {sum(s) / len(s):.3g} | {sum(e) / len(e):.3g} | {_g(t.mean)} [{_g(t.low)}, "
            f"{_g(t.high)}] | {_p(p_t.get(i))} | {_p(p_perm.get(i))} | {up} / {down} | "
            f"{rule + (f' ({why})' if why else '')} | {verdict} |"
        )
    findings = []
    if m:
        parts = [f"{len(above)} end above it", f"{len(below)} below it", f"{len(none)} no change detected"]
        text = f"Against its own warm start ({END} − {START}, Holm over {m} configurations): "
        text += ", ".join(parts)
        if below:
            text += "; below: " + "; ".join(below)
        findings.append(text + " (see Change from the warm start).")
    weak_lines, weak = _weak_warm_starts(ok)
    return lines + weak_lines, findings + weak


def _p(p: float | None) -> str:
    if p is None or math.isnan(p):
        return "–"
    return "<1e-4" if p < 1e-4 else f"{p:.2g}"


def _weak_warm_starts(ok: Sequence[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Seeds whose warm start scores below COLLAPSE_MIN_INIT, with their mean change beside the others'."""
    change: dict[str, list[float]] = {}
    weak = set()
    for r in ok:
        s, e, seed = _value(r, START), _value(r, END), str(r.get("seed", ""))
        if math.isfinite(s) and math.isfinite(e):
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
        f"the other {len(change) - len(weak)} seeds. Seeds that learn in no configuration add pairs near 0 "
        "to every paired difference (toward 'no difference' and 'equivalent'); they stay in every test "
        "(descriptive, no threshold declared before the data)."
    )
    return ["", text], [text]
