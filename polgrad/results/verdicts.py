"""Do an experiment's findings hold on another machine? Its md's verdicts beside another md's.

`python -m polgrad.results EXPERIMENT --compare-verdicts OTHER.md` reads the Predictions table of the
experiment's md (a rerun, e.g. the README's main command on the user's machine) and of OTHER.md, or of
the md as a commit has it (`git:HEAD`: the committed findings the rerun overwrote), side by side,
prediction by prediction. What is compared is the verdict, not the number: each md judged its own
predictions within its own Holm family, and another CPU, other warm starts or other seeds move every
number. A prediction **agrees** when both reach the same decisive verdict (confirmed, or refuted); two
verdicts that decide nothing (undecided, not confirmed) agree on nothing ("neither decides"); one
decisive and one not, or opposite ones, "no". A prediction the two declare differently (another
configuration, metric or expectation under the same claim) is not compared.

The machine line of each md names its CPU (model · ISA), commit and when its cells finished: the
table's column heads say which run is which, and a line says when both ran on the same CPU type (then
the comparison shows reproducibility, not portability). `--record FILE` appends the outcome to a CSV
(results/replications/verdicts.csv in this repository): which CPUs each experiment's verdicts have held on.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

from polgrad.errors import DataError
from polgrad.results.migrate import flat_path
from polgrad.results.provenance import _git, repo_root

HEADER = ("prediction", "configuration", "metric", "expected")
DECISIVE = ("confirmed", "refuted")
UNKNOWN_CPU = "CPU not recorded"
RECORD_COLUMNS = ("experiment", "cpu", "commit", "cells_finished", "agree", "predictions", "against")


def verdict_class(verdict: str) -> str:
    """confirmed / refuted / undecided / not confirmed / untested: the verdict's leading words (a
    significant difference inside the margin, 'confirmed and different', is confirmed)."""
    found = re.match(r"(not confirmed|confirmed|refuted|undecided|untested)", verdict)
    return found.group(1) if found else verdict


def agreement(a: str, b: str) -> str:
    """'yes' when the two verdicts are the same decisive one, 'no' when one decides and the other does
    not or decides the opposite, 'neither decides' otherwise."""
    ca, cb = verdict_class(a), verdict_class(b)
    if ca in DECISIVE and ca == cb:
        return "yes"
    if ca in DECISIVE or cb in DECISIVE:
        return "no"
    return "neither decides"


# How a sentence names the claims of each outcome but agreement (`compare`, and the replication study)
OUTCOME_WORDS = {
    "no": "decided differently",
    "neither decides": "decided in neither",
    "declared differently": "declared differently",
    "declared in one only": "declared in one only",
}


def others(counts: dict[str, list[str]]) -> str:
    """'; decided differently: a; b; decided in neither: c' for the claims of each outcome but 'yes'."""
    return "".join(f"; {what}: {'; '.join(counts[k])}" for k, what in OUTCOME_WORDS.items() if counts.get(k))


@dataclass(frozen=True)
class Prediction:
    claim: str
    configuration: str
    metric: str
    expected: str
    delta: str
    verdict: str


@dataclass(frozen=True)
class MdVerdicts:
    """What an experiment's md says: its name, the machine its rows ran on, and its predictions."""

    path: str
    experiment: str
    cpu: str
    commit: str
    cells_finished: str
    predictions: tuple[Prediction, ...]

    @property
    def label(self) -> str:
        return f"{self.cpu}, {self.commit}" if self.commit else self.cpu


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def committed_md(spec: str, md: str | Path) -> tuple[str, str]:
    """`git:REV` -> (name, text) of the md `md` as commit REV has it (`git show REV:<md>`): the committed
    findings, while the working tree holds the rerun's."""
    rev = spec.removeprefix("git:") or "HEAD"
    root = repo_root(Path(md).resolve().parent)
    if root is None:
        raise DataError(f"{spec}: {md} is not in a git checkout; give the other md's path instead")
    rel = Path(md).resolve().relative_to(root).as_posix()
    out = _git(["show", f"{rev}:{rel}"], root)
    flat = flat_path(Path(rel))  # a commit before one folder per experiment kept results/X/X.md flat
    if (out is None or out.returncode != 0) and flat is not None:
        older = _git(["show", f"{rev}:{flat.as_posix()}"], root)
        if older is not None and older.returncode == 0:
            rel, out = flat.as_posix(), older
    if out is None or out.returncode != 0:
        lines = out.stderr.decode(errors="replace").strip().splitlines() if out is not None else ["no git"]
        why = lines[-1] if lines else f"git exit status {out.returncode}"  # type: ignore[union-attr]
        raise DataError(f"{spec}: git cannot show {rev}:{rel} ({why})")
    return f"{rev}:{rel}", out.stdout.decode("utf-8", errors="replace")


def read_md(path: str | Path, text: str | None = None) -> MdVerdicts:
    """The predictions of an experiment's md (its Predictions table) and its machine line, from the file
    `path` (or from `text`, named `path`); a one-line DataError naming it when it is missing or has no
    Predictions table."""
    p = Path(path)
    if text is None:
        if not p.is_file():
            raise DataError(f"{p}: no such md (give the path of an experiment's .md, or git:REV)")
        text = p.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    title = next((ln[2:].strip() for ln in lines if ln.startswith("# ")), "")
    machine = next((ln for ln in lines if ln.startswith("Machine: ")), "")
    cpu = re.search(r" CPUs: (.*?)\) · python ", machine)  # a model name has its own "(R)"
    commit = re.search(r"· commit ([^·]+?) ·", machine)
    finished = re.search(r"· cells finished ([^·]+?) ·", machine)
    start = next((i for i, ln in enumerate(lines) if tuple(_cells(ln)[:4]) == HEADER), None)
    if start is None:
        raise DataError(
            f"{p}: no Predictions table (a row '| prediction | configuration | metric | expected | ...'); "
            "an experiment declares predictions with Sweep.predictions"
        )
    head = _cells(lines[start])
    if "verdict" not in head or not any(h.startswith("Δ") for h in head):
        raise DataError(f"{p}: the Predictions table has no Δ or verdict column: {' | '.join(head)}")
    i_delta, i_verdict = next(i for i, h in enumerate(head) if h.startswith("Δ")), head.index("verdict")
    preds = []
    for ln in lines[start + 2 :]:
        if not ln.startswith("|"):
            break
        row = _cells(ln)
        if len(row) != len(head):
            raise DataError(
                f"{p}: a Predictions row has {len(row)} cells, the header {len(head)}: {ln[:120]}"
            )
        preds.append(Prediction(*row[:4], delta=row[i_delta], verdict=row[i_verdict]))
    return MdVerdicts(
        path=str(p),
        experiment=title,
        cpu=cpu.group(1).strip() if cpu else UNKNOWN_CPU,
        commit=commit.group(1).strip() if commit else "",
        cells_finished=finished.group(1).strip() if finished else "",
        predictions=tuple(preds),
    )


@dataclass(frozen=True)
class Outcome:
    lines: list[str]
    agree: int
    disagree: int
    compared: int


def compare(this: MdVerdicts, other: MdVerdicts) -> Outcome:
    """The md lines of the side-by-side table and its sentence, and the counts."""
    mine = {p.claim: p for p in this.predictions}
    theirs = {p.claim: p for p in other.predictions}
    claims = [*mine, *(c for c in theirs if c not in mine)]
    beside = other.experiment if other.experiment != this.experiment else "another run"
    lines = [
        f"# {this.experiment}: verdicts beside {beside}",
        "",
        f"A: {this.path} ({this.label}"
        + (f", cells finished {this.cells_finished}" if this.cells_finished else "")
        + ")",
        f"B: {other.path} ({other.label}"
        + (f", cells finished {other.cells_finished}" if other.cells_finished else "")
        + ")",
        "",
        "Each md judged its own predictions (its own Holm family); verdicts are compared, not numbers. "
        "A prediction agrees when both reach the same decisive verdict (confirmed, or refuted).",
    ]
    if this.experiment != other.experiment:  # e.g. X and X_replication: the same design on other seeds
        lines.append(
            f"A is experiment {this.experiment}, B is {other.experiment}: predictions are matched by their "
            "claim, and compared only where both declare the same configuration, metric and expectation."
        )
    if this.cpu == other.cpu and this.cpu != UNKNOWN_CPU:
        lines.append(f"Both ran on the same CPU type ({this.cpu}): it does not test another CPU.")
    lines += [
        "",
        "| prediction | metric | Δ A [CI] | verdict A | Δ B [CI] | verdict B | agrees |",
        "|---|---|---|---|---|---|---|",
    ]
    counts: dict[str, list[str]] = {}
    for claim in claims:
        a, b = mine.get(claim), theirs.get(claim)
        if a is None or b is None:
            word = "declared in one only"
        elif (a.configuration, a.metric, a.expected) != (b.configuration, b.metric, b.expected):
            word = "declared differently"
        else:
            word = agreement(a.verdict, b.verdict)
        counts.setdefault(word, []).append(claim)
        metric = (a or b).metric  # type: ignore[union-attr]
        cells = [f"{x.delta} | {x.verdict}" if x else "– | (not in this md)" for x in (a, b)]
        lines.append(f"| {claim} | {metric} | {cells[0]} | {cells[1]} | {word} |")
    agree, disagree = len(counts.get("yes", [])), len(counts.get("no", []))
    lines += ["", f"Of {len(claims)} predictions, {agree} agree" + others(counts) + "."]
    return Outcome(lines=lines, agree=agree, disagree=disagree, compared=len(claims))


def record(path: str | Path, this: MdVerdicts, other: MdVerdicts, outcome: Outcome) -> None:
    """Append the comparison to the CSV `path` (its header written when new): the experiment, this md's
    CPU, commit and cell times, how many of how many predictions agree, and the md it was compared to."""
    p = Path(path)
    if not p.parent.is_dir():
        raise DataError(f"--record {p}: its folder {p.parent} does not exist; create it or give another file")
    new = not p.exists() or p.stat().st_size == 0
    if not new:
        with open(p, newline="") as fh:
            header = next(csv.reader(fh), [])
        if tuple(header) != RECORD_COLUMNS:
            raise DataError(f"{p}: its header is not {','.join(RECORD_COLUMNS)}; give another --record file")
    with open(p, "a", newline="") as fh:
        w = csv.writer(fh)
        if new:
            w.writerow(RECORD_COLUMNS)
        w.writerow(
            [
                this.experiment,
                this.cpu,
                this.commit,
                this.cells_finished,
                outcome.agree,
                outcome.compared,
                f"{other.path} ({other.label})",
            ]
        )


def main(experiment_md: str, other_md: str, record_to: str | None = None) -> int:
    """Print the comparison; 0 when no prediction is decided differently, 1 when one is. `other_md`
    `git:REV` is the experiment's own md as commit REV has it (`git:HEAD`: the committed one)."""
    this = read_md(experiment_md)
    other = (
        read_md(*committed_md(other_md, experiment_md)) if other_md.startswith("git:") else read_md(other_md)
    )
    outcome = compare(this, other)
    print("\n".join(outcome.lines))
    if record_to:
        record(record_to, this, other, outcome)
    return 1 if outcome.disagree else 0
