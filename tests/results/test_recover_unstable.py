"""A run that skipped most of its optimizer steps (non-finite loss or gradient) is 'unstable': its
summary and CSV row say so, the leaderboard lists it apart and ranks and tests only the ok cells."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from polgrad import sweep
from polgrad.registry import register
from polgrad.results.ranking import leaderboard
from polgrad.summary import summarize

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"


def _metrics(tmp_path: Path, skipped_per_step: list[int], updates_per_step: int | None) -> Path:
    rows, total = [], 0
    for i, s in enumerate(skipped_per_step):
        total += s
        row = {"step": i + 1, "reward_mean": 0.5, "skipped_steps": total}
        if updates_per_step is not None:
            row["optimizer_steps"] = updates_per_step
        rows.append(json.dumps(row))
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    "skipped, updates, threshold, status, frac",
    [
        ([0] + [1] * 19, 1, 0.5, "unstable", 19 / 20),  # the user's lr = 1e3 run: 19 of 20 skipped
        ([1] * 10 + [0] * 10, 1, 0.5, "ok", 10 / 20),  # exactly the threshold: not above it
        ([1] * 11 + [0] * 9, 1, 0.5, "unstable", 11 / 20),
        ([1] * 19 + [0], 4, 0.5, "ok", 19 / 80),  # PPO: 4 optimizer steps per step
        ([1] * 20, None, 0.5, "unstable", 1.0),  # rows of an older run: one optimizer step per step
        ([1] * 20, 1, 1.0, "ok", 1.0),  # train.unstable_skip_frac = 1: never unstable
    ],
)
def test_the_summary_status_follows_the_skipped_fraction(tmp_path, skipped, updates, threshold, status, frac):
    summary = summarize(str(_metrics(tmp_path, skipped, updates)), 1.0, unstable_skip_frac=threshold)
    assert summary["status"] == status
    assert summary["skipped_frac"] == pytest.approx(frac)
    assert summary["skipped_steps"] == sum(skipped)
    if status == "unstable":
        n = len(skipped) * (updates or 1)
        assert summary["unstable"].startswith(f"unstable: {sum(skipped)} of {n} optimizer steps skipped")
        assert f"train.unstable_skip_frac = {threshold:g}" in summary["unstable"]
    else:
        assert "unstable" not in summary


def test_the_threshold_is_checked():
    import gin

    from polgrad.config import parse_config
    from polgrad.errors import ConfigError
    from polgrad.train import run as train

    gin.clear_config()
    parse_config([str(TESTS.parent / "registry" / "grpo.gin")], ["train.unstable_skip_frac = 1.5"])
    with pytest.raises(ConfigError, match=r"train.unstable_skip_frac must be in \[0, 1\], got 1.5"):
        train("/nonexistent/never-written")


@register("clip", "test_recover_nan")
def nan_clip(logp, old_logp, adv, mask, *, rollout_logp=None):
    """Test part: plain PG plus a NaN on every token: every optimizer step is skipped."""
    z = torch.zeros_like(mask)
    return -torch.exp(logp - old_logp) * adv * mask + float("nan"), {
        "clip_low": z,
        "clip_high": z,
        "approx_kl": z,
    }


@pytest.mark.slow
def test_a_trainer_run_whose_every_step_is_skipped_is_unstable(tmp_path, capfd):
    from polgrad import train as train_cli

    binds = [
        "Algorithm.clip = @clip.test_recover_nan",
        "train.steps = 2",
        "train.prompts_per_step = 4",
        "train.eval_every = 100",
        "train.eval_size = 16",
        "train.checkpoint_every = 100",
    ]
    args = [str(TESTS.parent / "registry" / "reinforce.gin"), *(a for b in binds for a in ("--bind", b))]
    capfd.readouterr()
    assert train_cli.main([*args, "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["status"], summary["skipped_steps"], summary["skipped_frac"]) == ("unstable", 2, 1.0)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["optimizer_steps"] for r in rows] == [1, 1]
    warning = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("warning:")]
    assert warning == [f"warning: {summary['unstable']}"]


# ----------------------------------------------------------------------------- the sweep
# (fake_trainer: the fake trainer for sweeps, tests/conftest.py)
def test_an_unstable_cell_is_recorded_listed_apart_and_not_ranked(tmp_path, capsys, fake_trainer):
    import fake_train

    # Three configurations; the one with the best eval accuracy (lr 0.1 in fake_train's made-up
    # metrics) is unstable, so it must neither lead nor enter any comparison.
    accs = {
        lr: fake_train._metrics(fake_train.settings(lr=lr, steps=4), 3)["eval_accuracy"]
        for lr in (0.1, 0.2, 0.3)
    }
    assert max(accs, key=accs.get) == 0.1, accs
    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{DATA / 'base_fake.gin'}'\nSweep.specs = ['{DATA / 'spec_a.gin'}']\n"
        "Sweep.grid = {('fake_train.lr', 'fake_train.status'):\n"
        "    [(0.1, 'unstable'), (0.2, 'ok'), (0.3, 'ok')]}\n"
        "Sweep.seeds = [0, 1]\nSweep.seed_binding = 'fake_train.seed'\n"
        "Sweep.baseline = {'fake_train.lr': 0.2, 'fake_train.status': 'ok'}\n"
    )
    out = tmp_path / "r"
    assert sweep.main([str(path), "--results", str(out)]) == 0  # unstable cells are finished, not failed
    err = capsys.readouterr().err
    with open(out / "exp" / "exp.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    unstable = [r for r in rows if r["fake_train.lr"] == "0.1"]
    assert [r["status"] for r in unstable] == ["unstable", "unstable"]
    assert all(r["error"] == "unstable: 3 of 4 optimizer steps skipped" for r in unstable)
    assert all(r["eval_accuracy"] for r in unstable)  # the numbers are recorded, only not ranked
    assert "4 ok, 2 unstable (listed, not ranked), 0 failed of 6 cells" in err
    for r in unstable:
        assert f"unstable {r['cell_id']}: unstable: 3 of 4 optimizer steps skipped" in err

    md = (out / "exp" / "exp.md").read_text()
    assert "6 cells (4 finished, 2 unstable: listed below, not ranked, 0 failed)" in md
    section = md.split("## Unstable cells (not ranked)\n", 1)[1]
    assert all(f"`{r['cell_id']}`: unstable: 3 of 4 optimizer steps skipped" in section for r in unstable)
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and "`0." in ln]
    assert "`0.2`" in table[0] or "`0.3`" in table[0]  # the leader is an ok configuration
    assert "0 (2 unstable)" in next(ln for ln in table if "`0.1`" in ln)
    stats = md.split("## Does the leader", 1)[1].split("## Unstable cells", 1)[0]
    assert "fake_train.lr=0.1" not in stats and "fake_train.lr=0.3" in stats  # in no comparison

    # A re-run skips the unstable cells like the ok ones (their result does not change).
    assert sweep.main([str(path), "--results", str(out)]) == 0
    for r in rows:
        log = (out / r["run_dir"] / "invocations.jsonl").read_text().splitlines()
        assert sum('"t0"' in ln for ln in log) == 1


def test_the_leaderboard_keeps_unstable_rows_out_of_its_statistics():
    def row(cid, x, seed, acc, status="ok"):
        return {"cell_id": cid, "spec": "a", "x": x, "seed": seed, "eval_accuracy": acc, "status": status}

    rows = [row("a0", "1", "0", "0.2"), row("a1", "1", "1", "0.4"), row("b0", "2", "0", "0.9", "unstable")]
    board = leaderboard(rows, ["spec", "x"], "eval_accuracy")
    assert [(e["group"]["x"], e["n"], e["n_failed"], e["n_unstable"]) for e in board] == [
        ("1", 2, 0, 0),
        ("2", 0, 0, 1),
    ]
    assert board[0]["eval_accuracy"][0] == pytest.approx(0.3)
