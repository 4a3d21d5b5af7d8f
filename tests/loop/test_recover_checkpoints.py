"""A damaged checkpoint never leaves a run stuck: resume checks the tags and loads the newest intact
one (polgrad/checkpoints.py), and `python -m polgrad.sweep X.gin --restart CELL` starts a cell over
without deleting anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from polgrad import checkpoints, sweep
from polgrad.errors import ConfigError, DataError
from polgrad.sweep import folder

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
GRPO = str(REPO / "registry" / "grpo.gin")
MODEL = "mp_rank_00_model_states.pt"


# ----------------------------------------------------------------------------- which tag (unit)
def _tag(part_dir: Path, step: int, files=(MODEL,)) -> Path:
    d = part_dir / f"step{step}"
    d.mkdir(parents=True)
    for name in files:
        torch.save({"w": torch.arange(1000.0) + step}, d / name)
    (part_dir / "latest").write_text(f"step{step}")
    return d


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the tensor data: only the member's CRC tells
    path.write_bytes(bytes(data))


def test_the_newest_intact_tag_is_chosen_and_each_damaged_one_is_a_warning(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    for s in (1, 2, 3, 10):
        _tag(ckpt / "policy", s)
    _truncate(ckpt / "policy" / "step10" / MODEL)
    _flip_a_byte(ckpt / "policy" / "step3" / MODEL)
    assert checkpoints.resume_tag(ckpt) == "step2"  # 10 > 3 > 2: numeric order, not text order
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"warning: checkpoint {ckpt / 'policy' / 'step10'} is damaged: {MODEL}")
    assert "fails the CRC check" in lines[1] and str(ckpt / "policy" / "step3") in lines[1]
    assert all(f"resuming from the intact {ckpt / 'policy' / 'step2'}" in ln for ln in lines)


def test_a_file_overwritten_with_other_bytes_is_damaged_but_a_legacy_pickle_is_not(tmp_path, capsys):
    # Found by hand: 1000 random bytes over step25's model states passed the check (not a zip, taken
    # for torch's legacy format) and the resume died in torch.load instead of falling back.
    ckpt = tmp_path / "checkpoints"
    for s in (1, 2):
        _tag(ckpt / "policy", s)
    (ckpt / "policy" / "step2" / MODEL).write_bytes(b"garbage, not a checkpoint" * 40)
    assert checkpoints.resume_tag(ckpt) == "step1"
    err = capsys.readouterr().err
    assert f"{MODEL} is not a torch checkpoint (neither a zip archive nor a pickle)" in err
    legacy = tmp_path / "legacy" / "policy"
    d = _tag(legacy, 3)
    torch.save({"w": torch.ones(3)}, d / MODEL, _use_new_zipfile_serialization=False)
    assert checkpoints.problem(legacy, "step3") is None


def test_a_dangling_latest_is_reported_and_the_tags_decide(tmp_path, capsys):
    ckpt = tmp_path / "checkpoints"
    _tag(ckpt / "policy", 2)
    (ckpt / "policy" / "latest").write_text("step4")  # step4 was never written (or was deleted)
    assert checkpoints.resume_tag(ckpt) == "step2"
    err = capsys.readouterr().err
    assert f"{ckpt / 'policy' / 'latest'} names step4, which does not exist" in err


def test_a_tag_is_intact_only_in_every_part_and_with_every_shard(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for s in (1, 2):
        _tag(ckpt / "policy", s)
        _tag(ckpt / "critic", s)
    (ckpt / "critic" / "step2" / MODEL).unlink()
    assert checkpoints.resume_tag(ckpt, ("policy", "critic"), warn=False) == "step1"
    assert checkpoints.resume_tag(ckpt, ("policy",), warn=False) == "step2"
    shards = [MODEL, *(f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 2))]
    part = tmp_path / "zero" / "policy"
    _tag(part, 5, files=shards)
    assert checkpoints.problem(part, "step5") == "the ZeRO optim shard of rank 1 is missing"
    torch.save({}, part / "step5" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert checkpoints.problem(part, "step5") is None
    (part / "step5" / MODEL).write_bytes(b"")
    assert checkpoints.problem(part, "step5").endswith("is empty")


def test_no_intact_checkpoint_is_one_line_naming_the_folder_and_the_restart(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    _truncate(_tag(ckpt / "policy", 2) / MODEL)
    monkeypatch.delenv("POLGRAD_CELL_ID", raising=False)
    with pytest.raises(DataError) as e:
        checkpoints.resume_tag(ckpt)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot resume from {ckpt}: no intact checkpoint (checkpoint {ckpt / 'policy'}")
    # Not "run again without --resume": polgrad.train refuses a folder that holds a run (runlock.py).
    assert msg.endswith(
        f"to start over, move the run folder {tmp_path} aside (or delete it) and run again without --resume, "
        "or choose a new --out"
    )
    monkeypatch.setenv("POLGRAD_CELL_ID", "grpo-s0-1234abcd")  # what the sweep gives its cells
    with pytest.raises(DataError, match="re-run the sweep with --restart grpo-s0-1234abcd"):
        checkpoints.resume_tag(ckpt)
    shutil.rmtree(ckpt)
    assert checkpoints.resume_tag(ckpt) is None  # no checkpoint at all: a fresh start


# ----------------------------------------------------------------------------- the real trainer
FAST = [
    "train.prompts_per_step = 4",
    "train.eval_every = 100",
    "train.eval_size = 16",
    "train.checkpoint_every = 1",
    "train.progress = False",
]


def _train(out: Path, steps: int, resume: bool, extra: list[str] = ()) -> list[dict]:
    import gin

    from polgrad.config import parse_config
    from polgrad.train import run as train

    gin.clear_config()
    parse_config([GRPO], [*FAST, f"train.steps = {steps}", *extra])
    train(str(out), resume=resume)
    return [json.loads(line) for line in open(out / "metrics.jsonl")]


def _deterministic(rows):
    """Rows without wall-clock keys and without eval_accuracy (a run evaluates at its own last step)."""
    timing = {"time_gen", "time_ref", "time_values", "time_adv", "time_update", "tokens_per_s", "time_s"}
    return [{k: v for k, v in r.items() if k not in timing | {"peak_mem_mb", "eval_accuracy"}} for r in rows]


@pytest.mark.slow
def test_resume_falls_back_to_the_newest_intact_checkpoint_and_follows_it(tmp_path, capfd):
    """Step 3's checkpoint is truncated and `latest` names a tag that is gone: the run resumes from
    step 2 (warning lines name both), truncates metrics.jsonl to step 2, and ends with the rows of a
    run resumed from an intact step 3 (i.e. of an uninterrupted run)."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    _train(good, 3, resume=False)
    shutil.copytree(good, bad)
    _truncate(bad / "checkpoints" / "policy" / "step3" / MODEL)
    (bad / "checkpoints" / "policy" / "latest").write_text("step7")
    capfd.readouterr()
    rows = _train(bad, 4, resume=True)
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("warning: ")]
    assert len(err) == 2, err
    assert "names step7, which does not exist" in err[0]
    assert f"checkpoint {bad / 'checkpoints' / 'policy' / 'step3'} is damaged" in err[1]
    assert all(str(bad / "checkpoints" / "policy" / "step2") in ln for ln in err)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    reference = _train(good, 4, resume=True)
    assert _deterministic(rows) == _deterministic(reference)


@pytest.mark.slow
def test_no_intact_checkpoint_is_one_line_from_the_command(tmp_path, capfd, monkeypatch):
    from polgrad import train as train_cli

    out = tmp_path / "run"
    _train(out, 1, resume=False)
    _flip_a_byte(out / "checkpoints" / "policy" / "step1" / MODEL)
    monkeypatch.setenv("POLGRAD_CELL_ID", "grpo-s0-1234abcd")
    capfd.readouterr()
    bind = [a for b in [*FAST, "train.steps = 2"] for a in ("--bind", b)]
    rc = train_cli.main([GRPO, *bind, "--out", str(out), "--resume", "--no-progress"])
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith(("error", "Traceback"))]
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"error: cannot resume from {out / 'checkpoints'}"), err
    assert "re-run the sweep with --restart grpo-s0-1234abcd" in err[0]


# ----------------------------------------------------------------------------- sweep --restart
# (fake_trainer: the fake trainer for sweeps, tests/conftest.py)
def _experiment(tmp_path: Path, grid: str) -> Path:
    data = TESTS / "data"
    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{data / 'base_fake.gin'}'\nSweep.specs = ['{data / 'spec_a.gin'}']\n"
        f"Sweep.grid = {grid}\nSweep.seeds = [0]\nSweep.seed_binding = 'fake_train.seed'\n"
    )
    return path


def _invocations(run_dir: Path) -> list[tuple[bool, int]]:
    lines = [json.loads(ln) for ln in (run_dir / "invocations.jsonl").read_text().splitlines()]
    return [(i["resume"], i["start_step"]) for i in lines if "t0" in i]


def _rows(out: Path) -> dict[str, dict]:
    import csv

    with open(out / "exp" / "exp.csv", newline="") as fh:
        return {r["cell_id"]: r for r in csv.DictReader(fh)}


def test_restart_an_unknown_cell_is_one_line_with_the_closest_id(tmp_path, capsys, fake_trainer):
    path = _experiment(tmp_path, "{'fake_train.lr': [0.1, 0.2]}")
    _, cells = sweep.prepare(str(path))
    typo = cells[0].id[:-1] + "x"
    rc = sweep.main([str(path), "--results", str(tmp_path / "r"), "--restart", typo])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert err.startswith(f"error: --restart: {path} has no cell '{typo}'; did you mean '{cells[0].id}'?")
    assert all(c.id in err for c in cells)  # a short grid lists its ids
    assert not (tmp_path / "r" / "exp" / "runs").exists()  # nothing ran


def test_restart_moves_the_run_aside_and_keeps_the_row_until_the_new_one(tmp_path, capsys, fake_trainer):
    path = _experiment(tmp_path, "{'fake_train.lr': [0.1, 0.2]}")
    out = tmp_path / "r"
    assert sweep.main([str(path), "--results", str(out)]) == 0
    exp, cells = sweep.prepare(str(path))
    cid, other = cells[0].id, cells[1].id
    before = _rows(out)
    runs = out / "exp" / "runs"
    first_metrics = (runs / cid / "metrics.jsonl").read_text()

    # Moving aside alone (what --restart does before the cell runs again): the row stays, pointing
    # at the old folder, so an interrupted restart loses nothing.
    folder.restart(exp, cells, out, [cid], failed=False)
    (old,) = [p for p in runs.iterdir() if p.name.startswith(f"{cid}.old-")]
    assert not (runs / cid).exists() and (old / "metrics.jsonl").read_text() == first_metrics
    moved = _rows(out)[cid]
    assert moved["run_dir"] == str(old.relative_to(out))
    assert {k: v for k, v in moved.items() if k != "run_dir"} == {
        k: v for k, v in before[cid].items() if k != "run_dir"
    }

    rc = sweep.main([str(path), "--results", str(out), "--restart", cid])
    assert rc == 0, capsys.readouterr().err
    assert _invocations(runs / cid) == [(False, 0)]  # from scratch, not resumed
    assert _invocations(runs / other) == [(False, 0)]  # the other cell was not run again
    after = _rows(out)
    assert after[cid]["run_dir"] == str(Path("exp") / "runs" / cid) and after[cid]["status"] == "ok"
    assert after[other] == before[other]
    # --restart itself moves the (now finished) folder aside, in the same way; both attempts stay.
    assert sweep.main([str(path), "--results", str(out), "--restart", cid]) == 0
    assert _invocations(runs / cid) == [(False, 0)]
    assert len(list(runs.glob(f"{cid}.old-*"))) == 2
    assert _rows(out)[cid]["run_dir"] == str(Path("exp") / "runs" / cid)


def test_restart_failed_starts_failed_cells_over_instead_of_resuming(tmp_path, capsys, fake_trainer):
    path = _experiment(tmp_path, "{'fake_train.crash_at': [None, 3]}")
    out = tmp_path / "r"
    assert sweep.main([str(path), "--results", str(out)]) == 1
    rows = {r["fake_train.crash_at"]: r for r in _rows(out).values()}
    runs = out / "exp" / "runs"
    crashed, ok = rows["3"]["cell_id"], rows["None"]["cell_id"]
    assert (runs / crashed / "checkpoints" / "step_2.json").exists()  # a plain re-run would resume
    assert sweep.main([str(path), "--results", str(out), "--restart-failed"]) == 1
    assert _invocations(runs / crashed) == [(False, 0)]
    assert _invocations(runs / ok) == [(False, 0)]
    (old,) = runs.glob(f"{crashed}.old-*")
    assert _invocations(old) == [(False, 0)]
    err = capsys.readouterr().err
    assert f"restart {crashed}: moved its run folder to {old}" in err


# --------------------------------------------------------------------------- keep the N newest
def _tree(ckpt: Path, steps: list[int], marker: int | None) -> None:
    """A checkpoints/ folder: policy and critic tags, the async sampler's files, complete.json."""
    for part in ("policy", "critic"):
        for s in steps:
            (ckpt / part / f"step{s}").mkdir(parents=True)
            (ckpt / part / f"step{s}" / "mp_rank_00_model_states.pt").write_bytes(b"x")
        (ckpt / part / "latest").write_text(f"step{max(steps)}")
    (ckpt / "sampler").mkdir()
    for s in steps:
        (ckpt / "sampler" / f"step{s}.pt").write_bytes(b"x")
    if marker is not None:
        (ckpt / checkpoints.COMPLETE).write_text(json.dumps({"step": marker, "parts": ["policy", "critic"]}))


def _left(ckpt: Path) -> dict[str, list[str]]:
    return {
        p: sorted(x.name for x in (ckpt / p).iterdir() if x.name != "latest")
        for p in ("policy", "critic", "sampler")
    }


def test_prune_keeps_the_newest_tags_of_every_part(tmp_path):
    """Steps 2, 4, 6, 8 saved, complete.json at 6 (step 8's files may still be in flight): keep 2
    keeps 4 and 6 (and 8, newer than the marker, is left alone) in every part and the sampler's."""
    ckpt = tmp_path / "checkpoints"
    _tree(ckpt, [2, 4, 6, 8], marker=6)
    removed = checkpoints.prune(ckpt, 2)
    assert sorted(Path(r).name for r in removed) == ["step2", "step2", "step2.pt"]
    assert _left(ckpt) == {
        "policy": ["step4", "step6", "step8"],
        "critic": ["step4", "step6", "step8"],
        "sampler": ["step4.pt", "step6.pt", "step8.pt"],
    }
    assert checkpoints.prune(ckpt, 2) == []  # nothing more to remove
    assert checkpoints.prune(ckpt, 2, newest=8) and _left(ckpt)["policy"] == ["step6", "step8"]  # just saved


def test_prune_counts_only_tags_present_in_every_part(tmp_path):
    """A tag missing from one part (a critic's files never written) is no checkpoint to resume from:
    it takes no kept place, so keep 2 keeps the two newest tags both parts have."""
    ckpt = tmp_path / "checkpoints"
    _tree(ckpt, [2, 4, 6, 8], marker=8)
    shutil.rmtree(ckpt / "critic" / "step8")
    checkpoints.prune(ckpt, 2)
    # step 8 counted as a checkpoint would keep 8 and 6 and remove step 4, the fallback of step 6
    assert _left(ckpt)["policy"] == ["step4", "step6", "step8"] and _left(ckpt)["critic"] == [
        "step4",
        "step6",
    ]
    _tree(tmp_path / "c2", [2, 4, 6], marker=6)
    shutil.rmtree(tmp_path / "c2" / "critic" / "step6")
    shutil.rmtree(tmp_path / "c2" / "critic" / "step4")
    assert checkpoints.prune(tmp_path / "c2", 2) == []  # only step 2 is whole: nothing goes


def test_prune_without_a_saved_step_removes_nothing_and_keeps_at_least_two(tmp_path):
    ckpt = tmp_path / "checkpoints"
    _tree(ckpt, [2, 4, 6], marker=None)  # no marker, no step given: nothing is known to be saved
    assert checkpoints.prune(ckpt, 2) == [] and _left(ckpt)["policy"] == ["step2", "step4", "step6"]
    with pytest.raises(ConfigError, match="keep at least 2"):
        checkpoints.prune(ckpt, 1)


@pytest.mark.parametrize("keep", [0, 1, 2.5])
def test_keep_checkpoints_below_two_is_refused_at_the_build(keep):
    import gin

    from polgrad.config import build, parse_config

    gin.clear_config()
    parse_config([GRPO], [f"train.keep_checkpoints = {keep}"])
    with pytest.raises(
        ConfigError, match=rf"train.keep_checkpoints must be an integer >= 2 or None \(all\), got {keep}"
    ):
        build()
    gin.clear_config()


@pytest.mark.slow
def test_a_run_keeping_two_checkpoints_resumes_from_the_newest(tmp_path):
    """train.keep_checkpoints = 2 with a checkpoint every step: after 4 steps only steps 3 and 4 are
    left; a resume to step 5 ends with the rows of the run that kept every checkpoint."""
    kept, every = tmp_path / "kept", tmp_path / "every"
    _train(kept, 4, resume=False, extra=["train.keep_checkpoints = 2"])
    assert sorted(p.name for p in (kept / "checkpoints" / "policy").glob("step*")) == ["step3", "step4"]
    rows = _train(kept, 5, resume=True, extra=["train.keep_checkpoints = 2"])
    assert sorted(p.name for p in (kept / "checkpoints" / "policy").glob("step*")) == ["step4", "step5"]
    _train(every, 4, resume=False)
    reference = _train(every, 5, resume=True)
    assert len(list((every / "checkpoints" / "policy").glob("step*"))) == 5
    assert _deterministic(rows) == _deterministic(reference)
