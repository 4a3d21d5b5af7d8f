"""A pilot gate: what a committed pilot must show before an experiment's evaluation cells run.

An experiment declares (polgrad/sweep/pilot_gate.py reads it from its gin)

    Sweep.pilot = 'results/pilots/X_pilot/X_pilot.csv'
    Sweep.pilot_gate = [('len_incorrect_change', {'spec': 'grpo'}, '>=', 3, 'se'),
                        ('eval_accuracy_change', {'spec': 'grpo'}, '>=', 0.05, 'abs')]

Each condition is about one configuration of the pilot (its rows whose columns match, status ok, a
finite value), over its seeds: n ≥ MIN_SEEDS distinct seeds, none of them an evaluation seed; the
mean m of the metric and its standard error se = sd / √n (sd with n − 1). With unit 'se' the
threshold k is in standard errors: '>=' passes when m ≥ k·se (the pilot's mean lies at least k
standard errors above 0), '<=' when m ≤ −k·se (at least k below 0), '|>=|' when |m| ≥ k·se (at least
k from 0 on either side: a change of either sign); a pilot without spread (se = 0) passes none. A
seed with two ok runs of a condition's configuration (rows of an older grid) fails it. With unit
'abs' the threshold is in the metric's own units: '>=' passes when m ≥ k, '<=' when m ≤ k, '|>=|'
when |m| ≥ k. A '|>=|' threshold is > 0 in either unit (|m| ≥ 0 always holds).
`eval_accuracy_change` is eval_accuracy − eval_accuracy_init (the change from the warm start), any
other metric a column of the CSV.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

MIN_SEEDS = 3
OPS = (">=", "<=", "|>=|")
UNITS = ("se", "abs")
CHANGE = "eval_accuracy_change"  # eval_accuracy - eval_accuracy_init, per run


@dataclass(frozen=True)
class Outcome:
    """One condition, evaluated on the pilot's rows."""

    metric: str
    config: dict[str, str]
    op: str
    threshold: float
    unit: str
    n: int
    mean: float
    se: float
    passed: bool
    why: str  # '' when it passed; else what failed

    def text(self) -> str:
        cfg = " · ".join(f"{k}={v}" for k, v in self.config.items())
        side = {">=": "above", "<=": "below", "|>=|": "from"}[self.op]
        if self.unit == "se":
            want = f"{self.metric} at least {self.threshold:g} standard errors {side} 0 in {cfg}"
        elif self.op == "|>=|":
            want = f"|{self.metric}| >= {self.threshold:g} in {cfg}"
        else:
            want = f"{self.metric} {self.op} {self.threshold:g} in {cfg}"
        got = f"n = {self.n}, mean {self.mean:+.4g}, se {self.se:.3g}" if self.n else "no runs"
        return f"{want}: {got}: " + ("passed" if self.passed else f"not passed ({self.why})")


def _value(row: dict[str, str], metric: str) -> float:
    try:
        if metric == CHANGE:
            return float(row["eval_accuracy"]) - float(row["eval_accuracy_init"])
        return float(row[metric])
    except (KeyError, TypeError, ValueError):
        return math.nan


def _seed(value: Any) -> str:
    """A seed as the integer it names ('10', '10.0' and 10 are one seed)."""
    try:
        return str(int(float(value)))
    except (TypeError, ValueError):
        return str(value)


def evaluate(
    rows: Sequence[dict[str, str]], conditions: Sequence[dict[str, Any]], evaluation_seeds: Sequence[int]
) -> list[Outcome]:
    """Each condition ({metric, config, op, threshold, unit}) on the pilot's `rows`."""
    out = []
    banned = {_seed(s) for s in evaluation_seeds}
    for c in conditions:
        mine = [
            r
            for r in rows
            if r.get("status") == "ok" and all(str(r.get(k, "")) == str(v) for k, v in c["config"].items())
        ]
        values: dict[str, float] = {}
        twice = set()
        for r in mine:
            v = _value(r, c["metric"])
            seed = _seed(r.get("seed", ""))
            if math.isfinite(v):
                if seed in values:
                    twice.add(seed)
                values.setdefault(seed, v)
        n = len(values)
        mean = sum(values.values()) / n if n else math.nan
        sd = math.sqrt(sum((v - mean) ** 2 for v in values.values()) / (n - 1)) if n > 1 else math.nan
        se = sd / math.sqrt(n) if n > 1 else math.nan
        k = float(c["threshold"])
        bound = k * se if c["unit"] == "se" else k
        if c["op"] == ">=":
            passed = mean >= bound
        elif c["op"] == "|>=|":
            passed = abs(mean) >= bound
        else:
            passed = mean <= (-bound if c["unit"] == "se" else bound)
        why = ""
        if twice:  # e.g. rows of an older grid beside the pilot's current ones: which would count?
            why = (
                f"seed(s) {', '.join(sorted(twice))} have two ok runs of this configuration in the pilot CSV"
            )
        elif overlap := sorted(banned & set(values), key=lambda s: (len(s), s)):
            why = f"seeds {', '.join(overlap)} are evaluation seeds: a pilot runs seeds of its own"
        elif n < MIN_SEEDS:
            why = f"{n} seed(s) with an ok run and a value; a pilot needs at least {MIN_SEEDS}"
        elif c["unit"] == "se" and not se > 0:
            why = "no spread across the pilot's seeds: no standard error to measure the mean in"
        elif not passed:
            why = "the pilot does not show it"
        config = {k: str(v) for k, v in c["config"].items()}
        out.append(Outcome(c["metric"], config, c["op"], k, c["unit"], n, mean, se, not why, why))
    return out


def record(pilot: str, commit: str, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """What experiment.json keeps of the gate (the md's section reads it)."""
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"pilot": pilot, "commit": commit, "checked_at": now, "conditions": [asdict(o) for o in outcomes]}


def section(gate: dict[str, Any] | None) -> list[str]:
    """The md's "Pilot gate" section from experiment.json's record of it ([] without a gate)."""
    if not gate:
        return []
    when = f" at {gate['checked_at']}" if gate.get("checked_at") else ""
    lines = [
        "",
        "## Pilot gate",
        "",
        f"The sweep checked the experiment's declared pilot gate{when} before it started the evaluation "
        f"cells: the pilot {gate['pilot']} (commit {gate['commit']}, seeds disjoint from the evaluation "
        f"seeds, at least {MIN_SEEDS} per configuration) had to show",
        "",
    ]
    lines += [f"- {Outcome(**c).text()}" for c in gate["conditions"]]
    return lines
