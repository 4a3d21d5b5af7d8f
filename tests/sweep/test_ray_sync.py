"""How a Ray cell's run folder travels between its node and the driver (polgrad/sweep/ray_sync.py),
without Ray: what a change sends, under which names a rank's files arrive, what an attempt reports.
The cluster itself: tests/sweep/test_ray_cluster.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from polgrad.errors import PolgradError
from polgrad.sweep.grid import Cell
from polgrad.sweep.ray_attempts import Attempt
from polgrad.sweep.ray_sync import Mirror, rank_name, rank_snapshot, read_tree, usable_checkpoints, write_tree


def test_a_mirror_sends_what_changed_and_what_was_deleted_but_not_a_vanished_folder(tmp_path):
    root = tmp_path / "run"
    write_tree(root, {"metrics.jsonl": b"1\n", "checkpoints/policy/step1/m.pt": b"w1", ".lock": b"pid"})
    m = Mirror(root)
    files, deleted = m.delta()
    assert files == {"metrics.jsonl": b"1\n", "checkpoints/policy/step1/m.pt": b"w1"} and deleted == []
    assert m.delta() == ({}, [])  # nothing changed
    (root / "metrics.jsonl").write_bytes(b"1\n2\n")
    (root / "checkpoints/policy/step1/m.pt").unlink()
    assert m.delta() == ({"metrics.jsonl": b"1\n2\n"}, ["checkpoints/policy/step1/m.pt"])
    # a file rewritten with other bytes of the same size is sent again (its mtime moved)
    os.utime(root / "metrics.jsonl", ns=(1, 1))
    assert m.delta() == ({"metrics.jsonl": b"1\n2\n"}, [])
    # the folder itself gone (a wiped disk): no deletion of everything on the driver
    import shutil

    shutil.rmtree(root)
    assert m.delta() == ({}, [])


def test_files_the_driver_sent_are_not_sent_back(tmp_path):
    snapshot = {"stdout.log": b"old\n", "checkpoints/policy/latest": b"step2"}
    write_tree(tmp_path / "run", snapshot)
    m = Mirror(tmp_path / "run", snapshot)
    assert m.delta() == ({}, [])


def test_write_tree_refuses_a_path_out_of_the_run_folder(tmp_path):
    with pytest.raises(PolgradError, match="leaves the run folder"):
        write_tree(tmp_path / "run", {"../escaped": b"x"})
    assert not (tmp_path / "escaped").exists()


def test_a_rank_above_0_sends_its_shards_and_its_log_under_its_own_names(tmp_path):
    name = rank_name(1)
    assert name("checkpoints/policy/step2/zero_pp_rank_1_mp_rank_00_optim_states.pt") == (
        "checkpoints/policy/step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    assert (name("stdout.log"), name("cell.json")) == ("stdout.rank1.log", "cell.rank1.json")
    assert name("metrics.jsonl") is None and name("summary.json") is None  # rank 0's to write
    driver = {
        "stdout.log": b"rank 0",
        "cell.json": b"{0}",
        "stdout.rank1.log": b"rank 1",
        "cell.rank1.json": b"{1}",
        "stdout.rank2.log": b"rank 2",
        "checkpoints/policy/latest": b"step2",
    }
    assert rank_snapshot(driver, 1) == {
        "stdout.log": b"rank 1",
        "cell.json": b"{1}",
        "checkpoints/policy/latest": b"step2",
    }
    assert rank_snapshot(driver, 0) == {
        "stdout.log": b"rank 0",
        "cell.json": b"{0}",
        "checkpoints/policy/latest": b"step2",
    }
    # the round trip: rank 1's folder, started from the snapshot, sends back under the driver's names
    local = tmp_path / "rank1"
    mine = rank_snapshot(driver, 1)
    write_tree(local, mine)
    m = Mirror(local, mine, name)
    (local / "stdout.log").write_bytes(b"rank 1, more")
    (local / "metrics.jsonl").write_bytes(b"not rank 1's to send")
    assert m.delta() == ({"stdout.rank1.log": b"rank 1, more"}, [])
    assert read_tree(tmp_path / "missing") == {}


def _outcome(status: str, error: str = "") -> dict:
    return {
        "cell_id": "c",
        "status": status,
        "error": error,
        "summary": {"steps": 4} if status == "ok" else None,
    }


def test_an_attempt_reports_rank_0_or_the_first_rank_that_failed():
    cell = Cell("c", 0, "g.gin", "g", "g.gin", config_files=(), swept=(), seed=0, bindings=())
    att = Attempt(cell, 1, 2)
    att.outcomes = {0: _outcome("ok"), 1: _outcome("ok")}
    assert att.outcome() == _outcome("ok")
    att.outcomes = {0: _outcome("ok"), 1: _outcome("failed", "boom")}
    got = att.outcome()
    assert (got["status"], got["error"]) == ("failed", "rank 1: boom")
    att.outcomes = {1: _outcome("failed", "boom")}  # rank 0 cancelled when rank 1 failed
    assert att.outcome()["error"] == "rank 1: boom"
    att.outcomes = {0: _outcome("ok")}
    assert att.outcome()["error"] == "rank 1: did not end"
    att.outcomes = {0: _outcome("failed", "bad loss"), 1: _outcome("failed", "closed")}
    assert att.outcome()["error"] == "rank 0: bad loss"


def _tag(part: Path, step: int, ranks: range, truncated: bool = False) -> None:
    import torch

    d = part / f"step{step}"
    d.mkdir(parents=True)
    torch.save({"w": torch.ones(4)}, d / "mp_rank_00_model_states.pt")
    for r in ranks:
        torch.save({"s": torch.ones(3) * r}, d / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
    if truncated:
        f = d / "mp_rank_00_model_states.pt"
        f.write_bytes(f.read_bytes()[:40])
    (part / "latest").write_text(f"step{step}")


def test_checkpoints_cut_short_by_a_lost_node_are_set_aside_not_resumed_from(tmp_path):
    run = tmp_path / "run"
    part = run / "checkpoints" / "policy"
    _tag(part, 2, range(2))
    _tag(part, 4, range(2))
    _tag(part, 6, range(1))  # rank 1's shard never arrived
    _tag(part, 8, range(2), truncated=True)  # caught half copied
    moved = usable_checkpoints(run, world=2)
    assert sorted(Path(m).name for m in moved) == ["step6", "step8"]
    assert sorted(p.name for p in part.iterdir()) == [
        "latest", "step2", "step4", "step6.incomplete-1", "step8.incomplete-1"
    ]  # fmt: skip
    assert usable_checkpoints(run, world=2) == []  # what is left is intact
    # at world size 1 a single shard is complete
    solo = tmp_path / "solo"
    _tag(solo / "checkpoints" / "policy", 2, range(1))
    assert usable_checkpoints(solo, world=1) == []


def test_no_intact_checkpoint_left_means_a_fresh_start_with_the_folder_kept(tmp_path):
    run = tmp_path / "run"
    _tag(run / "checkpoints" / "policy", 2, range(1), truncated=True)
    usable_checkpoints(run, world=1)
    assert not (run / "checkpoints").exists()  # run_cell then starts the cell without --resume
    assert (run / "checkpoints.incomplete-1" / "policy" / "step2.incomplete-1").is_dir()  # nothing deleted


def test_an_emptied_folder_is_removed_with_its_last_file(tmp_path):
    root = tmp_path / "run"
    write_tree(root, {"checkpoints/policy/step2/a.pt": b"x", "metrics.jsonl": b"1"})
    write_tree(root, {}, ["checkpoints/policy/step2/a.pt"])
    assert not (root / "checkpoints").exists() and (root / "metrics.jsonl").exists()


def test_temp_files_and_set_aside_folders_are_never_synced(tmp_path):
    root = tmp_path / "run"
    write_tree(root, {"final.tmp-123/model.safetensors": b"x", "runs.old-20261126/a": b"y", "b.json": b"z"})
    assert read_tree(root) == {"b.json": b"z"}


def test_only_ray_errors_of_a_lost_node_or_worker_restart_a_cell():
    rex = pytest.importorskip("ray.exceptions")

    from polgrad.sweep.ray_attempts import node_lost

    assert node_lost(rex.NodeDiedError("node 1 died"))
    assert node_lost(rex.WorkerCrashedError())
    assert node_lost(rex.OwnerDiedError("ab", None, ""))
    assert not node_lost(rex.OutOfMemoryError("the task used too much memory"))
    assert not node_lost(ValueError("the task's own bug"))


def test_a_rank_that_failed_because_its_peers_node_died_makes_a_lost_node_not_a_failed_cell():
    cell = Cell("c", 0, "g.gin", "g", "g.gin", config_files=(), swept=(), seed=0, bindings=())
    att = Attempt(cell, 1, 2)
    att.nodes = ["head", "worker"]
    att.outcomes = {0: _outcome("failed", "Connection closed by peer")}
    att.deadline = 100.0
    assert not att.judge([], now=50.0)  # within the grace: wait for the other rank, or for Ray
    assert att.judge(["worker"], now=51.0) and att.lost is not None  # Ray says the node died: lost
    other = Attempt(cell, 1, 2)
    other.outcomes, other.deadline = {0: _outcome("failed", "bad loss")}, 100.0
    assert other.judge([], now=101.0) and other.lost is None  # every node alive: the cell failed
    assert other.outcome()["error"] == "rank 0: bad loss"


def test_the_trainers_marker_says_which_tags_are_whole_and_which_parts_they_need(tmp_path):
    import json

    run = tmp_path / "run"
    policy, critic = run / "checkpoints" / "policy", run / "checkpoints" / "critic"
    for step in (2, 4, 6):
        _tag(policy, step, range(1))
    _tag(critic, 2, range(1))  # the critic's step 4 never reached the driver
    (run / "checkpoints" / "complete.json").write_text(json.dumps({"step": 4, "parts": ["policy", "critic"]}))
    moved = usable_checkpoints(run, world=1)
    # step 4 lacks its critic part; step 6 is newer than the newest whole checkpoint (its files may
    # look intact yet miss what the trainer had not written when the node died)
    assert sorted(Path(m).name for m in moved) == ["step4", "step6"]
    assert [p.name for p in sorted(policy.iterdir()) if p.name.startswith("step")][:1] == ["step2"]


def test_without_the_marker_no_tag_is_trusted_beyond_its_latest(tmp_path):
    run = tmp_path / "run"
    part = run / "checkpoints" / "policy"
    _tag(part, 2, range(2))
    _tag(part, 4, range(2))
    (part / "latest").write_text("step2")  # step 4's model states arrived, its shards may not have
    assert [Path(m).name for m in usable_checkpoints(run, world=2)] == ["step4"]


def test_the_trainer_writes_the_marker_naming_every_part_it_saved(tmp_path, monkeypatch):
    """checkpoints.save's marker lists the policy and a critic's own engine: a marker without
    the critic would let `usable_checkpoints` accept a tag whose critic never reached the driver (the
    test above). The engines' saves are stand-ins: only the marker is under test."""
    import json
    from types import SimpleNamespace

    from polgrad import checkpoints

    saved = []

    def save(engine, folder, tag, client_state):
        saved.append((engine, Path(folder).name, tag, client_state["polgrad"]["step"]))
        (Path(folder) / tag).mkdir(parents=True)

    monkeypatch.setattr(checkpoints, "save_engine", save)
    models = SimpleNamespace(
        engine="policy engine",
        critic=SimpleNamespace(engines=lambda: [("critic", "critic engine")]),
        sampler=SimpleNamespace(save=lambda folder, step: None),
    )
    checkpoints.save(models, str(tmp_path), 3, {"polgrad": {"step": 3}})
    assert saved == [("policy engine", "policy", "step3", 3), ("critic engine", "critic", "step3", 3)]
    marker = json.loads((tmp_path / "checkpoints" / checkpoints.COMPLETE).read_text())
    assert marker == {"step": 3, "parts": ["policy", "critic"]}


class _NodeDied(Exception):
    """The stand-in Ray's `exceptions.NodeDiedError`."""


class _Answer:
    """A stand-in ObjectRef of a clean-up task (hashable, as Ray's are); ray.get gives its value."""

    def __init__(self, value):
        self.value = value


def _fake_ray(
    plan: list[str],
    logs: tuple[str, ...] = (),
    cleaned: list | None = None,
    asked: list | None = None,
    nodes: list | None = None,
):
    """A stand-in for the `ray` module `ray_cells.run` drives, enough for a cell of one rank: each
    `.remote()` is one attempt, whose task yields its node (and `logs`, as a task's output on its
    node), then, by `plan` (one word per attempt), Ray's error of a lost node ('lost') or the cell's
    outcome ('ok'): a cell of k ranks takes k words. The end-of-sweep clean-up's tasks are recorded in
    `cleaned` as (node, key); each rank task's options in `asked`, a placement group's bundles as
    {"bundles": ...}. `nodes`: ray.nodes() (one node of 64 CPUs). Returns (modules, attempts made)."""
    import types

    started: list[int] = []
    cleaned = [] if cleaned is None else cleaned
    asked = [] if asked is None else asked

    def stream(cell):
        number = len(started)
        started.append(number)
        yield {"node": f"node{number}", "host": f"host{number}"}
        if logs:
            yield {"log": list(logs)}
        if plan[number] == "lost":
            raise _NodeDied(f"node{number} died")
        yield {"outcome": {"cell_id": cell.id, "status": "ok", "summary": {"steps": 1}, "error": ""}}

    remote = types.SimpleNamespace(remote=lambda cell, *args, **kw: stream(cell))
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True  # run() then neither starts nor stops Ray

    def clean_on(**kw):
        return types.SimpleNamespace(
            remote=lambda key: cleaned.append((kw["scheduling_strategy"], key)) or _Answer(([], []))
        )

    def options(fn):
        if fn.__name__ == "node_cleanup":
            return clean_on
        if fn.__name__ == "rendezvous":  # rank 0's address, for the ranks of a cell spanning nodes
            return lambda **kw: types.SimpleNamespace(remote=lambda: ("10.0.0.1", 29500))
        return lambda **kw: (asked.append(kw), remote)[1]

    ray.remote = lambda fn: types.SimpleNamespace(options=options(fn))
    ray.put = lambda x: x
    ray.get = lambda x: x.value if isinstance(x, _Answer) else x
    ray.wait = lambda refs, num_returns, timeout: (refs[:num_returns], refs[num_returns:])
    ray.cancel = lambda ref, force=False: None
    # one live node that holds the cell (run() checks every cell's resources against the nodes first)
    ray.nodes = lambda: nodes or [{"NodeID": "n", "Alive": True, "Resources": {"CPU": 64.0}}]
    ray.exceptions = types.SimpleNamespace(NodeDiedError=_NodeDied)
    util = types.ModuleType("ray.util")
    pg = types.ModuleType("ray.util.placement_group")
    pg.placement_group = lambda bundles, strategy: asked.append({"bundles": bundles, "strategy": strategy})
    pg.remove_placement_group = lambda group: None
    strategies = types.ModuleType("ray.util.scheduling_strategies")
    strategies.PlacementGroupSchedulingStrategy = lambda group, placement_group_bundle_index: (
        "bundle",
        placement_group_bundle_index,
    )
    strategies.NodeAffinitySchedulingStrategy = lambda node, soft: ("on", node, soft)
    modules = {
        "ray": ray,
        "ray.exceptions": ray.exceptions,
        "ray.util": util,
        "ray.util.placement_group": pg,
        "ray.util.scheduling_strategies": strategies,
    }
    return modules, started


def _drive(
    tmp_path,
    monkeypatch,
    plan,
    ray_settings=None,
    logs=(),
    cleaned=None,
    asked=None,
    nodes=None,
    **exp_kw,
):
    """ray_cells.run, the real driver loop, on one cell with the stand-in Ray of `_fake_ray`; returns
    (attempts started, the cell's run folder, the recorded outcomes, the lines written to the bar)."""
    import sys
    from types import SimpleNamespace

    from polgrad.sweep import ray_cells

    modules, started = _fake_ray(plan, logs, cleaned, asked, nodes)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(ray_cells._results, "cell_environment", lambda run_dir, name: {})
    cell = Cell("c", 0, "g.gin", "g", "g.gin", config_files=(), swept=(), seed=0, bindings=())
    run_dir = tmp_path / "results" / "x" / "runs" / cell.id
    exp = SimpleNamespace(
        name="x",
        file="x.gin",
        processes_per_cell=1,
        num_gpus=0,
        num_cpus=1,
        launcher="torchrun",
        timeout_s=None,
        **({"ray": ray_settings} if ray_settings else {}),
    )
    exp.__dict__.update(exp_kw)
    recorded, written = [], []
    progress = SimpleNamespace(
        start=lambda *a: None,
        stop=lambda *a: None,
        finish=lambda *a: None,
        refresh=lambda: None,
        bar=SimpleNamespace(write=lambda text, **kw: written.append(text)),
    )
    ray_cells.run(
        exp,
        [cell],
        {cell.id: str(run_dir)},
        lambda c, outcome: recorded.append(outcome),
        progress,
        parallel=1,
        train_module="polgrad.train",
    )
    return started, run_dir, recorded, written


@pytest.mark.parametrize("ends", ["ok", "lost"])
@pytest.mark.parametrize("written", [None, {"retries": 1}])
def test_a_cell_whose_node_dies_is_started_again_node_loss_retries_times(
    tmp_path, monkeypatch, ends, written
):
    """Sweep.ray's retries (3 by default) lost nodes: the cell is started that many times more, each
    attempt a line of ray_attempts.jsonl; the last ends the cell, with its outcome or, lost too, as
    failed. The driver loop is the real one (ray_cells.run); Ray is a stand-in whose tasks lose their
    node on cue."""
    import json

    from polgrad.sweep import ray_cells
    from polgrad.sweep.ray_checks import read_settings

    settings = read_settings(written) if written else None
    retries = 3 if written is None else written["retries"]
    started, run_dir, recorded, _ = _drive(tmp_path, monkeypatch, ["lost"] * retries + [ends], settings)
    assert len(started) == retries + 1
    lines = [json.loads(line) for line in (run_dir / ray_cells.ATTEMPTS).read_text().splitlines()]
    statuses = ["node lost"] * retries + ["ok" if ends == "ok" else "failed"]
    assert [(a["attempt"], a["status"]) for a in lines] == list(enumerate(statuses, 1))
    (outcome,) = recorded
    assert outcome["attempts"] == retries + 1 and outcome["status"] == statuses[-1]
    if ends == "lost":
        assert outcome["error"].startswith(
            f"ray (node lost {retries + 1} times): _NodeDied: node{retries} died"
        )


def test_what_a_task_writes_on_its_node_reaches_the_driver_and_the_run_folder(tmp_path, monkeypatch):
    """A task's output on its node (and Ray's warnings there), which Ray with log_to_driver off keeps in
    the node's log files: one line on the driver's terminal per line, named by cell and host, and the
    same lines in the run folder's ray_node.log."""
    from polgrad.sweep.ray_sync import NODE_LOG

    logs = ("warning: something on the node", "ray warning: a worker is slow")
    _, run_dir, (outcome,), written = _drive(tmp_path, monkeypatch, ["ok"], logs=logs)
    assert outcome["status"] == "ok"
    want = [f"c on host0: {line}" for line in logs]
    assert [w for w in written if w.startswith("c on ")] == want
    assert (run_dir / NODE_LOG).read_text().splitlines() == want


def test_the_sweeps_end_cleans_node_copies_on_every_live_node(tmp_path, monkeypatch):
    """At the end the driver runs node_cleanup on each live node (pinned there, not soft), under its
    own key: the copies of tasks it stopped, or of a node that came back, are removed."""
    cleaned: list = []
    _drive(tmp_path, monkeypatch, ["ok"], cleaned=cleaned)
    ((strategy, key),) = cleaned
    assert strategy == ("on", "n", False) and len(key) == 12  # the stand-in's one live node


def test_a_gpu_cell_of_two_gpus_is_two_ranks_of_one_gpu_each_wherever_ray_places_them(tmp_path, monkeypatch):
    """Sweep.num_gpus = 2 under --executor ray: a placement group of two bundles of one GPU each (and
    half the CPUs), a rank task in each asking for one GPU, so that Ray may put the ranks on two nodes
    of one GPU (Sweep.placement); the cell's outcome is the two ranks'. On CPU only this plumbing is
    what runs (Ray stand-in); the refusal on a cluster without GPUs is below."""
    asked: list = []
    gpu_nodes = [{"NodeID": n, "Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}} for n in ("a", "b")]
    _, _, (outcome,), _ = _drive(
        tmp_path, monkeypatch, ["ok", "ok"], asked=asked, nodes=gpu_nodes,
        num_gpus=2, num_cpus=4, placement="SPREAD", processes_per_cell=1,
    )  # fmt: skip
    group, *ranks = asked
    assert group == {"bundles": [{"CPU": 2.0, "GPU": 1.0}] * 2, "strategy": "SPREAD"}
    assert [(r["num_gpus"], r["num_cpus"], r["scheduling_strategy"]) for r in ranks] == [
        (1.0, 2.0, ("bundle", 0)),
        (1.0, 2.0, ("bundle", 1)),
    ]
    assert outcome["status"] == "ok" and outcome["attempts"] == 1


def test_a_gpu_cell_spanning_nodes_on_a_cluster_without_the_gpus_is_one_line():
    import types

    from polgrad.errors import PolgradError
    from polgrad.sweep import ray_checks

    cpu_only = [{"NodeID": n, "Alive": True, "Resources": {"CPU": 8.0}} for n in ("a", "b")]
    cell = types.SimpleNamespace(file="x.gin", num_cpus=2, num_gpus=2, placement="PACK")
    with pytest.raises(PolgradError) as e:
        ray_checks.check_resources(cell, "c1", 2, cpu_only)
    assert str(e.value) == (
        "x.gin: cell c1: 2 ranks of 1 GPU and 1 CPUs each (Sweep.num_gpus = 2), but the Ray cluster's nodes "
        "hold 0 such ranks (0 GPUs in all); lower Sweep.num_gpus or Sweep.num_cpus, add GPU nodes, or run "
        "CPU cells (Sweep.num_gpus = 0)"
    )
    one_each = [{"NodeID": n, "Alive": True, "Resources": {"CPU": 8.0, "GPU": 1.0}} for n in ("a", "b")]
    ray_checks.check_resources(cell, "c1", 2, one_each)  # one GPU on each of two nodes holds it
    # a bundle needs its GPU and its CPUs on one node: the CPU-rich node has no GPU, the GPU nodes 0.5 CPU
    split = [{"NodeID": "big", "Alive": True, "Resources": {"CPU": 64.0}}] + [
        {"NodeID": n, "Alive": True, "Resources": {"CPU": 0.5, "GPU": 1.0}} for n in ("g1", "g2")
    ]
    with pytest.raises(PolgradError, match="the Ray cluster's nodes hold 0 such ranks .2 GPUs in all."):
        ray_checks.check_resources(cell, "c1", 2, split)
    strict = types.SimpleNamespace(file="x.gin", num_cpus=2, num_gpus=2, placement="STRICT_PACK")
    with pytest.raises(
        PolgradError, match="'STRICT_PACK' puts the 2 ranks of 1 GPU .* a node holds at most 1"
    ):
        ray_checks.check_resources(strict, "c1", 2, one_each)
    two_on_one = [{"NodeID": "a", "Alive": True, "Resources": {"CPU": 8.0, "GPU": 2.0}}]
    spread = types.SimpleNamespace(file="x.gin", num_cpus=2, num_gpus=2, placement="STRICT_SPREAD")
    with pytest.raises(
        PolgradError, match="'STRICT_SPREAD' puts each of the 2 ranks .* but 1 nodes hold one"
    ):
        ray_checks.check_resources(spread, "c1", 2, two_on_one + cpu_only)
