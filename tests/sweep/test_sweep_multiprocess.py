"""Sweep cells of several ranks on CPU (`Sweep.processes_per_cell`), under both launchers.

The launcher tests run tests/fake_train.py (POLGRAD_TRAIN_MODULE=fake_train): its ranks join no
process group, rank 0 writes the run's files, every rank logs its pid and rank to
invocations.jsonl. The last test trains the real tiny model at world size 2 with ZeRO-3 through
`python -m polgrad.sweep`, once per launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import csv_rows

from polgrad import results, sweep
from polgrad.sweep import processes
from polgrad.sweep.experiment import TRAIN_MODULE_ENV
from polgrad.sweep.slots import GpuSlot, launch_command

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
DATA = TESTS / "data"
LAUNCHERS = ["torchrun", "deepspeed"]
# Variables a launcher sets for its ranks: a test run under a launcher must not pass them on.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def fake_ranks(fake_trainer, monkeypatch):
    """The fake trainer (conftest) launched as ranks: the repository on the ranks' PYTHONPATH and no
    launcher variables left from the environment pytest runs in."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)


def fake_exp(tmp_path: Path, launcher: str, body: str = "") -> Path:
    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{DATA / 'base_fake.gin'}'\n"
        f"Sweep.specs = ['{DATA / 'spec_a.gin'}']\n"
        "Sweep.seeds = [0]\nSweep.seed_binding = 'fake_train.seed'\n"
        f"Sweep.processes_per_cell = 2\nSweep.launcher = '{launcher}'\n" + body
    )
    return path


def starts(run_dir: Path) -> list[dict]:
    lines = [json.loads(ln) for ln in (run_dir / "invocations.jsonl").read_text().splitlines()]
    return [ln for ln in lines if "t0" in ln]


def assert_all_ended(pids) -> None:
    """No pid still runs (a zombie has ended; its parent reaps it)."""
    for pid in pids:
        assert not processes.alive(pid), f"rank process {pid} outlived its cell"


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


def test_cpu_ranks_launch_command_per_launcher():
    py = "/py"
    cmd, env = launch_command("polgrad.train", None, launcher="torchrun", python=py, processes=2)
    assert cmd == [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] + [
        "-m",
        "polgrad.train",
    ]
    assert env == {"CUDA_VISIBLE_DEVICES": ""}  # CPU ranks see no GPU; torchrun picks its own port
    cmd, env = launch_command(
        "polgrad.train", None, launcher="deepspeed", master_port=29611, python=py, processes=3
    )
    assert cmd == [py, "-m", "deepspeed.launcher.runner", "--num_accelerators", "3"] + [
        "--master_port",
        "29611",
        "--no_local_rank",
        "--module",
        "polgrad.train",
    ]
    assert env == {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": None}
    # One process: plain python, whatever the launcher; a GPU slot decides the ranks by its devices.
    for launcher in LAUNCHERS:
        assert launch_command("m", None, launcher=launcher, python=py, processes=1) == ([py, "-m", "m"], {})
    cmd, _ = launch_command("m", GpuSlot(0, (0, 1)), launcher="torchrun", python=py, processes=1)
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"


def test_deepspeed_launcher_accepts_the_binding_flag_it_gets():
    """DeepSpeed's launchers refuse `--bind` (an abbreviation of their --bind_cores_to_rank /
    --bind_core_list) anywhere on the line, but pass `--binding` on to the ranks."""
    from deepspeed.launcher import launch as ds_launch
    from deepspeed.launcher import runner

    user = ["polgrad.train", "a.gin", "--binding", "train.zero_stage = 3", "--out", "d"]
    args = runner.parse_args(["--num_accelerators", "2", "--no_local_rank", "--module", *user])
    assert [args.user_script, *args.user_args] == user
    sys_argv = sys.argv
    try:
        sys.argv = ["launch.py", "--world_info=x", "--module", *user]
        parsed = ds_launch.parse_args()
        assert [parsed.training_script, *parsed.training_script_args] == user
        sys.argv = [
            "launch.py",
            "--world_info=x",
            "--module",
            *[a.replace("--binding", "--bind") for a in user],
        ]
        with pytest.raises(SystemExit):
            ds_launch.parse_args()  # the reason for --binding
    finally:
        sys.argv = sys_argv


# ---------------------------------------------------------------------------------------------
# Running cells of two ranks (fake trainer)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_rank_cell_runs_both_ranks_and_records_world_size(tmp_path, fake_ranks, launcher):
    path = fake_exp(tmp_path, launcher, "fake_train.zero_stage = 3\n")
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out)]) == 0
    (row,) = csv_rows(out / "exp" / "exp.csv")
    assert (row["status"], row["world_size"], row["zero_stage"]) == ("ok", "2", "3")
    run_dir = out / "exp" / "runs" / row["cell_id"]
    ranks = starts(run_dir)
    assert sorted((s["rank"], s["world_size"]) for s in ranks) == [(0, 2), (1, 2)]
    assert all(s["omp"] == str(max(1, results.cpu_count() // 2)) for s in ranks)  # cores split by rank
    cell = json.loads((run_dir / "cell.json").read_text())
    assert cell["ranks"] == 2 and cell["command"].count("--binding" if launcher == "deepspeed" else "--bind ")
    md = (out / "exp" / "exp.md").read_text()
    assert "| world size | ZeRO stage |" in md and "| 2 | 3 |" in md
    assert_all_ended(s["pid"] for s in ranks)


def test_concurrent_deepspeed_cells_get_their_own_master_ports(tmp_path, fake_ranks, monkeypatch):
    from polgrad.sweep import memory

    monkeypatch.setattr(memory, "available_mb", lambda: 1e9)  # --parallel 2 not lowered by a busy machine
    path = fake_exp(
        tmp_path, "deepspeed", "fake_train.sleep_s = 3.0\nSweep.grid = {'fake_train.lr': [0.1, 0.2]}\n"
    )
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out), "--parallel", "2"]) == 0
    rows = csv_rows(out / "exp" / "exp.csv")
    assert [(r["status"], r["world_size"]) for r in rows] == [("ok", "2"), ("ok", "2")]
    ports, spans = set(), []
    for r in rows:
        run_dir = out / "exp" / "runs" / r["cell_id"]
        cmd = json.loads((run_dir / "cell.json").read_text())["command"].split()
        ports.add(cmd[cmd.index("--master_port") + 1])
        ranks = starts(run_dir)
        assert all(s["omp"] == str(max(1, results.cpu_count() // 4)) for s in ranks)  # 2 cells x 2 ranks
        spans.append(min(s["t0"] for s in ranks))
    assert len(ports) == 2
    # The two cells ran at once: each runs 4 steps of 3 s, so one started before the other ended. (Each
    # start waits for its launcher, ranks and imports: seconds apart on a loaded machine, which a
    # 4 x 1 s run could not absorb.)
    assert abs(spans[0] - spans[1]) < 12.0


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_failing_rank_fails_the_cell_with_its_error(tmp_path, fake_ranks, launcher):
    path = fake_exp(
        tmp_path, launcher, "fake_train.sleep_s = 1.0\nfake_train.crash_at = 1\nfake_train.crash_rank = 1\n"
    )
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out)]) == 1
    (row,) = csv_rows(out / "exp" / "exp.csv")
    assert row["status"] == "failed" and row["error"] == "boom at step 1 on rank 1", row
    assert row["world_size"] == "2"  # no summary: the ranks the sweep started
    run_dir = out / "exp" / "runs" / row["cell_id"]
    assert not (run_dir / "summary.json").exists()  # rank 0 was stopped before its end
    assert_all_ended(s["pid"] for s in starts(run_dir))


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_timeout_kills_every_rank_of_the_cell(tmp_path, fake_ranks, launcher, monkeypatch):
    """Sweep.timeout_s = 2, counted from when both ranks run: the cell's trainer is waited on with
    that timeout only once its ranks have logged their start (up to 60 s: the launcher and two ranks
    took over 12 s on a loaded machine), so the test spends 2 s, not a start-up margin, waiting for
    the limit, and the limit is sure to fall while both ranks run their first step (it sleeps 120 s)."""
    path = fake_exp(tmp_path, launcher, "fake_train.sleep_s = 120.0\nSweep.timeout_s = 2\n")
    out = tmp_path / "results"
    (cell,) = sweep.prepare(str(path))[1]
    run_dir = out / "exp" / "runs" / cell.id

    class RanksFirst(subprocess.Popen):
        def wait(self, timeout=None):
            if timeout == 2:  # the sweep's wait on the cell: start its clock when both ranks run
                deadline = time.monotonic() + 60
                while self.poll() is None and time.monotonic() < deadline:
                    try:
                        if (run_dir / "invocations.jsonl").exists() and len(starts(run_dir)) == 2:
                            break
                    except ValueError:  # a line a rank is still writing: read again
                        pass
                    time.sleep(0.05)
            return super().wait(timeout)

    monkeypatch.setattr(subprocess, "Popen", RanksFirst)
    start = time.monotonic()
    assert sweep.main([str(path), "--results", str(out)]) == 1
    assert time.monotonic() - start < 100  # not the 120 s a step sleeps
    (row,) = csv_rows(out / "exp" / "exp.csv")
    assert row["status"] == "failed" and row["error"] == "timed out after 2 s (Sweep.timeout_s)"
    assert row["cell_id"] == cell.id
    ranks = starts(run_dir)
    assert sorted(s["rank"] for s in ranks) == [0, 1]  # both were running when the time was up
    assert_all_ended(s["pid"] for s in ranks)
    assert processes.cell_pids(run_dir.resolve()) == []  # nor the launcher, nor anything of the cell


def start_sweep(path: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "polgrad.sweep", str(path), "--results", str(out)]
    return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for_ranks(proc: subprocess.Popen, run_dir: Path, n: int = 2) -> list[dict]:
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the ranks never started"
        assert proc.poll() is None, "the sweep ended before its ranks started"
        if (run_dir / "invocations.jsonl").exists() and len(starts(run_dir)) == n:
            return starts(run_dir)
        time.sleep(0.1)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_interrupted_sweep_stops_every_rank(tmp_path, fake_ranks, launcher):
    """^C (SIGINT to the sweep alone: the ranks are in a process group of their own)."""
    path = fake_exp(tmp_path, launcher, "fake_train.sleep_s = 60.0\n")
    out = tmp_path / "results"
    (cell,) = sweep.prepare(str(path))[1]
    run_dir = (out / "exp" / "runs" / cell.id).resolve()
    proc = start_sweep(path, out)
    try:
        ranks = wait_for_ranks(proc, run_dir)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        assert_all_ended(s["pid"] for s in ranks)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in processes.cell_pids(run_dir):  # a failed test leaves nothing running
            os.kill(pid, signal.SIGKILL)


def test_ranks_left_by_a_killed_sweep_are_stopped_before_the_cell_runs_again(tmp_path, fake_ranks):
    """SIGKILL to the sweep alone leaves DeepSpeed's launcher and ranks running; the next run of the
    cell finds them by their `--out` and stops them first."""
    path = fake_exp(tmp_path, "deepspeed", "fake_train.sleep_s = 60.0\n")
    out = tmp_path / "results"
    (cell,) = sweep.prepare(str(path))[1]
    run_dir = (out / "exp" / "runs" / cell.id).resolve()
    proc = start_sweep(path, out)
    try:
        ranks = wait_for_ranks(proc, run_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert all(processes.alive(s["pid"]) for s in ranks)  # orphans, still training
        assert len(processes.cell_pids(run_dir)) == 4  # the runner, its launch.py and two ranks
        processes.kill_stale_trainer(run_dir)
        assert_all_ended(s["pid"] for s in ranks)
        assert processes.cell_pids(run_dir) == []
    finally:
        for pid in processes.cell_pids(run_dir):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# The real trainer: world size 2, ZeRO-3, through python -m polgrad.sweep
# ---------------------------------------------------------------------------------------------


# Trains the real model, yet not marked slow: 14 s (torchrun) and 19 s (deepspeed) on 2 idle cores,
# 31 s and 49 s on the same cores under load.
@pytest.mark.cpu_matrix
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_zero3_cell_of_two_ranks_trains_through_the_sweep(tmp_path, launcher):
    exp = tmp_path / "ws2.gin"
    exp.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\n"
        "train.steps = 2\ntrain.prompts_per_step = 2\nAlgorithm.group_size = 4\n"
        "train.eval_every = 2\ntrain.eval_size = 8\ntrain.checkpoint_every = 100\n"
        "train.zero_stage = 3\n"
        f"Sweep.specs = ['{REPO / 'registry' / 'grpo.gin'}']\nSweep.seeds = [0]\n"
        f"Sweep.processes_per_cell = 2\nSweep.launcher = '{launcher}'\nSweep.timeout_s = 300\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARS, TRAIN_MODULE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    out = tmp_path / "results"
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=360,
    )
    print(f"{launcher}: world size 2, ZeRO-3 cell through the sweep: {time.monotonic() - start:.1f} s")
    (row,) = csv_rows(out / "ws2" / "ws2.csv")
    run_dir = out / "ws2" / "runs" / row["cell_id"]
    log = (run_dir / "stdout.log").read_text()
    assert proc.returncode == 0, (row["error"], log[-3000:])
    assert (row["status"], row["world_size"], row["zero_stage"]) == ("ok", "2", "3")
    assert log.count(f"done: {run_dir.resolve()}") == 2  # each rank ran to its end
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["zero_stage"], summary["steps"]) == (2, 3, 2)
    launcher_module = {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner"}
    assert f"-m {launcher_module[launcher]}" in json.loads((run_dir / "cell.json").read_text())["command"]


# ---------------------------------------------------------------------------------------------
# Dry run
# ---------------------------------------------------------------------------------------------


def real_exp(tmp_path: Path, spec: str, processes: int, extra: str = "") -> Path:
    path = tmp_path / f"{spec}_{processes}.gin"
    path.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\ntrain.zero_stage = 3\n"
        f"Sweep.specs = ['{REPO / 'registry' / f'{spec}.gin'}']\nSweep.seeds = [0, 1]\n"
        f"Sweep.processes_per_cell = {processes}\nSweep.launcher = 'torchrun'\n{extra}"
    )
    return path


def test_dry_run_shows_the_ranks_and_refuses_what_the_trainer_refuses_at_world_size_2(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.delenv(TRAIN_MODULE_ENV, raising=False)
    assert sweep.main([str(real_exp(tmp_path, "grpo", 2)), "--dry-run"]) == 0
    assert "= 2 cells, 2 ranks each (torchrun)" in capsys.readouterr().out
    # DAPO's filters keep whole groups and the loop evens the ranks out: fine at world size 2.
    assert sweep.main([str(real_exp(tmp_path, "dapo", 2)), "--dry-run"]) == 0
    capsys.readouterr()
    # vLLM rollouts run on one process only: the trainer refuses them at world size > 1.
    vllm = "train.rollout_backend = 'vllm'\n"
    assert sweep.main([str(real_exp(tmp_path, "grpo", 1, vllm)), "--dry-run"]) == 0
    capsys.readouterr()
    path = real_exp(tmp_path, "grpo", 2, vllm)
    assert sweep.main([str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}: cell grpo-") and "\n" not in err, err
    assert (
        "at Sweep.processes_per_cell = 2: train.rollout_backend = 'vllm' is supported on one process only"
        in err
    )
