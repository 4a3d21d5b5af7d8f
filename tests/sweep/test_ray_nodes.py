"""A Ray node's copies of the cells it runs: held while their task runs, removed once nobody holds them
(a task that was cancelled, or died with its node), and what a task writes there brought to the driver.
Pure process and file work: no Ray (a stand-in module where a task asks Ray who it is)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from polgrad.sweep import ray_cells, ray_nodes
from polgrad.sweep.grid import Cell


@pytest.fixture
def node(tmp_path, monkeypatch):
    monkeypatch.setenv("POLGRAD_NODE_DIR", str(tmp_path / "node"))
    return tmp_path / "node"


def _copy(root: Path, rel: str, held: bool = False):
    local = root / rel
    (local / "checkpoints").mkdir(parents=True)
    (local / "metrics.jsonl").write_text("{}\n")
    if held:
        return ray_nodes.hold(local)
    local.with_name(local.name + ray_nodes.HELD).touch()
    return None


def test_copies_nobody_holds_are_removed_held_ones_and_other_drivers_kept(node):
    fh = _copy(node, "k1/x/runs/running", held=True)
    _copy(node, "k1/x/runs/stopped")
    _copy(node, "k1/x/runs/span.rank1")
    _copy(node, "k2/x/runs/another_drivers")
    gone = ray_nodes.sweep_copies("k1")
    assert sorted(Path(g).name for g in gone) == ["span.rank1", "stopped"]
    assert (node / "k1/x/runs/running/metrics.jsonl").exists()
    assert not (node / "k1/x/runs/stopped").exists() and not (node / "k1/x/runs/stopped.held").exists()
    assert (node / "k2/x/runs/another_drivers").exists()
    fh.close()  # its task ended without cleaning up (an error of its own): the next sweep removes it
    assert [Path(g).name for g in ray_nodes.sweep_copies("k1")] == ["running"]


def test_a_copy_whose_process_was_killed_is_removed(node):
    """The lock goes with its process however it ends (kill -9: a lost worker, a forced cancel)."""
    code = (
        "import sys, time; from pathlib import Path; from polgrad.sweep import ray_nodes; "
        "fh = ray_nodes.hold(Path(sys.argv[1])); print('held', flush=True); time.sleep(600)"
    )
    local = node / "k/x/runs/c"
    proc = subprocess.Popen([sys.executable, "-c", code, str(local)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        local.mkdir(parents=True)
        assert ray_nodes.sweep_copies("k") == []  # held by the live process
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert ray_nodes.sweep_copies("k") == [str(local)] and not local.exists()


def test_without_a_node_dir_the_copies_under_a_previous_node_id_are_swept(tmp_path, monkeypatch):
    """A node that comes back after a loss has a new Ray node id, so a new default folder: the copies
    under its old id are this machine's too."""
    monkeypatch.delenv("POLGRAD_NODE_DIR", raising=False)
    monkeypatch.setattr(ray_nodes.tempfile, "gettempdir", lambda: str(tmp_path))
    _copy(tmp_path / "polgrad-ray" / "oldnodeid", "k/x/runs/c")
    assert [Path(g).name for g in ray_nodes.sweep_copies("k")] == ["c"]


def test_a_node_log_collects_output_warnings_and_rays_own_warnings():
    import logging
    import warnings

    with ray_nodes.NodeLog() as log:
        print("plain line")
        print(":task_name:cell_task")  # Ray's own mark for its log files: dropped
        print("a", end="")
        print("b")
        warnings.warn("careful", stacklevel=1)
        logging.getLogger("ray").warning("resources short")
        logging.getLogger("ray").info("chatter")  # below WARNING: not sent
        lines = log.take()
    assert lines[:2] == ["plain line", "ab"]
    assert any("UserWarning: careful" in line for line in lines)
    assert "ray warning: resources short" in lines and not any("chatter" in line for line in lines)
    assert log.take() == []


def test_a_task_sweeps_stale_copies_sends_its_output_and_removes_its_own_copy(node, monkeypatch):
    """cell_task on a node: copies an earlier task of its driver left there are removed as it starts
    (said in a line the driver receives), the task's own output reaches the driver as {"log"}, and at
    its end its copy and lock are gone."""
    fake = types.ModuleType("ray")
    fake.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: "n" * 20)
    fake.get_gpu_ids = lambda: []
    monkeypatch.setitem(sys.modules, "ray", fake)
    _copy(node, "key/x/runs/stale")
    seen = {}

    def run_cell(cell, local, **kw):
        seen["held"] = ray_nodes.sweep_copies("key")  # its own copy is held meanwhile
        (Path(local) / "summary.json").write_text(json.dumps({"steps": 1}))
        print("hello from the node")
        time.sleep(0.3)
        return {"cell_id": cell.id, "status": "ok", "error": "", "returncode": 0}

    monkeypatch.setattr(ray_cells, "run_cell", run_cell)
    cell = Cell("c", 0, "g.gin", "g", "g.gin", config_files=(), swept=(), seed=0, bindings=())
    items = list(ray_cells.cell_task(cell, "key/x/runs/c", {}, {"environment": {}}, sync_s=0.05))
    logs = [line for item in items if "log" in item for line in item["log"]]
    assert logs[0] == f"removed the node copy {node / 'key/x/runs/stale'}, left by a stopped or lost task"
    assert "hello from the node" in logs
    assert seen["held"] == []  # the running task's copy was not removed under it
    assert items[-1]["outcome"]["status"] == "ok"
    assert any("summary.json" in item.get("files", {}) for item in items)
    assert not (node / "key/x/runs/stale").exists()
    assert not (node / "key/x/runs/c").exists() and not (node / "key/x/runs/c.held").exists()


def _experiment(tmp_path: Path, ray: str) -> str:
    repo = Path(__file__).resolve().parents[2]
    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{repo / 'experiments' / 'base_tiny.gin'}'\nSweep.name = 'exp'\n"
        f"Sweep.specs = ['registry/grpo.gin']\nSweep.seeds = [0]\nSweep.ray = {ray}\n"
    )
    return str(path)


def test_sweep_ray_sets_the_sync_interval_the_retries_and_the_grace(tmp_path):
    from polgrad.sweep import load_experiment
    from polgrad.sweep.ray_checks import RaySettings

    exp = load_experiment(_experiment(tmp_path, "{'retries': 0, 'sync_s': 5}"))
    assert exp.ray == RaySettings(sync_s=5, retries=0, grace_s=60.0)
    assert load_experiment(_experiment(tmp_path, "{}")).ray == RaySettings()


@pytest.mark.parametrize(
    ("ray", "says"),
    [
        ("{'sync': 2}", "unknown key 'sync'; valid: sync_s, retries, grace_s"),
        ("{'retries': -1}", "'retries' must be an int >= 0"),
        ("{'retries': 1.5}", "'retries' must be an int >= 0"),
        ("{'grace_s': 0}", "'grace_s' must be a positive number of seconds, got 0"),
        ("{'sync_s': 'fast'}", "'sync_s' must be a positive number of seconds"),
        ("5", "must be a dict of some of sync_s, retries, grace_s, got 5"),
    ],
)
def test_a_wrong_sweep_ray_is_one_line_naming_the_file_and_line(tmp_path, ray, says):
    from polgrad.errors import ConfigError
    from polgrad.sweep import load_experiment

    path = _experiment(tmp_path, ray)
    with pytest.raises(ConfigError) as e:
        load_experiment(path)
    assert str(e.value).startswith(f"{path}: line 5: Sweep.ray: ") and says in str(e.value), str(e.value)


def test_a_sweep_that_opened_a_lock_another_sweep_then_removed_leaves_the_new_copy_alone(node):
    """Sweep B opens X.held; sweep A removes the copy and its lock; a task makes a new copy and lock at
    the same path and holds it. B's lock on the removed file succeeds, but the path is another file
    now: B must not remove the task's copy (it did before the inode check)."""
    import os

    local = node / "k/x/runs/c"
    _copy(node, "k/x/runs/c")  # a stopped task's copy, its lock free
    lock = local.with_name("c" + ray_nodes.HELD)
    fd = os.open(lock, os.O_RDONLY)  # B
    try:
        assert ray_nodes.sweep_copies("k") == [str(local)]  # A
        fh = ray_nodes.hold(local)  # a new task, a new lock file
        local.mkdir(parents=True)
        (local / "metrics.jsonl").write_text("{}\n")
        assert ray_nodes._remove_if_free(lock, fd) is None  # B's turn
        assert (local / "metrics.jsonl").exists() and lock.exists()
        fh.close()
    finally:
        os.close(fd)


def test_the_end_of_sweep_cleanup_names_the_copies_it_left_held(node):
    fh = _copy(node, "k/x/runs/running", held=True)
    _copy(node, "k/x/runs/stopped")
    gone, held = ray_nodes.node_cleanup("k")
    assert [Path(g).name for g in gone] == ["stopped"]
    assert [Path(h).name for h in held] == ["running"]
    fh.close()
    assert ray_nodes.node_cleanup("k") == ([str(node / "k/x/runs/running")], [])
