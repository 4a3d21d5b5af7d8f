"""Expanding an experiment into cells: specs × the product of the grid axes × seeds.

A cell's id is a readable prefix plus a hash of what the experiment file says about it (includes,
spec, bindings, seed), so it is the same between runs and machines.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import re
from collections.abc import Sequence
from pathlib import Path

from polgrad.errors import ConfigError
from polgrad.sweep import budget
from polgrad.sweep.budget import CellBudget
from polgrad.sweep.experiment import Experiment
from polgrad.sweep.values import gin_text


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid cell: a spec, one value per axis, a seed; everything the trainer is called with."""

    id: str
    index: int
    spec: str  # spec file as written in the experiment
    spec_name: str  # its stem: 'grpo'
    spec_path: str  # resolved path
    config_files: tuple[str, ...]  # resolved includes + spec, in order
    swept: tuple[tuple[str, str], ...]  # (binding key, gin text) of the grid values
    seed: int
    bindings: tuple[str, ...]  # imports, fixed, grid, seed: what goes to --bind, in order
    # What the dry run found the built cell never reads: (binding key, what the cell builds instead),
    # over every binding of its config (polgrad/sweep/reads.py); empty before validation.
    not_read: tuple[tuple[str, str], ...] = ()
    # What the dry run's Sweep.budget made of the cell (polgrad/sweep/budget.py: its bindings, already
    # in `bindings`, its prompts per step and how it spends a step); None before validation.
    budget: CellBudget | None = None

    @property
    def unread(self) -> tuple[str, ...]:
        """The swept binding keys this cell does not read (left out of its labels)."""
        keys = {k for k, _ in self.not_read}
        return tuple(k for k, _ in self.swept if k in keys)

    def describe(self) -> str:
        unread = set(self.unread)
        return (
            ", ".join(f"{k} = {v}" + (" (not read)" if k in unread else "") for k, v in self.swept)
            or "(no grid bindings)"
        )


def _slug(text: str) -> str:
    """A short readable form of a gin value for the cell id: @kl.k3 -> k3, 'loss' -> loss."""
    text = text.strip()
    if text.startswith("@"):
        text = text.rstrip("()").rsplit("/", 1)[-1].rsplit(".", 1)[-1]
    text = re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_.")
    return text[:12] or "x"


def cell_id(
    includes: Sequence[str], spec: str, bindings: Sequence[str], seed: int, slugs: Sequence[str]
) -> str:
    """Readable prefix + 8 hex of sha1 over (includes, spec, sorted bindings, seed): stable everywhere."""
    payload = json.dumps(
        {"includes": list(includes), "spec": spec, "bindings": sorted(bindings), "seed": seed},
        sort_keys=True,
    )
    digest = hashlib.sha1(payload.encode()).hexdigest()[:8]
    prefix = "-".join([_slug(Path(spec).stem), *slugs, f"s{seed}"])
    prefix = re.sub(r"[^A-Za-z0-9_.\-]", "_", prefix)[:48].rstrip("-_.")
    return f"{prefix}-{digest}"


# Sweep.tuning's keys that only say why (polgrad/sweep/tuning.py) and change no cell: not in the ids
TUNING_NOTES = ("at_edge",)


def _declaration(tuning):
    """Sweep.tuning without `TUNING_NOTES`: writing one changes no cell id."""
    return {k: v for k, v in tuning.items() if k not in TUNING_NOTES} if isinstance(tuning, dict) else tuning


def expand(exp: Experiment) -> list[Cell]:
    """Every cell: specs × product of the axes × seeds, in that nesting order."""
    cells: list[Cell] = []
    fixed = [b.text for b in exp.fixed]
    # A tuning stage's values are bound later (polgrad/sweep/tuning.py); its declaration is in the id
    tuned = [f"Sweep.tuning = {gin_text(_declaration(exp.tuning))}"] if exp.tuning is not None else []
    # values chosen by another experiment's tuning stage are bound at the start too: its name is in the id
    tuned += [f"Sweep.tuned_by = {gin_text(exp.tuned_by)}"] if exp.tuned_by is not None else []
    for spec, spec_path in zip(exp.specs, exp.spec_paths, strict=True):
        for combo in itertools.product(*[values for _, values in exp.axes]):
            swept: list[tuple[str, str]] = []
            for (keys, _), value in zip(exp.axes, combo, strict=True):
                parts = value if len(keys) > 1 else (value,)
                swept.extend((k, gin_text(v)) for k, v in zip(keys, parts, strict=True))
            grid = [f"{k} = {v}" for k, v in swept]
            for seed in exp.seeds:
                seed_line = f"{exp.seed_binding} = {seed}"
                cid = cell_id(
                    exp.includes, spec, [*fixed, *grid, seed_line, *tuned], seed, [_slug(v) for _, v in swept]
                )
                cells.append(
                    Cell(
                        id=cid,
                        index=len(cells),
                        spec=spec,
                        spec_name=Path(spec).stem,
                        spec_path=spec_path,
                        config_files=(*exp.include_paths, spec_path),
                        swept=tuple(swept),
                        seed=seed,
                        bindings=(*exp.imports, *fixed, *grid, seed_line),
                    )
                )
    ids = [c.id for c in cells]
    if len(set(ids)) != len(ids):  # only if two values have the same gin text, which load_experiment forbids
        raise ConfigError(f"{exp.file}: the grid expands to duplicate cells")
    return cells


def with_budget(exp: Experiment, cell: Cell, planned: CellBudget) -> Cell:
    """The cell with what Sweep.budget made of it: its bindings go after the grid values (before the
    seed) and into the id's hash, so a cell the budget configures differently is a new cell."""
    fixed = [b.text for b in exp.fixed]
    grid = [f"{k} = {v}" for k, v in cell.swept]
    seed_line = f"{exp.seed_binding} = {cell.seed}"
    cid = cell.id
    if planned.bindings:
        own = [*fixed, *grid, *planned.bindings, seed_line]
        cid = cell_id(exp.includes, cell.spec, own, cell.seed, [_slug(v) for _, v in cell.swept])
    bindings = (*exp.imports, *fixed, *grid, *planned.bindings, seed_line)
    return dataclasses.replace(cell, id=cid, bindings=bindings, budget=planned)


def format_cells(exp: Experiment, cells: Sequence[Cell]) -> str:
    sizes = " × ".join(
        [
            f"{len(exp.specs)} specs",
            *(f"{len(v)} {'/'.join(k)}" for k, v in exp.axes),
            f"{len(exp.seeds)} seeds",
        ]
    )
    lines = [f"{exp.name}: {sizes} = {len(cells)} cells"]
    if exp.processes_per_cell > 1:
        lines[0] += f", {exp.processes_per_cell} ranks each ({exp.launcher})"
    declared = budget.record(exp.budget, cells)
    if declared:
        lines.append(f"Budget ({exp.budget}): {declared['text']}")
    width = max(len(c.id) for c in cells)
    spec_w = max(len(c.spec_name) for c in cells)
    for c in cells:
        lines.append(f"{c.id:<{width}}  {c.spec_name:<{spec_w}}  seed={c.seed:<4} {c.describe()}")
    swept = set(exp.swept_columns)
    unused: dict[tuple[str, str], list[str]] = {}
    for c in cells:
        for key, why in c.not_read:
            if key not in swept:
                unused.setdefault((key, why), []).append(c.id)
    if unused:
        lines.append("Bound but not read by these cells (allowed: not swept):")
        for (key, why), ids in unused.items():
            if len(ids) == len(cells):
                which = f"all {len(cells)} cells"
            elif len(ids) <= 3:
                which = ", ".join(ids)
            else:
                specs = dict.fromkeys(c.spec_name for c in cells if c.id in set(ids))
                which = f"{len(ids)} of {len(cells)} cells ({', '.join(specs)})"
            lines.append(f"  {key}: {which}: the cell {why}")
    return "\n".join(lines)
