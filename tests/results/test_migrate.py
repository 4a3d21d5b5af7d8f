"""polgrad.results.migrate: a results folder of the layout before one folder per experiment
(results/X.csv beside results/X/, the tuning stage results/X_tuning/ beside it) moved into today's
(polgrad/results/paths.py), nothing lost or overwritten; and the sweep and the report refuse the old
layout in one line naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polgrad.errors import DataError
from polgrad.results import migrate, paths
from polgrad.results.__main__ import main as results_main

# The old layout: two experiments whose names nest (kl, kl_ablation), kl with a tuning stage and a
# study's file, and a sub-folder that is no experiment (pilots)
OLD = {
    "kl.csv": "kl rows",
    "kl.md": "kl report",
    "kl.png": "kl forest",
    "kl_curves.png": "kl curves",
    "kl_gao.md": "kl's study",
    "kl/experiment.json": "{}",
    "kl/runs/c0/summary.json": "c0",
    "kl_tuning.csv": "tuning rows",
    "kl_tuning.md": "tuning report",
    "kl_tuning_curves.png": "tuning curves",
    "kl_tuning/experiment.json": "{}",
    "kl_tuning/runs/t0/summary.json": "t0",
    "kl_ablation.csv": "ablation rows",
    "kl_ablation.md": "ablation report",
    "kl_ablation/experiment.json": "{}",
    "pilots/README.md": "pilots",
    "README.md": "the index",
}
NEW = {
    "kl/kl.csv": "kl rows",
    "kl/kl.md": "kl report",
    "kl/kl.png": "kl forest",
    "kl/kl_curves.png": "kl curves",
    "kl/kl_gao.md": "kl's study",
    "kl/experiment.json": "{}",
    "kl/runs/c0/summary.json": "c0",
    "kl/kl_tuning/kl_tuning.csv": "tuning rows",
    "kl/kl_tuning/kl_tuning.md": "tuning report",
    "kl/kl_tuning/kl_tuning_curves.png": "tuning curves",
    "kl/kl_tuning/experiment.json": "{}",
    "kl/kl_tuning/runs/t0/summary.json": "t0",
    "kl_ablation/kl_ablation.csv": "ablation rows",
    "kl_ablation/kl_ablation.md": "ablation report",
    "kl_ablation/experiment.json": "{}",
    "pilots/README.md": "pilots",
    "README.md": "the index",
}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def _tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_old_layout_moves_into_one_folder_per_experiment_and_nothing_is_lost(tmp_path, capsys):
    _write(tmp_path, OLD)
    assert migrate.old_layout("kl", tmp_path) == [
        tmp_path / name for name in ("kl.csv", "kl.md", "kl.png", "kl_curves.png", "kl_gao.md")
    ] + [tmp_path / name for name in ("kl_tuning.csv", "kl_tuning.md", "kl_tuning_curves.png", "kl_tuning")]
    assert migrate.main(["--results", str(tmp_path)]) == 0
    assert _tree(tmp_path) == NEW  # every file at its place, every byte kept, nothing else
    assert paths.csv_path("kl_tuning", paths.stage_results("kl", tmp_path)).read_text() == "tuning rows"
    assert capsys.readouterr().out.strip().endswith("11 moved")  # 10 files and a folder
    assert migrate.old_layout("kl", tmp_path) == [] and migrate.plan(tmp_path) == []
    assert migrate.main(["--results", str(tmp_path)]) == 0  # again: nothing to move
    assert "nothing in the old layout" in capsys.readouterr().out


def test_a_file_in_both_layouts_moves_nothing(tmp_path, capsys):
    _write(tmp_path, {**OLD, "kl/kl.csv": "a newer run's rows"})
    assert migrate.main(["--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and f"{tmp_path / 'kl' / 'kl.csv'} already exists" in err[0]
        and "nothing moved" in err[0]
    )
    assert _tree(tmp_path) == {**OLD, "kl/kl.csv": "a newer run's rows"}


def test_the_report_refuses_the_old_layout_in_one_line_naming_the_migration(tmp_path, capsys):
    _write(tmp_path, OLD)
    assert results_main(["kl", "--results", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"{tmp_path / 'kl.csv'} and 8 more: kl's results are in the layout before" in line
    assert f"python -m polgrad.results.migrate --results {tmp_path}" in line
    with pytest.raises(DataError):
        migrate.refuse_old_layout("kl_ablation", tmp_path)
    migrate.refuse_old_layout("kl_replication", tmp_path)  # no such experiment: nothing to refuse


@pytest.mark.usefixtures("fake_trainer")
def test_the_sweep_refuses_the_old_layout_before_any_cell_runs(tmp_path, capsys):
    from polgrad import sweep

    data = Path(__file__).resolve().parents[1] / "data"
    exp = tmp_path / "exp.gin"
    exp.write_text(
        f"include '{data / 'base_fake.gin'}'\nSweep.specs = ['{data / 'spec_a.gin'}']\n"
        "Sweep.seeds = [0]\nSweep.seed_binding = 'fake_train.seed'\n"
    )
    out = tmp_path / "results"
    _write(out, {"exp.csv": "old rows", "exp/experiment.json": json.dumps({"file": str(exp)})})
    assert sweep.main([str(exp), "--results", str(out)]) == 2
    (line,) = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.startswith("error")]
    assert "exp's results are in the layout before one folder per experiment" in line
    assert not (out / "exp" / "runs").exists() and (out / "exp.csv").read_text() == "old rows"
    assert migrate.main(["--results", str(out)]) == 0
    assert sweep.main([str(exp), "--results", str(out)]) == 0  # after the move the sweep runs
    assert (out / "exp" / "exp.md").is_file()


def test_a_sweep_stopped_in_its_tuning_stage_is_moved_too(tmp_path, capsys):
    """No results/e/experiment.json yet (the evaluation never started): the tuning stage is known by
    its own experiment.json's question, refused before the move and moved into results/e/."""
    stage = json.dumps({"name": "e_tuning", "question": "Tuning stage of e: which value of train.lr ..."})
    _write(
        tmp_path,
        {"e_tuning/experiment.json": stage, "e_tuning/runs/t0/summary.json": "t0", "e_tuning.csv": "r"},
    )
    with pytest.raises(DataError, match="e's results are in the layout before"):
        migrate.refuse_old_layout("e", tmp_path)
    assert migrate.main(["--results", str(tmp_path)]) == 0
    assert _tree(tmp_path) == {
        "e/e_tuning/experiment.json": stage,
        "e/e_tuning/runs/t0/summary.json": "t0",
        "e/e_tuning/e_tuning.csv": "r",
    }
    migrate.refuse_old_layout("e", tmp_path)  # nothing left to refuse
