"""Which warm starts an experiment's runs started from, in words: the md's first paragraph.

Each finished run records the policy it started from (summary.json's `warm_start`, the CSV's
`warm_start` column: the SFT warm start's cache key, polgrad/build.py `warm_start_id`). By default a
seed fixes its warm start (train.init_seed follows train.seed), so an experiment's rows fall in one of
these designs, and `warm_start_paragraph` says which:

- one warm start for every seed (train.init_seed bound, or one train.policy_path): the conclusions
  hold for that one SFT policy, and the spread over seeds leaves out the warm start's variance;
- each seed its own warm start, the same in every configuration (the default): paired by seed, and
  the spread includes the warm start's variance;
- not recorded (a CSV from before the column): the md says so instead of guessing, and reports what
  the rows' step-0 held-out accuracy (`eval_accuracy_init`, the warm start's greedy accuracy on the
  same eval set) shows: one value in every row of several seeds is what one shared warm start gives
  (two different SFT policies agreeing to every digit on ~1,000 prompts is not expected), several
  values that each seed's runs share are what one warm start per seed gives.

Pairing: the paired statistics compare configurations seed by seed, assuming a seed's cells start
from one policy. A seed whose cells started from different warm starts is named in a **Pairing
broken** warning (not an error: a grid axis may change the warm start on purpose, e.g.
train.sft_steps or train.model_kwargs, and the md is still the record of what ran).
"""

from __future__ import annotations

from collections.abc import Sequence

from polgrad.results.record import FINISHED
from polgrad.results.store import WARM_START


def _seed_key(seed: str) -> tuple[int, str]:
    try:
        return (0, f"{int(seed):012d}")
    except ValueError:
        return (1, seed)


def warm_start_paragraph(rows: Sequence[dict[str, str]]) -> list[str]:
    """The md's paragraph on the runs' warm starts (then a blank line), [] when no run finished."""
    done = [r for r in rows if r.get("status") in FINISHED]
    if not done:
        return []
    known = [r for r in done if (r.get(WARM_START) or "").strip()]
    if not known:
        return [f"**Warm start.** Warm start not recorded: {_init_accuracy_evidence(done)}", ""]
    by_seed: dict[str, dict[str, int]] = {}
    for r in known:
        counts = by_seed.setdefault(str(r.get("seed", "")), {})
        counts[r[WARM_START]] = counts.get(r[WARM_START], 0) + 1
    seeds = sorted(by_seed, key=_seed_key)
    distinct = {w for counts in by_seed.values() for w in counts}
    broken = [s for s in seeds if len(by_seed[s]) > 1]
    if len(distinct) == 1:
        text = (
            "One warm start for every seed: the conclusions hold for this one SFT policy "
            f"(`{distinct.pop()}`); the spread over seeds leaves out the warm start's own variance."
        )
    elif not broken and len(distinct) == len(seeds):
        text = (
            "Each seed has its own warm start (same seed → same warm start in every configuration), so the "
            "spread over seeds includes the warm start's variance."
        )
    elif not broken:
        text = (
            f"{len(distinct)} warm starts for {len(seeds)} seeds (same seed → same warm start in every "
            "configuration)."
        )
    else:
        text = f"{len(distinct)} warm starts for {len(seeds)} seeds."
    if len(known) < len(done):
        text += f" (Warm start not recorded for {len(done) - len(known)} of {len(done)} runs.)"
    lines = [f"**Warm start.** {text}", ""]
    if broken:
        which = "; ".join(
            f"seed {s}: " + ", ".join(f"`{w}` ({n} runs)" for w, n in sorted(by_seed[s].items()))
            for s in broken[:3]
        )
        more = f" (+{len(broken) - 3} more seeds)" if len(broken) > 3 else ""
        lines += [
            f"**Pairing broken:** {len(broken)} of {len(seeds)} seeds started from different warm starts "
            f"in different configurations ({which}{more}), so the paired comparisons below also compare "
            "different SFT policies. Intended only when a swept binding changes the warm start (e.g. "
            "train.sft_steps, train.model_kwargs, train.init_seed); otherwise re-run those cells.",
            "",
        ]
    return lines


def _init_accuracy_evidence(rows: Sequence[dict[str, str]]) -> str:
    """What rows without a warm_start column show of their warm starts: their eval_accuracy_init."""
    head = "these runs predate the CSV's `warm_start` column"
    by_seed: dict[str, set[str]] = {}
    for r in rows:
        value = (r.get("eval_accuracy_init") or "").strip()
        if value:
            by_seed.setdefault(str(r.get("seed", "")), set()).add(value)
    values = {v for vs in by_seed.values() for v in vs}
    if len(by_seed) < 2:
        return (
            f"{head}, so this md cannot say whether every seed started from one SFT policy or each from "
            "its own."
        )
    if len(values) == 1:
        return (
            f"{head}, but every run of all {len(by_seed)} seeds starts at the same held-out accuracy "
            f"(eval_accuracy_init = {_sig4(next(iter(values)))}), as one warm start shared by every seed "
            "gives: the conclusions most likely hold for that one SFT policy, and the spread over seeds "
            "leaves out the warm start's own variance."
        )
    if all(len(vs) == 1 for vs in by_seed.values()):
        return (
            f"{head}; each seed's runs share one step-0 held-out accuracy (eval_accuracy_init) and the seeds "
            f"differ ({len(values)} values for {len(by_seed)} seeds), as one warm start per seed gives."
        )
    return (
        f"{head}, and the runs of one seed start at different held-out accuracies (eval_accuracy_init), so "
        "they did not all start from one policy: the pairing by seed may be broken."
    )


def _sig4(text: str) -> str:
    """A CSV number to 4 significant digits (0.34424603174603174 -> 0.3442); other text as it is."""
    try:
        return f"{float(text):.4g}"
    except ValueError:
        return text
