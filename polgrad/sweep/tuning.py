"""The tuning stage of a sweep: each configuration's learning rate (and β where it has a KL term)
chosen on tuning seeds, then bound in its evaluation cells (Henderson et al. 2018, "Deep RL that Matters").

    Sweep.seeds = [0, 1, 2, 3, 4]
    Sweep.tuning = {'seeds': [100, 101, 102],
                    'grid': {'train.lr': [3e-5, 1e-4, 3e-4], 'Algorithm.kl_coef': [0.01, 0.1]}}

`declared` checks the declaration: 'seeds' (ints) disjoint from `Sweep.seeds`, 'grid' axes as in
`Sweep.grid` (zipped axes too) on bindings no `Sweep.grid` axis varies. `plan` expands stage 1: every
configuration of the evaluation (spec + swept bindings) × the tuning grid × the tuning seeds, as an
experiment of its own, `<name>_tuning` (its folder inside the experiment's:
results/<name>/<name>_tuning/; the sweep's own lock, skip and resume). An axis is tuned only in the
configurations that read its bindings (the dry run's reads, polgrad/sweep/reads.py: `Algorithm.kl_coef`
is not read when `Algorithm.kl = None`); there its first value stands, marked not read. `bind` makes
stage 2: per configuration, the grid value with the best mean tuning metric over the tuning seeds
(optional 'metric', default the primary metric, and 'higher_is_better', default `Sweep.higher_is_better`
for the primary metric and True for another: a KL-primary experiment tunes by accuracy, not by the
learning rate that moves least; ties: the first declared; a value with an unstable or failed tuning run
ranks last) is bound in that configuration's evaluation cells, and experiment.json records the choice
(`Plan.record`; the md's Tuning section, polgrad/results/tuning.py). The choice is a function of the
tuning CSV, whose finished cells a re-run skips; an evaluation cell's id hashes the declaration, so a new
grid makes new cells, and a choice that changed under evaluation runs already started is refused in one
line. A choice at an edge of a numeric axis of 3 or more values blocks the evaluation (`check_edges`)
unless the optional 'at_edge' says why it may stand (not in the cell ids: grid.TUNING_NOTES).

`Sweep.tuned_by = 'X'` binds the choice of another experiment's tuning stage instead:
polgrad/sweep/borrow.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.checks import is_int
from polgrad.errors import PolgradError, did_you_mean
from polgrad.results import paths
from polgrad.results.tuning import edges as grid_edges
from polgrad.sweep.axes import _fail, _firsts, _read_grid
from polgrad.sweep.experiment import Experiment
from polgrad.sweep.grid import Cell, _slug, cell_id, format_cells
from polgrad.sweep.validation import validate
from polgrad.sweep.values import gin_text

KEYS = ("seeds", "grid")  # required
OPTIONAL = ("metric", "higher_is_better", "at_edge")  # the choice's metric and direction (default: the
# primary's); why a choice at an edge of the grid may stand (else it blocks the evaluation: `check_edges`)


@dataclasses.dataclass(frozen=True)
class Declared:
    """Sweep.tuning, checked."""

    seeds: list[int]
    axes: list[tuple[tuple[str, ...], list[Any]]]
    metric: str  # the choice ranks the grid values by their mean of this over the tuning seeds
    higher_is_better: bool
    at_edge: str = ""  # why a choice at an edge of the grid may stand ('': it blocks the evaluation)

    @property
    def keys(self) -> list[str]:
        return [k for keys, _ in self.axes for k in keys]


@dataclasses.dataclass(frozen=True)
class Group:
    """One configuration's tuning: its cells per grid value, in declared order."""

    config: tuple[tuple[str, str], ...]  # ('spec', name), then its swept bindings
    tuned: list[str]  # the binding keys tuned here (the configuration reads them)
    values: list[tuple[tuple[tuple[str, str], ...], list[str]]]  # (tuned bindings, tuning cell ids)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The tuning stage of an experiment: its own experiment and cells, and after it ran, the choice."""

    declared: Declared
    experiment: Experiment  # <name>_tuning
    cells: list[Cell]
    groups: list[Group]
    record: dict[str, Any] | None = None  # experiment.json's "tuning", once chosen


def declared(exp: Experiment) -> Declared | None:
    """Sweep.tuning checked against the experiment; one ConfigError line naming the file if wrong."""
    value = exp.tuning
    if value is None:
        return None
    where = f"line {exp.lines['tuning']}: Sweep.tuning" if "tuning" in exp.lines else "Sweep.tuning"
    example = "e.g. {'seeds': [100, 101, 102], 'grid': {'train.lr': [3e-5, 1e-4, 3e-4]}}"
    if not isinstance(value, dict) or set(value) - {*KEYS, *OPTIONAL} or not set(KEYS) <= set(value):
        raise _fail(
            exp.file,
            where,
            f"must be a dict with the keys {', '.join(map(repr, KEYS))} (optional: "
            f"{', '.join(map(repr, OPTIONAL))}), {example}",
        )
    metric = value.get("metric", exp.primary_metric)
    if metric not in _results.OUTCOME_METRICS:
        raise _fail(
            exp.file,
            f"{where}['metric']",
            f"unknown metric {gin_text(metric)}; valid: {', '.join(_results.OUTCOME_METRICS)}"
            + did_you_mean(str(metric), _results.OUTCOME_METRICS),
        )
    higher = value.get("higher_is_better", exp.higher_is_better if metric == exp.primary_metric else True)
    if not isinstance(higher, bool):
        raise _fail(exp.file, f"{where}['higher_is_better']", "must be True or False")
    at_edge = value.get("at_edge", "")
    if not isinstance(at_edge, str) or ("at_edge" in value and not at_edge.strip()):
        raise _fail(
            exp.file,
            f"{where}['at_edge']",
            "must be a sentence saying why a choice at an edge of the grid may stand, got "
            + gin_text(at_edge),
        )
    seeds = value["seeds"]
    if (
        not isinstance(seeds, (list, tuple))
        or not seeds
        or not all(is_int(s) for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise _fail(exp.file, f"{where}['seeds']", f"must be a list of distinct ints, got {gin_text(seeds)}")
    both = [s for s in seeds if s in exp.seeds]
    if both:
        raise _fail(
            exp.file,
            f"{where}['seeds']",
            f"seed{'s' if len(both) > 1 else ''} {', '.join(map(str, both))} also evaluate "
            f"(Sweep.seeds = {gin_text(exp.seeds)}): values tuned on the seeds they are evaluated on "
            "flatter them; use tuning seeds outside Sweep.seeds, e.g. [100, 101, 102]",
        )
    if not isinstance(value["grid"], dict) or not value["grid"]:
        raise _fail(exp.file, f"{where}['grid']", f"must be a non-empty dict of axes, {example}")
    axes = _read_grid(exp.file, value, value.get, lambda _: f"{where}['grid']", exp.seed_binding)
    swept = [k for k in (k for keys, _ in axes for k in keys) if k in exp.swept_columns]
    if swept:
        raise _fail(
            exp.file, f"{where}['grid']", f"'{swept[0]}' is also a Sweep.grid axis: tune it or sweep it"
        )
    return Declared(list(seeds), axes, metric, higher, at_edge.strip())


def plan(exp: Experiment, decl: Declared | None, cells: Sequence[Cell], train_module: str):
    """(exp with `tuning` = its Plan, the evaluation cells) after expanding and validating stage 1.

    `cells` are the validated evaluation cells, asked about the tuning keys (`validate(..., ask=)`)."""
    if decl is None:
        return exp, list(cells)
    asked = set(decl.keys)
    configs: dict[tuple, Cell] = {}
    for c in cells:
        configs.setdefault((c.spec, c.swept), c)
    fixed = [b.text for b in exp.fixed]
    out: list[Cell] = []
    groups: list[Group] = []
    for (spec, swept), first in configs.items():
        unread = {k for k, _ in first.not_read}
        acts = [not unread & set(keys) for keys, _ in decl.axes]
        group = Group(
            (("spec", first.spec_name), *swept),
            [k for a, (ks, _) in zip(acts, decl.axes, strict=True) for k in ks if a],
            [],
        )
        for combo in itertools.product(
            *[vals if a else vals[:1] for a, (_, vals) in zip(acts, decl.axes, strict=True)]
        ):
            tuned = [
                (k, gin_text(v))
                for (keys, _), value in zip(decl.axes, combo, strict=True)
                for k, v in zip(keys, value if len(keys) > 1 else (value,), strict=True)
            ]
            grid = [f"{k} = {v}" for k, v in (*swept, *tuned)]
            ids = []
            for seed in decl.seeds:
                seed_line = f"{exp.seed_binding} = {seed}"
                slugs = [_slug(v) for _, v in (*swept, *tuned)]
                cid = cell_id(exp.includes, spec, [*fixed, *grid, seed_line], seed, slugs)
                ids.append(cid)
                out.append(
                    dataclasses.replace(
                        first,
                        id=cid,
                        index=len(out),
                        swept=(*swept, *tuned),
                        seed=seed,
                        bindings=_with(first, [f"{k} = {v}" for k, v in tuned], exp.seed_binding, seed),
                        not_read=(),
                    )
                )
            group.values.append((tuple((k, v) for k, v in tuned if k in group.tuned), ids))
        groups.append(group)
    first_values = {k: gin_text(v) for keys, vals in decl.axes for k, v in _firsts(keys, vals)}
    t_exp = dataclasses.replace(
        exp,
        name=f"{exp.name}{paths.TUNING}",
        axes=[*exp.axes, *decl.axes],
        seeds=list(decl.seeds),
        baseline={**exp.baseline, **first_values},
        predictions=[],
        question=f"Tuning stage of {exp.name}: which value of {', '.join(decl.keys)} does each configuration "
        f"do best with on the tuning seeds? (the evaluation binds it: ../{exp.name}.md, 'Tuning')",
        tuning=None,
        studies=[],  # a study reads the evaluation's runs, not the tuning grid's
        pilot_gate=None,  # the gate stands before the evaluation cells, not the tuning stage's
    )
    t_cells = validate(t_exp, out, train_module)
    # Sweep.budget's bindings go into a validated cell's id (grid.with_budget): the groups must name the
    # cells that run, else the choice finds none of their rows and falls back to the first value
    renamed = {before.id: after.id for before, after in zip(out, t_cells, strict=True)}
    for g in groups:
        g.values[:] = [(tuned, [renamed[i] for i in ids]) for tuned, ids in g.values]
    evaluation = [
        dataclasses.replace(c, not_read=tuple((k, w) for k, w in c.not_read if k not in asked)) for c in cells
    ]
    return dataclasses.replace(exp, tuning=Plan(decl, t_exp, t_cells, groups)), evaluation


def _score(rows: dict[str, dict[str, str]], ids: Sequence[str], metric: str) -> tuple[float | None, int]:
    """(mean over the tuning seeds, or None when a run is not ok or has no value; the ok runs)."""
    got = []
    for cid in ids:
        row = rows.get(cid) or {}
        try:
            v = float(row.get(metric) or "nan") if row.get("status") == "ok" else math.nan
        except ValueError:
            v = math.nan
        if math.isfinite(v):
            got.append(v)
    return (sum(got) / len(got) if len(got) == len(ids) else None), len(got)


def choose(exp: Experiment, rows: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The choice per configuration from the tuning CSV's rows (by cell id), as experiment.json records it."""
    p: Plan = exp.tuning
    metric, higher = p.declared.metric, p.declared.higher_is_better
    sign = 1.0 if higher else -1.0
    configurations = []
    for g in p.groups:
        scored = [(dict(tuned), *_score(rows, ids, metric), len(ids)) for tuned, ids in g.values]
        best = None
        for i, (_, mean, _, _) in enumerate(scored):  # strictly better only: ties keep the first
            if mean is not None and (best is None or sign * mean > sign * scored[best][1]):
                best = i
        configurations.append(
            {
                "config": dict(g.config),
                "tuned": g.tuned,
                "chosen": scored[best if best is not None else 0][0],
                "note": "" if best is not None else "no value finished ok on every tuning seed: the first",
                "values": [{"values": v, "mean": m, "n_ok": k, "n": n} for v, m, k, n in scored],
            }
        )
    return {
        "experiment": p.experiment.name,
        "metric": metric,
        "higher_is_better": higher,
        "seeds": p.declared.seeds,
        "grid": {", ".join(keys): [gin_text(v) for v in vals] for keys, vals in p.declared.axes},
        "configurations": configurations,
        **({"at_edge": p.declared.at_edge} if p.declared.at_edge else {}),
    }


def check_edges(exp: Experiment) -> None:
    """Refuse the evaluation when a configuration chose a value at an edge of a numeric grid axis (its
    best may lie beyond the grid) and Sweep.tuning's 'at_edge' does not say why that may stand. A
    configuration none of whose values finished took the first value by default (its `note`): that is
    a failed tuning stage, which the tuning report names, not an edge choice."""
    p: Plan = exp.tuning
    if p.declared.at_edge or p.record is None:
        return
    at = [
        f"{_label(tuple(c['config'].items()))} ({'; '.join(e)})"
        for c in p.record["configurations"]
        if not c.get("note") and (e := grid_edges(p.record["grid"], c["chosen"]))
    ]
    if at:
        where = f"line {exp.lines['tuning']}: Sweep.tuning" if "tuning" in exp.lines else "Sweep.tuning"
        raise PolgradError(
            f"{exp.file}: {where}: the tuning stage chose a value at an edge of its grid for {len(at)} of "
            f"{len(p.record['configurations'])} configurations: {', '.join(at)}; its best may lie beyond the "
            "grid: extend 'grid' past that edge (the finished tuning cells are kept), or add 'at_edge': "
            "'why the edge may stand' to Sweep.tuning"
        )


def bind(
    exp: Experiment, cells: Sequence[Cell], results_dir: Path, restart: Sequence[str] = ()
) -> tuple[Experiment, list[Cell]]:
    """Stage 2: the evaluation cells with their configuration's chosen values bound (before the seed);
    `restart`: evaluation cells about to start over, which may take a new choice."""
    p: Plan = exp.tuning
    rows = {
        r.get("cell_id", ""): r
        for r in _results.read_rows(
            paths.csv_path(p.experiment.name, paths.stage_results(exp.name, results_dir))
        )
    }
    record = choose(exp, rows)
    chosen = {tuple(c["config"].items()): c["chosen"] for c in record["configurations"]}
    _check_unchanged(exp, [c for c in cells if c.id not in restart], chosen, results_dir)
    out = []
    for c in cells:
        tuned = [f"{k} = {v}" for k, v in chosen[_cell_config(c)].items()]
        out.append(dataclasses.replace(c, bindings=_with(c, tuned, exp.seed_binding, c.seed)))
    return dataclasses.replace(exp, tuning=dataclasses.replace(p, record=record)), out


def _key(config) -> tuple[str, frozenset]:
    """A configuration as (spec, its swept bindings as a set), from a record's "config" dict or a
    cell's (('spec', name), *swept) tuple: two experiments that declare the same axes in another
    order name the same configurations."""
    items = list(config.items() if isinstance(config, dict) else config)
    return str(dict(items).get("spec", "")), frozenset((k, v) for k, v in items if k != "spec")


def _cell_config(c: Cell) -> tuple[tuple[str, str], ...]:
    return (("spec", c.spec_name), *c.swept)


def _with(cell: Cell, tuned: Sequence[str], seed_binding: str, seed: int) -> tuple[str, ...]:
    """The cell's bindings but its seed's, the tuned ones, then `seed` (later wins in gin): whatever
    else the evaluation cell binds, its tuning cells and its tuned self bind too."""
    own = f"{seed_binding} = {cell.seed}"
    return (*(b for b in cell.bindings if b != own), *tuned, f"{seed_binding} = {seed}")


def _check_unchanged(
    exp: Experiment, cells: Sequence[Cell], chosen: dict, results_dir: Path, whose: str = "the tuning stage"
) -> None:
    """Refuse a choice that differs from the one the configuration's started evaluation cells ran with
    (`chosen`: by `_key`); `whose` names where the choice is made in the line."""
    try:
        before = json.loads(paths.meta_path(exp.name, results_dir).read_text()).get("tuning") or {}
    except (OSError, ValueError):
        return
    chosen = {_key(k): v for k, v in chosen.items()}
    for c in before.get("configurations", []):
        key = _key(c["config"])
        if key not in chosen or chosen[key] == c["chosen"]:
            continue
        started = [x.id for x in cells if _key(_cell_config(x)) == key]
        started = [i for i in started if (paths.runs_dir(exp.name, results_dir) / i).exists()]
        if started:
            raise PolgradError(
                f"{exp.file}: {whose} now chooses {_text(chosen[key])} for "
                f"{_label(tuple(c['config'].items()))} (its evaluation cells ran with {_text(c['chosen'])}: "
                f"the tuning results changed since); start them over with --restart {' '.join(started)}"
            )


def _text(values: dict[str, str]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in values.items()) or "no tuned binding"


def _label(config: tuple) -> str:
    return " · ".join([config[0][1], *(f"{k}={v}" for k, v in config[1:])])


def format_stages(exp: Experiment, cells: Sequence[Cell]) -> str:
    """--dry-run: the tuning cells, then the evaluation cells and where their tuned values come from."""
    p = exp.tuning
    if not isinstance(p, Plan):
        return format_cells(exp, cells)
    untuned = [
        f"{k} in {', '.join(names)}"
        for k in p.declared.keys
        if (names := [_label(g.config) for g in p.groups if k not in g.tuned])
    ]
    return "\n".join(
        [
            f"stage 1, tuning: {p.experiment.name}: {len(p.groups)} configurations × the values of "
            f"{', '.join(p.declared.keys)} each reads × {len(p.declared.seeds)} tuning seeds = "
            f"{len(p.cells)} cells",
            *format_cells(p.experiment, p.cells).splitlines()[1:],
            "",
            "stage 2, evaluation: " + format_cells(exp, cells),
            f"The evaluation cells' {', '.join(p.declared.keys)} come from tuning: per configuration, the "
            f"value with the {'highest' if p.declared.higher_is_better else 'lowest'} mean "
            f"{p.declared.metric} over the tuning seeds "
            f"{gin_text(p.declared.seeds)} (results/{exp.name}/{p.experiment.name}/{p.experiment.name}.csv)"
            + (f"; not tuned where not read: {'; '.join(untuned)}" if untuned else ""),
        ]
    )
