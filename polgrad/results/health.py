"""Failed runs: runs that finished ('ok') but whose outcome is a failure, named in the md, never
averaged into a 'no difference'.

A run (an ok CSV row) failed when, from the columns the CSV has:

- **collapse**: its held-out accuracy (eval_accuracy) ended at 0, or below COLLAPSE_FRACTION (half)
  of its own warm start's accuracy (eval_accuracy_init);
- **KL explosion**: its exact KL to the reference (kl_exact, else the sampled kl) ends above KL_LIMIT
  (1 nat per token: the policy no longer resembles the model it started from).

Per configuration the md says how many of its seeds failed, and names **bimodal** outcomes (some
seeds collapsed, others did not: a mean and a t-test over them describe neither mode). Across the
experiment, when the collapsed runs end with a higher train reward than the runs that did not
collapse, the md says so: the reward the policy was trained on (a reward model's score where
train.reward_source = 'reward_model') disagrees with the gold accuracy (reward hacking). The CSV holds
the final train reward only, so that is a comparison between runs, not a rise within one.

A comparison involving a configuration with failed runs needs the sign-flip test as well as the
t-test (polgrad.results.compare), and its non-significance is not reported as 'no difference'.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

COLLAPSE_FRACTION = 0.5
KL_LIMIT = 1.0  # nats per token
HEADING = "## Failed runs"

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
    """One ok run whose outcome failed: its configuration, seed, cell and what went wrong."""

    key: Key
    seed: str
    cell_id: str
    collapsed: bool
    kl_exploded: bool
    why: str


def _kl_column(rows: Sequence[dict[str, Any]]) -> str:
    return "kl_exact" if any(str(r.get("kl_exact", "")).strip() for r in rows) else "kl"


def run_failures(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> list[RunFailure]:
    """The failed runs among the ok rows, in row order."""
    kl_col = _kl_column(rows)
    out = []
    for r in rows:
        if r.get("status") != "ok":
            continue
        acc, init, kl = _f(r, "eval_accuracy"), _f(r, "eval_accuracy_init"), _f(r, kl_col)
        why = []
        collapsed = False
        if math.isfinite(acc) and acc <= 0.0:
            collapsed = True
            why.append(f"held-out accuracy ended at {acc:.3g}" + (f" (from {init:.3g})" if init > 0 else ""))
        elif math.isfinite(acc) and init > 0 and acc < COLLAPSE_FRACTION * init:
            collapsed = True
            why.append(f"held-out accuracy fell from {init:.3g} to {acc:.3g}")
        exploded = math.isfinite(kl) and kl > KL_LIMIT
        if exploded:
            why.append(f"{kl_col} {kl:.3g} nats per token (> {KL_LIMIT:g})")
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


def failed_keys(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> set[Key]:
    """Configurations with at least one failed run."""
    return {f.key for f in run_failures(rows, group_columns)}


def section(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], label: Callable[[Key], str]
) -> tuple[list[str], list[str]]:
    """The md lines of the failed-runs section and its findings (empty when no run failed)."""
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
        f"A run failed when its held-out accuracy ended at 0 or below {COLLAPSE_FRACTION:g} of its own warm "
        f"start's (collapse), or its KL to the reference ended above {KL_LIMIT:g} nat per token. These runs "
        "are failures of their configuration: a comparison with them needs the exact sign-flip test as "
        "well as the t-test, and a difference not detected there is not evidence of 'no difference'.",
        "",
    ]
    findings = []
    by_key: dict[Key, list[RunFailure]] = {}
    for f in failures:
        by_key.setdefault(f.key, []).append(f)
    for key, fs in by_key.items():
        n = len(seeds.get(key, []))
        collapsed = [f.seed for f in fs if f.collapsed]
        lines.append(f"- **{label(key)}**: {len(fs)} of {n} runs failed:")
        lines += [f"  - seed {f.seed} (`{f.cell_id}`): {f.why}" for f in fs]
        words = [f"{len(fs)} of {n} runs failed"]
        if collapsed:
            words.append(
                f"{len(collapsed)} collapsed (seed{'s' if len(collapsed) > 1 else ''} {', '.join(collapsed)})"
            )
        if collapsed and len(collapsed) < n:
            rest = [s for s in seeds.get(key, []) if s not in collapsed]
            bimodal = (
                f"bimodal outcomes: seeds {', '.join(collapsed)} collapsed while seeds {', '.join(rest)} "
                "did not, so its mean describes neither"
            )
            lines.append(f"  - {bimodal}.")
            words.append(bimodal)
        exploded = [f.seed for f in fs if f.kl_exploded]
        if exploded:
            words.append(f"the KL exploded in {len(exploded)}")
        findings.append(f"{label(key)} failed: " + "; ".join(words) + f" (see {HEADING[3:]}).")
    hacked = _reward_disagrees(ok, failures, group_columns)
    if hacked:
        lines += ["", hacked]
        findings.append(hacked)
    return lines, findings


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
