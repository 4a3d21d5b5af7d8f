"""Study plug-ins (polgrad/results/studies.py): an experiment names them in `Sweep.studies`, the dry run
checks that each imports and is a study, the sweep records them in experiment.json, and the report
loads them from there; a name that does not import or a module that is not a study is one line naming
the file and the binding, in the dry run and in the report alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polgrad.errors import ConfigError
from polgrad.results.studies import Study, load
from polgrad.sweep import load_experiment, main

REPO = Path(__file__).resolve().parents[2]


def _experiment(tmp_path: Path, studies: str) -> str:
    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\nSweep.name = 'exp'\n"
        f"Sweep.specs = ['registry/grpo.gin']\nSweep.seeds = [0]\nSweep.studies = {studies}\n"
    )
    return str(path)


def test_the_repositorys_studies_load_and_declare_what_the_report_needs():
    replication, overoptimization = load(["studies.replication", "studies.overoptimization"], "here")
    assert isinstance(replication, Study) and replication.section and replication.answer
    assert overoptimization.answers == ("_gao",) and overoptimization.section is None
    assert replication.outputs == ()
    assert overoptimization.outputs == ("_best_of_n.csv", "_points.csv", "_gao.md", "_gao.png")


@pytest.mark.parametrize(
    ("studies", "says"),
    [
        ("['studies.no_such_study']", "study 'studies.no_such_study' does not import"),
        ("['polgrad.table5']", "module 'polgrad.table5' is not a study: it needs a module-level STUDY"),
        ("'studies.replication'", "a list of study modules"),
        ("['not a module']", "is not a module name"),
    ],
)
def test_a_wrong_study_is_one_line_in_the_dry_run(tmp_path, capsys, studies, says):
    path = _experiment(tmp_path, studies)
    assert main([path, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {path}: line 5: Sweep.studies: "), err
    assert says in err


def test_the_experiment_reads_its_studies_and_a_tuning_stage_has_none(tmp_path):
    from polgrad.sweep import prepare

    exp = load_experiment(_experiment(tmp_path, "['studies.replication']"))
    assert exp.studies == ["studies.replication"]
    path = _experiment(tmp_path, "['studies.replication']")
    with open(path, "a") as f:
        f.write("Sweep.tuning = {'seeds': [100], 'grid': {'train.lr': [1e-4, 3e-4]}}\n")
    planned, _cells = prepare(path)
    assert planned.studies == ["studies.replication"] and planned.tuning.experiment.studies == []
    assert load_experiment(str(REPO / "experiments" / "kl_ablation_replication.gin")).studies == [
        "studies.replication"
    ]  # inherited from kl_ablation.gin
    assert load_experiment(str(REPO / "experiments" / "clip_rules.gin")).studies == []


def test_the_report_of_an_experiment_json_naming_a_missing_study_is_one_line(tmp_path):
    from polgrad.results.report import write_report

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "experiment.json").write_text(json.dumps({"studies": ["studies.gone"], "cells": []}))
    with pytest.raises(
        ConfigError, match=r"x/experiment.json: studies: study .studies.gone. does not import"
    ):
        write_report("x", tmp_path)


def test_the_sweep_records_the_studies_in_experiment_json_and_only_when_named(tmp_path):
    from polgrad.sweep.folder import write_experiment_json
    from polgrad.sweep.grid import expand

    for studies, recorded in (("['studies.replication']", ["studies.replication"]), ("[]", None)):
        exp = load_experiment(_experiment(tmp_path, studies))
        meta = write_experiment_json(exp, expand(exp), tmp_path / "results", "python -m polgrad.sweep x")
        on_disk = json.loads((tmp_path / "results" / "exp" / "experiment.json").read_text())
        assert meta.get("studies") == on_disk.get("studies") == recorded  # none: the file as before studies


def test_a_sweep_started_from_another_directory_finds_the_repositorys_studies(tmp_path):
    """`python -m polgrad.sweep /repo/experiments/kl_ablation.gin` from elsewhere finds the specs it names
    relative to the file; it finds the studies it names in the same repository too."""
    import os
    import subprocess
    import sys

    lib = tmp_path / "lib"  # this checkout's polgrad on the path, its studies/ not
    lib.mkdir()
    (lib / "polgrad").symlink_to(REPO / "polgrad")
    env = {**os.environ, "PYTHONPATH": str(lib)}
    probe = subprocess.run(
        [sys.executable, "-c", "import studies"], cwd=tmp_path, env=env, capture_output=True
    )
    assert probe.returncode != 0  # from here the repository's studies/ is not on the path by itself
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(REPO / "experiments" / "kl_ablation.gin"), "--dry-run"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
