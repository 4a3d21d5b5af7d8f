"""Paired comparisons between an experiment's configurations: the numbers behind ★ and the findings.

Cells of an experiment that share a seed share the warm start, the prompt stream and the eval set,
so configurations are compared within a seed: for each pair of configurations the differences of
a metric seed by seed get a paired t-test and an exact sign-flip test (polgrad.results.stats), and
the p-values of a family of comparisons are Holm-corrected, each kind separately (family-wise error
rate ALPHA).

The rules, stated once (the md repeats them):

- **Seeds.** Only ok rows are tested. A seed that is not ok (failed or unstable) in ANY configuration
  that has an ok run is dropped from every comparison of the experiment (`dropped_seeds`), so every
  test runs on the same seeds; the md names the dropped seeds and why. A configuration with no ok run
  at all has nothing to compare and drops no seed (its cells are listed as unstable or failed).
  Likewise a seed where the ok row of a configuration that has values of a metric elsewhere has none
  (a blank, NaN or inf cell: non-finite values are no values) is dropped from every comparison of
  that metric (`missing_values`). A configuration with no row at all for a seed (not run) is compared
  on the seeds it has. Two rows of one (configuration, seed) are a DataError.
- **Which test decides** (`Comparison.rule`): the t-test alone (RULE_T) where the paired differences
  look normal; both the t-test and the sign-flip test, each Holm-corrected, below ALPHA (RULE_BOTH)
  where the outcomes are visibly non-normal: Shapiro-Wilk p < NORMALITY_ALPHA on the paired
  differences, or failed runs (polgrad.results.health) in either configuration; the sign-flip test
  alone (RULE_PERM) where the differences have no spread (the t-test is undefined). With n seeds the
  sign-flip p cannot go below 2/2^n (0.0625 at n = 5), so under RULE_BOTH or RULE_PERM a family of
  m with m·2/2^n >= ALPHA can give no verdict (`Comparison.reachable`).
- **Identical configurations.** A configuration whose every outcome metric (OUTCOMES) equals, seed by
  seed up to float rounding (IDENTICAL_RTOL), the reference's or an earlier configuration's of the
  family is the same runs again (e.g. an off-policy correction at staleness 0): it is reported as
  identical (`identical_to`) and left out of Holm's m.

- `against(rows, ..., reference)`: every other configuration against one reference (the
  experiment's baseline), one family of the m tested comparisons.
- `leader(rows, ...)`: the configuration with the best mean over the seeds every configuration has
  (`ranking_seeds`: the seeds the paired tests use) against every other one. It earns ★ only if it is
  significantly better than each of them after correction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from polgrad.errors import DataError
from polgrad.results.health import config_key, failed_keys
from polgrad.results.stats import Paired, holm, min_signflip_p, paired

ALPHA = 0.05
POWER = 0.8
NORMALITY_ALPHA = 0.05
IDENTICAL_RTOL = 1e-6  # fp32 metrics: ~10 ulp of their scale
# the outcome columns compared to call two configurations identical (not the timings)
OUTCOMES = ("final_train_reward", "eval_accuracy", "eval_accuracy_init", "kl", "kl_exact", "entropy")

RULE_T = "t-test"
RULE_BOTH = "t-test and sign-flip"
RULE_PERM = "sign-flip only"

Key = tuple[str, ...]


@dataclass(frozen=True)
class Comparison:
    """`other` − `reference` in `metric`, paired by seed, with its Holm-adjusted p-values (t-test and
    sign-flip) within its family of m tested comparisons, the rule that decides, and why."""

    reference: Key
    other: Key
    metric: str
    test: Paired
    p_holm: float
    m: int  # tested comparisons in the family
    p_perm_holm: float = math.nan
    rule: str = RULE_T
    reason: str = ""
    identical_to: Key | None = None  # the same runs as this configuration: not a test

    @property
    def p_decision(self) -> float:
        """The corrected p the verdict rests on (the larger of both under RULE_BOTH)."""
        return decide(self.rule, self.p_holm, self.p_perm_holm)

    @property
    def significant(self) -> bool:
        p = self.p_decision
        return not math.isnan(p) and p < ALPHA

    @property
    def mde(self) -> float:
        """Smallest difference detectable at 80% power at the family's strictest level alpha/m."""
        return self.test.mde(ALPHA / max(self.m, 1), POWER)

    @property
    def reachable(self) -> bool:
        """Whether the deciding tests can reach ALPHA at all with this n and m (sign-flip floor)."""
        if self.rule == RULE_T:
            return True
        return self.test.n >= 1 and max(self.m, 1) * min_signflip_p(self.test.n) < ALPHA


def decide(rule: str, p_t: float, p_perm: float) -> float:
    """The deciding p of a rule from its corrected t and sign-flip p-values."""
    if rule == RULE_PERM:
        return p_perm
    if rule == RULE_BOTH:
        return p_perm if math.isnan(p_t) else max(p_t, p_perm)
    return p_t


def rule_of(test: Paired, failed: bool) -> tuple[str, str]:
    """(rule, why) for one comparison: see the module docstring."""
    if test.no_spread:
        return RULE_PERM, "no spread: the t-test is undefined"
    if failed:
        return RULE_BOTH, "failed runs"
    if not math.isnan(test.shapiro_p) and test.shapiro_p < NORMALITY_ALPHA:
        return RULE_BOTH, f"Shapiro-Wilk p = {test.shapiro_p:.2g} on the differences"
    return RULE_T, ""


def _describe(key: Key, group_columns: Sequence[str]) -> str:
    return ", ".join(f"{c}={v}" for c, v in zip(group_columns, key, strict=True))


def check_duplicates(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> None:
    """Two rows of one (configuration, seed) are a DataError naming both cells (the second used to
    overwrite the first silently)."""
    seen: dict[tuple[Key, str], str] = {}
    for r in rows:
        key, seed = config_key(r, group_columns), str(r.get("seed", ""))
        if (key, seed) in seen:
            raise DataError(
                f"configuration {_describe(key, group_columns)} has two rows for seed {seed}: cells "
                f"'{seen[key, seed]}' and '{r.get('cell_id', '')}'; a configuration has one cell per seed, "
                "so remove the row (and run folder) that does not belong to the experiment"
            )
        seen[key, seed] = str(r.get("cell_id", ""))


def dropped_seeds(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str]
) -> dict[str, list[dict[str, Any]]]:
    """{seed: its rows that are not ok} for every seed not ok in some configuration that has an ok run."""
    tested = {config_key(r, group_columns) for r in rows if r.get("status") == "ok"}
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status") != "ok" and config_key(r, group_columns) in tested:
            out.setdefault(str(r.get("seed", "")), []).append(r)
    return out


def _values(rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str) -> dict[Key, dict]:
    """{configuration: {seed: finite value}} over the ok cells of the seeds `dropped_seeds` keeps."""
    dropped = dropped_seeds(rows, group_columns)
    out: dict[Key, dict] = {}
    for r in rows:
        if r.get("status") != "ok" or str(r.get("seed", "")) in dropped:
            continue
        try:
            value = float(r.get(metric))
        except (TypeError, ValueError):
            continue
        if not math.isfinite(value):  # 'nan'/'inf' in a CSV: no value, as a blank cell
            continue
        out.setdefault(config_key(r, group_columns), {})[str(r.get("seed", ""))] = value
    return out


def missing_values(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str
) -> dict[str, list[Key]]:
    """{seed: the configurations without a finite `metric` there} for every kept seed where the ok row
    of a configuration that has finite values of `metric` elsewhere holds none (blank, 'nan', 'inf'):
    such a seed is dropped from every comparison of `metric`, so all its tests use the same seeds."""
    values = _values(rows, group_columns, metric)
    dropped = dropped_seeds(rows, group_columns)
    out: dict[str, list[Key]] = {}
    for r in rows:
        key, seed = config_key(r, group_columns), str(r.get("seed", ""))
        if r.get("status") == "ok" and seed not in dropped and values.get(key) and seed not in values[key]:
            out.setdefault(seed, []).append(key)
    return dict(sorted(out.items(), key=lambda kv: (len(kv[0]), kv[0])))


def by_seed(rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str) -> dict[Key, dict]:
    """{configuration: {seed: value}} over the ok cells of the seeds not dropped, neither for a run
    that is not ok (`dropped_seeds`) nor for a missing value of `metric` (`missing_values`); a
    configuration = its group columns' values; a DataError on a duplicate (configuration, seed)."""
    check_duplicates(rows, group_columns)
    values = _values(rows, group_columns, metric)
    gaps = missing_values(rows, group_columns, metric)
    return {k: {s: x for s, x in v.items() if s not in gaps} for k, v in values.items()}


def _identical(tables: dict[str, dict[Key, dict]], a: Key, b: Key) -> bool:
    """Every outcome metric equal seed by seed (up to IDENTICAL_RTOL of its size), on >= 1 seed."""
    compared = 0
    for values in tables.values():
        x, y = values.get(a, {}), values.get(b, {})
        if set(x) != set(y):
            return False
        for s in x:
            if abs(x[s] - y[s]) > IDENTICAL_RTOL * max(abs(x[s]), abs(y[s])):
                return False
            compared += 1
    return compared > 0


def twins(rows: Sequence[dict[str, Any]], group_columns: Sequence[str]) -> dict[Key, Key]:
    """{configuration: the earlier configuration (row order) whose runs it repeats}: every outcome
    metric equal seed by seed, as `against` finds them (the same runs, not a test)."""
    tables = {m: t for m in OUTCOMES if (t := by_seed(rows, group_columns, m))}
    keys = list(dict.fromkeys(config_key(r, group_columns) for r in rows if r.get("status") == "ok"))
    out: dict[Key, Key] = {}
    for i, k in enumerate(keys):
        same = next((e for e in keys[:i] if e not in out and _identical(tables, e, k)), None)
        if same is not None:
            out[k] = same
    return out


def against(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str, reference: Key
) -> list[Comparison]:
    """Each configuration other than `reference` against it, Holm-corrected as one family (the
    identical and the untested ones left out of m)."""
    tables = {m: by_seed(rows, group_columns, m) for m in dict.fromkeys([metric, *OUTCOMES])}
    tables = {m: t for m, t in tables.items() if t}
    values = tables.get(metric, {})
    base = values.get(reference, {})
    failed = failed_keys(rows, group_columns)
    others = [k for k in values if k != reference]
    tests = [paired(base, values[k]) for k in others]
    same: list[Key | None] = []
    for i, k in enumerate(others):
        earlier = [reference] + [o for o, s in zip(others[:i], same, strict=True) if s is None]
        same.append(next((e for e in earlier if _identical(tables, e, k)), None))
    member = [s is None and t.n >= 2 for t, s in zip(tests, same, strict=True)]
    m = sum(member)
    p_t = holm([t.p if ok else math.nan for t, ok in zip(tests, member, strict=True)], m)
    p_perm = holm([t.p_perm if ok else math.nan for t, ok in zip(tests, member, strict=True)], m)
    out = []
    for i, (k, t) in enumerate(zip(others, tests, strict=True)):
        rule, why = rule_of(t, k in failed or reference in failed)
        out.append(Comparison(reference, k, metric, t, p_t[i], m, p_perm[i], rule, why, same[i]))
    return out


def ranking_seeds(values: dict[Key, dict]) -> list[str]:
    """The seeds every configuration has a value for (the seed set of the paired tests), sorted."""
    sets = [set(v) for v in values.values() if v]
    common = set.intersection(*sets) if sets else set()
    return sorted(common, key=lambda s: (len(s), s))


def leader(
    rows: Sequence[dict[str, Any]], group_columns: Sequence[str], metric: str, higher_is_better: bool = True
) -> tuple[Key | None, list[Comparison], bool]:
    """The configuration with the best mean over `ranking_seeds` (each one's own seeds when no seed is
    common to all), its comparisons with every other one (others − leader), and whether it is
    significantly better than all of them (the ★)."""
    values = by_seed(rows, group_columns, metric)
    seeds = set(ranking_seeds(values))
    means = {
        k: sum(x for s, x in v.items() if s in seeds or not seeds) / (len(seeds) or len(v))
        for k, v in values.items()
        if v
    }
    if not means:
        return None, [], False
    best = (max if higher_is_better else min)(means, key=lambda k: means[k])
    comps = against(rows, group_columns, metric, best)
    judged = [c for c in comps if c.identical_to is None]  # a twin of the leader is the same runs: not judged
    worse = [(c.test.mean < 0) if higher_is_better else (c.test.mean > 0) for c in judged]
    starred = bool(judged) and all(c.significant and w for c, w in zip(judged, worse, strict=True))
    return best, comps, starred


def p_text(x: float) -> str:
    """A p-value as the md prints it: 2 significant digits, '<1e-4' below, '–' for none."""
    return "–" if x is None or math.isnan(x) else (f"{x:.2g}" if x >= 1e-4 else "<1e-4")


def rule_text(c: Comparison, label) -> str:
    """The rule that decides `c`, as the md names it (or why it is not tested)."""
    if c.identical_to is not None:
        return f"identical to {label(c.identical_to)}: not tested"
    if c.test.n < 2:
        return "not tested (n < 2)"
    return c.rule + (f" ({c.reason})" if c.reason else "")
