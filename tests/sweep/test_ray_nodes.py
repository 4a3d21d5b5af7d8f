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


class _Ref:
    """A stand-in ObjectRef: hashable; `late` ones are never ready; `completed()` as a generator's."""

    def __init__(self, value=None, late=False, error=None):
        self.value, self.late, self.error = value, late, error

    def completed(self):
        return _Ref(("ended", self))


def _sweep_nodes_with(monkeypatch, answers: dict, stopped=(), **kw) -> tuple[list, list]:
    """`ray_nodes.sweep_nodes` against a stand-in Ray whose nodes answer the clean-up from `answers`
    (node -> a list of answers, one per pass, the last repeated: (removed, held), 'late' or an
    exception); returns (the refs each ray.wait got, the lines written)."""
    waited, written, passes = [], [], {}
    ray = types.ModuleType("ray")

    def answer(node):
        got = answers[node][min(passes.get(node, 0), len(answers[node]) - 1)]
        passes[node] = passes.get(node, 0) + 1
        if got == "late":
            return _Ref(late=True)
        return _Ref(error=got) if isinstance(got, Exception) else _Ref(got)

    ray.remote = lambda fn: types.SimpleNamespace(
        options=lambda **o: types.SimpleNamespace(remote=lambda key: answer(o["scheduling_strategy"]))
    )
    ray.nodes = lambda: [{"NodeID": n, "Alive": True} for n in answers] + [{"NodeID": "dead", "Alive": False}]

    def wait(refs, num_returns, timeout):
        waited.append(list(refs))
        return [r for r in refs if not r.late], [r for r in refs if r.late]

    def get(ref):
        if ref.error is not None:
            raise ref.error
        return ref.value

    ray.wait, ray.get = wait, get
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.NodeAffinitySchedulingStrategy = lambda node, soft: node
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", types.ModuleType("ray.util"))
    monkeypatch.setitem(sys.modules, "ray.util.scheduling_strategies", strategies)
    bar = types.SimpleNamespace(write=lambda line, file=None: written.append(line))
    ray_nodes.sweep_nodes("k", list(stopped), types.SimpleNamespace(bar=bar), **kw)
    return waited, written


def test_the_sweeps_end_waits_for_the_stopped_tasks_to_end_not_for_their_next_item(monkeypatch):
    """A cancelled rank is a streaming generator, whose own ref is ready at its next item (it usually
    has one unread): the wait is on `completed()`, ready when the task has ended and its lock gone."""
    stopped = [_Ref(), _Ref()]
    waited, written = _sweep_nodes_with(monkeypatch, {"a": [(["/a/c"], [])]}, stopped)
    assert [r.value for r in waited[0]] == [("ended", s) for s in stopped]
    assert written == ["removed 1 node copy left by stopped or lost tasks"]


def test_a_copy_still_held_is_tried_again_until_its_lock_goes(monkeypatch):
    """The lock goes with the task's process: a copy held at the first clean-up is removed at a later
    pass on its node (the other node is not asked again), and nothing is said to be left."""
    answers = {"a": [([], ["/a/c.rank1"]), ([], ["/a/c.rank1"]), (["/a/c.rank1"], [])], "b": [(["/b/d"], [])]}
    waited, written = _sweep_nodes_with(monkeypatch, answers, poll_s=0.01)
    assert [len(refs) for refs in waited] == [2, 1, 1]
    assert written == ["removed 2 node copies left by stopped or lost tasks"]


def test_the_sweeps_end_names_what_it_had_to_leave(monkeypatch):
    """A copy still held when the time is up, a node that does not answer and one whose clean-up fails
    keep their copies; the other nodes' answers stand, and one line says what was left and why."""
    answers = {
        "a": [([], ["/a/c.rank1", "/a/e"])],
        "b": ["late"],
        "c": [OSError("disk gone")],
        "d": [(["/d/f"], [])],
    }
    _, written = _sweep_nodes_with(monkeypatch, answers, wait_s=0.05, poll_s=0.01)
    assert written == [
        "removed 1 node copy left by stopped or lost tasks",
        "left 2 node copies still held by tasks that had not ended (/a/c.rank1 among others) and the copies "
        "on 1 node that did not answer and the copies on 1 node whose clean-up failed (OSError: disk gone) "
        "within 0.05 s: the next run of this sweep removes them",
    ]
    _, written = _sweep_nodes_with(monkeypatch, {"a": [([], [])]})
    assert written == []  # nothing removed, nothing left: nothing said


def test_a_task_that_ends_before_its_trainer_leaves_the_lock_to_the_trainers_thread(node, monkeypatch):
    """The driver closes a rank's task (its cell's other rank failed) while its trainer still runs: the
    copy stays held while the trainer runs, and its lock goes when the trainer ends, not with the Ray
    worker (reused by later tasks, it kept the lock, and no sweep could remove the copy)."""
    import threading

    fake = types.ModuleType("ray")
    fake.get_runtime_context = lambda: types.SimpleNamespace(get_node_id=lambda: "n" * 20)
    fake.get_gpu_ids = lambda: []
    monkeypatch.setitem(sys.modules, "ray", fake)
    release = threading.Event()

    def run_cell(cell, local, **kw):
        print("training")
        release.wait(10)
        return {"cell_id": cell.id, "status": "ok", "error": "", "returncode": 0}

    monkeypatch.setattr(ray_cells, "run_cell", run_cell)
    cell = Cell("c", 0, "g.gin", "g", "g.gin", config_files=(), swept=(), seed=0, bindings=())
    task = ray_cells.cell_task(cell, "key/x/runs/c", {}, {"environment": {}}, sync_s=0.05)
    assert "node" in next(task)  # where it runs
    assert next(task) == {"log": ["training"]}  # its trainer runs
    task.close()  # the driver stops reading it: GeneratorExit in the task, its trainer still running
    assert ray_nodes.node_cleanup("key") == ([], [str(node / "key/x/runs/c")])
    release.set()
    deadline = time.monotonic() + 10
    while ray_nodes.node_cleanup("key")[1] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (node / "key/x/runs/c").exists()
