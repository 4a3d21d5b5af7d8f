"""A run folder has one owner, is never silently overwritten, and a resume trains what the run trained.

The lock (polgrad/runlock.py) and the config comparison (polgrad/resume_config.py) are tested on
their own, then through `python -m polgrad.train`, which refuses in one line before any model is
built (so those tests are fast). The acceptance run (two real trainers on one --out at once) is
the slow test at the end.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import gin
import pytest

from polgrad import resume_config, runlock
from polgrad import train as train_cli
from polgrad.config import parse_config
from polgrad.critic import NoCritic
from polgrad.errors import ConfigError

TESTS = Path(__file__).resolve().parents[1]
GRPO = str(TESTS.parent / "registry" / "grpo.gin")
FAST = [
    "train.prompts_per_step = 4",
    "train.eval_every = 100",
    "train.eval_size = 16",
    "train.checkpoint_every = 1",
]


def _binds(*extra: str) -> list[str]:
    return [a for b in [*FAST, *extra] for a in ("--bind", b)]


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(("error", "Traceback"))]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# A second process holding the lock of a folder until it is killed (what a running trainer does).
HOLDER = (
    "import sys, time; from polgrad import runlock; runlock.acquire(sys.argv[1]); print('held', flush=True); "
    "time.sleep(600)"
)


def _holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ----------------------------------------------------------------------------- the lock
def test_a_held_folder_refuses_a_second_owner_in_one_line_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        with pytest.raises(runlock.RunLocked) as e:
            runlock.acquire(run)
    finally:
        holder.kill()
        holder.wait()
    msg = str(e.value)
    assert "\n" not in msg
    assert f"in use by another trainer (pid {holder.pid} on host {socket.gethostname()} since " in msg
    assert "choose another --out" in msg


def test_the_lock_is_released_on_exit_and_on_an_error(tmp_path):
    run = tmp_path / "run"
    with runlock.acquire(run):
        assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    assert not (run / ".lock").exists()
    with pytest.raises(RuntimeError), runlock.acquire(run):
        raise RuntimeError("a crash inside the run")
    assert not (run / ".lock").exists()
    runlock.acquire(run).release()  # free again


def test_a_folder_the_lock_made_is_removed_if_nothing_was_written_and_an_old_one_kept(tmp_path):
    """A run refused before it wrote anything (a config error after the lock) leaves no empty --out
    behind; a folder that existed before, or one the run wrote into, stays."""
    new = tmp_path / "new"
    with pytest.raises(RuntimeError), runlock.acquire(new):
        raise RuntimeError("a config error before any work")
    assert not new.exists()
    with runlock.acquire(new):
        (new / "metrics.jsonl").write_text("{}\n")
    assert (new / "metrics.jsonl").exists() and not (new / ".lock").exists()
    old = tmp_path / "old"
    old.mkdir()
    runlock.acquire(old).release()
    assert old.is_dir()


def test_a_killed_holders_lock_is_taken_over_with_one_warning(tmp_path):
    """kill -9 leaves the lock file (nothing released it) but not the kernel's flock."""
    run = tmp_path / "run"
    holder = _holder(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert (run / ".lock").exists()
    warnings: list[str] = []
    with runlock.acquire(run, warn=warnings.append):
        assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    assert len(warnings) == 1
    assert warnings[0].startswith(f"warning: taking over the stale lock {run / '.lock'} of pid {holder.pid} ")
    assert warnings[0].endswith("(no longer running)")


def test_a_stale_lock_file_of_a_dead_pid_on_this_host_is_taken_over(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    pid = _dead_pid()
    (run / ".lock").write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "since": "then"}))
    warnings: list[str] = []
    runlock.acquire(run, warn=warnings.append).release()
    assert warnings == [
        f"warning: taking over the stale lock {run / '.lock'} of pid {pid} on host {socket.gethostname()} "
        "since then (no longer running)"
    ]


def test_a_lock_file_of_another_host_is_refused(tmp_path):
    """polgrad cannot tell whether a process on another host still runs: it names the file to delete."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text(json.dumps({"pid": 12, "host": "elsewhere", "since": "then"}))
    with pytest.raises(runlock.RunLocked, match=r"pid 12 on host elsewhere since then, another host") as e:
        runlock.acquire(run)
    assert f"delete {run / '.lock'}" in str(e.value)
    assert (run / ".lock").exists()  # not ours to remove


def test_a_lock_file_replaced_between_open_and_flock_is_not_an_orphan_lock(tmp_path, monkeypatch):
    """The holder releases (unlinks its file) and a new owner locks a new file while we are between
    open and flock: our flock then succeeds on the orphan, so we must see the path moved on and lock
    the new file (held: refused), not own a file nobody else can see."""
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    real_flock, new_owner = fcntl.flock, []

    def flock(fd, op):
        if not new_owner:
            new_owner.append(None)
            os.unlink(run / ".lock")
            new_owner[0] = runlock.acquire(run)  # its own flock is the real one (new_owner is set)
        return real_flock(fd, op)

    monkeypatch.setattr(runlock.fcntl, "flock", flock)
    with pytest.raises(runlock.RunLocked, match=f"pid {os.getpid()} "):
        runlock.acquire(run)
    new_owner[0].release()


def test_releasing_a_lock_whose_file_was_replaced_leaves_the_new_owners_file(tmp_path):
    """Our lock file was deleted by hand while we ran and another trainer then locked a new one at
    the same path: our release must not unlink that file (the path no longer names ours), or a third
    trainer could take the folder while the second still runs."""
    run = tmp_path / "run"
    ours = runlock.acquire(run)
    os.unlink(run / ".lock")
    theirs = runlock.acquire(run)  # a new file: our flock is on the unlinked one
    try:
        ours.release()
        assert (run / ".lock").exists() and json.loads((run / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(runlock.RunLocked):
            runlock.acquire(run)  # still held by the new owner
    finally:
        theirs.release()
    assert not (run / ".lock").exists()


def test_out_below_a_regular_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(runlock.RunFolderError) as e:
        runlock.acquire(tmp_path / "f" / "run")
    assert (
        str(e.value)
        == f"--out {tmp_path / 'f' / 'run'}: {tmp_path / 'f'} is a file, not a folder; choose another --out"
    )


# ----------------------------------------------------------------------------- the CLI, before any model
def test_a_held_out_folder_stops_the_trainer_in_one_line(tmp_path, capfd):
    """A second `polgrad.train` on a folder another process holds: exit 2, one line, nothing written."""
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        rc = subprocess.run(
            [sys.executable, "-m", "polgrad.train", GRPO, *_binds("train.steps = 2"), "--out", str(run)],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
    assert rc.returncode == 2
    assert _error_lines(rc.stderr) == [
        f"error: the run folder {run} is in use by another trainer (pid {holder.pid} on host "
        f"{socket.gethostname()} since {json.loads((run / '.lock').read_text())['since']}; lock file "
        f"{run / '.lock'}); wait for it to end, or choose another --out"
    ]
    assert sorted(p.name for p in run.iterdir()) == [".lock"]


@pytest.mark.parametrize("left", ["metrics.jsonl", "summary.json", "checkpoints/policy/step1/x.pt"])
def test_a_folder_holding_a_run_is_not_started_over_without_resume(tmp_path, capfd, left):
    run = tmp_path / "run"
    (run / left).parent.mkdir(parents=True, exist_ok=True)
    (run / left).write_text("kept\n")
    rc = train_cli.main([GRPO, *_binds("train.steps = 2"), "--out", str(run), "--no-progress"])
    err = _error_lines(capfd.readouterr().err)
    assert rc == 2
    assert len(err) == 1 and err[0].startswith(f"error: {run} already holds a run ("), err
    assert err[0].endswith(
        "add --resume to continue it, or choose a new --out to start another (nothing was overwritten)"
    )
    assert (run / left).read_text() == "kept\n"
    assert not (run / ".lock").exists()  # released on the error


def test_an_empty_checkpoints_folder_is_no_run(tmp_path):
    """What the sweep leaves before a fresh start: its stale files removed, maybe an empty checkpoints/."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.gin").write_text("")
    (tmp_path / "cell.json").write_text("{}")
    runlock.check_not_a_run(tmp_path)


def test_out_below_a_file_from_the_command_is_one_line(tmp_path, capfd):
    (tmp_path / "f").write_text("x")
    rc = train_cli.main([GRPO, *_binds("train.steps = 2"), "--out", str(tmp_path / "f" / "run")])
    out, f = tmp_path / "f" / "run", tmp_path / "f"
    assert rc == 2
    assert _error_lines(capfd.readouterr().err) == [
        f"error: --out {out}: {f} is a file, not a folder; choose another --out"
    ]


def test_a_read_only_new_out_says_choose_another_not_resume(tmp_path, capfd, monkeypatch):
    """Today: 'free space and re-run with --resume' for a run that never started."""
    real = os.makedirs
    target = tmp_path / "ro" / "run"

    def makedirs(path, *args, **kwargs):
        if str(path) == str(target):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", makedirs)
    rc = train_cli.main([GRPO, *_binds("train.steps = 2"), "--out", str(target)])
    assert rc == 2
    assert _error_lines(capfd.readouterr().err) == [
        f"error: cannot create the run folder {target} (permission denied); choose another --out"
    ]


# ----------------------------------------------------------------------------- the resumed config
def _config(*bindings: str) -> str:
    gin.clear_config()
    parse_config([GRPO], list(bindings))
    text = gin.config_str()
    gin.clear_config()
    return text


def test_the_diff_names_what_changes_training_with_full_names():
    old = _config("train.steps = 2")
    new = _config("train.steps = 2", "Algorithm.kl_coef = 0.5", "clip.ppo.eps_high = 0.28", "train.lr = 3e-4")
    changes = resume_config.training_changes(resume_config.diff(old, new))
    assert resume_config.describe(changes) == (
        "Algorithm.kl_coef: 0.04 -> 0.5, clip.ppo.eps_high: 0.2 -> 0.28, train.lr: 0.0001 -> 0.0003"
    )


def test_a_changed_macro_is_a_change_of_each_binding_that_reads_it():
    """`Algorithm.kl_coef = %KL` with KL changed: the diff names Algorithm.kl_coef with its values
    (which the resume then applies), not only the macro (which nothing would apply)."""
    old = _config("KL = 0.04", "Algorithm.kl_coef = %KL")
    new = _config("KL = 0.5", "Algorithm.kl_coef = %KL")
    changes = resume_config.training_changes(resume_config.diff(old, new))
    assert changes["Algorithm.kl_coef"] == (0.04, 0.5), changes
    assert resume_config.diff(old, _config("KL = 0.04", "Algorithm.kl_coef = %KL")) == {}


def test_a_reference_change_is_a_change():
    changes = resume_config.diff(_config(), _config("Algorithm.kl = @kl.k1"))
    assert resume_config.describe(changes) == "Algorithm.kl: @kl.k3 -> @kl.k1"


def test_steps_may_grow_and_cosmetic_bindings_may_change():
    old = _config("train.steps = 2")
    new = _config(
        "train.steps = 4",
        "train.progress = False",
        "train.checkpoint_every = 3",
        "train.loggers = ['tensorboard']",
        "tracker.mlflow.tracking_uri = 'file:x'",
    )
    changes = resume_config.diff(old, new)
    assert set(changes) == {
        "train.steps",
        "train.progress",
        "train.checkpoint_every",
        "train.loggers",
        "tracker.mlflow.tracking_uri",
    }
    assert resume_config.training_changes(changes) == {}


def test_a_change_of_type_only_is_a_change():
    """1 -> 1.0 compares equal in Python but is another binding (a check may refuse a float where an
    integer belongs, a part may compute with it differently, and the config the run records changes):
    the resume names it."""
    changes = resume_config.diff(_config("train.seed = 1"), _config("train.seed = 1.0"))
    assert list(changes) == ["train.seed"] and [type(v) for v in changes["train.seed"]] == [int, float]
    assert resume_config.describe(resume_config.training_changes(changes)) == "train.seed: 1 -> 1.0"


def test_fewer_steps_is_a_change():
    changes = resume_config.training_changes(
        resume_config.diff(_config("train.steps = 4"), _config("train.steps = 2"))
    )
    assert resume_config.describe(changes) == "train.steps: 4 -> 2"


def test_a_binding_set_to_its_default_is_no_change_and_a_new_one_is_compared_with_the_default():
    """train.top_p is unbound in the old run (default 1.0): binding 1.0 changes nothing, 0.9 does."""
    old = _config()
    assert resume_config.diff(old, _config("train.top_p = 1.0")) == {}
    assert (
        resume_config.describe(resume_config.diff(old, _config("train.top_p = 0.9")))
        == "train.top_p: 1.0 -> 0.9"
    )


def _resumable(run: Path, *bindings: str) -> None:
    """A run folder as the trainer leaves it after a checkpoint: config.gin and a step tag."""
    (run / "checkpoints" / "policy" / "step1").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "config.gin").write_text(_config(*bindings))


def test_check_refuses_a_training_change_unless_allowed(tmp_path, monkeypatch):
    monkeypatch.delenv("POLGRAD_CELL_ID", raising=False)
    _resumable(tmp_path, "train.steps = 2")
    parse_config([GRPO], ["train.steps = 4", "Algorithm.kl_coef = 0.5"])
    with pytest.raises(ConfigError) as e:
        resume_config.check(tmp_path, allow=False)
    assert str(e.value).startswith(
        "--resume with a config that changes training: Algorithm.kl_coef: 0.04 -> 0.5 ("
    )
    assert "pass --allow-config-change" in str(e.value) and "choose a new --out" in str(e.value)
    assert set(resume_config.check(tmp_path, allow=True)) == {"Algorithm.kl_coef"}


def test_a_sweep_cell_whose_file_changed_is_told_to_restart(tmp_path, monkeypatch):
    """A sweep resumes an unfinished cell with its file's bindings of now; it passes no override flag."""
    _resumable(tmp_path, "train.steps = 2")
    parse_config([GRPO], ["train.steps = 2", "train.lr = 3e-4"])
    monkeypatch.setenv("POLGRAD_CELL_ID", "grpo-s0-1234abcd")
    with pytest.raises(ConfigError) as e:
        resume_config.check(tmp_path, allow=False)
    assert str(e.value).startswith(
        "--resume with a config that changes training: train.lr: 0.0001 -> 0.0003 ("
    )
    assert str(e.value).endswith(
        "undo the change, or re-run the sweep with --restart grpo-s0-1234abcd (it moves the old run folder "
        "aside)"
    )


def test_check_without_a_checkpoint_compares_nothing(tmp_path):
    """A resume with no checkpoint starts the run afresh (and writes config.gin anew)."""
    (tmp_path / "config.gin").write_text(_config())
    parse_config([GRPO], ["Algorithm.kl_coef = 0.5"])
    assert resume_config.check(tmp_path, allow=False) == {}


def test_resume_with_a_changed_kl_coef_exits_in_one_line_naming_it(tmp_path, capfd):
    run = tmp_path / "run"
    _resumable(run, *FAST, "train.steps = 2")
    rc = train_cli.main(
        [
            GRPO,
            *_binds("train.steps = 3", "Algorithm.kl_coef = 0.5"),
            "--out",
            str(run),
            "--resume",
            "--no-progress",
        ]
    )
    err = _error_lines(capfd.readouterr().err)
    assert rc == 2
    assert len(err) == 1, err
    assert err[0].startswith(
        "error: --resume with a config that changes training: Algorithm.kl_coef: 0.04 -> 0.5 ("
    )
    assert not (run / "resume_overrides.jsonl").exists()


def _fake_run(lr: float = 1e-4):
    groups = [{"lr": lr, "eps": 1e-8}, {"lr": lr, "eps": 1e-8}]
    engine = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=groups))
    m = types.SimpleNamespace(engine=engine, critic=NoCritic())
    cfg = types.SimpleNamespace(lr=3e-4, critic_lr=2e-4, adam_eps=1e-6)
    return m, cfg


def _record(run_dir):
    """The ConfigRecord the entry point hands a resume: the parsed bindings and what differs from
    config.gin (polgrad.train.run)."""
    from polgrad import config, resume_config

    bindings = gin.config_str()
    changes = resume_config.diff(resume_config.saved_config(run_dir), bindings)
    return config.ConfigRecord(bindings, "", resume_config.override(changes))


def test_an_allowed_change_acts_from_the_resumed_step_and_is_recorded(tmp_path):
    """The checkpoint restores the old KL coefficient and optimizer lr/eps: the new bindings replace
    them, resume_overrides.jsonl says what changed at which step, config.gin holds the new bindings."""
    from polgrad.loop_state import LoopState, _config_changes

    (tmp_path / "config.gin").write_text(_config("train.steps = 2"))
    parse_config(
        [GRPO], ["train.steps = 4", "Algorithm.kl_coef = 0.5", "train.lr = 3e-4", "train.adam_eps = 1e-6"]
    )
    m, cfg = _fake_run()
    saved = LoopState(step=2, kl_coef=0.04, skipped_steps=1)
    algo = types.SimpleNamespace(kl_coef=0.5)
    state = _config_changes(cfg, algo, m, str(tmp_path), saved, True, _record(tmp_path))
    assert state == LoopState(step=2, kl_coef=0.5, skipped_steps=1)
    assert m.engine.optimizer.param_groups == [{"lr": 3e-4, "eps": 1e-6}, {"lr": 2e-4, "eps": 1e-6}]
    (row,) = [json.loads(line) for line in open(tmp_path / "resume_overrides.jsonl")]
    assert row["step"] == 2
    assert row["changes"] == {
        "Algorithm.kl_coef": ["0.04", "0.5"],
        "train.adam_eps": ["1e-08", "1e-06"],
        "train.lr": ["0.0001", "0.0003"],
        "train.steps": ["2", "4"],
    }
    assert row["overridden"] == ["Algorithm.kl_coef", "train.adam_eps", "train.lr"]
    assert (tmp_path / "config.gin").read_text() == gin.config_str()
    assert resume_config.diff((tmp_path / "config.gin").read_text(), gin.config_str()) == {}


def test_an_unchanged_config_keeps_the_checkpoints_loop_state(tmp_path):
    """A KL controller moved the coefficient to 0.07: a plain resume must not reset it to 0.04."""
    from polgrad.loop_state import LoopState, _config_changes

    (tmp_path / "config.gin").write_text(_config("train.steps = 2"))
    parse_config([GRPO], ["train.steps = 2"])
    m, cfg = _fake_run()
    saved = LoopState(step=2, kl_coef=0.07, skipped_steps=0)
    algo = types.SimpleNamespace(kl_coef=0.04)
    assert _config_changes(cfg, algo, m, str(tmp_path), saved, True, _record(tmp_path)) == saved
    assert m.engine.optimizer.param_groups[0] == {"lr": 1e-4, "eps": 1e-8}
    assert not (tmp_path / "resume_overrides.jsonl").exists()


# ----------------------------------------------------------------------------- acceptance: real trainers
def _trainer(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "polgrad.train", GRPO, *_binds(*extra), "--out", str(out), "--no-progress"]


@pytest.mark.slow
def test_two_trainers_on_one_folder_one_refused_each_step_once(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen(_trainer(run, "train.steps = 3"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (run / ".lock").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    second = subprocess.run(_trainer(run, "train.steps = 3"), capture_output=True, text=True, timeout=300)
    _, first_err = first.communicate(timeout=900)
    assert first.returncode == 0, first_err
    assert second.returncode == 2
    (line,) = _error_lines(second.stderr)
    assert line.startswith(
        f"error: the run folder {run} is in use by another trainer (pid {first.pid} on host "
    )
    assert [json.loads(r)["step"] for r in open(run / "metrics.jsonl")] == [1, 2, 3]
    assert not (run / ".lock").exists()

    # --resume with a changed kl_coef: refused, naming it; allowed with the flag, then it acts.
    changed = ("train.steps = 4", "Algorithm.kl_coef = 0.5")
    refused = subprocess.run(
        [*_trainer(run, *changed), "--resume"], capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 2
    assert _error_lines(refused.stderr)[0].startswith(
        "error: --resume with a config that changes training: Algorithm.kl_coef: 0.04 -> 0.5 ("
    )
    allowed = subprocess.run(
        [*_trainer(run, *changed), "--resume", "--allow-config-change"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert allowed.returncode == 0, allowed.stderr
    rows = [json.loads(r) for r in open(run / "metrics.jsonl")]
    assert [(r["step"], r["kl_coef"]) for r in rows] == [(1, 0.04), (2, 0.04), (3, 0.04), (4, 0.5)]
    assert "Algorithm.kl_coef = 0.5" in (run / "operative_config.gin").read_text()
    (record,) = [json.loads(r) for r in open(run / "resume_overrides.jsonl")]
    assert record["step"] == 3 and record["overridden"] == ["Algorithm.kl_coef"]


# ----------------------------------------------------------------------------- one async setting
def test_a_config_gin_from_before_one_async_setting_reads_in_todays_terms():
    """A run folder's config.gin written when train.async_rollouts existed: async on with the staleness
    unbound trained at k = 1 (the default then), async off trained synchronously whatever k said."""
    diff = resume_config.diff
    assert diff("train.async_rollouts = True\n", "train.max_staleness = 1\n") == {}
    assert diff("train.async_rollouts = True\ntrain.max_staleness = 3\n", "train.max_staleness = 3\n") == {}
    assert diff("train.async_rollouts = False\ntrain.max_staleness = 3\n", "") == {}
    # and a real change still shows: the old async run at k = 1 resumed synchronously
    assert diff("train.async_rollouts = True\n", "") == {"train.max_staleness": (1, 0)}


def _rows(run: Path, rows: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_resume_that_would_switch_async_on_or_off_is_refused_by_the_runs_own_rows(tmp_path):
    """An old config.gin could bind train.max_staleness = k with async off (k did nothing then): read
    today it looks asynchronous. The rows say what the run did (an async step logs staleness_max)."""
    check = resume_config._check_async_matches_rows
    sync_run, async_run = tmp_path / "sync", tmp_path / "async"
    _rows(sync_run, [{"step": 1, "reward_mean": 0.5}])
    _rows(async_run, [{"step": 1, "staleness_max": 1.0}])
    check(sync_run, 0)
    check(async_run, 2)
    with pytest.raises(
        ConfigError, match=r"the run sampled synchronously, and train.max_staleness = 2 would"
    ):
        check(sync_run, 2)
    with pytest.raises(ConfigError, match=r"the run sampled asynchronously .* train.max_staleness = 0 would"):
        check(async_run, 0)
    check(tmp_path / "empty", 3)  # no rows yet: nothing to go by
