"""`Sweep.tuned_by = 'X'` (with no Sweep.tuning of its own): no tuning stage runs; `borrow` binds in each
configuration's evaluation cells the value experiment X's tuning stage chose for it, as recorded in
results/X/experiment.json (the same --results folder), so a replication on new seeds evaluates the
configurations at the values the original chose rather than re-tuning them (a second choice could
differ by chance, and the two experiments would then compare different things). Configurations are
matched by spec and swept bindings, in any axis order. `borrowed_record` refuses in one line when X has
no readable record, chose nothing for one of these configurations (or none of its values finished
there), tuned on one of these seeds, or borrowed its own choice; the record, with `chosen_by`, goes
into this experiment's experiment.json and md (polgrad/results/tuning.py). The tuning stage itself:
polgrad/sweep/tuning.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import PolgradError
from polgrad.results import paths
from polgrad.sweep.experiment import Experiment
from polgrad.sweep.grid import Cell, format_cells
from polgrad.sweep.tuning import _cell_config, _check_unchanged, _key, _label, _text, _with
from polgrad.sweep.values import gin_text


@dataclasses.dataclass(frozen=True)
class Borrowed:
    """Sweep.tuned_by, read: the experiment that tuned, and its record as this experiment binds it."""

    source: str
    record: dict[str, Any]  # the source's experiment.json "tuning", with "chosen_by": source


def borrowed_record(exp: Experiment, cells: Sequence[Cell], results_dir: Path) -> dict[str, Any]:
    """`exp.tuned_by`'s tuning record, checked against `exp` and its cells and cut to their
    configurations (in their order), with "chosen_by"; one PolgradError line when it cannot bind."""
    src = exp.tuned_by
    line = f"line {exp.lines['tuned_by']}: " if "tuned_by" in exp.lines else ""
    where = f"{exp.file}: {line}Sweep.tuned_by"
    meta = paths.meta_path(src, results_dir)
    try:
        source = json.loads(meta.read_text())
        record = source.get("tuning")
    except FileNotFoundError:
        raise PolgradError(
            f"{where}: {meta} does not exist: {src}'s sweep has not chosen its values yet in {results_dir} "
            f"(run it first, with the same --results), or the name is wrong"
        ) from None
    except (OSError, ValueError, AttributeError) as e:
        raise PolgradError(
            f"{where}: cannot read {meta} ({e}): re-run {src}'s sweep, which rewrites it"
        ) from None
    again = f"python -m polgrad.sweep {source.get('file') or src + '.gin'} --results {results_dir}"
    if not isinstance(record, dict) or not record.get("configurations"):
        raise PolgradError(
            f"{where}: {meta} records no tuning choice: {src} has no tuning stage (Sweep.tuning), so there "
            "is nothing to bind; tune here with Sweep.tuning instead"
        )
    if record.get("chosen_by"):  # a choice that was itself borrowed: name where it was made
        raise PolgradError(
            f"{where}: {src} did not tune: its values come from {record['chosen_by']}; name that one"
        )
    try:
        chosen = {_key(c["config"]): c for c in record["configurations"]}
        if not all(isinstance(c["chosen"], dict) for c in chosen.values()):
            raise TypeError("a choice is not a dict")
    except (KeyError, TypeError, ValueError, AttributeError):
        raise PolgradError(
            f"{where}: {meta}'s tuning record is malformed (a configuration without 'config' or 'chosen'); "
            f"re-run {again}, which rewrites it"
        ) from None
    both = sorted(set(record.get("seeds", [])) & set(exp.seeds))
    if both:
        raise PolgradError(
            f"{where}: {src} tuned on seed{'s' if len(both) > 1 else ''} {', '.join(map(str, both))}, which "
            f"this experiment evaluates (Sweep.seeds = {gin_text(exp.seeds)}): values tuned on the seeds "
            "they are evaluated on flatter them; evaluate on other seeds"
        )
    mine = list(dict.fromkeys(_cell_config(c) for c in cells))
    missing = [_label(k) for k in mine if _key(k) not in chosen]
    if missing:
        raise PolgradError(
            f"{where}: {src}'s tuning stage chose nothing for {len(missing)} of this experiment's "
            f"{len(mine)} configurations: {', '.join(missing)} (it chose for: "
            f"{', '.join(_label(tuple(c['config'].items())) for c in chosen.values())}); declare the "
            "specs and grid it tuned, or tune here with Sweep.tuning"
        )
    failed = [k for k in mine if chosen[_key(k)].get("note")]
    if failed:
        raise PolgradError(
            f"{where}: {src}'s tuning stage made no choice for {', '.join(map(_label, failed))} "
            f"({chosen[_key(failed[0])]['note']}); run its failed tuning cells again "
            f"({again} --restart-failed) until a value finishes ok on every tuning seed"
        )
    return {**record, "chosen_by": src, "configurations": [chosen[_key(k)] for k in mine]}


def borrow(
    exp: Experiment, cells: Sequence[Cell], results_dir: Path, restart: Sequence[str] = ()
) -> tuple[Experiment, list[Cell]]:
    """The evaluation cells with the values `exp.tuned_by`'s tuning stage chose for their configuration
    bound (before the seed), read from its experiment.json (`borrowed_record`); `restart`: evaluation
    cells about to start over, which may take a changed choice."""
    record = borrowed_record(exp, cells, results_dir)
    values = {_key(c["config"]): c["chosen"] for c in record["configurations"]}
    _check_unchanged(
        exp,
        [c for c in cells if c.id not in restart],
        {tuple(c["config"].items()): c["chosen"] for c in record["configurations"]},
        results_dir,
        f"Sweep.tuned_by: {exp.tuned_by}'s record ({paths.meta_path(exp.tuned_by, results_dir)})",
    )
    out = [
        dataclasses.replace(
            c,
            bindings=_with(
                c,
                [f"{k} = {v}" for k, v in values[_key(_cell_config(c))].items()],
                exp.seed_binding,
                c.seed,
            ),
        )
        for c in cells
    ]
    return dataclasses.replace(exp, tuning=Borrowed(exp.tuned_by, record)), out


def format_stages(exp: Experiment, cells: Sequence[Cell], results_dir: str | Path = "results") -> str:
    """--dry-run: the evaluation cells and the values they would bind, or why not yet."""
    try:
        record = borrowed_record(exp, cells, Path(results_dir))
        bound = "; ".join(
            f"{_label(tuple(c['config'].items()))}: {_text(c['chosen'])}" for c in record["configurations"]
        )
    except PolgradError as e:  # said, not raised: a dry run checks the file, not the results
        bound = f"not yet: the sweep would refuse: {str(e).split('Sweep.tuned_by: ', 1)[-1]}"
    return "\n".join(
        [
            format_cells(exp, cells),
            f"The evaluation cells' tuned bindings come from {exp.tuned_by}'s tuning stage, not "
            f"re-tuned ({paths.meta_path(exp.tuned_by, results_dir)}): {bound}",
        ]
    )
