"""`Sweep.budget`: the amount of experience every configuration of a comparison gets, declared and enforced.

    Sweep.budget = ('sampled_sequences', 64)     # (unit, value per step)

A comparison of algorithms that sample different numbers of sequences per step compares budgets as
much as methods, so an experiment says which unit it holds equal, and the sweep makes every cell
spend the same amount of it:

- `'sampled_sequences'`: every cell samples `value` sequences per step (summed over its ranks). The
  sweep sets each cell's `train.prompts_per_step` to value / (sequences per prompt × ranks) and its
  `train.max_sampled_sequences` to value × `train.steps`, the total of every cell. A spec's
  sequences per prompt come from its built `Algorithm`: `Algorithm.group_size`, plus one when a part
  declares `needs_baseline_rollout` (ReMax's greedy baseline, one greedy sequence per prompt); a
  preference spec (DPO) samples nothing and trains on fixed pairs, so its `train.prompts_per_step`
  is its pairs per step and it counts the 2 sequences of each pair it trains on (its CSV row and the
  md say "not sampled"). The trainer counts what it samples (every refill round of DAPO's dynamic
  sampling, the greedy baselines, the groups a faulty reward drops) and stops after the step at
  which the count reaches the total (polgrad/stopping.py), so a spec that samples more than it keeps
  stops after fewer optimizer steps; it reports what it kept too (`kept_sequences`).
  `train.steps` is the cap and must be the same in every cell.
- `'generated_tokens'`: the same with `value` generated tokens per step, nominally: prompts per step
  = value / (sequences per prompt × `train.max_new_tokens` × ranks), i.e. the sequences of a step at
  their longest; the total, value × `train.steps`, is what the stop enforces
  (`train.max_generated_tokens`), so a cell of shorter responses runs more steps (up to the cap).
- `'optimizer_steps'`: `value` is the `train.steps` of every cell, checked; the sweep sets nothing
  else, so sampled sequences per step differ by spec (the md lists them).

Refused in one line naming the experiment file (before anything trains): an unknown unit or a value
that is not a positive int; a binding or grid axis of a setting the budget sets
(`train.prompts_per_step`, `train.max_sampled_sequences`, `train.max_generated_tokens`); a grid axis
on `train.steps`; cells whose `train.steps` differ; and a per-step value some cell cannot meet with
a whole number of prompts (its spec, its sequences per prompt and the per-step values every cell
can meet are named). The cell's id hashes the bindings the budget adds, so changing the budget (or
what it derives) starts new cells. experiment.json records the budget (`record`) and each cell's
`prompts_per_step` and `budget_note`; the CSV copies them and the md states the budget in one line.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from polgrad.checks import is_int
from polgrad.errors import ConfigError, did_you_mean

UNITS = ("sampled_sequences", "generated_tokens", "optimizer_steps")
PROMPTS = "train.prompts_per_step"
STEPS = "train.steps"
# The trainer's stop each unit sets (none for 'optimizer_steps': train.steps is the budget).
LIMITS = {
    "sampled_sequences": "train.max_sampled_sequences",
    "generated_tokens": "train.max_generated_tokens",
}
# The md's statement of the budget, per unit (`record`).
TEXTS = {
    "sampled_sequences": "equal sampled sequences, {v} per step × {steps} steps = {total} per cell (a run "
    "stops once it has sampled them, every refill round and greedy baseline counted: {limit}; train.steps "
    "is the cap). Per step: {ways}.",
    "generated_tokens": "equal generated tokens, {v} per step (nominally: the step's sequences at "
    "train.max_new_tokens) × {steps} steps = {total} per cell (a run stops once it has generated them, "
    "greedy baselines counted: {limit}; train.steps is the cap). Per step: {ways}.",
    "optimizer_steps": "equal optimizer steps, train.steps = {v} in every cell; what a step samples "
    "differs: {ways}.",
}


@dataclasses.dataclass(frozen=True)
class Budget:
    """A declared `Sweep.budget`; `where` locates it in the experiment file for messages."""

    unit: str
    value: int
    where: str = "Sweep.budget"

    def __str__(self) -> str:
        return f"Sweep.budget = ({self.unit!r}, {self.value})"


class Facts(NamedTuple):
    """What the budget needs of one built cell (`facts`)."""

    steps: int
    max_new_tokens: int
    prompts_per_step: int
    per_prompt: int  # sequences one prompt costs per step
    how: str  # how that number comes about, e.g. 'Algorithm.group_size = 1 + 1 greedy baseline (...)'
    short: str  # the same for a note: '8', '(1 + 1 greedy)'
    offline: bool  # a preference spec: samples nothing, trains on pairs


class CellBudget(NamedTuple):
    """What the budget made of one cell: the bindings it adds, its prompts per step, a note for its
    row (how it spends a step) and its train.steps."""

    bindings: tuple[str, ...]
    prompts_per_step: int
    note: str
    steps: int


def read(file: str, value: Any, where: str) -> Budget | None:
    """`Sweep.budget` as written (None: not declared), checked: (unit, positive int)."""
    if value is None:
        return None
    shape = "must be (unit, value per step), e.g. ('sampled_sequences', 64); units: " + ", ".join(UNITS)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ConfigError(f"{file}: {where}: {shape}; got {value!r}")
    unit, per_step = value
    if unit not in UNITS:
        hint = did_you_mean(str(unit), UNITS)
        raise ConfigError(f"{file}: {where}: unknown unit {unit!r}{hint}; {shape}")
    if not is_int(per_step) or per_step < 1:
        raise ConfigError(f"{file}: {where}: the value must be a positive int, got {per_step!r}; {shape}")
    return Budget(unit, per_step, where)


def _unscoped(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def check_file(file: str, budget: Budget | None, fixed: Sequence[Any], axes: Sequence[Any]) -> None:
    """Refuse what the budget cannot leave to the file: a binding or grid axis of a setting it sets,
    or a grid axis on `train.steps` (the total is per step × steps, the same in every cell)."""
    if budget is None:
        return
    sets = {PROMPTS, *LIMITS.values()} if budget.unit in LIMITS else set()
    why = f"{budget} sets each cell's {PROMPTS} and {LIMITS.get(budget.unit)} itself"
    for b in fixed:
        if _unscoped(b.key) in sets:
            raise ConfigError(
                f"{file}: line {b.line}: binding '{b.text}': {why}: remove this binding (to compare at "
                "equal steps only, declare Sweep.budget = ('optimizer_steps', <train.steps>))"
            )
    for keys, _ in axes:
        for key in keys:
            if _unscoped(key) in sets:
                raise ConfigError(
                    f"{file}: Sweep.grid[{key!r}]: {why}, so this axis would break the equal budget: remove "
                    "it (vary Algorithm.group_size instead: the sweep then sets the prompts per step)"
                )
            if _unscoped(key) == STEPS:
                raise ConfigError(
                    f"{file}: Sweep.grid[{key!r}]: {budget} compares cells at equal {STEPS}: remove "
                    "this axis (bind train.steps once for every cell)"
                )


def sequences_per_prompt(algo) -> tuple[int, str, str]:
    """The sequences one prompt of `train.prompts_per_step` costs a step of this built `Algorithm`,
    how (for messages) and a short form (for notes): G samples (`Algorithm.group_size`), + 1 greedy
    sequence when a part declares `needs_baseline_rollout` (ReMax), or 2 per preference pair for a
    preference spec (DPO: chosen and rejected, not sampled)."""
    if algo.offline:
        return 2, "2 per preference pair: chosen and rejected, not sampled", "2"
    g = algo.group_size
    if algo.needs_baseline_rollout:
        binding = next(b for b, e in algo.parts.items() if e.meta.get("needs_baseline_rollout"))
        why = f"{binding} = @{algo.parts[binding].full_name}"
        return g + 1, f"Algorithm.group_size = {g} + 1 greedy baseline of {why}", f"({g} + 1 greedy)"
    return g, f"Algorithm.group_size = {g}", str(g)


def facts(cfg, algo) -> Facts:
    """The budget's view of a cell built by `polgrad.config.build()` (its TrainConfig and Algorithm)."""
    per_prompt, how, short = sequences_per_prompt(algo)
    return Facts(cfg.steps, cfg.max_new_tokens, cfg.prompts_per_step, per_prompt, how, short, algo.offline)


def _as_is(f: Facts, ranks: int) -> CellBudget:
    """A cell the budget leaves as the file configures it (no budget, or 'optimizer_steps')."""
    return CellBudget((), f.prompts_per_step, note(f.prompts_per_step, f, ranks), f.steps)


def note(prompts: int, f: Facts, ranks: int) -> str:
    """How a cell spends a step, for its CSV row and the md's budget line."""
    if f.offline:
        on = f" on each of {ranks} ranks" if ranks > 1 else ""
        return (
            f"not sampled: {prompts} preference pairs per step{on} ({2 * prompts * ranks} sequences): the "
            "task's fixed pairs of a correct answer and a corrupted one, offline data and another kind of "
            "information than a sampled reward"
        )
    rk = f" × {ranks} ranks" if ranks > 1 else ""
    return f"{prompts} prompts × {f.short}{rk} = {prompts * f.per_prompt * ranks} sequences"


def plan(
    file: str, budget: Budget | None, cells: Sequence[Any], facts_of: Mapping[str, Facts], ranks: int
) -> dict[str, CellBudget]:
    """Each cell's budget bindings, prompts per step and note; one ConfigError line for a grid the
    budget cannot equalise. `cells` need `id`, `spec` and `describe()`; `facts_of` is keyed by cell id
    (every cell built: polgrad's own trainer); `ranks` the data-parallel ranks of each cell."""
    if not cells:
        return {}
    missing = [c for c in cells if c.id not in facts_of]
    if missing:
        if budget is None:
            return {}
        raise ConfigError(
            f"{file}: {budget.where}: the budget needs each cell's Algorithm, which only polgrad's own "
            "trainer builds (a stand-in train module only parses the cells): remove Sweep.budget or run "
            "with polgrad.train"
        )

    def where(c) -> str:
        return f"cell {c.id} ({c.spec}; {c.describe()})"

    if budget is None:
        return {c.id: _as_is(facts_of[c.id], ranks) for c in cells}
    first = cells[0]
    steps = facts_of[first.id].steps
    for c in cells:
        if budget.unit == "optimizer_steps" and facts_of[c.id].steps != budget.value:
            raise ConfigError(
                f"{file}: {budget.where}: {where(c)} runs {STEPS} = {facts_of[c.id].steps}, not the "
                f"{budget.value} of {budget}: bind train.steps = {budget.value} for every cell"
            )
        if facts_of[c.id].steps != steps:
            raise ConfigError(
                f"{file}: {budget.where}: {budget} needs the same {STEPS} in every cell, but {where(first)} "
                f"runs {steps} and {where(c)} {facts_of[c.id].steps}: bind train.steps once for every cell"
            )
    if budget.unit not in LIMITS:
        return {c.id: _as_is(facts_of[c.id], ranks) for c in cells}
    tokens = budget.unit == "generated_tokens"

    def divisor(f: Facts) -> int:
        return f.per_prompt * ranks * (f.max_new_tokens if tokens else 1)

    common = math.lcm(*(divisor(facts_of[c.id]) for c in cells))
    out = {}
    for c in cells:
        f = facts_of[c.id]
        if budget.value % divisor(f):
            low = budget.value // common * common
            examples = ", ".join(str(v) for v in (low, low + common) if v > 0)
            per = f" × {f.max_new_tokens} tokens (train.max_new_tokens)" if tokens else ""
            rk = f" × {ranks} ranks" if ranks > 1 else ""
            cost = f" = {divisor(f)} per prompt" if per or rk else ""
            raise ConfigError(
                f"{file}: {budget.where}: {where(c)} costs {f.per_prompt} sequences per prompt ({f.how})"
                f"{per}{rk}{cost}, so {budget.value} per step is not a whole number of prompts; per-step "
                f"values every cell can meet: multiples of {common} (e.g. {examples})"
            )
        prompts = budget.value // divisor(f)
        bindings = (f"{PROMPTS} = {prompts}", f"{LIMITS[budget.unit]} = {budget.value * f.steps}")
        out[c.id] = CellBudget(bindings, prompts, note(prompts, f, ranks), f.steps)
    return out


def record(budget: Budget | None, cells: Sequence[Any]) -> dict[str, Any] | None:
    """experiment.json's `budget` (None when the file declares none): the declaration, the steps and
    total of every cell, and `text`, the md's one-line statement of it with how each spec spends a
    step. `cells` carry their `CellBudget` as `budget` (the dry run's) and `spec_name`."""
    if budget is None:
        return None
    planned = [c for c in cells if c.budget is not None]
    steps = planned[0].budget.steps if planned else None
    notes: dict[str, list[str]] = {}
    for c in planned:
        if c.budget.note not in notes.setdefault(c.spec_name, []):
            notes[c.spec_name].append(c.budget.note)
    ways = "; ".join(f"{spec} {' / '.join(n)}" for spec, n in notes.items())
    v = budget.value
    total = v if budget.unit == "optimizer_steps" else v * steps if steps is not None else None
    text = TEXTS[budget.unit].format(v=v, steps=steps, total=total, ways=ways, limit=LIMITS.get(budget.unit))
    return {"unit": budget.unit, "value": v, "steps": steps, "total": total, "text": text}
