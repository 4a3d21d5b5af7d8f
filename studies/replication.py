"""Study: an experiment and its replication side by side: X and X_replication, the same design on
disjoint seeds (hence other warm starts), e.g. experiments/kl_ablation_replication.gin. Both experiment
files name it (`Sweep.studies = ['studies.replication']`; polgrad/results/studies.py).

Each md of the pair gets a section "Replication" with, per declared prediction, the verdict and the
paired difference to the baseline [CI] in each experiment (each judged within its own experiment's
Holm family, as its own Predictions section does) and whether it replicates: the same decisive verdict
(confirmed, or refuted) in both. Two verdicts that decide nothing (undecided, not confirmed) are
"decided in neither", not agreement. A prediction declared differently in the two (another
configuration, metric or margin under the same claim), or in one only, is said so, as are different
baselines, swept columns, primary metric or budget. It ends with one sentence saying which replicate.
The section needs both CSVs and both experiment.json files; when the partner has not run, the md of a
replication says so in one line, and the original's has no section.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from polgrad.results.compare import Comparison, against
from polgrad.results.findings import kl_metric
from polgrad.results.paths import csv_path, meta_path
from polgrad.results.predictions import NO_DIFFERENCE, judge, prediction_delta
from polgrad.results.predictions import delta_text as _delta
from polgrad.results.store import read_rows
from polgrad.results.studies import Study
from polgrad.results.verdicts import agreement, others

SUFFIX = "_replication"


def partner(experiment: str) -> str:
    """The other experiment of the pair: X_replication for X, X for X_replication."""
    return experiment.removesuffix(SUFFIX) if experiment.endswith(SUFFIX) else experiment + SUFFIX


def _meta(experiment: str, results_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = meta_path(experiment, results_dir)
    return json.loads(path.read_text()) if path.is_file() else None


def verdicts(rows: Sequence[dict[str, str]], meta: dict[str, Any]) -> list[tuple[str, str, str, int, str]]:
    """(claim, metric, Δ [CI] text, paired seeds, verdict) of each declared prediction in `rows`, as the
    md's Predictions section computes them (the 90% CI of TOST for a 'no difference' prediction with a
    margin, else the 95% CI)."""
    group_columns = ["spec", *meta["swept_columns"]]
    rows = _current(rows, meta)

    base = _key_of(rows, group_columns, meta.get("baseline"))
    preds = [
        (p["claim"], _key_of(rows, group_columns, p["config"]), p["metric"], p["expected"], p.get("margin"))
        for p in meta.get("predictions", ())
    ]
    if base is None or not preds:
        return []
    fams = {m: {c.other: c for c in against(rows, group_columns, m, base)} for m in {p[2] for p in preds}}
    comps = [fams[m].get(k) if k is not None else None for _, k, m, _, _ in preds]
    out = []
    for (claim, _, metric, expected, margin), c, j in zip(preds, comps, judge(preds, comps), strict=True):
        delta = prediction_delta(c, margin if expected == NO_DIFFERENCE else None)
        out.append((claim, metric, delta, c.test.n if c else 0, j.verdict))
    return out


def _key_of(rows: Sequence[dict[str, str]], group_columns: Sequence[str], config: dict[str, Any] | None):
    """The configuration key of the first row matching `config` (column -> value), or None."""
    for r in rows:
        if config and all(r.get(c) == str(v) for c, v in config.items()):
            return tuple(r[c] for c in group_columns)
    return None


def _current(rows: Sequence[dict[str, str]], meta: dict[str, Any]) -> list[dict[str, str]]:
    """The rows of the cells the experiment declares now (a CSV may hold rows of an older grid)."""
    current = {c["id"] for c in meta["cells"]}
    return [r for r in rows if r.get("cell_id") in current]


# What of the two experiments' declarations must be the same for their verdicts to be compared
DECLARED = ("baseline", "swept_columns", "primary_metric", "budget")


def _seeds(rows: Sequence[dict[str, str]]) -> str:
    seeds = sorted({int(r["seed"]) for r in rows if str(r.get("seed", "")).lstrip("-").isdigit()})
    if seeds and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


def _predictions(meta: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["claim"]: p for p in meta.get("predictions", ())}


def section(experiment: str, results_dir: str | os.PathLike = "results") -> list[str]:
    """The md lines of the Replication section of `experiment` (empty unless it is one of a pair that
    exists: X_replication always gets one; X only once its replication has run)."""
    other = partner(experiment)
    original, replica = sorted((experiment, other), key=lambda e: e.endswith(SUFFIX))
    metas = {e: _meta(e, results_dir) for e in (original, replica)}
    paths = {e: csv_path(e, results_dir) for e in (original, replica)}
    if metas[other] is None or not paths[other].is_file():
        if experiment.endswith(SUFFIX):
            return ["", "## Replication", "", f"The experiment this replicates, {other}, has no results yet."]
        return []
    rows = {e: _current(read_rows(paths[e]), metas[e]) for e in (original, replica)}
    judged = {e: {claim: rest for claim, *rest in verdicts(rows[e], metas[e])} for e in (original, replica)}
    lines = [
        "",
        "## Replication",
        "",
        f"{replica} runs {original}'s design on other seeds and warm starts ({original}: "
        f"{_seeds(rows[original])}; {replica}: {_seeds(rows[replica])}). Each verdict is judged within "
        "its own experiment (its own Holm family of the declared predictions). A prediction replicates "
        "when both reach the same decisive verdict (confirmed, or refuted); two verdicts that decide "
        "nothing (undecided, not confirmed) agree on nothing.",
    ]
    differs = [k for k in DECLARED if metas[original].get(k) != metas[replica].get(k)]
    if differs:
        lines.append(
            f"The two declare different {', '.join(differs)}: their verdicts answer different designs."
        )
    lines.append("")
    preds = {e: _predictions(metas[e]) for e in (original, replica)}
    claims = [*preds[original], *(c for c in preds[replica] if c not in preds[original])]
    if not judged[original] and not judged[replica]:
        return lines + ["Neither has predictions with a baseline to judge: nothing to replicate."]
    lines += [
        f"| prediction | metric | Δ {original} [CI] | verdict {original} | Δ {replica} [CI] | "
        f"verdict {replica} | replicates |",
        "|---|---|---|---|---|---|---|",
    ]
    outcome: dict[str, list[str]] = {}
    for claim in claims:
        a, b = judged[original].get(claim), judged[replica].get(claim)
        metric = (a or b or ("–",))[0]
        if a is None or b is None:
            word = "declared in one only"
        elif preds[original][claim] != preds[replica][claim]:
            word = "declared differently"
        else:
            word = agreement(a[3], b[3])
        outcome.setdefault(word, []).append(claim)
        cells = [f"{x[1]} | {x[3]}" if x else "– | (not judged)" for x in (a, b)]
        lines.append(f"| {claim} | {metric} | {cells[0]} | {cells[1]} | {word} |")
    text = f"Of {len(claims)} predictions, {len(outcome.get('yes', []))} replicate"
    text += f" ({'; '.join(outcome['yes'])})" if outcome.get("yes") and len(outcome) > 1 else ""
    text += others(outcome)
    table, sentence = _comparisons(original, replica, rows, metas)
    return lines + table + ["", text + ". " + sentence]


def _word_of(c: Comparison | None) -> str:
    if c is None or c.test.n < 2:
        return "untested"
    if c.identical_to is not None:
        return "identical"
    if c.significant:
        return "lower" if c.test.mean < 0 else "higher"
    if c.reason == "failed runs":
        return "no verdict (failed runs)"
    return "no difference detected"


def _comparisons(
    original: str, replica: str, rows: dict[str, list[dict[str, str]]], metas: dict[str, dict[str, Any]]
) -> tuple[list[str], str]:
    """Every configuration − the baseline in the md's outcome metrics (the primary, the KL, held-out
    accuracy), each experiment's own Holm family per metric: the table and one sentence."""
    meta = metas[original]
    group_columns = ["spec", *meta["swept_columns"]]
    both = rows[original] + rows[replica]
    metrics = [m for m in dict.fromkeys([meta["primary_metric"], kl_metric(both), "eval_accuracy"])]
    metrics = [m for m in metrics if any(str(r.get(m, "")).strip() for r in both)]
    comps, bases = {}, {}
    for e in (original, replica):
        bases[e] = base = _key_of(rows[e], group_columns, metas[e].get("baseline"))
        comps[e] = {m: {c.other: c for c in against(rows[e], group_columns, m, base)} for m in metrics}
    if bases[original] is None or bases[original] != bases[replica]:
        return [], "The two have no common baseline to compare the other configurations with."
    lines = [
        "",
        "Every configuration − the baseline, as each md's baseline section tests it (Holm within each metric "
        "over its own comparisons; not declared in advance, so a difference here is a finding to confirm, "
        "not a confirmation). 'no' means their verdicts differ (a difference detected in one only, or "
        "opposite ones); a difference detected in one only is not evidence that the effects differ "
        "(compare the two intervals). 'not compared': identical runs, too few seeds or failed runs.",
        "",
        f"| configuration | metric | Δ {original} [95% CI] | {original} | Δ {replica} [95% CI] | {replica} | "
        "replicates |",
        "|---|---|---|---|---|---|---|",
    ]
    outcome: dict[str, int] = {}
    differ = []
    for m in metrics:
        for key in comps[original][m]:
            a, b = comps[original][m][key], comps[replica][m].get(key)
            wa, wb = _word_of(a), _word_of(b)
            if wa in ("lower", "higher") and wa == wb:
                word = "yes"
            elif "lower" in (wa, wb) or "higher" in (wa, wb):
                word = "no"
                differ.append(f"{' · '.join(key)} in {m} ({original}: {wa}; {replica}: {wb})")
            else:
                word = "neither detects" if wa == wb == "no difference detected" else "not compared"
            outcome[word] = outcome.get(word, 0) + 1
            deltas = [_delta(x) if x is not None else "–" for x in (a, b)]
            lines.append(f"| {' · '.join(key)} | {m} | {deltas[0]} | {wa} | {deltas[1]} | {wb} | {word} |")
    total = sum(outcome.values())
    sentence = (
        f"Of {total} comparisons with the baseline, {outcome.get('yes', 0)} show the same significant "
        f"difference in both, {outcome.get('neither detects', 0)} none in either"
    )
    if outcome.get("not compared"):
        sentence += f", {outcome['not compared']} not compared"
    sentence += f", and {len(differ)} differ: " + "; ".join(differ) + "." if differ else "."
    return lines, sentence


def answer(experiment: str, own: str, section_lines: Sequence[str]) -> str | None:
    """A replication's answer: whether the original's verdicts hold (the section's summary), then its
    own; the original's answer stays as it is."""
    if not experiment.endswith(SUFFIX):
        return None
    return f"As a replication of {experiment.removesuffix(SUFFIX)}: {section_lines[-1]} This run alone: {own}"


STUDY = Study(title="Replication", section=section, answer=answer)
