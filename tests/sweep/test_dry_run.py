"""The sweep's dry run checks every cell exactly as the trainer does, before any cell trains.

For each bad binding below: the message `python -m polgrad.train` gives (parse_config, then
config.build(), which is where the trainer's checks live) must appear verbatim in what
`python -m polgrad.sweep --dry-run` prints for an experiment that puts the same binding in its
grid, and a real sweep of that file must stop before training any cell.
"""

from __future__ import annotations

import os

import gin
import pytest

from polgrad import config
from polgrad.errors import ConfigError
from polgrad.sweep import main as sweep_main
from polgrad.train import main as train_main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (grid key, a valid value, the bad value, the spec)
BAD = [
    ("clip.ppo.eps_low", "0.2", "-0.1", "grpo"),
    ("clip.ppo.eps_high", "0.2", "'big'", "grpo"),
    ("Algorithm.kl", "@kl.k3", "'k3'", "grpo"),
    ("Algorithm.group_size", "4", "1", "grpo"),
    ("Algorithm.value_init", "@value_init.policy", "None", "ppo"),
    ("Algorithm.kl_placement", "'loss'", "'both'", "grpo"),
    ("Algorithm.kl_coef", "0.04", "-1.0", "grpo"),
    ("train.lr", "1e-4", "-0.1", "grpo"),
    ("train.steps", "2", "0", "grpo"),
    ("train.reward_source", "'task'", "'oracle'", "grpo"),
    ("train.task", "@task.add", "@advantage.grpo", "grpo"),
    ("Algorithm.advantage", "@advantage.grpo", "@advantage.rlooo", "grpo"),
]
IDS = [f"{k}={bad}" for k, _, bad, _ in BAD]


def trainer_message(spec: str, binding: str) -> str:
    """The one line the trainer's config path raises for `binding` (without the binding prefix)."""
    gin.clear_config()
    try:
        with pytest.raises(ConfigError) as err:
            config.parse_config([os.path.join(REPO, "registry", f"{spec}.gin")], [binding])
            config.build()
    finally:
        gin.clear_config()
    msg = str(err.value)
    prefix = f"--bind {binding!r}: "
    return msg[len(prefix) :] if msg.startswith(prefix) else msg


def experiment(tmp_path, key: str, good: str, bad: str, spec: str) -> str:
    path = tmp_path / "bad_cell.gin"
    path.write_text(
        "include 'experiments/base_tiny.gin'\n"
        "Sweep.name = 'bad_cell'\n"
        f"Sweep.specs = ['registry/{spec}.gin']\n"
        # the bad value, crossed with a harmless axis (a grid axis may not mix value types, so
        # the good value gets its own test below)
        f"Sweep.grid = {{'{key}': [{bad}], 'train.eval_every': [5, 10]}}\n"
        "Sweep.seeds = [0]\n"
    )
    return str(path)


@pytest.mark.parametrize("key, good, bad, spec", BAD, ids=IDS)
def test_dry_run_raises_what_the_trainer_raises(tmp_path, capsys, key, good, bad, spec):
    expected = trainer_message(spec, f"{key} = {bad}")
    path = experiment(tmp_path, key, good, bad, spec)
    results = tmp_path / "results"
    rc = sweep_main([path, "--dry-run", "--results", str(results)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert expected in err, (expected, err)
    # A real sweep of the same file stops before any cell trains: no run folder exists.
    rc = sweep_main([path, "--results", str(results)])
    assert rc == 2
    assert not list(results.rglob("metrics.jsonl"))


@pytest.mark.parametrize("key, good, bad, spec", BAD, ids=IDS)
def test_the_valid_value_of_each_case_builds(key, good, bad, spec):
    """Non-vacuity: only the bad value fails; the same binding with the good value builds."""
    gin.clear_config()
    try:
        config.parse_config([os.path.join(REPO, "registry", f"{spec}.gin")], [f"{key} = {good}"])
        config.build()
    finally:
        gin.clear_config()


def test_the_train_cli_prints_the_same_line(tmp_path, capsys):
    key, _, bad, spec = BAD[0]
    expected = trainer_message(spec, f"{key} = {bad}")
    rc = train_main([f"registry/{spec}.gin", "--bind", f"{key} = {bad}", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert expected in capsys.readouterr().err


def test_the_dry_run_reads_the_base_config_the_launched_trainer_reads(tmp_path, capsys):
    """A cell is launched as `python -m polgrad.train ...`, which parses experiments/base_tiny.gin
    first: an experiment that includes nothing must validate the same way (it trains fine)."""
    path = tmp_path / "no_include.gin"
    path.write_text(
        "Sweep.specs = ['registry/grpo.gin']\nSweep.grid = {'Algorithm.kl_coef': [0.01]}\nSweep.seeds = [0]\n"
    )
    rc = sweep_main([str(path), "--dry-run", "--results", str(tmp_path / "r")])
    assert rc == 0, capsys.readouterr().err
