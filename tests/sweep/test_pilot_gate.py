"""Sweep.pilot_gate: the evaluation cells start only when a committed pilot shows what the gin declares
(polgrad/results/gate.py, polgrad/sweep/pilot_gate.py)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
from pathlib import Path

import pytest

from polgrad.errors import ConfigError
from polgrad.results import gate
from polgrad.sweep import cli
from polgrad.sweep.experiment import load_experiment

pytestmark = pytest.mark.usefixtures("fake_trainer")

DATA = Path(__file__).resolve().parents[1] / "data"


def _rows(values: dict[int, float], spec: str = "spec_a", metric: str = "eval_accuracy") -> list[dict]:
    return [{"spec": spec, "seed": str(s), "status": "ok", metric: repr(v)} for s, v in values.items()]


def _cond(op=">=", k=3.0, unit="se", metric="eval_accuracy", config=None):
    return {"metric": metric, "config": config or {"spec": "spec_a"}, "op": op, "threshold": k, "unit": unit}


def test_the_conditions_on_known_values():
    # seeds 100-103 with values 1, 2, 3, 4: mean 2.5, sd = sqrt(5/3) = 1.2910, se = sd/2 = 0.64550, so
    # the mean lies 2.5 / 0.64550 = 3.873 standard errors above 0
    rows = _rows({100: 1.0, 101: 2.0, 102: 3.0, 103: 4.0})
    (o,) = gate.evaluate(rows, [_cond(k=3.0)], evaluation_seeds=range(10, 20))
    assert (o.n, o.mean) == (4, 2.5) and o.se == pytest.approx(math.sqrt(5 / 3) / 2, rel=1e-12)
    assert o.passed and o.why == ""
    assert not gate.evaluate(rows, [_cond(k=3.9)], range(10, 20))[0].passed  # 3.873 < 3.9
    assert gate.evaluate(rows, [_cond(k=2.5, unit="abs")], range(10, 20))[0].passed  # 2.5 >= 2.5
    assert not gate.evaluate(rows, [_cond(k=2.6, unit="abs")], range(10, 20))[0].passed
    neg = _rows({100: -1.0, 101: -2.0, 102: -3.0, 103: -4.0})
    assert gate.evaluate(neg, [_cond(op="<=", k=3.0)], range(10, 20))[0].passed  # -2.5 <= -3 se
    assert not gate.evaluate(rows, [_cond(op="<=", k=3.0)], range(10, 20))[0].passed
    # '|>=|': at least k standard errors from 0 on either side (the same 3.873 se, of either sign)
    for values in (rows, neg):
        assert gate.evaluate(values, [_cond(op="|>=|", k=3.0)], range(10, 20))[0].passed
        assert not gate.evaluate(values, [_cond(op="|>=|", k=3.9)], range(10, 20))[0].passed
        assert gate.evaluate(values, [_cond(op="|>=|", k=2.5, unit="abs")], range(10, 20))[0].passed
        assert not gate.evaluate(values, [_cond(op="|>=|", k=2.6, unit="abs")], range(10, 20))[0].passed
    # a negative mean inside the band: -1/6, se 0.601 (sd 1.041 / sqrt 3), within 1 se of 0 and below
    # 0.2 in the metric's units
    near = _rows({100: 1.0, 101: -1.0, 102: -0.5})
    assert not gate.evaluate(near, [_cond(op="|>=|", k=1.0)], range(10, 20))[0].passed
    assert not gate.evaluate(near, [_cond(op="|>=|", k=0.2, unit="abs")], range(10, 20))[0].passed
    (o,) = gate.evaluate(neg, [_cond(op="|>=|", k=2.0, unit="abs")], range(10, 20))
    assert "|eval_accuracy| >= 2 in spec=spec_a" in o.text()
    (o,) = gate.evaluate(neg, [_cond(op="|>=|", k=3.0)], range(10, 20))
    assert "eval_accuracy at least 3 standard errors from 0 in spec=spec_a" in o.text()
    # eval_accuracy_change: eval_accuracy - eval_accuracy_init per run
    change = [r | {"eval_accuracy_init": "0.5"} for r in _rows({100: 0.6, 101: 0.61, 102: 0.62})]
    (c,) = gate.evaluate(change, [_cond(metric=gate.CHANGE, k=0.1, unit="abs")], range(10, 20))
    assert c.mean == pytest.approx(0.11, abs=1e-12) and c.passed


def test_a_pilot_without_spread_or_with_a_seed_twice_does_not_pass():
    # three runs at 0.0: se = 0, so "at least 3 standard errors above 0" and "... below 0" both held
    # with k·se = 0; there is nothing to measure the mean in
    flat = _rows({100: 0.0, 101: 0.0, 102: 0.0})
    for op in gate.OPS:
        (o,) = gate.evaluate(flat, [_cond(op=op)], range(10, 20))
        assert not o.passed and "no spread" in o.why
    twice = _rows({100: 0.1, 101: 0.2, 102: 0.3}) + _rows({101: 0.9})  # a row of an older grid
    (o,) = gate.evaluate(twice, [_cond(k=0.0)], range(10, 20))
    assert not o.passed and "seed(s) 101 have two ok runs" in o.why
    (o,) = gate.evaluate(_rows({100: 0.1, 101: 0.2, 102: 0.3}), [_cond(op="<=", k=0.25, unit="abs")], [])
    assert o.passed and "eval_accuracy <= 0.25 in spec=spec_a" in o.text()  # 'abs': the mean 0.2 <= 0.25


def test_too_few_seeds_or_evaluation_seeds_do_not_pass():
    (few,) = gate.evaluate(_rows({100: 5.0, 101: 6.0}), [_cond(k=0.0)], range(10, 20))
    assert not few.passed and "2 seed(s)" in few.why and "at least 3" in few.why
    (own,) = gate.evaluate(_rows({10: 5.0, 101: 6.0, 102: 7.0}), [_cond(k=0.0)], range(10, 20))
    assert not own.passed and "seeds 10 are evaluation seeds" in own.why
    written = [r | {"seed": "10.0"} if r["seed"] == "10" else r for r in _rows({10: 5.0, 101: 6.0, 102: 7.0})]
    assert "seeds 10 are evaluation seeds" in gate.evaluate(written, [_cond(k=0.0)], range(10, 20))[0].why
    failed = _rows({100: 5.0, 101: 6.0, 102: 7.0}) + [{"spec": "spec_a", "seed": "103", "status": "failed"}]
    assert gate.evaluate(failed, [_cond(k=0.0)], range(10, 20))[0].n == 3  # only ok runs count


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root), *args], check=True)


def _repo(tmp_path: Path, gate_text: str) -> Path:
    """A git checkout holding an experiment (fake trainer, 2 seeds) gated on
    results/pilots/exp_pilot/exp_pilot.csv."""
    exp = tmp_path / "exp.gin"
    exp.write_text(
        f"include '{DATA / 'base_fake.gin'}'\nSweep.specs = ['{DATA / 'spec_a.gin'}']\n"
        "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0, 1]\n"
        "Sweep.seed_binding = 'fake_train.seed'\n" + gate_text
    )
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "experiment")
    return exp


def _write_pilot(path: Path, values: dict[int, float]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [r | {"fake_train.lr": "0.1"} for r in _rows(values)]  # the configuration's swept column
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


GATE = "Sweep.pilot_gate = [('eval_accuracy', {'spec': 'spec_a'}, '>=', 3, 'se')]\n"


def test_the_sweep_starts_the_evaluation_cells_only_on_a_committed_pilot_that_passes(
    tmp_path, capsys, monkeypatch
):
    exp = _repo(tmp_path, GATE)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results"
    pilot = tmp_path / "results" / "pilots" / "exp_pilot" / "exp_pilot.csv"

    def refused(text: str) -> None:
        assert cli.main([str(exp), "--results", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and text in err[0] and "the evaluation cells did not start" in err[0], err
        assert not (out / "exp" / "runs").exists()  # no cell ran

    refused("results/pilots/exp_pilot/exp_pilot.csv does not exist")
    flat = tmp_path / "results" / "pilots" / "exp_pilot.csv"  # the layout before one folder per experiment
    _write_pilot(flat, {100: 0.1, 101: 0.2, 102: 0.3})
    refused(
        f"is at {flat}, the layout before one folder per experiment: move it with "
        "`python -m polgrad.results.migrate"
    )
    flat.unlink()
    _write_pilot(pilot, {100: 0.1, 101: 0.2, 102: 0.3})
    refused("results/pilots/exp_pilot/exp_pilot.csv is not committed")
    _git(tmp_path, "add", "results/pilots/exp_pilot/exp_pilot.csv")
    _git(tmp_path, "commit", "-q", "-m", "pilot")
    # 0.1, 0.2, 0.3 (below) lie 3.46 standard errors above 0 and pass; -0.1, 0.2, 0.4 only 1.15:
    _write_pilot(pilot, {100: -0.1, 101: 0.2, 102: 0.4})
    refused("differs from HEAD")
    _git(tmp_path, "commit", "-q", "-am", "noisy pilot")
    refused("eval_accuracy at least 3 standard errors above 0 in spec=spec_a · fake_train.lr=0.1: n = 3")
    assert "not passed (the pilot does not show it)" in (cli.pilot_gate.state(load_experiment(str(exp)))[1])
    _write_pilot(pilot, {100: 0.1, 101: 0.2, 102: 0.3})
    _git(tmp_path, "commit", "-q", "-am", "pilot that passes")
    assert cli.main([str(exp), "--results", str(out), "--dry-run"]) == 0
    assert (
        "pilot gate: results/pilots/exp_pilot/exp_pilot.csv passes (eval_accuracy)" in capsys.readouterr().out
    )
    assert cli.main([str(exp), "--results", str(out)]) == 0
    capsys.readouterr()
    meta = json.loads((out / "exp" / "experiment.json").read_text())
    (c,) = meta["pilot_gate"]["conditions"]
    assert (
        meta["pilot_gate"]["pilot"] == "results/pilots/exp_pilot/exp_pilot.csv"
        and c["passed"]
        and c["n"] == 3
    )
    md = (out / "exp" / "exp.md").read_text()
    assert (
        "## Pilot gate" in md
        and "eval_accuracy at least 3 standard errors above 0" in md
        and ": passed" in md
    )
    # a sweep with nothing left to run checks nothing: an edited pilot does not refuse it, and the
    # record of the check that let its cells start is kept
    _write_pilot(pilot, {100: -0.1, 101: 0.2, 102: 0.4})
    _git(tmp_path, "commit", "-q", "-am", "a later pilot that fails")
    assert cli.main([str(exp), "--results", str(out)]) == 0
    capsys.readouterr()
    assert json.loads((out / "exp" / "experiment.json").read_text())["pilot_gate"] == meta["pilot_gate"]


def test_a_pilot_that_includes_its_experiment_is_not_gated_by_it(tmp_path):
    exp = _repo(tmp_path, GATE)
    child = tmp_path / "exp_pilot.gin"
    child.write_text(f"include '{exp}'\nSweep.seeds = [100, 101, 102]\n")
    assert load_experiment(str(exp)).pilot_gate is not None
    assert load_experiment(str(child)).pilot_gate is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[('eval_acc', {'spec': 'spec_a'}, '>=', 3, 'se')]", "unknown metric 'eval_acc'; valid: "),
        ("[('eval_accuracy', {'spec': 'spec_a'}, '>', 3, 'se')]", "the comparison is one of >=, <=, |>=|"),
        ("[('eval_accuracy', {'spec': 'spec_a'}, '|>=|', 0, 'abs')]", "> 0 with '|>=|'"),
        ("[('eval_accuracy', {'spec': 'spec_a'}, '|>=|', 0, 'se')]", "> 0 with '|>=|'"),
        ("[('eval_accuracy', {'spec': 'spec_a'}, '>=', -1, 'se')]", "the threshold must be a number"),
        ("[('eval_accuracy', {'spec': 'nope'}, '>=', 3, 'se')]", "nope"),
        ("('eval_accuracy', {'spec': 'spec_a'}, '>=', 3, 'se')", "[0]: must be (metric"),
        (
            "[('eval_accuracy', {'spec': 'spec_a'}, '<=', 1e999, 'abs')]",
            "the threshold must be a number",
        ),
    ],
)
def test_a_wrong_gate_is_one_line_naming_the_file_and_line(tmp_path, text, message):
    exp = tmp_path / "exp.gin"
    exp.write_text(
        f"include '{DATA / 'base_fake.gin'}'\nSweep.specs = ['{DATA / 'spec_a.gin'}']\nSweep.seeds = [0]\n"
        f"Sweep.pilot_gate = {text}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_experiment(str(exp))
    assert str(e.value).startswith(f"{exp}: line 4: Sweep.pilot_gate") and message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "Sweep.pilot = 3\nSweep.pilot_gate = [('eval_accuracy', {'spec': 'spec_a'}, '>=', 3, 'se')]",
            "line 4: Sweep.pilot: must be the path",
        ),
        ("Sweep.pilot = 'p.csv'", "line 4: Sweep.pilot: a pilot without Sweep.pilot_gate gates nothing"),
    ],
)
def test_a_wrong_pilot_is_one_line(tmp_path, text, message):
    exp = tmp_path / "exp.gin"
    head = f"include '{DATA / 'base_fake.gin'}'\nSweep.specs = ['{DATA / 'spec_a.gin'}']\nSweep.seeds = [0]\n"
    exp.write_text(head + text + "\n")
    with pytest.raises(ConfigError) as e:
        load_experiment(str(exp))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_tuning_stage_is_not_gated_but_does_not_run_before_a_failing_gate(tmp_path, capsys, monkeypatch):
    """The gate stands before the evaluation cells, not the tuning stage's (its seeds are not
    evaluation seeds): while the pilot is missing, nothing runs (tuning cells would be of no use);
    once it passes, the tuning stage runs and then the evaluation."""
    exp = _repo(
        tmp_path,
        GATE + "Sweep.tuning = {'seeds': [200, 201], 'grid': {'fake_train.eval_every': [2, 4]}}\n",
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results"
    assert cli.main([str(exp), "--results", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "exp_pilot.csv does not exist" in err[-1] and "the evaluation cells did not start" in err[-1]
    assert not (out / "exp" / "exp_tuning" / "runs").exists() and not (out / "exp" / "runs").exists()
    _write_pilot(
        tmp_path / "results" / "pilots" / "exp_pilot" / "exp_pilot.csv", {100: 0.1, 101: 0.2, 102: 0.3}
    )
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "pilot")
    assert cli.main([str(exp), "--results", str(out)]) == 0
    capsys.readouterr()
    assert len(list((out / "exp" / "exp_tuning" / "runs").iterdir())) == 4  # 2 values x 2 tuning seeds ran
    assert "pilot_gate" not in json.loads((out / "exp" / "exp_tuning" / "experiment.json").read_text())
    assert json.loads((out / "exp" / "experiment.json").read_text())["pilot_gate"]["conditions"][0]["passed"]
