"""An experiment and its replication side by side: X and X_replication, the same design on disjoint
seeds (hence other warm starts), e.g. experiments/kl_ablation_replication.gin.

Each md of the pair gets a section "Replication" with, per declared prediction, the verdict and the
paired difference to the baseline [95% CI] in each experiment (each judged within its own experiment's
Holm family, as its own Predictions section does) and whether the two agree: the same verdict word
(confirmed / refuted / undecided / not confirmed / untested). It ends with one sentence saying where
they agree and where not. The section needs both CSVs and both experiment.json files; when the partner
has not run (or has no predictions), the md says so in one line instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad.results.compare import against
from polgrad.results.findings import _delta
from polgrad.results.predictions import judge
from polgrad.results.store import csv_path, read_rows

SUFFIX = "_replication"


def partner(experiment: str) -> str:
    """The other experiment of the pair: X_replication for X, X for X_replication."""
    return experiment.removesuffix(SUFFIX) if experiment.endswith(SUFFIX) else experiment + SUFFIX


def _meta(experiment: str, results_dir: str | os.PathLike) -> dict[str, Any] | None:
    import json

    path = Path(results_dir) / experiment / "experiment.json"
    return json.loads(path.read_text()) if path.is_file() else None


def verdicts(rows: Sequence[dict[str, str]], meta: dict[str, Any]) -> list[tuple[str, str, str, int, str]]:
    """(claim, metric, Δ [95% CI] text, paired seeds, verdict) of each declared prediction in `rows`."""
    group_columns = ["spec", *meta["swept_columns"]]
    current = {c["id"] for c in meta["cells"]}
    rows = [r for r in rows if r.get("cell_id") in current]

    def key_of(config: dict[str, Any] | None):
        for r in rows:
            if config and all(r.get(c) == str(v) for c, v in config.items()):
                return tuple(r[c] for c in group_columns)
        return None

    base = key_of(meta.get("baseline"))
    preds = [
        (p["claim"], key_of(p["config"]), p["metric"], p["expected"], p.get("margin"))
        for p in meta.get("predictions", ())
    ]
    if base is None or not preds:
        return []
    fams = {m: {c.other: c for c in against(rows, group_columns, m, base)} for m in {p[2] for p in preds}}
    comps = [fams[m].get(k) if k is not None else None for _, k, m, _, _ in preds]
    out = []
    for (claim, _, metric, _, _), c, j in zip(preds, comps, judge(preds, comps), strict=True):
        delta = _delta(c) if c is not None else "–"
        out.append((claim, metric, delta, c.test.n if c else 0, j.verdict))
    return out


def _word(verdict: str) -> str:
    word = verdict.split(" ")[0]
    return "not confirmed" if word == "not" else word


def _seeds(rows: Sequence[dict[str, str]]) -> str:
    seeds = sorted({int(r["seed"]) for r in rows if str(r.get("seed", "")).lstrip("-").isdigit()})
    if seeds and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"seeds {seeds[0]}-{seeds[-1]}"
    return "seeds " + ", ".join(map(str, seeds))


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
    rows = {e: read_rows(paths[e]) for e in (original, replica)}
    judged = {e: verdicts(rows[e], metas[e]) for e in (original, replica)}
    lines = [
        "",
        "## Replication",
        "",
        f"{replica} runs {original}'s design on other seeds and warm starts ({original}: "
        f"{_seeds(rows[original])}; {replica}: {_seeds(rows[replica])}). Each verdict is judged within "
        "its own experiment (its own Holm family of the declared predictions); the two agree on a "
        "prediction when they reach the same verdict.",
        "",
    ]
    if not judged[original] or not judged[replica]:
        return lines + ["Neither has predictions with a baseline to compare: nothing to replicate."]
    by_claim = {claim: rest for claim, *rest in judged[replica]}
    lines += [
        f"| prediction | metric | Δ {original} [95% CI] | verdict {original} | Δ {replica} [95% CI] | "
        f"verdict {replica} | agree |",
        "|---|---|---|---|---|---|---|",
    ]
    agree, differ = [], []
    for claim, metric, delta, _, verdict in judged[original]:
        if claim not in by_claim:
            lines.append(f"| {claim} | {metric} | {delta} | {verdict} | – | (not declared) | – |")
            differ.append(claim)
            continue
        _, r_delta, _, r_verdict = by_claim[claim]
        same = _word(verdict) == _word(r_verdict)
        (agree if same else differ).append(claim)
        mark = "yes" if same else "no"
        lines.append(f"| {claim} | {metric} | {delta} | {verdict} | {r_delta} | {r_verdict} | {mark} |")
    total = len(judged[original])
    text = f"The two agree on {len(agree)} of {total} predictions"
    text += f" ({'; '.join(agree)})" if agree and differ else ""
    text += f"; they differ on {'; '.join(differ)}." if differ else "."
    return lines + ["", text]
