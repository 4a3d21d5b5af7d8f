"""Failed and flagged runs: runs that finished (status 'ok') but whose outcome is a failure, or worth a
flag, named in the md; a failure is never averaged into a 'no difference'.

From the columns the CSV has, a finished run (an ok CSV row) is

- **failed (collapsed)** by the library's collapse rule (polgrad/collapse.py, which the trainer reports
  from too): its held-out accuracy (eval_accuracy) ended at 0, or fell below COLLAPSE_FRACTION (half)
  of its own warm start's accuracy (eval_accuracy_init) where that warm start's accuracy is at least
  COLLAPSE_MIN_INIT (0.1): below it, a fall to half (e.g. 0.024 to 0.01, a few questions of the eval
  set) is within the noise of the eval set, not a collapse;
- **flagged as drifted far from the reference** when its KL to the reference (kl_exact, else the
  sampled kl) ends above KL_LIMIT (1 nat per token; inf included). A flag, not a failure: a run can
  drift far and still improve (0.024 to 0.443 accuracy).

Per configuration the md says how many of its seeds collapsed and how many drifted, and names
**bimodal** outcomes (some seeds collapsed, others did not: a mean and a t-test over them describe
neither mode). Across the
experiment, when the collapsed runs end with a higher train reward than the runs that did not
collapse, the md says so: the reward the policy was trained on (a reward model's score where
train.reward_source = 'reward_model') disagrees with the gold accuracy (reward hacking). The CSV holds
the final train reward only, so that is a comparison between runs, not a rise within one.

A comparison involving a configuration with collapsed runs (`failed_keys`) needs the sign-flip test
as well as the t-test (polgrad.results.compare), and its non-significance is not reported as 'no difference'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

from polgrad.collapse import COLLAPSE_FRACTION, COLLAPSE_MIN_INIT, collapse_reason

KL_LIMIT = 1.0  # nats per token
HEADING = "## Failed and flagged runs"

Key = tuple[str, ...]


def config_key(row: dict[str, Any], group_columns: Sequence[str]) -> Key:
    """A row's configuration: the values of its group columns (spec + swept bindings)."""
    return tuple(str(row.get(c, "")) for c in group_columns)


def _f(row: dict[str, Any], col: str) -> float:
    try:
        v = float(row.get(col))
    except (TypeError, ValueError):
        return math.nan
    return v


@dataclass(frozen=True)
class RunFailure:
    """One finished run that collapsed (failed) or drifted far from the reference (flagged): its
    configuration, seed, cell and what happened."""

    key: Key
    seed: str
    cell_id: str
    collapsed: bool
    kl_exploded: bool  # drifted far from the reference: KL above KL_LIMIT
    why: str


def _kl_column(rows: Sequence[dict[str, Any]]) -> str:
    return "kl_exact" if any(str(r.get("kl_exact", "")).strip() for r in rows) else "kl"


def run_failures(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> list[RunFailure]:
    """The collapsed or drifted runs among the ok rows, in row order."""
    kl_col = _kl_column(rows)
    out = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        collapse = collapse_reason(_f(r, "eval_accuracy"), _f(r, "eval_accuracy_init"))
        kl = _f(r, kl_col)
        why = [collapse] if collapse else []
        collapsed = collapse is not None
        exploded = kl > KL_LIMIT  # inf too (NaN compares False)
        if exploded:
            why.append(f"drifted far from the reference: {kl_col} {kl:.3g} nats per token (> {KL_LIMIT:g})")
        if why:
            out.append(
                RunFailure(
                    config_key(r, group_columns),
                    str(r.get("seed", "")),
                    str(r.get("cell_id", "")),
                    collapsed,
                    exploded,
                    "; ".join(why),
                )
            )
    return out


def below_start(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> tuple[int, int]:
    """(ok runs that did not collapse and record both accuracies, how many of them ended below their
    warm start: eval_accuracy < eval_accuracy_init): whether avoiding collapse alone would answer."""
    collapsed = {f.cell_id for f in run_failures(rows, group_columns) if f.collapsed}
    pairs = [
        (_f(r, "eval_accuracy"), _f(r, "eval_accuracy_init"))
        for r in rows
        if r.get("status") == "ok" and str(r.get("cell_id", "")) not in collapsed
    ]
    pairs = [(a, b) for a, b in pairs if not (math.isnan(a) or math.isnan(b))]
    return len(pairs), sum(a < b for a, b in pairs)


def what_would_answer(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> str:
    """For an experiment whose every configuration has collapsed runs: what runs would answer it. Runs
    that do not collapse, unless most of those too ended below their warm start (`below_start`)."""
    kept, below = below_start(rows, group_columns)
    if 2 * below <= kept:
        return "runs that do not collapse would answer it"
    return (
        f"of the {kept} runs that did not collapse, {below} also ended below their warm start, so avoiding "
        "collapse alone would not answer it; runs that end above their warm start would"
    )


def failed_keys(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> set[Key]:
    """Configurations with at least one failed (collapsed) run."""
    return {f.key for f in run_failures(rows, group_columns) if f.collapsed}


def section(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], label: Callable[[Key], str]
) -> tuple[list[str], list[str]]:
    """The md lines of the failed-and-flagged-runs section and its findings (empty when none)."""
    failures = run_failures(rows, group_columns)
    if not failures:
        return [], []
    ok = [r for r in rows if r.get("status") == "ok"]
    seeds: dict[Key, list[str]] = {}
    for r in ok:
        seeds.setdefault(config_key(r, group_columns), []).append(str(r.get("seed", "")))
    lines = [
        "",
        HEADING,
        "",
        f"A finished run failed (collapsed) when its held-out accuracy ended at 0, or below "
        f"{COLLAPSE_FRACTION:g} of its own warm start's where that is at least {COLLAPSE_MIN_INIT:g} (below, "
        "such a fall is within the eval set's noise). Collapsed runs are failures of their configuration: "
        "a comparison with them needs the sign-flip test as well as the t-test, and a difference not "
        "detected there is not evidence of 'no difference'. A run whose KL to the reference ended above "
        f"{KL_LIMIT:g} nat per token is flagged as drifted far from the reference: named here, not a "
        "failure.",
        "",
    ]
    findings = []
    by_key: dict[Key, list[RunFailure]] = {}
    for f in failures:
        by_key.setdefault(f.key, []).append(f)
    for key, fs in by_key.items():
        n = len(seeds.get(key, []))
        collapsed = [f.seed for f in fs if f.collapsed]
        exploded = [f.seed for f in fs if f.kl_exploded]
        counts = [f"{len(s)} of {n} runs {w}" for s, w in ((collapsed, "collapsed"), (exploded, _DRIFT)) if s]
        lines.append(f"- **{label(key)}**: {'; '.join(counts)}:")
        lines += [f"  - seed {f.seed} (`{f.cell_id}`): {f.why}" for f in fs]
        words = []
        if collapsed:
            words.append(f"{len(collapsed)} of {n} runs collapsed ({_seeds(collapsed)})")
        if collapsed and len(collapsed) < n:
            rest = [s for s in seeds.get(key, []) if s not in collapsed]
            bimodal = (
                f"bimodal outcomes: {_seeds(collapsed)} collapsed while {_seeds(rest)} did not, so its mean "
                "describes neither"
            )
            lines.append(f"  - {bimodal}.")
            words.append(bimodal)
        if exploded:
            words.append(f"{len(exploded)} of {n} runs {_DRIFT} (a flag, not a failure)")
        what = "failed" if collapsed else "flagged"
        findings.append(f"{label(key)} {what}: " + "; ".join(words) + f" (see {HEADING[3:]}).")
    hacked = _reward_disagrees(ok, failures, group_columns)
    if hacked:
        lines += ["", hacked]
        findings.append(hacked)
    return lines, findings


def _seeds(seeds: Sequence[str]) -> str:
    return f"seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)}"


_DRIFT = f"drifted far from the reference (KL above {KL_LIMIT:g} nat per token)"


def _reward_disagrees(ok, failures, group_columns) -> str:
    collapsed = {(f.key, f.seed) for f in failures if f.collapsed}
    inside, outside = [], []
    for r in ok:
        reward = _f(r, "final_train_reward")
        if math.isfinite(reward):
            is_in = (config_key(r, group_columns), str(r.get("seed", ""))) in collapsed
            (inside if is_in else outside).append(reward)
    if not inside or not outside:
        return ""
    a, b = sum(inside) / len(inside), sum(outside) / len(outside)
    if a <= b:
        return ""
    return (
        f"The reward trained on disagrees with the held-out accuracy: the {len(inside)} collapsed runs end "
        f"with a mean final train reward of {a:.3g}, the {len(outside)} others with {b:.3g}. The policy "
        "was rewarded most where its accuracy collapsed (reward hacking, where the reward is a reward "
        "model's score)."
    )


def answer_tail(failed: Sequence[Key], compared: Collection[Key], label: Callable[[Key], str]) -> str:
    """The clause an answer ends with when configurations' runs failed: a verdict on one a judged
    prediction compares (`compared`) describes those runs as they ran, collapses included; for the
    others the answer says nothing until runs that do not collapse are compared."""
    judged, rest = [k for k in failed if k in compared], [k for k in failed if k not in compared]

    def which(keys: Sequence[Key]) -> str:
        names = "; ".join(label(k) for k in keys)
        return f"{'the configurations' if len(keys) > 1 else 'the configuration'} whose runs failed ({names})"

    return (
        f"; its verdicts on {which(judged)} describe those runs, collapses included" if judged else ""
    ) + (
        f", and for {which(rest)} it answers nothing until runs that do not collapse are compared"
        if rest
        else ""
    )
