"""The sweep runner: experiment files, validation, executors, resume after a crash or a SIGKILL.

Cells run tests/fake_train.py, a fast stand-in that obeys polgrad.train's command-line contract
(POLGRAD_TRAIN_MODULE=fake_train). Experiments are tests/data/fake_grid.gin or small files written
into tmp_path that include tests/data/base_fake.gin and the fake specs spec_a.gin / spec_b.gin.
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
from polgrad.errors import ConfigError
from polgrad.sweep import executors, folder, launch
from polgrad.sweep.slots import GpuSlot, assign_gpu_slots, launch_command

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"
GRID = DATA / "fake_grid.gin"


pytestmark = pytest.mark.usefixtures("fake_trainer")  # every sweep here runs the fake trainer (conftest)


def write_exp(tmp_path: Path, body: str, name: str = "exp") -> Path:
    """An experiment file in tmp_path on top of the fake base config and specs."""
    path = tmp_path / f"{name}.gin"
    path.write_text(
        f"include '{DATA / 'base_fake.gin'}'\n" + body + "\nSweep.seed_binding = 'fake_train.seed'\n"
    )
    return path


def specs(*names: str) -> str:
    return "Sweep.specs = [" + ", ".join(f"'{DATA / n}'" for n in names) + "]\n"


def sweep_env() -> dict[str, str]:
    return dict(os.environ)  # the autouse fixture has set the trainer module and PYTHONPATH


def invocations(run_dir: Path) -> list[dict]:
    lines = (run_dir / "invocations.jsonl").read_text().splitlines()
    return [json.loads(ln) for ln in lines if "t0" in json.loads(ln)]


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: "), err
    assert "\n" not in err, err
    return err


# ---------------------------------------------------------------------------------------------
# Expansion and dry run
# ---------------------------------------------------------------------------------------------


def test_dry_run_expands_the_grid_with_stable_distinct_ids(capsys):
    rc = sweep.main([str(GRID), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0
    exp, cells = sweep.prepare(str(GRID))
    assert len(cells) == 2 * 2 * 2 * 2  # specs × kl × eval_every × seeds
    ids = [c.id for c in cells]
    assert len(set(ids)) == len(ids)
    assert out.splitlines()[0] == (
        "fake_grid: 2 specs × 2 fake_train.kl × 2 fake_train.eval_every × 2 seeds = 16 cells"
    )
    for c in cells:
        line = next(ln for ln in out.splitlines() if ln.startswith(c.id))
        assert c.spec_name in line and f"seed={c.seed}" in line
        for key, value in c.swept:
            assert f"{key} = {value}" in line
    # Every combination once, seed bound last.
    combos = {(c.spec_name, c.swept, c.seed) for c in cells}
    assert len(combos) == 16
    assert all(c.bindings[-1] == f"fake_train.seed = {c.seed}" for c in cells)
    # Stable: a hash of what the file says (pinned), the same in another process and hash seed.
    first = next(c for c in cells if c.spec_name == "spec_a" and c.seed == 0)
    assert first.id == "spec_a-k1-1-s0-0ad121d4"
    again = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(GRID), "--dry-run"],
        capture_output=True,
        text=True,
        env={**sweep_env(), "PYTHONHASHSEED": "12345"},
        timeout=120,
    )
    assert again.returncode == 0, again.stderr
    assert [ln.split()[0] for ln in again.stdout.splitlines()[1:]] == ids


def test_zipped_axis_macro_axis_and_fixed_bindings(tmp_path):
    path = write_exp(
        tmp_path,
        "LR = 0.5\nfake_train.lr = %LR\nfake_train.sleep_s = 0.0\n"
        + specs("spec_a.gin")
        + "Sweep.grid = {('fake_train.steps', 'fake_train.eval_every'): [(2, 1), (4, 2), (6, 3)],"
        " 'LR': [0.1, 0.2]}\nSweep.seeds = [3]\n",
    )
    exp, cells = sweep.prepare(str(path))
    assert len(cells) == 3 * 2
    assert exp.swept_columns == ["fake_train.steps", "fake_train.eval_every", "LR"]
    assert dict(cells[0].swept) == {"fake_train.steps": "2", "fake_train.eval_every": "1", "LR": "0.1"}
    # Order the trainer sees: fixed bindings, then the grid, then the seed.
    assert cells[0].bindings == (
        "LR = 0.5",
        "fake_train.lr = %LR",
        "fake_train.sleep_s = 0.0",
        "fake_train.steps = 2",
        "fake_train.eval_every = 1",
        "LR = 0.1",
        "fake_train.seed = 3",
    )
    assert cells[0].config_files == (str(DATA / "base_fake.gin"), str(DATA / "spec_a.gin"))


def test_cell_id_changes_with_what_the_file_says_about_the_cell(tmp_path):
    body = specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\n"
    a = sweep.expand(sweep.load_experiment(str(write_exp(tmp_path, body, "a"))))[0].id
    b = sweep.expand(sweep.load_experiment(str(write_exp(tmp_path, "fake_train.steps = 9\n" + body, "b"))))[
        0
    ].id
    c = sweep.expand(sweep.load_experiment(str(write_exp(tmp_path, body, "c"))))[0].id
    assert a == c  # the experiment's file name is not part of a cell's identity
    assert a != b and a.rsplit("-", 1)[0] == b.rsplit("-", 1)[0]  # same readable prefix, other hash


# ---------------------------------------------------------------------------------------------
# Bad experiment files: one line naming the file and the binding, before anything runs
# ---------------------------------------------------------------------------------------------

OK_GRID = "Sweep.grid = {'fake_train.kl': [@fakekl.k1, @fakekl.k2]}\nSweep.seeds = [0]\n"

BAD_FILES = {
    "unknown registered component": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.kl': [@fakekl.k1, @kl.k9]}\nSweep.seeds = [0]\n",
        ["Sweep.grid binding 'fake_train.kl = @kl.k9'", "unknown kl 'k9'", "valid kl names:", "did you mean"],
    ),
    "unknown configurable in a grid value": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.kl': [@fakekl.k1, @fakekl.k9]}\nSweep.seeds = [0]\n",
        # not a polgrad part: gin's public API lists no names to suggest from
        ["Sweep.grid binding 'fake_train.kl = @fakekl.k9'", "unknown configurable 'fakekl.k9'"],
    ),
    "unknown parameter in a fixed binding": (
        "fake_train.stepz = 3\n" + specs("spec_a.gin") + OK_GRID,
        [
            "line 2: binding 'fake_train.stepz = 3'",
            "'fake_train' has no parameter 'stepz'",
            "did you mean 'steps'",
        ],
    ),
    "unknown parameter on a grid axis": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.lrr': [0.1, 0.2]}\nSweep.seeds = [0]\n",
        ["Sweep.grid binding 'fake_train.lrr = 0.1'", "no parameter 'lrr'", "did you mean 'lr'"],
    ),
    "unknown configurable in a binding key": (
        "fake_trian.steps = 3\n" + specs("spec_a.gin") + OK_GRID,
        ["line 2: binding 'fake_trian.steps = 3'", "unknown configurable 'fake_trian'"],
    ),
    "mixed types on an axis": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': [0.1, 'big']}\nSweep.seeds = [0]\n",
        ["Sweep.grid['fake_train.lr']", "values mix types (number, string)"],
    ),
    "a quoted reference": (
        specs("spec_a.gin")
        + "Sweep.grid = {'fake_train.kl': [@fakekl.k1, '@fakekl.k2']}\nSweep.seeds = [0]\n",
        ["Sweep.grid['fake_train.kl']", "mix types", "without quotes"],
    ),
    "zipped axis with a short tuple": (
        specs("spec_a.gin") + "Sweep.grid = {('fake_train.lr', 'fake_train.steps'): [(0.1, 2), (0.2,)]}\n"
        "Sweep.seeds = [0]\n",
        ["Sweep.grid[('fake_train.lr', 'fake_train.steps')]", "tuple of 2"],
    ),
    "missing include": (
        "include 'no_such_base.gin'\n" + specs("spec_a.gin") + OK_GRID,
        ["include 'no_such_base.gin'", "file not found"],
    ),
    "missing spec": (
        "Sweep.specs = ['no_such_spec.gin']\n" + OK_GRID,
        ["Sweep.specs: 'no_such_spec.gin'", "spec file not found"],
    ),
    "no specs": (OK_GRID, ["Sweep.specs", "missing"]),
    "empty grid": (specs("spec_a.gin") + "Sweep.grid = {}\nSweep.seeds = [0]\n", ["Sweep.grid", "is empty"]),
    "empty axis": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': []}\nSweep.seeds = [0]\n",
        ["Sweep.grid['fake_train.lr']", "has no values"],
    ),
    "no seeds": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = []\n",
        ["Sweep.seeds", "non-empty list of ints"],
    ),
    "missing seeds": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': [0.1]}\n",
        ["Sweep.seeds", "missing"],
    ),
    "unknown Sweep parameter": (
        specs("spec_a.gin") + OK_GRID + "Sweep.seed = [1]\n",
        ["Sweep.seed", "unknown Sweep parameter 'seed'", "did you mean 'seeds'"],
    ),
    "unknown primary metric": (
        specs("spec_a.gin") + OK_GRID + "Sweep.primary_metric = 'eval_acc'\n",
        ["Sweep.primary_metric", "unknown metric 'eval_acc'", "did you mean 'eval_accuracy'"],
    ),
    "processes_per_cell not a whole number": (
        specs("spec_a.gin") + OK_GRID + "Sweep.processes_per_cell = 2.0\n",
        ["Sweep.processes_per_cell", "must be an int >= 1, got 2.0"],
    ),
    "processes_per_cell zero": (
        specs("spec_a.gin") + OK_GRID + "Sweep.processes_per_cell = 0\n",
        ["Sweep.processes_per_cell", "must be an int >= 1, got 0"],
    ),
    "processes_per_cell against the GPUs": (
        specs("spec_a.gin") + OK_GRID + "Sweep.num_gpus = 1\nSweep.processes_per_cell = 2\n",
        ["Sweep.processes_per_cell", "one process per GPU (Sweep.num_gpus = 1)"],
    ),
    "unknown placement": (
        specs("spec_a.gin") + OK_GRID + "Sweep.placement = 'SPREADS'\n",
        ["Sweep.placement", "unknown placement 'SPREADS'", "valid: PACK, SPREAD", "did you mean 'SPREAD'"],
    ),
    "gin syntax error": (
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': [0.1,\nSweep.seeds = [0]\n",
        ["exp.gin"],
    ),
    "module that does not import": (
        "import no_such_module_xyz\n" + specs("spec_a.gin") + OK_GRID,
        ["'import no_such_module_xyz'", "cannot import"],
    ),
    "REQUIRED left unset": (
        "fake_train.crash_message = %gin.REQUIRED\n" + specs("spec_a.gin") + OK_GRID,
        ["cell spec_a-", "fake_train.crash_message", "REQUIRED"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_experiment_file_is_one_line_naming_file_and_binding(case, tmp_path, capsys):
    body, expected = BAD_FILES[case]
    path = write_exp(tmp_path, body)
    out = tmp_path / "results"
    rc = sweep.main([str(path), "--results", str(out)])
    err = one_line_error(capsys)
    assert rc == 2
    assert f"error: {path}:" in err
    for fragment in expected:
        assert fragment in err, (fragment, err)
    assert not out.exists()  # nothing started


def test_bad_binding_inside_a_spec_names_the_spec(tmp_path, capsys):
    spec = tmp_path / "broken_spec.gin"
    spec.write_text("fake_train.lr = 0.1\nfake_train.epochz = 2\n")
    path = write_exp(tmp_path, f"Sweep.specs = ['{spec}']\n" + OK_GRID)
    assert sweep.main([str(path), "--dry-run"]) == 2
    err = one_line_error(capsys)
    assert str(path) in err and str(spec) in err and "no parameter 'epochz'" in err


def test_unknown_component_of_a_user_module_gets_the_closest_registered_name(tmp_path):
    """`import` in an experiment file loads a user's parts (here in a subprocess: no registry leak)."""
    path = write_exp(
        tmp_path,
        "import sweep_plugin\n"
        + specs("spec_a.gin")
        + "Sweep.grid = {'fake_train.kl': [@kl.sweeptest_k1, @kl.sweeptest_k9]}\nSweep.seeds = [0]\n",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(path), "--dry-run"],
        capture_output=True,
        text=True,
        env=sweep_env(),
        timeout=120,
    )
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert str(path) in err and "@kl.sweeptest_k9" in err
    assert "unknown kl 'sweeptest_k9'" in err and "did you mean 'sweeptest_k1'?" in err


def test_validation_error_is_a_config_error_for_library_callers(tmp_path):
    path = write_exp(
        tmp_path, specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': [0.1, 'x']}\nSweep.seeds = [0]\n"
    )
    with pytest.raises(ConfigError, match="values mix types"):
        sweep.prepare(str(path))


# ---------------------------------------------------------------------------------------------
# Running: crashes, skipping, resuming, parallel, ray
# ---------------------------------------------------------------------------------------------


def test_crashing_cell_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    path = write_exp(
        tmp_path,
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.crash_at': [None, 3, 1]}\nSweep.seeds = [0]\n",
        name="crashy",
    )
    out = tmp_path / "results"
    rc = sweep.main([str(path), "--results", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    rows = {r["fake_train.crash_at"]: r for r in csv_rows(out / "crashy" / "crashy.csv")}
    assert set(rows) == {"None", "3", "1"}
    assert rows["None"]["status"] == "ok" and float(rows["None"]["eval_accuracy"]) > 0
    for at in ("3", "1"):
        assert rows[at]["status"] == "failed"
        assert rows[at]["error"] == f"boom at step {at}"  # the trainer's last stderr line
        assert rows[at]["eval_accuracy"] == ""
    assert "1 ok, 2 failed of 3 cells" in err
    assert f"failed {rows['3']['cell_id']}: boom at step 3" in err
    log = (out / "crashy" / "runs" / rows["3"]["cell_id"] / "stdout.log").read_text()
    assert "fake_train: steps 0..3" in log and "error: boom at step 3" in log  # stdout and stderr
    md = (out / "crashy" / "crashy.md").read_text()
    assert "## Failed cells" in md and "boom at step 1" in md

    # Re-run: the finished cell is skipped, the failed ones run again; the one that got past a
    # checkpoint (step 2) resumes from it.
    rc = sweep.main([str(path), "--results", str(out)])
    assert rc == 1
    runs = out / "crashy" / "runs"
    assert len(invocations(runs / rows["None"]["cell_id"])) == 1
    again = invocations(runs / rows["3"]["cell_id"])
    assert [(i["resume"], i["start_step"]) for i in again] == [(False, 0), (True, 2)]
    assert [(i["resume"], i["start_step"]) for i in invocations(runs / rows["1"]["cell_id"])] == [
        (False, 0),
        (False, 0),
    ]
    assert len(csv_rows(out / "crashy" / "crashy.csv")) == 3


def test_rerun_skips_finished_cells_and_results_are_deterministic(tmp_path):
    path = write_exp(
        tmp_path,
        specs("spec_a.gin", "spec_b.gin") + "Sweep.grid = {'fake_train.kl': [@fakekl.k1, @fakekl.k3]}\n"
        "Sweep.seeds = [0, 1]\nSweep.name = 'det'\n",
    )
    out1, out2 = tmp_path / "r1", tmp_path / "r2"
    assert sweep.main([str(path), "--results", str(out1)]) == 0
    first = (out1 / "det" / "det.csv").read_text()
    assert sweep.main([str(path), "--results", str(out1)]) == 0  # nothing left to do
    assert (out1 / "det" / "det.csv").read_text() == first  # rows intact, not duplicated
    _, cells = sweep.prepare(str(path))
    for c in cells:
        assert len(invocations(out1 / "det" / "runs" / c.id)) == 1
        run = out1 / "det" / "runs" / c.id
        assert {"config.gin", "metrics.jsonl", "summary.json", "stdout.log", "cell.json"} <= {
            p.name for p in run.iterdir()
        }
        cell = json.loads((run / "cell.json").read_text())
        assert cell["command"].split()[1:3] == ["-m", "fake_train"] and "--out" in cell["command"]

    assert sweep.main([str(path), "--results", str(out2), "--parallel", "2"]) == 0
    metric_cols = ["cell_id", "spec", "fake_train.kl", "seed", *results.METRICS, "steps", "status"]
    a, b = csv_rows(out1 / "det" / "det.csv"), csv_rows(out2 / "det" / "det.csv")
    assert [[r[c] for c in metric_cols] for r in a] == [[r[c] for c in metric_cols] for r in b]
    assert [r["cell_id"] for r in a] == [c.id for c in cells]  # expansion order, not finish order


def test_parallel_runs_cells_concurrently_with_split_threads(tmp_path, monkeypatch):
    from polgrad.sweep import memory

    # Memory is not what this test is about: --parallel 2 must not be lowered by a busy machine's
    # MemAvailable. Each cell runs 4 steps of 1.5 s, so two starts seconds apart still overlap.
    monkeypatch.setattr(memory, "available_mb", lambda: 1e9)
    path = write_exp(
        tmp_path,
        "fake_train.sleep_s = 1.5\n"
        + specs("spec_a.gin")
        + "Sweep.grid = {'fake_train.lr': [0.1, 0.2]}\nSweep.seeds = [0]\n",
    )
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out), "--parallel", "2"]) == 0
    starts, ends = [], []
    for run in (out / "exp" / "runs").iterdir():
        lines = [json.loads(ln) for ln in (run / "invocations.jsonl").read_text().splitlines()]
        starts.append(lines[0]["t0"])
        ends.append(lines[-1]["end"])
        assert lines[0]["omp"] == str(max(1, results.cpu_count() // 2))
    assert max(starts) < min(ends)  # both were running at once


def test_sigkill_mid_grid_then_rerun_resumes_without_duplicates(tmp_path):
    path = write_exp(
        tmp_path,
        "fake_train.sleep_s = 0.3\nfake_train.steps = 6\n"
        + specs("spec_a.gin")
        + "Sweep.grid = {'fake_train.lr': [0.1, 0.2, 0.3]}\nSweep.seeds = [0]\nSweep.name = 'killed'\n",
    )
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "polgrad.sweep", str(path), "--results", str(out)]
    _, cells = sweep.prepare(str(path))
    runs = out / "killed" / "runs"
    proc = subprocess.Popen(
        cmd, env=sweep_env(), start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 90
        while True:  # wait for: one cell in the CSV, the next one past its first checkpoint
            assert time.monotonic() < deadline, "the sweep never reached the kill point"
            assert proc.poll() is None, "the sweep ended before it could be killed"
            csv_file = out / "killed" / "killed.csv"
            done = csv_rows(csv_file) if csv_file.exists() else []
            if len(done) == 1 and (runs / cells[1].id / "checkpoints" / "step_2.json").exists():
                break
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its trainer: the same process group
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    killed_pid = invocations(runs / cells[1].id)[0]["pid"]
    time.sleep(0.2)
    assert not Path(f"/proc/{killed_pid}").exists() or "Z" in Path(f"/proc/{killed_pid}/stat").read_text()
    before = csv_rows(out / "killed" / "killed.csv")
    assert [r["cell_id"] for r in before] == [cells[0].id]

    rerun = subprocess.run(cmd, env=sweep_env(), capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    after = csv_rows(out / "killed" / "killed.csv")
    assert [r["cell_id"] for r in after] == [c.id for c in cells]  # no duplicates, expansion order
    assert after[0] == before[0]  # the finished row is untouched
    assert all(r["status"] == "ok" for r in after)
    assert len(invocations(runs / cells[0].id)) == 1
    resumed = invocations(runs / cells[1].id)
    assert [(i["resume"], i["start_step"]) for i in resumed][-1][0] is True
    assert resumed[-1]["start_step"] >= 2
    steps = [json.loads(ln)["step"] for ln in (runs / cells[1].id / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(6))  # the resumed curve has each step once
    results.load("killed", out)  # parses


def _require_ray():
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray is not installed; CI must install the ray extra (pip install '.[ray]')")
        pytest.importorskip("ray", reason="ray is not installed (pip install 'polgrad[ray]')")


@pytest.mark.ray
def test_ray_executor_runs_cells_as_ray_tasks(tmp_path):
    _require_ray()
    path = write_exp(
        tmp_path,
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.kl': [@fakekl.k1, @fakekl.k2]}\nSweep.seeds = [0]\n"
        "Sweep.name = 'on_ray'\nSweep.num_cpus = 1\n",
    )
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(path), "--executor", "ray", "--results", str(out)],
        capture_output=True,
        text=True,
        env={**sweep_env(), "RAY_USAGE_STATS_ENABLED": "0"},
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = csv_rows(out / "on_ray" / "on_ray.csv")
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows)
    for r in rows:
        inv = invocations(out / r["run_dir"])
        assert len(inv) == 1 and inv[0]["omp"] == "1"  # threads = the task's num_cpus
    assert (out / "on_ray" / "on_ray.md").exists() and (out / "on_ray" / "on_ray.png").exists()


def test_ray_executor_without_ray_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    path = write_exp(tmp_path, specs("spec_a.gin") + OK_GRID)
    assert sweep.main([str(path), "--executor", "ray", "--results", str(tmp_path / "r")]) == 2
    assert "needs Ray: pip install 'polgrad[ray]'" in one_line_error(capsys)


# ---------------------------------------------------------------------------------------------
# GPU slots and launch commands (pure; no GPU needed)
# ---------------------------------------------------------------------------------------------


def test_assign_gpu_slots_packs_disjoint_slices():
    slots = assign_gpu_slots(8, 2, 10)
    assert [s.cuda_visible_devices for s in slots] == ["0,1", "2,3", "4,5", "6,7"]
    assert assign_gpu_slots(8, 2, 3) == assign_gpu_slots(8, 2, 10)[:3]  # no more than cells
    assert [s.devices for s in assign_gpu_slots(5, 2, 9)] == [(0, 1), (2, 3)]  # GPU 4 idles
    assert [s.devices for s in assign_gpu_slots(4, 4, 2)] == [(0, 1, 2, 3)]
    # Physical ids from CUDA_VISIBLE_DEVICES of the sweep itself.
    assert [s.cuda_visible_devices for s in assign_gpu_slots(4, 1, 4, devices=[4, 5, 6, 7])] == [
        "4",
        "5",
        "6",
        "7",
    ]
    # A fraction 1/k packs k cells per GPU.
    assert [s.devices for s in assign_gpu_slots(2, 0.5, 8)] == [(0,), (0,), (1,), (1,)]
    all_devices = [d for s in assign_gpu_slots(8, 2, 10) for d in s.devices]
    assert len(all_devices) == len(set(all_devices))
    assert assign_gpu_slots(8, 2, 0) == []
    with pytest.raises(ValueError, match="needs 4 GPUs but only 2"):
        assign_gpu_slots(2, 4, 1)
    with pytest.raises(ValueError, match="1/k"):
        assign_gpu_slots(2, 0.4, 1)


def test_launch_command_per_slot():
    py = "/py"
    assert launch_command("polgrad.train", None, python=py) == ([py, "-m", "polgrad.train"], {})
    one = GpuSlot(0, (3,))
    assert launch_command("polgrad.train", one, python=py) == (
        [py, "-m", "polgrad.train"],
        {"CUDA_VISIBLE_DEVICES": "3"},
    )
    two = GpuSlot(1, (2, 3))
    cmd, env = launch_command("polgrad.train", two, launcher="deepspeed", master_port=29611, python=py)
    assert cmd == [
        py,
        "-m",
        "deepspeed.launcher.runner",
        "--include",
        "localhost:2,3",
        "--master_port",
        "29611",
        "--no_local_rank",
        "--module",
        "polgrad.train",
    ]
    assert env == {"CUDA_VISIBLE_DEVICES": None}  # deepspeed picks GPUs by --include
    cmd, env = launch_command("polgrad.train", two, launcher="torchrun", python=py)
    assert cmd == [
        py,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "polgrad.train",
    ]
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3"}


def test_local_executor_gives_each_cell_its_gpu_slot(tmp_path, monkeypatch):
    """On a (pretend) 4-GPU node with 2 GPUs per cell: two cells at a time, disjoint devices."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    seen = []
    real = launch.run_cell

    def spy(cell, run_dir, **kw):
        seen.append((kw["slot"].devices, kw["launcher"], kw["threads"]))
        return real(cell, run_dir, **{**kw, "slot": None})  # the fake trainer runs on CPU

    monkeypatch.setattr(executors, "run_cell", spy)  # where the local executor looks it up
    path = write_exp(
        tmp_path,
        specs("spec_a.gin") + "Sweep.grid = {'fake_train.lr': [0.1, 0.2, 0.3]}\nSweep.seeds = [0]\n"
        "Sweep.num_gpus = 2\nSweep.launcher = 'torchrun'\n",
    )
    assert sweep.main([str(path), "--results", str(tmp_path / "r")]) == 0
    assert len(seen) == 3
    assert {s[0] for s in seen} <= {(0, 1), (2, 3)}
    assert all(s[1] == "torchrun" and s[2] == max(1, results.cpu_count() // 2) for s in seen)


# ---------------------------------------------------------------------------------------------
# Leaderboard files
# ---------------------------------------------------------------------------------------------


def test_markdown_and_png_after_a_sweep(tmp_path, monkeypatch):
    # Each spec's runs record their Table-5 row in summary.json (as polgrad.train does); the md
    # takes it from the CSV, never from the spec files.
    table = {
        "spec_a": "{'method': 'A-PO', 'type': 'on-policy', 'reward_model': 'rule', 'value_function': 'none', "
        "'reference_policy': 'yes', 'core_loss': 'clip(r·A)'}",
        "spec_b": "{'method': 'B-PO', 'type': 'on-policy', 'reward_model': 'rule', "
        "'value_function': 'critic', 'reference_policy': 'no', 'core_loss': 'r·A'}",
    }
    for name, row in table.items():
        (tmp_path / f"{name}.gin").write_text(
            (DATA / f"{name}.gin").read_text() + f"fake_train.table5 = {row}\n"
        )
    (tmp_path / "base_fake.gin").write_text((DATA / "base_fake.gin").read_text())
    (tmp_path / "fake_grid.gin").write_text(GRID.read_text())
    grid = tmp_path / "fake_grid.gin"
    out = tmp_path / "results"
    assert sweep.main([str(grid), "--results", str(out), "--parallel", "2"]) == 0
    rows = csv_rows(out / "fake_grid" / "fake_grid.csv")
    assert len(rows) == 16
    expected_cols = [
        "experiment",
        "cell_id",
        "spec",
        "spec_file",
        "fake_train.kl",
        "fake_train.eval_every",
        "seed",
        "warm_start",  # the policy the run started from (empty: the stand-in trainer records none)
        "not_read",  # the swept bindings a cell does not read (empty: a stand-in trainer is not built)
        *results.METRICS,
        "steps",
        "world_size",
        "zero_stage",
        "table5_method",
        "table5_type",
        "table5_reward_model",
        "table5_value_function",
        "table5_reference_policy",
        "table5_core_loss",
        "status",
        "error",
        "run_dir",
        "git_commit",
        "git_diff",
        "python",
        "torch",
        "transformers",
        "deepspeed",
        "hostname",
        "cpu_count",
        "cpu",  # model · torch's CPU capability · bf16 ISA flags (polgrad/machine.py)
        "finished_at",
    ]
    assert list(rows[0]) == expected_cols
    assert {r["fake_train.kl"] for r in rows} == {"@fakekl.k1", "@fakekl.k2"}

    md = (out / "fake_grid" / "fake_grid.md").read_text()
    lines = md.splitlines()
    assert lines[0] == "# fake_grid"
    assert lines[2].startswith("Machine: ") and "python " in lines[2] and "torch " in lines[2]
    assert "command: `python -m polgrad.sweep" in lines[2]
    header = next(ln for ln in lines if ln.startswith("| rank"))
    for col in (
        "fake_train.kl",
        "fake_train.eval_every",
        "eval_accuracy",
        "world size",
        "ZeRO stage",
        "method",
        "type",
        "reward model",
        "value function",
        "reference policy",
        "core loss",
    ):
        assert f" {col} |" in header
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| rank"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    body = [ln for ln in lines[start + 2 : end]]  # the leaderboard's rows
    assert len(body) == 8  # groups: 2 specs × 2 kl × 2 eval_every, 2 seeds each
    # the ★ is given only where the leader section's corrected p-values support it
    starred = any("★" in ln for ln in body)
    assert starred == ("significantly higher than each other configuration" in md)
    assert "A-PO" in md and "B-PO" in md and "clip(r·A)" in md
    assert " ± " in body[0]  # two seeds: a CI
    # Sorted by the primary metric, best first.
    board = results.leaderboard(rows, ["spec", "fake_train.kl", "fake_train.eval_every"], "eval_accuracy")
    means = [e["eval_accuracy"][0] for e in board]
    assert means == sorted(means, reverse=True)

    import matplotlib.image

    img = matplotlib.image.imread(out / "fake_grid" / "fake_grid.png")
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400
    assert img[..., :3].std() > 0.01  # not a blank canvas

    # The report can be rewritten from the CSV alone.
    (out / "fake_grid" / "fake_grid.md").unlink()
    assert results.main(["fake_grid", "--results", str(out)]) == 0
    assert (out / "fake_grid" / "fake_grid.md").read_text().splitlines()[4:] == lines[4:]


def test_table5_row_of_the_summary_lands_in_the_csv(tmp_path):
    """summary["table5"] (the trainer's Table-5 row) becomes table5_* columns; without it, none."""
    spec_t5 = tmp_path / "spec_t5.gin"
    spec_t5.write_text(
        "fake_train.lr = 0.2\n"
        "fake_train.table5 = {'method': 'T5-PO', 'type': 'on-policy', 'reward_model': 'rule', "
        "'value_function': 'none', 'reference_policy': 'yes', 'core_loss': 'clip(r·A)'}\n"
    )
    path = write_exp(
        tmp_path,
        f"Sweep.specs = ['{DATA / 'spec_a.gin'}', '{spec_t5}']\n"
        "Sweep.grid = {'fake_train.kl': [@fakekl.k1]}\nSweep.seeds = [0]\nSweep.name = 't5'\n",
    )
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out)]) == 0
    table5_cols = [
        "table5_method",
        "table5_type",
        "table5_reward_model",
        "table5_value_function",
        "table5_reference_policy",
        "table5_core_loss",
    ]
    rows = {r["spec"]: r for r in csv_rows(out / "t5" / "t5.csv")}
    assert set(rows) == {"spec_a", "spec_t5"}
    header = list(rows["spec_t5"])
    assert all(c in header for c in table5_cols)
    assert [rows["spec_t5"][c] for c in table5_cols] == [
        "T5-PO",
        "on-policy",
        "rule",
        "none",
        "yes",
        "clip(r·A)",
    ]
    assert [rows["spec_a"][c] for c in table5_cols] == [""] * 6  # its summary had no table5

    # The row itself: the columns only when summary["table5"] is a dict.
    exp, cells = sweep.prepare(str(path))
    run_dir = out / "t5" / "runs" / cells[0].id
    for table5, present in ((None, False), ("not a dict", False), ({"type": "on-policy"}, True)):
        summary = {"status": "ok", "table5": table5}
        row = folder.row(exp, cells[0], run_dir, out, {"status": "ok", "summary": summary})
        assert all((c in row) is present for c in table5_cols), (table5, row)
    assert row["table5_type"] == "on-policy" and row["table5_core_loss"] is None


def test_cell_over_its_timeout_is_killed_and_recorded(tmp_path, capsys):
    path = write_exp(
        tmp_path,
        "fake_train.sleep_s = 5.0\n"
        + specs("spec_a.gin")
        + "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [0]\nSweep.timeout_s = 1.5\n",
    )
    out = tmp_path / "results"
    start = time.monotonic()
    assert sweep.main([str(path), "--results", str(out)]) == 1
    assert time.monotonic() - start < 30
    (row,) = csv_rows(out / "exp" / "exp.csv")
    assert row["status"] == "failed" and row["error"] == "timed out after 1.5 s (Sweep.timeout_s)"
    # the cell's log says so too, last (the real trainer answers SIGTERM with 'interrupted; re-run
    # with --resume', which alone read as if someone had pressed ^C)
    log = (out / "exp" / "runs" / row["run_dir"].split("/")[-1] / "stdout.log").read_text().splitlines()
    assert "timed out after 1.5 s (Sweep.timeout_s): stopping the trainer" in log[-2]
    assert log[-1] == "error: timed out after 1.5 s (Sweep.timeout_s); re-run the sweep to resume the cell"


def test_two_sweeps_on_one_experiment_folder_do_not_run_at_once(tmp_path, capsys):
    path = write_exp(tmp_path, specs("spec_a.gin") + OK_GRID)
    out = tmp_path / "results"
    (out / "exp").mkdir(parents=True)
    with folder.sweep_lock(out / "exp"):
        assert sweep.main([str(path), "--results", str(out)]) == 2
        err = one_line_error(capsys)
        assert "is in use by another sweep" in err and f"pid {os.getpid()}" in err
    assert sweep.main([str(path), "--results", str(out)]) == 0  # released


def test_an_experiment_that_includes_another_inherits_it_and_overrides(tmp_path):
    """A pilot is its experiment on other seeds under another name: including the experiment file
    inherits its includes, bindings and Sweep parameters (the included file is not passed to gin, whose
    parser knows no Sweep), so the pilot's cells are the experiment's cells but for the seed."""
    body = (
        specs("spec_a.gin")
        + "fake_train.steps = 3\nSweep.grid = {'fake_train.lr': [0.1, 0.2]}\nSweep.seeds = [10, 11]\n"
        + "Sweep.question = 'q?'\n"
    )
    full = write_exp(tmp_path, body, "full")
    pilot = tmp_path / "sub" / "pilot.gin"
    pilot.parent.mkdir()
    pilot.write_text(
        "include '../full.gin'\nSweep.name = 'full_pilot'\nSweep.seeds = [0]\nfake_train.sleep_s = 0.0\n"
    )
    exp_full, exp_pilot = sweep.load_experiment(str(full)), sweep.load_experiment(str(pilot))
    assert (exp_pilot.name, exp_pilot.seeds, exp_pilot.question) == ("full_pilot", [0], "q?")
    assert exp_pilot.axes == exp_full.axes and exp_pilot.seed_binding == "fake_train.seed"
    assert exp_pilot.include_paths == exp_full.include_paths  # base_fake.gin, not full.gin
    cells_full, cells_pilot = sweep.expand(exp_full), sweep.expand(exp_pilot)
    assert [c.config_files for c in cells_pilot] == [c.config_files for c in cells_full[::2]]
    # the parent's bindings first, then the pilot's own
    assert "fake_train.steps = 3" in cells_pilot[0].bindings
    assert cells_pilot[0].bindings.index("fake_train.steps = 3") < cells_pilot[0].bindings.index(
        "fake_train.sleep_s = 0.0"
    )
    loop = tmp_path / "loop.gin"
    loop.write_text("include 'loop.gin'\n" + body)
    with pytest.raises(ConfigError, match="include each other in a cycle"):
        sweep.load_experiment(str(loop))


def test_an_inherited_experiment_means_the_same_files_from_another_folder(tmp_path, monkeypatch):
    """The parent's include and specs are rebased (a decoy spec of the same name beside the pilot is not
    taken), the pilot names its own results, and its cell ids do not depend on where the checkout lives
    or which folder the sweep is started from."""
    import shutil

    def tree(root: Path) -> Path:
        (root / "a").mkdir(parents=True)
        (root / "b").mkdir()
        shutil.copy(DATA / "base_fake.gin", root / "a" / "base.gin")
        shutil.copy(DATA / "spec_a.gin", root / "a" / "myspec.gin")
        (root / "b" / "myspec.gin").write_text("fake_train.steps = 99\n")  # a decoy: not the parent's spec
        (root / "a" / "exp.gin").write_text(
            "include 'base.gin'\nSweep.name = 'exp'\nSweep.specs = ['myspec.gin']\n"
            "Sweep.grid = {'fake_train.lr': [0.1]}\nSweep.seeds = [10]\n"
            "Sweep.seed_binding = 'fake_train.seed'\n"
        )
        (root / "b" / "pilot.gin").write_text("include '../a/exp.gin'\nSweep.seeds = [0]\n")
        return root

    one, two = tree(tmp_path / "one"), tree(tmp_path / "elsewhere" / "two")
    monkeypatch.chdir(tmp_path)
    pilot = sweep.load_experiment(str(one / "b" / "pilot.gin"))
    assert pilot.name == "pilot" and pilot.seeds == [0]  # not the parent's name: its own results
    assert [Path(p).resolve() for p in pilot.spec_paths] == [(one / "a" / "myspec.gin").resolve()]
    assert [Path(p).resolve() for p in pilot.include_paths] == [(one / "a" / "base.gin").resolve()]
    ids_one = [c.id for c in sweep.expand(pilot)]
    monkeypatch.chdir(two)  # (not two/b: a path is looked up in the working directory first, by design)
    ids_two = [c.id for c in sweep.expand(sweep.load_experiment("b/pilot.gin"))]
    assert ids_one == ids_two
