"""The report of one experiment: its md (`markdown`: the header, the overview, the ranked table of
polgrad.results.ranking, the statistical sections of polgrad.results.findings) and `write_report`,
which rewrites results/<experiment>/<experiment>.md and its figures (polgrad.results.figures) from the
CSV."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import DataError
from polgrad.io import atomic_write_text
from polgrad.results import gate, paths
from polgrad.results.figures import FIGURES_JSON, curves_path, plot
from polgrad.results.findings import sections
from polgrad.results.header import header
from polgrad.results.provenance import TUNING, portable_command, repo_root
from polgrad.results.ranking import UNSTABLE, cell_lists, leaderboard, ranking_lines
from polgrad.results.store import csv_path, read_rows, unread_columns
from polgrad.results.studies import Study
from polgrad.results.studies import load as load_studies
from polgrad.results.tuning import edge_count
from polgrad.results.tuning import section as tuning_section

# The md's budget line of a sweep that declared none (Sweep.budget; experiment.json without "budget").
NO_BUDGET = (
    "none declared (Sweep.budget) when these cells ran: nothing made the configurations sample the same "
    "number of sequences per step, so a difference between them may be one of sample budget, not method."
)


def markdown(
    experiment: str,
    rows: Sequence[dict[str, str]],
    *,
    swept_columns: Sequence[str],
    primary_metric: str,
    higher_is_better: bool = True,
    command: str = "",
    stale_rows: int = 0,
    missing_cells: tuple[int, int] = (0, 0),
    baseline: dict[str, str] | None = None,
    question: str = "",
    predictions: Sequence[dict[str, Any]] = (),
    figures: Sequence[str] = (),
    tuning: dict[str, Any] | None = None,
    budget: str = "",
    study_sections: Sequence[tuple[Study, Sequence[str]]] = (),
    companions: Sequence[tuple[str, str]] = (),
    pilot_gate: dict[str, Any] | None = None,
) -> str:
    """The leaderboard of `experiment` as markdown: a header (machine, versions, command), one line per
    design of warm starts (polgrad.results.warm_starts), one line per
    group (spec + swept bindings) with mean ± 95% CI per metric, its world size and ZeRO stage, and the
    group's Table-5 columns (read
    from the rows' table5_* columns, "n/a" where they have none), the paired comparisons with the
    leader and with the `baseline` (column -> value text) and the findings they support
    (polgrad.results.findings), and the failed cells. `study_sections` ((study, its section's lines))
    come from the experiment's studies (polgrad/results/studies.py): each non-empty section goes before
    the findings, in order, its last line also opens them, and a study may restate the md's own answer
    (several restatements are joined in order). `companions` ((md file name, its
    Answer)) are the experiment's own analyses of the same runs; the Answer quotes theirs after its
    own."""
    group_columns = ["spec", *swept_columns]
    board = leaderboard(rows, group_columns, primary_metric, higher_is_better)
    unread = unread_columns(rows, group_columns)

    def label(key) -> str:
        return _group_label(dict(zip(group_columns, key, strict=True)), swept_columns, unread.get(tuple(key)))

    def key_of(config: dict[str, str] | None):
        return next(
            (
                tuple(e["group"][c] for c in group_columns)
                for e in board
                if config and all(e["group"].get(c) == str(v) for c, v in config.items())
            ),
            None,
        )

    base_key = key_of(baseline)
    preds = [
        (p["claim"], key_of(p["config"]), p["metric"], p["expected"], p.get("margin")) for p in predictions
    ]
    tuned = {key_of(c["config"]): c.get("chosen") or {} for c in (tuning or {}).get("configurations", [])}
    stats_lines, best_key, starred = sections(
        rows,
        group_columns,
        label,
        primary=primary_metric,
        higher_is_better=higher_is_better,
        baseline=base_key,
        predictions=preds,
        tuned={k: v for k, v in tuned.items() if k is not None},
        n_at_edge=edge_count(tuning),
        warm_start=not experiment.endswith(TUNING),  # a tuning grid's 3-seed cells: no verdict to give
    )
    lines = header(experiment, rows, question=question, command=command, budget=budget)
    lines += _overview(rows, len(board), primary_metric, higher_is_better, figures, missing_cells, stale_rows)
    lines += ranking_lines(
        rows, board, swept_columns, primary_metric, unread, label, best_key if starred else None
    )
    if baseline and base_key is None:
        lines += ["", f"(The baseline {baseline} matches no configuration with finished cells.)"]
    lines += tuning_section(tuning)  # the values a tuning stage chose (polgrad/results/tuning.py)
    lines += gate.section(pilot_gate)  # what the pilot had to show (polgrad/results/gate.py)
    shown = [(study, list(section)) for study, section in study_sections if section]
    if shown:  # e.g. X and X_replication side by side (studies/replication.py)
        # before the findings; each last line, a summary, also opens them (the answer stays last)
        at = stats_lines.index("## Findings") - 1
        head, tail = stats_lines[:at], stats_lines[at + 3 :]
        body = [line for k, (_, section) in enumerate(shown) for line in ([""] if k else []) + section]
        opens = [f"- {study.title}: {section[-1]}" for study, section in shown]
        stats_lines = [*head, *body, "", "## Findings", "", *opens, *tail]
        own = stats_lines[-1].removeprefix("- **Answer.** ")  # each study restates the md's own answer
        restated = [
            a for study, section in shown if study.answer and (a := study.answer(experiment, own, section))
        ]
        if restated:
            stats_lines[-1] = f"- **Answer.** {' '.join(restated)}"
    for name, answer in companions:  # the answer stays the last line of the findings
        stats_lines[-1] += f" By its own declared method, [{name}]({name}) answers: {answer}"
    lines += stats_lines
    lines += cell_lists(rows)
    return "\n".join(lines) + "\n"


def _overview(
    rows: Sequence[dict[str, str]],
    n_groups: int,
    primary_metric: str,
    higher_is_better: bool,
    figures: Sequence[str],
    missing_cells: tuple[int, int],
    stale_rows: int,
) -> list[str]:
    """How many cells finished, how the table is sorted and read, the figures, what the CSV lacks."""
    direction = "higher is better" if higher_is_better else "lower is better"
    word = "higher" if higher_is_better else "lower"
    n_ok = sum(r.get("status") == "ok" for r in rows)
    n_unstable = sum(r.get("status") == UNSTABLE for r in rows)
    lines = [
        f"{len(rows)} cells ({n_ok} finished, "
        + (f"{n_unstable} unstable: listed below, not ranked, " if n_unstable else "")
        + f"{len(rows) - n_ok - n_unstable} failed) in {n_groups} groups (spec + swept "
        f"bindings). Sorted by **{primary_metric}** ({direction}); ★ marks a group significantly {word} in "
        f"{primary_metric} than every other one (paired by seed, Holm-corrected: see below), so no group has "
        f"★ when no configuration is significantly {word} than every other. Each value is "
        "the mean over seeds ± the half-width of its 95% confidence interval (Student t, n−1 degrees of "
        "freedom); `(n=1)` means a single seed, so no interval.",
    ]
    if figures:
        lines += [
            "",
            "Figures: the paired differences to the baseline with their 95% CIs (the numbers of the table "
            '"Paired differences to the baseline" below), then each configuration\'s learning curves against '
            "the baseline.",
            "",
            *(f"![{Path(f).stem}]({f})" for f in figures),
        ]
    if missing_cells[0]:
        lines += [
            "",
            f"**Incomplete.** {missing_cells[0]} of the experiment's {missing_cells[1]} cells have no row in "
            "the CSV (not run yet, running, or their rows lost): the tables and statistics below cover the "
            "others only. Re-run the sweep to run them.",
        ]
    if stale_rows:
        lines += [
            "",
            f"({stale_rows} rows of the CSV belong to cells no longer in the experiment file; "
            "they are left out here.)",
        ]
    return lines


def _group_label(group: dict[str, str], swept_columns: Sequence[str], unread: set[str] | None = None) -> str:
    """'spec · binding=value · ...' over the swept bindings the group's cells read."""
    parts = [group["spec"]]
    for c in swept_columns:
        if c not in (unread or ()):
            parts.append(f"{c.split('/')[-1]}={group[c]}")
    return " · ".join(parts)


def _portable(command: str, results_dir: str | os.PathLike) -> str:
    """A recorded command without a machine's folders (a record written before the sweep did this),
    paths inside the checkout that holds `results_dir` relative to it."""
    try:
        return portable_command(shlex.split(command), repo_root(Path(results_dir).resolve()))
    except ValueError:  # unbalanced quotes: shown as recorded
        return command


def experiment_meta(experiment: str, results_dir: str | os.PathLike = "results") -> dict[str, Any]:
    path = paths.meta_path(experiment, results_dir)
    if not path.exists():
        raise DataError(f"no sweep metadata for '{experiment}': {path} does not exist (run the sweep first)")
    return json.loads(path.read_text())


def companions(
    experiment: str, results_dir: str | os.PathLike = "results", suffixes: Sequence[str] = ()
) -> list[tuple[str, str]]:
    """(file name, its Answer sentence) of each analysis md of `experiment`'s own runs beside its md in
    its folder: <experiment><suffix>.md for each of `suffixes` (its studies' `answers`: e.g.
    overoptimization_gao.md, written by studies/overoptimization from the same CSV) that has a line
    starting "**Answer.**". By exact name, so a pilot's (X_pilot_gao.md), a replication's or another
    experiment's with a longer name is never quoted."""
    found = []
    for suffix in suffixes:
        md = paths.output(experiment, results_dir, f"{suffix}.md")
        if not md.is_file():
            continue
        answers = [
            line.strip().removeprefix("- ").removeprefix("**Answer.** ")
            for line in md.read_text().splitlines()
            if line.strip().removeprefix("- ").startswith("**Answer.**")
        ]
        if answers:
            found.append((md.name, answers[-1]))
    return found


def write_report(experiment: str, results_dir: str | os.PathLike = "results") -> tuple[Path, Path]:
    """Write <experiment>.md, .png (forest plot) and _curves.png (learning curves) in the experiment's
    folder (polgrad/results/paths.py) from the
    CSV, the sweep's experiment.json and the run folders; return the md's and the forest plot's paths."""
    meta = experiment_meta(experiment, results_dir)
    studies = load_studies(
        meta.get("studies", ()),
        f"{paths.meta_path(experiment, results_dir)}: studies",
        lambda: repo_root(Path(results_dir).resolve()),
    )
    path = csv_path(experiment, results_dir)
    if not path.exists():
        raise DataError(f"no results for experiment '{experiment}': {path} does not exist")
    all_rows = read_rows(path)
    current = {c["id"] for c in meta["cells"]}
    rows = [r for r in all_rows if r.get("cell_id") in current]
    png_path = paths.png_path(experiment, results_dir)
    md = markdown(
        experiment,
        rows,
        swept_columns=meta["swept_columns"],
        primary_metric=meta["primary_metric"],
        higher_is_better=meta.get("higher_is_better", True),
        command=_portable(meta.get("command", ""), results_dir),
        stale_rows=len(all_rows) - len(rows),
        missing_cells=(len(current - {r.get("cell_id") for r in rows}), len(current)),
        baseline=meta.get("baseline"),
        question=meta.get("question", ""),
        predictions=meta.get("predictions", ()),
        figures=(png_path.name, curves_path(png_path).name),
        tuning=meta.get("tuning"),
        budget=(meta.get("budget") or {}).get("text") or NO_BUDGET,
        study_sections=[(s, s.section(experiment, results_dir)) for s in studies if s.section],
        companions=companions(experiment, results_dir, [x for s in studies for x in s.answers]),
        pilot_gate=meta.get("pilot_gate"),
    )
    md_path = paths.md_path(experiment, results_dir)
    atomic_write_text(md_path, md)
    figs = plot(
        png_path,
        experiment,
        rows,
        swept_columns=meta["swept_columns"],
        results_dir=results_dir,
        primary_metric=meta["primary_metric"],
        higher_is_better=meta.get("higher_is_better", True),
        baseline=meta.get("baseline"),
        cells=meta["cells"],
        predictions=meta.get("predictions", ()),
    )
    drawn = paths.folder(experiment, results_dir) / FIGURES_JSON
    try:  # a hand-edited or torn figures.json is rewritten, not trusted
        previous = json.loads(drawn.read_text()) if drawn.is_file() else None
    except (OSError, ValueError):
        previous = None
    previous = previous if isinstance(previous, dict) else None
    atomic_write_text(drawn, json.dumps(figs.drawn(previous), indent=1, sort_keys=True) + "\n")
    return md_path, png_path
