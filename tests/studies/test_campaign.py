"""The campaign's check (`python -m studies.campaign TAG`, studies/campaign.py):
every CSV directly under the results folder comes from the commit TAG names, clean, with >= 10 seeds
per configuration and one warm start per seed; pilots in a sub-folder are not its business."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from studies import campaign
from studies.campaign import main


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with two commits, the first tagged `camp`; the working directory is in it."""
    _git(tmp_path, "init", "-q")
    for n in ("a", "b"):
        (tmp_path / n).write_text(n)
        _git(tmp_path, "add", n)
        _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", n)
        if n == "a":
            _git(tmp_path, "tag", "camp")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    return tmp_path


def _write(
    results: Path, name: str, rows: list[dict[str, str]], sweep: bool = True, folder: str = ""
) -> None:
    """results/<folder or name>/<name>.csv (and a sweep's experiment.json beside it)."""
    where = results / (folder or name)
    where.mkdir(parents=True, exist_ok=True)
    with open(where / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    if sweep:
        cells = [
            {"id": r["cell_id"], "spec": "grpo", "swept": {"x": r["x"]}, "seed": int(r["seed"])} for r in rows
        ]
        meta = {"swept_columns": ["x"], "cells": cells}
        (where / "experiment.json").write_text(json.dumps(meta))


def _rows(commit: str, seeds=range(10), configs=("p", "q"), warm=lambda s: f"w{s}") -> list[dict[str, str]]:
    return [
        {
            "cell_id": f"{x}-s{s}",
            "spec": "grpo",
            "x": x,
            "seed": str(s),
            "status": "ok",
            "warm_start": warm(s),
            "git_commit": commit,
            "git_diff": "",
        }
        for x in configs
        for s in seeds
    ]


def test_a_campaign_of_clean_rows_from_the_tag_passes(repo, capsys):
    sha = _git(repo, "rev-parse", "camp")
    _write(repo / "results", "exp", _rows(sha[:7]))
    tuning = _rows(sha[:7], seeds=range(100, 103))
    _write(repo / "results", "exp_tuning", tuning, folder="exp/exp_tuning")  # 3 tuning seeds: fine
    _write(
        repo / "results", "exp_points", [{"d": "0.1", "gold": "0.2"}], sweep=False, folder="exp"
    )  # no commit
    (repo / "results" / "pilots").mkdir()
    _write(repo / "results" / "pilots", "pilot", _rows("0123456", seeds=range(2)))  # not the campaign's
    assert main(["camp"]) == 0
    out = capsys.readouterr().out
    assert f"ok results/exp/exp.csv: 20 rows from {sha[:7]}" in out
    assert f"ok results/exp/exp_tuning/exp_tuning.csv: 6 rows from {sha[:7]}" in out
    assert "ok results/exp/exp_points.csv: 1 row (no git_commit column: its sweep's exp.csv passes)" in out
    assert "all 3 CSVs of results from camp" in out and "pilot" not in out


def test_each_rule_broken_is_one_line_naming_the_csv_and_the_rerun(repo):
    sha, head = _git(repo, "rev-parse", "camp"), _git(repo, "rev-parse", "HEAD")
    results = repo / "results"
    _write(results, "later", _rows(head[:7]))  # a clean commit, but not the tag's
    dirty = _rows(sha[:7])
    dirty[3]["git_commit"] = f"{sha[:7]}-dirty"
    _write(results, "dirty", dirty)
    _write(results, "few", _rows(sha[:7], seeds=range(9)))
    _write(results, "shared", _rows(sha[:7], warm=lambda s: "w0"))
    mixed = _rows(sha[:7])
    mixed[0]["warm_start"] = "other"  # p-s0 and q-s0 started from different policies
    _write(results, "mixed", mixed)
    _write(results, "few_points", [{"d": "0.1"}], sweep=False, folder="few")
    problems, passes = campaign.check("camp", "results")
    by_csv = {line.split(":")[0]: line for line in problems}
    assert passes == [] and len(problems) == 6
    assert f"1 row from {sha[:7]} with uncommitted edits" in by_csv["results/dirty/dirty.csv"]
    assert f"20 rows from {head[:7]}" in by_csv["results/later/later.csv"]
    assert "grpo · x=p declares 9 seeds (the protocol: ≥ 10)" in by_csv["results/few/few.csv"]
    assert (
        "experiments/few.gin breaks the protocol: change it, tag a new campaign commit"
        in by_csv["results/few/few.csv"]
    )
    assert "10 seeds share 1 warm starts" in by_csv["results/shared/shared.csv"]
    assert "seeds 0 started from more than one warm start" in by_csv["results/mixed/mixed.csv"]
    assert "its sweep's few.csv fails" in by_csv["results/few/few_points.csv"]
    assert by_csv["results/few/few_points.csv"].endswith(
        "(python -m studies.overoptimization experiments/few.gin)"
    )
    assert (
        "rerun it from a clean clone of camp (python -m polgrad.sweep experiments/dirty.gin)"
        in by_csv["results/dirty/dirty.csv"]
    )


def test_every_declared_cell_must_have_finished_and_recorded_its_warm_start(repo):
    """A failed or missing cell fails the check (rerun it); an unstable one is an outcome, not a gap."""
    sha = _git(repo, "rev-parse", "camp")[:7]
    results = repo / "results"
    rows = _rows(sha)
    rows[0]["status"], rows[1]["status"] = "failed", "unstable"
    _write(results, "failed", rows)
    rows = _rows(sha)
    _write(results, "missing", rows[:-1])  # the CSV lacks q-s9, which experiment.json declares
    meta = json.loads((results / "missing" / "experiment.json").read_text())
    meta["cells"].append({"id": "q-s9", "spec": "grpo", "swept": {"x": "q"}, "seed": 9})
    (results / "missing" / "experiment.json").write_text(json.dumps(meta))
    rows = _rows(sha)
    for r in rows[2:]:
        r["warm_start"] = ""
    _write(results, "partial", rows)
    problems, passes = campaign.check("camp", "results")
    by_csv = {line.split(":")[0]: line for line in problems}
    assert passes == [] and len(problems) == 3
    assert "1 cells did not finish (p-s0)" in by_csv["results/failed/failed.csv"]
    assert "1 declared cells have no row (q-s9)" in by_csv["results/missing/missing.csv"]
    assert "18 rows record no warm start" in by_csv["results/partial/partial.csv"]


def test_an_unknown_tag_is_one_line_and_exit_2(repo, capsys):
    assert main(["no-such-tag"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no-such-tag: no such tag or commit" in err


def test_a_csv_outside_every_experiments_folder_is_a_problem(repo):
    """The old flat layout (results/exp.csv beside results/exp/) is named, with the move that fixes it."""
    sha = _git(repo, "rev-parse", "camp")
    _write(repo / "results", "exp", _rows(sha[:7]))
    (repo / "results" / "old.csv").write_text("cell_id\nc0\n")
    problems, passes = campaign.check("camp", "results")
    assert passes == [f"results/exp/exp.csv: 20 rows from {sha[:7]}"]
    (line,) = problems
    assert line.startswith("results/old.csv: a CSV outside any experiment's folder")
    assert "python -m polgrad.results.migrate --results results" in line
