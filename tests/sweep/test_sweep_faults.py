"""Faults a user met in the sweep runner: each is one line before any work, or a recovery with nothing lost.

Cells run tests/fake_train.py (POLGRAD_TRAIN_MODULE=fake_train) on the fake base config and specs of
tests/data; Ray's cluster state is faked where a check reads it, so no test here starts Ray.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import types
from pathlib import Path

import pytest
from helpers import csv_rows

from polgrad import sweep
from polgrad.errors import PolgradError

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"
REPO = TESTS.parent

pytestmark = pytest.mark.usefixtures("fake_trainer")


def write_exp(folder: Path, body: str, name: str = "exp") -> Path:
    """An experiment file in `folder` on top of the fake base config and spec_a."""
    path = folder / f"{name}.gin"
    path.write_text(
        f"include '{DATA / 'base_fake.gin'}'\nSweep.specs = ['{DATA / 'spec_a.gin'}']\n"
        + body
        + "\nSweep.seed_binding = 'fake_train.seed'\n"
    )
    return path


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: "), err
    assert "\n" not in err, err
    return err


# ---------------------------------------------------------------------------------------------
# A cell killed by a signal; progress bars on stderr
# ---------------------------------------------------------------------------------------------


def test_a_cell_killed_by_sigkill_is_recorded_as_such_and_a_progress_bar_is_never_the_reason(
    tmp_path, capsys
):
    """Both cells print a traceback's last line, then a loading bar (carriage returns and all), as HF
    does; one then exits 1, the other is SIGKILLed (as by the OOM killer). The killed one is recorded
    as killed, with the likely cause and the fix, in the console, the CSV and the md; the other's
    reason is its exception's line, not the bar drawn after it."""
    path = write_exp(
        tmp_path,
        "fake_train.crash_at = 1\nfake_train.error_line = False\nfake_train.progress_bar = True\n"
        "Sweep.grid = {'fake_train.kill_signal': [0, 9]}\nSweep.seeds = [0]\nSweep.name = 'oom'\n",
    )
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out)]) == 1
    err = capsys.readouterr().err
    rows = {r["fake_train.kill_signal"]: r for r in csv_rows(out / "oom" / "oom.csv")}
    killed = (
        "killed by SIGKILL, usually the kernel's out-of-memory killer (dmesg says so): "
        "run fewer cells at a time (a lower --parallel)"
    )
    assert rows["9"]["status"] == "failed" and rows["9"]["error"] == killed
    assert rows["0"]["status"] == "failed" and rows["0"]["error"] == "RuntimeError: boom at step 1"
    assert f"FAILED  {rows['9']['cell_id']}: {killed}" in err
    assert f"failed {rows['9']['cell_id']}: {killed}" in err
    assert f"failed {rows['0']['cell_id']}: RuntimeError: boom at step 1" in err
    assert "Loading weights" not in "".join(r["error"] for r in rows.values())
    md = (out / "oom" / "oom.md").read_text()
    assert killed in md and "Loading weights" not in md
    # the log keeps what the trainer wrote, bar included
    log = (out / "oom" / "runs" / rows["9"]["cell_id"] / "stdout.log").read_text()
    assert "Loading weights: 100%" in log


def test_a_rank_killed_by_a_signal_under_a_launcher_is_recorded_as_such():
    """A launcher outlives its killed rank and exits 1 with a report whose last line is a rule; the
    report's signal is the cell's reason (torchrun's and DeepSpeed's wording)."""
    from polgrad.sweep import launch

    torchrun = [
        "polgrad.train FAILED",
        "  exitcode  : -9 (pid: 4242)",
        "  traceback : Signal 9 (SIGKILL) received by PID 4242",
        "============================================================",
    ]
    deepspeed = [
        "[launch.py:259:sigkill_handler] ['python', '-m', 'polgrad.train'] exits with return code = -9"
    ]
    for tail in (torchrun, deepspeed):
        assert launch._error_line(None, tail, 1) == "a rank " + launch.killed_by(9)
    assert launch.killed_by(11) == "killed by SIGSEGV"
    assert launch._error_line("error: boom", torchrun, 1) == "boom"  # a rank's own error line first


def test_a_tqdm_line_is_a_progress_bar_even_without_its_carriage_return():
    from polgrad.sweep.launch import is_progress

    assert is_progress("Loading weights: 100%|##########| 3/3 [00:00<00:00, 99.0it/s]\n", False)
    assert is_progress("Map: 12 examples [00:01, 9.80 examples/s]\n", False)
    assert is_progress("anything\r", False) and is_progress("anything\n", True)
    assert not is_progress("RuntimeError: CUDA out of memory (100% of 8 GiB)\n", False)
    assert not is_progress("a Windows line\r\n", False)


# ---------------------------------------------------------------------------------------------
# How many cells at a time
# ---------------------------------------------------------------------------------------------


def test_parallel_above_the_cells_to_run_prints_the_number_that_runs(tmp_path, capsys, monkeypatch):
    from polgrad.sweep import memory

    monkeypatch.setattr(memory, "available_mb", lambda: 1e9)  # memory is not what this test is about
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1, 0.2]}\nSweep.seeds = [0]\n")
    assert sweep.main([str(path), "--results", str(tmp_path / "r"), "--parallel", "99"]) == 0
    err = capsys.readouterr().err
    assert "2 to run (local, 2 at a time)" in err and "99 at a time" not in err


def test_parallel_cells_are_lowered_to_what_fits_in_available_memory(tmp_path, capsys, monkeypatch):
    """3 cells asked at a time, room for 2.5 cells of the default estimate: 2 run at a time, one line
    says why, and every cell still runs."""
    from polgrad.sweep import memory

    monkeypatch.setattr(memory, "available_mb", lambda: 2.5 * memory.CELL_MB)
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1, 0.2, 0.3]}\nSweep.seeds = [0]\n")
    out = tmp_path / "r"
    assert sweep.main([str(path), "--results", str(out), "--parallel", "3"]) == 0
    err = capsys.readouterr().err
    assert (
        f"exp: 3 cells at a time would need about 3 × 1.5 GiB (the tiny default model's), but "
        f"{2.5 * 1.5:.1f} GiB is available (MemAvailable): running 2 at a time"
    ) in err
    assert "3 to run (local, 2 at a time)" in err
    assert [r["status"] for r in csv_rows(out / "exp" / "exp.csv")] == ["ok"] * 3


def test_the_disk_estimate_is_the_largest_finished_run_folder_times_the_cells_to_run(tmp_path):
    from polgrad.sweep import disk

    dirs = [tmp_path / "a", tmp_path / "b"]
    for d, size in zip(dirs, (1000, 3000), strict=True):
        (d / "checkpoints").mkdir(parents=True)
        (d / "checkpoints" / "w.pt").write_bytes(b"x" * size)
        (d / "metrics.jsonl").write_bytes(b"y" * 24)
    assert disk.folder_bytes(dirs[1]) == 3024 and disk.folder_bytes(tmp_path / "gone") == 0
    # 4 cells of up to 3024 bytes: 12,096 bytes against 12,095 free warns, against 12,096 does not
    line = disk.check("x", tmp_path, dirs, 4, free=12_095)
    assert line.startswith("warning: x: the 4 cells to run may write about 4 × 0.00 GiB") and "\n" not in line
    assert disk.check("x", tmp_path, dirs, 4, free=12_096) is None
    assert disk.check("x", tmp_path, [], 4, free=0) is None  # nothing finished: nothing to estimate from
    assert disk.check("x", tmp_path, dirs, 0, free=0) is None  # nothing to run
    assert disk.free_bytes(tmp_path / "not" / "yet") == disk.free_bytes(tmp_path)  # its existing parent


def test_a_sweep_whose_cells_may_not_fit_on_the_disk_warns_and_runs_them(tmp_path, capsys, monkeypatch):
    """A re-run with one cell finished and two to run, on a disk with room for less than two of its run
    folders: one line says so before any cell starts, and every cell still runs."""
    from polgrad.sweep import disk

    out = tmp_path / "r"
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\n")
    assert sweep.main([str(path), "--results", str(out)]) == 0
    (run,) = (out / "exp" / "runs").iterdir()
    size = disk.folder_bytes(run)
    monkeypatch.setattr(disk, "free_bytes", lambda _: int(1.5 * size))
    capsys.readouterr()
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1, 0.2, 0.3]}\nSweep.seeds = [0]\n")
    assert sweep.main([str(path), "--results", str(out)]) == 0
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("warning: exp: the 2 cells to run")]
    assert f"but the disk of {out} has" in line and "runs/<cell>/checkpoints" in line
    assert err.index(line) < err.index("1 already finished, 2 to run")  # before any cell starts
    assert [r["status"] for r in csv_rows(out / "exp" / "exp.csv")] == ["ok"] * 3


def test_the_memory_estimate_is_the_finished_cells_peak_times_the_ranks(tmp_path):
    from polgrad.sweep import memory

    dirs = [tmp_path / "a", tmp_path / "b", tmp_path / "c"]
    for d, peak in zip(dirs, (700.0, 1000.0), strict=False):  # c has not finished
        d.mkdir()
        (d / "summary.json").write_text(f'{{"status": "ok", "peak_mem_mb": {peak}}}')
    assert memory.measured_mb(dirs) == 1000.0
    # 2 ranks of 1000 MiB per cell, 5000 MiB available: 2 cells fit of the 4 asked
    n, line = memory.fit("x", 4, dirs, ranks=2, available=5000.0)
    assert n == 2 and "4 × 2.0 GiB (the largest peak of its finished cells)" in line
    assert memory.fit("x", 2, dirs, ranks=2, available=5000.0) == (2, None)  # fits: unchanged
    assert memory.fit("x", 4, dirs, ranks=1, available=10.0)[0] == 1  # never below one
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemAvailable:    2097152 kB\n")
    assert memory.available_mb(meminfo) == 2048.0
    assert memory.available_mb(tmp_path / "absent") is None


# ---------------------------------------------------------------------------------------------
# The results folder
# ---------------------------------------------------------------------------------------------


def test_results_under_a_regular_file_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    from polgrad.sweep import cli

    def never(*args, **kwargs):
        raise AssertionError("the experiment was validated before the results folder was checked")

    monkeypatch.setattr(cli, "prepare", never)
    somefile = tmp_path / "somefile.txt"
    somefile.write_text("mine\n")
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\n")
    for results in (somefile / "out", somefile):
        assert sweep.main([str(path), "--results", str(results)]) == 2
        assert one_line_error(capsys) == (
            f"error: --results {results}: {somefile} is a file, not a folder; give --results a folder "
            "(it is created if missing; default: results)"
        )
    exp, cells = sweep.prepare(str(path))  # the package's own prepare; run() refuses it too, first
    with pytest.raises(PolgradError, match=r"somefile.txt is a file, not a folder"):
        sweep.run(exp, cells, results_dir=somefile / "out")
    assert somefile.read_text() == "mine\n"


def test_another_experiment_file_of_the_same_name_is_refused_and_nothing_is_written(tmp_path, capsys):
    """b.gin reuses a.gin's Sweep.name with another grid into the same results folder: refused in one
    line naming both files, experiment.json, the CSV and the run folders untouched. a.gin re-run (a
    resume) and a.gin with an edited grid (recorded, the old rows kept) still run."""
    a = write_exp(
        tmp_path, "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\nSweep.name = 'shared'\n", "a"
    )
    b = write_exp(
        tmp_path, "Sweep.grid = {'fake_train.lr': [0.3]}\nSweep.seeds = [0]\nSweep.name = 'shared'\n", "b"
    )
    out = tmp_path / "results"
    assert sweep.main([str(a), "--results", str(out)]) == 0
    capsys.readouterr()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".sweep.lock"}
    assert sweep.main([str(b), "--results", str(out)]) == 2
    assert one_line_error(capsys) == (
        f"error: {out / 'shared' / 'experiment.json'} is the sweep of {a}, not of {b}: both are "
        f"Sweep.name = 'shared', so their cells would mix in one CSV and folder; rename Sweep.name in {b} "
        "or give it another --results folder"
    )
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".sweep.lock"}
    assert after == before
    assert sweep.main([str(a), "--results", str(out)]) == 0  # the same file: a resume
    a.write_text(a.read_text().replace("[0.1]", "[0.1, 0.2]"))  # the same file, its grid edited
    assert sweep.main([str(a), "--results", str(out)]) == 0
    assert [r["fake_train.lr"] for r in csv_rows(out / "shared" / "shared.csv")] == ["0.1", "0.2"]


# ---------------------------------------------------------------------------------------------
# --executor ray, with Ray faked: its cluster state, its init (and the SIGTERM handler it installs)
# ---------------------------------------------------------------------------------------------


class FakeRay(types.ModuleType):
    """The part of Ray's API polgrad/sweep/ray_cells.py calls, on a cluster of `nodes` (ray.nodes()'s
    form). A submitted cell never runs: it is recorded in `submitted`, and `on_wait` is what happens
    when the driver waits for its cells."""

    def __init__(self, nodes, on_wait):
        super().__init__("ray")
        self._nodes, self.on_wait, self.submitted, self.inited = nodes, on_wait, [], False
        fake = self

        class Remote:
            def options(self, **kwargs):
                return self

            def remote(self, *args, **kwargs):
                fake.submitted.append(args)
                return object()

        self.remote = lambda fn: Remote()

    def init(self, **kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray.init does
        self.inited = True

    def is_initialized(self):
        return self.inited

    def nodes(self):
        return self._nodes

    def put(self, value):
        return value

    def wait(self, refs, num_returns=1, timeout=None):
        self.on_wait(self)
        return [], refs

    def cancel(self, ref, force=False):
        pass

    def shutdown(self):
        self.inited = False


@pytest.fixture
def fake_ray(monkeypatch):
    """Install a FakeRay (and the two submodules ray_cells imports) for this test; returns a factory
    `(nodes, on_wait) -> FakeRay`."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def install(nodes, on_wait):
        ray = FakeRay(nodes, on_wait)
        util = types.ModuleType("ray.util")
        groups = types.ModuleType("ray.util.placement_group")
        groups.placement_group = groups.remove_placement_group = lambda *a, **k: None
        strategies = types.ModuleType("ray.util.scheduling_strategies")
        strategies.PlacementGroupSchedulingStrategy = lambda *a, **k: None
        for name, module in (
            ("ray", ray),
            ("ray.util", util),
            ("ray.util.placement_group", groups),
            ("ray.util.scheduling_strategies", strategies),
        ):
            monkeypatch.setitem(sys.modules, name, module)
        return ray

    return install


def _no_cell_may_be_submitted(ray):
    raise AssertionError(f"{len(ray.submitted)} cells were submitted; the check should have refused them")


def test_a_ray_address_where_nothing_listens_is_one_line_within_seconds(
    tmp_path, capsys, monkeypatch, fake_ray
):
    """Ray would retry for minutes; a TCP connect to the address answers at once (connection refused).
    Checked before the experiment is validated and before ray.init."""
    from polgrad.sweep import cli, ray_checks

    def never(*args, **kwargs):
        raise AssertionError("the address was not checked first")

    fake = fake_ray([], _no_cell_may_be_submitted)
    monkeypatch.setattr(fake, "init", never)
    monkeypatch.setattr(cli, "prepare", never)
    with socket.socket() as s:  # a port free now: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\n")
    args = ["--executor", "ray", "--ray-address", f"127.0.0.1:{port}", "--results", str(tmp_path / "r")]
    start = time.monotonic()
    assert sweep.main([str(path), *args]) == 2
    assert time.monotonic() - start < 20  # refused at once (a dropped packet: CONNECT_TIMEOUT_S, 3 s)
    assert one_line_error(capsys) == (
        f"error: --ray-address 127.0.0.1:{port}: no Ray cluster answers there (connection refused); start it "
        "first (`ray start --head` on 127.0.0.1), correct the address, or drop --executor ray to run the "
        "cells on this machine"
    )
    assert not (tmp_path / "r").exists()
    with socket.socket() as server:  # something that answers passes
        server.bind(("127.0.0.1", 0))
        server.listen()
        ray_checks.check_address(f"127.0.0.1:{server.getsockname()[1]}")
    with pytest.raises(PolgradError, match=r"^--ray-address 10\.0\.0\.5: not an address of a Ray cluster"):
        ray_checks.check_address("10.0.0.5")  # no port: Ray's own ValueError, deep in ray.init
    monkeypatch.setenv("RAY_ADDRESS", f"ray://127.0.0.1:{port}")  # what ray.init reads without one
    with pytest.raises(PolgradError, match=rf"^RAY_ADDRESS ray://127.0.0.1:{port}: no Ray cluster answers"):
        ray_checks.check_address(None)
    ray_checks.check_address("local")  # a local Ray: nothing to reach


def test_a_ray_address_ray_cannot_connect_to_is_one_line(tmp_path, capsys, monkeypatch, fake_ray):
    """'auto' with no cluster on this machine (no address to try beforehand): ray.init's ConnectionError
    is one line, not a traceback."""
    fake = fake_ray([], _no_cell_may_be_submitted)

    def no_cluster(**kwargs):
        raise ConnectionError(
            "Could not find any running Ray instance. Please specify the one to connect to by setting the "
            "`--address` flag or `RAY_ADDRESS` environment variable."
        )

    monkeypatch.setattr(fake, "init", no_cluster)
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\n")
    args = ["--executor", "ray", "--ray-address", "auto", "--results", str(tmp_path / "r")]
    assert sweep.main([str(path), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln for ln in lines if ln.startswith(("error", "Traceback"))] == lines[-1:]
    assert lines[-1] == (
        "error: --ray-address auto: Could not find any running Ray instance; start the cluster first "
        "(`ray start --head`), give its address, or drop --executor ray to run the cells on this machine"
    )


def test_a_cell_no_node_can_hold_is_one_line_before_it_is_submitted(tmp_path, capsys, fake_ray):
    """A one-rank cell asking for more CPUs than any live node has would wait for ever (the check
    covered only cells of several ranks); so would a GPU cell on a cluster without GPUs."""
    from polgrad.sweep import ray_checks

    nodes = [
        {"NodeID": "a", "Alive": True, "Resources": {"CPU": 2.0}},
        {"NodeID": "b", "Alive": True, "Resources": {"CPU": 3.0}},
        {"NodeID": "c", "Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}},  # dead: not counted
    ]
    fake = fake_ray(nodes, _no_cell_may_be_submitted)
    path = write_exp(
        tmp_path, "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\nSweep.num_cpus = 4\n"
    )
    assert sweep.main([str(path), "--executor", "ray", "--results", str(tmp_path / "r")]) == 2
    (cell,) = sweep.prepare(str(path))[1]
    # the sweep has started (its first line, the bar), nothing was submitted: one error line, the last
    lines = capsys.readouterr().err.strip().splitlines()
    assert [ln for ln in lines if ln.startswith(("error", "Traceback"))] == lines[-1:]
    assert lines[-1] == (
        f"error: {path}: cell {cell.id} asks for 4 CPUs (Sweep.num_cpus, Sweep.num_gpus), more than any node "
        "of the Ray cluster has (at most 3 CPUs and 0 GPUs on a node); lower them or add a larger node"
    )
    assert fake.submitted == []
    gpu_cell = types.SimpleNamespace(file="x.gin", num_cpus=1, num_gpus=1, placement="PACK")
    with pytest.raises(PolgradError, match=r"^x.gin: cell c1 asks for 1 CPUs and 1 GPUs .* 0 GPUs on a node"):
        ray_checks.check_resources(gpu_cell, "c1", 1, nodes)
    fits = types.SimpleNamespace(file="x.gin", num_cpus=3, num_gpus=0, placement="PACK")
    ray_checks.check_resources(fits, "c1", 1, nodes)  # the largest node holds it


def test_sigterm_to_the_ray_driver_stops_like_the_local_executor(tmp_path, capsys, fake_ray):
    """ray.init installs a SIGTERM handler that exits at once; the sweep's own (stop the cells, say how
    to resume, exit 130) is put back, as the local executor has it."""

    def terminate(ray):
        assert ray.submitted, "the SIGTERM is meant to come while a cell runs"
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
        raise AssertionError("SIGTERM did not stop the driver")

    fake = fake_ray([{"NodeID": "a", "Alive": True, "Resources": {"CPU": 2.0}}], terminate)
    path = write_exp(tmp_path, "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\n")
    before = signal.getsignal(signal.SIGTERM)
    assert sweep.main([str(path), "--executor", "ray", "--results", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err
    assert "exp: stopping; running cells checkpoint their current step" in err
    assert "exp: interrupted; re-run the same command to resume" in err
    assert not fake.inited  # the driver's Ray was shut down
    assert signal.getsignal(signal.SIGTERM) == before


# ---------------------------------------------------------------------------------------------
# Predictions on a metric the design's runs do not record (real cells: polgrad.train's build)
# ---------------------------------------------------------------------------------------------


def test_a_prediction_on_a_metric_no_run_records_is_refused_by_the_dry_run(tmp_path, capsys, monkeypatch):
    """`final_gold_reward` is a reward-model run's; on a sweep trained on the task's reward no run records
    it, and the prediction would stay undecided after every cell trained. The dry run refuses it (and so
    does the real run, whose validation is the same) naming the prediction, the metric and what the runs
    record; a prediction on a recorded metric passes."""
    monkeypatch.delenv("POLGRAD_TRAIN_MODULE", raising=False)  # polgrad's own trainer: cells are built
    monkeypatch.chdir(REPO)
    path = tmp_path / "gold.gin"
    body = (
        "include 'experiments/base_tiny.gin'\nSweep.specs = ['registry/grpo.gin']\n"
        "Sweep.grid = {'Algorithm.kl_coef': [0.0, 0.1]}\nSweep.seeds = [0]\n"
        "Sweep.predictions = [('a KL term keeps the gold', {'Algorithm.kl_coef': 0.1}, '%s', 'higher')]\n"
    )
    path.write_text(body % "final_gold_reward")
    assert sweep.main([str(path), "--dry-run"]) == 2
    assert one_line_error(capsys) == (
        f"error: {path}: line 5: Sweep.predictions[0] ('a KL term keeps the gold'): its metric "
        "final_gold_reward is recorded by none of the 2 runs it compares, so it could never be decided; "
        "they record final_train_reward, eval_accuracy, eval_accuracy_init, kl, kl_exact, entropy, "
        "tokens_per_s, wall_time_s, peak_mem_mb, final_len_correct, final_len_incorrect, "
        "len_incorrect_change: predict one of those, or train with what records it "
        "(train.reward_source = 'reward_model')"
    )
    assert sweep.main([str(path), "--results", str(tmp_path / "r")]) == 2  # the real run: before any cell
    assert "final_gold_reward is recorded by none" in one_line_error(capsys)
    assert not (tmp_path / "r").exists()
    path.write_text(body % "final_train_reward")
    assert sweep.main([str(path), "--dry-run"]) == 0


def test_what_a_built_cell_records():
    """The rules of polgrad/sweep/recorded.py on stand-ins for a TrainConfig and an Algorithm."""
    from types import SimpleNamespace as NS

    from polgrad.results.store import OUTCOME_METRICS
    from polgrad.sweep.recorded import recorded

    rl = NS(needs_reward_model=False, offline=False, needs_reference=True)
    task, rm = NS(reward_source="task", measure_kl=True), NS(reward_source="reward_model", measure_kl=True)
    assert set(recorded(rm, rl)) == set(OUTCOME_METRICS)
    gold = {"final_gold_reward", "eval_rm_score", "eval_rm_score_init", "rm_heldout_accuracy"}
    assert set(OUTCOME_METRICS) - set(recorded(task, rl)) == gold
    reads_rm = NS(needs_reward_model=True, offline=False, needs_reference=True)  # value_init.reward_model
    assert "rm_heldout_accuracy" in recorded(task, reads_rm)
    no_ref = NS(needs_reward_model=False, offline=False, needs_reference=False)
    assert {"kl", "kl_exact"} & set(recorded(NS(reward_source="task", measure_kl=False), no_ref)) == set()
    dpo = NS(needs_reward_model=False, offline=True, needs_reference=True)
    assert recorded(task, dpo) == (
        "eval_accuracy",
        "eval_accuracy_init",
        "tokens_per_s",
        "wall_time_s",
        "peak_mem_mb",
    )
