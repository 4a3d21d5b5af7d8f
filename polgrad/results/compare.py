"""Paired comparisons between an experiment's configurations: the numbers behind ★ and the findings.

Cells of an experiment that share a seed share the warm start, the prompt stream and the eval set,
so configurations are compared within a seed: for each pair of configurations the differences of
a metric seed by seed are tested with a paired t-test (scipy.stats.ttest_rel), and the p-values
of a family of comparisons are Holm-corrected (family-wise error rate ALPHA).

- `against(rows, ..., reference)`: every other configuration against one reference (the
  experiment's baseline), one family of m = configurations − 1 tests.
- `leader(rows, ...)`: the configuration with the best mean against every other one. It earns ★
  only if it is significantly better than each of them after correction; otherwise the leaders
  are tied and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polgrad.results.stats import Paired, holm, paired

ALPHA = 0.05
POWER = 0.8

Key = tuple[str, ...]


@dataclass(frozen=True)
class Comparison:
    """`other` − `reference` in `metric`, paired by seed, with its Holm-adjusted p within its family."""

    reference: Key
    other: Key
    metric: str
    test: Paired
    p_holm: float
    m: int  # comparisons in the family

    @property
    def significant(self) -> bool:
        return not math.isnan(self.p_holm) and self.p_holm < ALPHA

    @property
    def mde(self) -> float:
        """Smallest difference detectable at 80% power at the family's strictest level alpha/m."""
        return self.test.mde(ALPHA / max(self.m, 1), POWER)


def by_seed(rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str) -> dict[Key, dict]:
    """{configuration: {seed: value}} over the ok cells (a configuration = its group columns' values)."""
    out: dict[Key, dict] = {}
    for r in rows:
        if r.get("status") != "ok":
            continue
        key = tuple(str(r.get(c, "")) for c in group_columns)
        try:
            out.setdefault(key, {})[str(r.get("seed", ""))] = float(r.get(metric))
        except (TypeError, ValueError):
            continue
    return out


def against(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str, reference: Key
) -> list[Comparison]:
    """Each configuration other than `reference` against it, Holm-corrected as one family."""
    values = by_seed(rows, group_columns, metric)
    base = values.get(reference, {})
    others = [k for k in values if k != reference]
    tests = [paired(base, values[k]) for k in others]
    adjusted = holm([t.p for t in tests])
    m = sum(not math.isnan(t.p) for t in tests)
    return [
        Comparison(reference, k, metric, t, p, m) for k, t, p in zip(others, tests, adjusted, strict=True)
    ]


def leader(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str, higher_is_better: bool = True
) -> tuple[Key | None, list[Comparison], bool]:
    """The configuration with the best mean, its comparisons with every other one (others − leader),
    and whether it is significantly better than all of them (the ★)."""
    values = by_seed(rows, group_columns, metric)
    means = {k: sum(v.values()) / len(v) for k, v in values.items() if v}
    if not means:
        return None, [], False
    best = (max if higher_is_better else min)(means, key=lambda k: means[k])
    comps = against(rows, group_columns, metric, best)
    worse = [(c.test.mean < 0) if higher_is_better else (c.test.mean > 0) for c in comps]
    starred = bool(comps) and all(c.significant and w for c, w in zip(comps, worse, strict=True))
    return best, comps, starred
