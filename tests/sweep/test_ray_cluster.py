"""A Ray cluster of two nodes on this machine, as a cluster behaves: no shared disk, a node lost.

The fixture starts a head node (127.0.0.1) and a worker node (127.0.0.2), each with `ray start`, its
own temp dir, one CPU, its own working directory and its own `POLGRAD_NODE_DIR` (where its cells
train) and, for the worker, its own warm-start cache (a copy of the driver's, as a node image would
carry it): nothing of the driver's run folders is on its paths, so whatever the driver ends up with
came through Ray. The test stops both nodes by their
processes (never `ray stop`, which would stop every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import csv_rows

from polgrad.models.cache import default_cache_dir
from polgrad.sweep.ray_cells import ATTEMPTS
from polgrad.sweep.slots import free_port

pytestmark = pytest.mark.ray

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("ray is not installed; CI must install the ray extra (pip install '.[ray]')")
        pytest.importorskip("ray", reason="ray is not installed (pip install 'polgrad[ray]')")


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*LAUNCHER_VARS, "POLGRAD_TRAIN_MODULE")}
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",
            # the head notices a dead node within seconds, not Ray's default half-minute
            "RAY_health_check_period_ms": "1000",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            # Ray starts its workers (and so the cells' trainers) at niceness 15: on a busy machine
            # (the other xdist worker, anything else) they got ~3% of a core each and every cluster
            # sweep here ran past its 900 s limit. Niceness 0, as a dedicated node's would be.
            "RAY_worker_niceness": "0",
        }
    )
    return env


def _pids_with(text: str) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            pids.append(int(name))
    return pids


def _descendants(pids: list[int]) -> list[int]:
    parent = {}
    for name in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            parent[int(name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError):
            continue
    found, todo = set(pids), list(pids)
    while todo:
        p = todo.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                found.add(child)
                todo.append(child)
    return sorted(found)


def _kill_all(text: str) -> list[int]:
    """Stop every process whose command line has `text`, and all their descendants (the raylet's
    workers, their trainers), then kill them: as at a machine's loss, none of them sees another die
    (a Ray worker that saw its trainer die would report that as the cell's outcome)."""
    pids = _descendants(_pids_with(text))
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return pids


class Node:
    def __init__(self, name: str, root: Path):
        self.name = name
        self.root = root  # temp dir (short: Ray's socket paths must stay under 108 bytes)
        self.home = root / "home"  # the node's own working directory
        self.runs = root / "home" / "runs"  # its POLGRAD_NODE_DIR
        self.home.mkdir(parents=True)

    def kill(self) -> list[int]:
        """What the loss of the machine does: every process of the node dies at once."""
        return _kill_all(str(self.root))


class Cluster:
    """The two nodes; `ensure_worker()` starts the worker node again after a test killed it."""

    def __init__(self):
        self.ray = str(Path(sys.executable).with_name("ray"))
        self.roots = [Path(tempfile.mkdtemp(prefix=f"pg{n}", dir="/tmp")) for n in ("h", "w")]
        self.head, self.worker = Node("head", self.roots[0]), Node("worker", self.roots[1])
        self.env = _base_env()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        subprocess.run(
            [self.ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
             "--temp-dir", str(self.head.root / "ray"), "--include-dashboard", "false", *self.common],
            cwd=self.head.home, env={**self.env, "POLGRAD_NODE_DIR": str(self.head.runs)},
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        self.ensure_worker()

    common = ["--num-cpus", "1", "--disable-usage-stats"]

    def ensure_worker(self) -> None:
        w = self.worker
        if _pids_with(str(w.root / "ray")):
            return
        w.home.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [self.ray, "start", "--address", self.address, "--node-ip-address", "127.0.0.2",
             "--temp-dir", str(w.root / "ray"), *self.common],
            cwd=w.home,
            env={**self.env, "POLGRAD_NODE_DIR": str(w.runs), "POLGRAD_CACHE": str(w.home / "cache")},
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip

    def give_worker_the_warm_starts(self) -> None:
        """The worker node's own copy of the warm starts (a node image would carry them)."""
        shutil.copytree(default_cache_dir(), self.worker.home / "cache", dirs_exist_ok=True)

    def stop(self) -> None:
        for node in (self.worker, self.head):
            node.kill()
        for root in self.roots:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    _require_ray()
    c = Cluster()
    try:
        yield c
    finally:
        c.stop()


# Every cell starts from the seed-0 warm start (train.init_seed = 0), the one the rest of the suite
# builds: a seed-1 warm start (640 SFT steps) would be built for these tests alone, and what they check
# (cells moved between nodes, ranks spread over them) does not depend on which SFT policy a cell starts
# from. What this gives up: a node that loaded another seed's cached warm start would no longer show in
# the per-cell comparison (the cache key's seed is tests/pretrain/test_warm_start.py's to check).
INIT = "train.init_seed = 0\n"


def _experiment(tmp_path: Path) -> Path:
    """4 cells of the real tiny GRPO run (2 KL coefficients x 2 seeds), a checkpoint every 2 steps."""
    path = tmp_path / "cluster.gin"
    path.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\n{INIT}"
        "train.steps = 20\ntrain.prompts_per_step = 4\nAlgorithm.group_size = 4\n"
        "train.eval_every = 20\ntrain.eval_size = 16\ntrain.checkpoint_every = 2\n"
        f"Sweep.specs = ['{REPO / 'registry' / 'grpo.gin'}']\n"
        "Sweep.grid = {'Algorithm.kl_coef': [0.0, 0.05]}\nSweep.seeds = [0, 1]\n"
        "Sweep.name = 'cluster'\nSweep.num_cpus = 1\nSweep.timeout_s = 600\n"
    )
    return path


# Columns that differ between two runs of the same cells by nature: wall-clock, paths, where, and the
# checkout's state when each cell started (checked apart).
_NOT_COMPARED = ("time", "tokens_per_s", "run_dir", "peak_mem", "started", "finished", "host", "node", "git_")


def _metrics(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {
        r["cell_id"]: {k: v for k, v in r.items() if not any(t in k for t in _NOT_COMPARED)} for r in rows
    }


def _deterministic(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time") or k in ("tokens_per_s", "peak_mem_mb"))}
            for r in rows]  # fmt: skip


def _node_copies(cluster) -> list[str]:
    """Copies of cells (and their locks) left on either node's POLGRAD_NODE_DIR: none once a sweep ended."""
    return [str(p) for n in (cluster.head, cluster.worker) for p in n.runs.glob("*/*/runs/*")]


def _attempts(run_dir: Path) -> list[dict]:
    path = run_dir / ATTEMPTS
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def test_sweep_on_two_nodes_without_shared_disk_survives_losing_a_node(tmp_path, cluster):
    cluster.ensure_worker()
    address, worker, env = cluster.address, cluster.worker, cluster.env
    exp = _experiment(tmp_path)
    local = tmp_path / "local"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(local), "--parallel", "2"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"local sweep: {time.monotonic() - t0:.0f} s")
    cluster.give_worker_the_warm_starts()  # built just now by the local sweep

    out = tmp_path / "on_cluster"
    runs = out / "cluster" / "runs"
    t0 = time.monotonic()
    sweep = subprocess.Popen(
        [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(out), "--parallel", "2",
         "--executor", "ray", "--ray-address", address],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "sweep.err", "w"),
    )  # fmt: skip
    # Wait until a cell has finished on the worker node and the next one there has a checkpoint on
    # the driver's disk; then the worker node dies, with its private folder.
    worker_node, victim = None, None
    deadline = time.monotonic() + 900
    while victim is None:
        assert sweep.poll() is None, (
            "the sweep ended before a second cell ran on the worker node:\n"
            + (tmp_path / "sweep.err").read_text()[-3000:]
        )
        assert time.monotonic() < deadline, "no second cell on the worker node in 900 s"
        for cell_dir in runs.glob("*") if runs.exists() else []:
            on_worker = any(worker.runs.glob(f"*/cluster/runs/{cell_dir.name}"))
            info = cell_dir / "cell.json"
            if on_worker and info.exists() and worker_node is None:
                worker_node = json.loads(info.read_text()).get("ray_node")
            done_there = [a for a in _attempts(cell_dir) if a["node"] == worker_node and a["status"] == "ok"]
            if done_there:
                continue
            ckpt = cell_dir / "checkpoints"
            finished_one = any(
                a["node"] == worker_node and a["status"] == "ok" for d in runs.glob("*") for a in _attempts(d)
            )
            # two tags on the driver: the older is whole (the newer may be in flight, then set aside)
            tags = [t for t in ckpt.glob("policy/step*") if any(t.glob("*model_states.pt"))]
            if on_worker and finished_one and len(tags) >= 2:
                victim = cell_dir.name
        time.sleep(0.2)
    killed = worker.kill()
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in killed if Path(f"/proc/{p}/comm").exists()]
    print(f"killed the worker node's {len(killed)} processes ({names})")
    shutil.rmtree(worker.home)
    rc = sweep.wait(timeout=900)
    err = (tmp_path / "sweep.err").read_text()
    print(f"cluster sweep: {time.monotonic() - t0:.0f} s; killed the worker node during {victim}")
    assert rc == 0, err[-3000:]
    assert f"LOST    {victim}" in err

    rows, expected = csv_rows(out / "cluster" / "cluster.csv"), csv_rows(local / "cluster" / "cluster.csv")
    assert len(rows) == 4, rows
    assert all(r["status"] == "ok" for r in rows), [(r["cell_id"], r["error"]) for r in rows]
    assert _metrics(rows) == _metrics(expected)  # per-cell results equal the undisturbed sweep's
    # the code a cell ran is the driver's checkout (the worker's working directory is no checkout)
    assert all(r["git_commit"] not in ("", "unknown") for r in rows), [r["git_commit"] for r in rows]
    nodes = set()
    for r in rows:
        run_dir = runs / r["cell_id"]
        attempts = _attempts(run_dir)
        nodes.add(attempts[-1]["node"])
        assert attempts[-1]["status"] == "ok"
        # the whole folder is on the driver: curve (each step once), summary, log, checkpoints
        assert _deterministic(run_dir) == _deterministic(local / "cluster" / "runs" / r["cell_id"])
        assert (run_dir / "summary.json").exists() and (run_dir / "stdout.log").exists()
        assert any((run_dir / "checkpoints").rglob("*.pt"))
    lost = _attempts(runs / victim)
    assert [a["status"] for a in lost] == ["node lost", "ok"], lost
    assert lost[0]["node"] == worker_node and lost[1]["node"] != worker_node
    assert json.loads((runs / victim / "cell.json").read_text())["resume"] is True  # from its checkpoint
    assert worker_node in nodes and len(nodes) == 2  # cells finished on both nodes
    assert _node_copies(cluster) == [], err[-2000:]


def _close(a: list[dict], b: list[dict], rel: float) -> list[str]:
    """Where two metric curves differ: key by key, numbers to `rel` relative, the rest exactly."""
    bad = []
    for ra, rb in zip(a, b, strict=True):
        for k in sorted(set(ra) | set(rb)):
            x, y = ra.get(k), rb.get(k)
            if isinstance(x, float) and isinstance(y, float):
                if abs(x - y) > rel * max(abs(x), abs(y), 1e-12):
                    bad.append(f"step {ra.get('step')} {k}: {x!r} vs {y!r}")
            elif x != y:
                bad.append(f"step {ra.get('step')} {k}: {x!r} vs {y!r}")
    return bad


def _span_experiment(tmp_path: Path, name: str, steps: int, seeds: str = "[0]", cpus: int = 2) -> Path:
    exp = tmp_path / f"{name}.gin"
    exp.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\n{INIT}"
        f"train.steps = {steps}\ntrain.prompts_per_step = 2\nAlgorithm.group_size = 4\n"
        f"train.eval_every = {steps}\ntrain.eval_size = 8\ntrain.checkpoint_every = 2\ntrain.zero_stage = 3\n"
        f"Sweep.specs = ['{REPO / 'registry' / 'grpo.gin'}']\nSweep.seeds = {seeds}\nSweep.name = '{name}'\n"
        f"Sweep.processes_per_cell = 2\nSweep.num_cpus = {cpus}\nSweep.launcher = 'torchrun'\n"
        "Sweep.placement = 'SPREAD'\nSweep.timeout_s = 600\n"
    )
    return exp


@pytest.mark.cpu_matrix
def test_cells_spanning_two_nodes_equal_the_two_process_cells_of_one_node(tmp_path, cluster):
    """ZeRO-3 at world size 2: rank 0 on one node, rank 1 on the other (a placement group, SPREAD),
    torch.distributed (gloo) between them, against the same cells as 2 processes under torchrun on one
    machine. Per-step metrics (losses, KL, gradient norm, rewards) agree to 1e-6 relative: the ranks
    compute the same sums in the same order, only the transport differs. Two cells and room for one
    at a time (two 1-CPU nodes): the second waits for the first's group, and the driver goes on
    syncing and recording the first meanwhile (a driver that waited for the group hung here)."""
    cluster.ensure_worker()
    exp = _span_experiment(tmp_path, "span", steps=4, seeds="[0, 1]")
    local, out = tmp_path / "local", tmp_path / "on_cluster"
    for results_dir, extra in ((local, []), (out, ["--executor", "ray", "--ray-address", cluster.address])):
        proc = subprocess.run(
            [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(results_dir), *extra],
            cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        cluster.give_worker_the_warm_starts()
    rows = csv_rows(out / "span" / "span.csv")
    assert len(rows) == 2
    for row in rows:
        assert (row["status"], row["world_size"], row["zero_stage"]) == ("ok", "2", "3"), row["error"]
        run_dir = out / "span" / "runs" / row["cell_id"]
        (attempt,) = _attempts(run_dir)
        assert len(set(attempt["node"])) == 2, attempt  # rank 0 and rank 1 on different nodes
        ranks = {json.loads((run_dir / f).read_text())["ray_node"] for f in ("cell.json", "cell.rank1.json")}
        assert ranks == set(attempt["node"])
        # rank 1's own checkpoint files (its ZeRO-3 shards) came back from its node
        shards = sorted(p.name for p in (run_dir / "checkpoints").rglob("*"))
        assert any(n.startswith("zero_pp_rank_1_") for n in shards), shards
        assert (run_dir / "stdout.rank1.log").exists()
        expected = _deterministic(local / "span" / "runs" / row["cell_id"])
        got = _deterministic(run_dir)
        assert [r["step"] for r in got] == [1, 2, 3, 4]
        assert _close(got, expected, rel=1e-6) == []


def test_a_placement_the_cluster_cannot_hold_is_one_line(tmp_path, cluster):
    cluster.ensure_worker()
    exp = _span_experiment(tmp_path, "too_big", steps=2, cpus=3)
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(tmp_path / "r"),
         "--executor", "ray", "--ray-address", cluster.address],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith(("error", "Traceback"))]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert (
        "Sweep.num_cpus = 3 gives each of the 2 ranks 1.5 CPUs, more than any node of the Ray cluster has (1)"
        in (errors[0])
    )


@pytest.mark.cpu_matrix
def test_a_cell_spanning_two_nodes_starts_again_whole_when_one_node_dies(tmp_path, cluster):
    """The worker node dies while it holds one rank of a 2-rank ZeRO-3 cell: the rank on the head fails
    (its peer is gone) and Ray reports the other lost; the attempt counts as a lost node, not a failed
    cell. The node comes back (a new node id); the cell starts again in a new placement group from the
    checkpoint whose shards of both ranks reached the driver, and ends equal to the one-node cell."""
    cluster.ensure_worker()
    exp = _span_experiment(tmp_path, "span_loss", steps=12)
    local, out = tmp_path / "local", tmp_path / "on_cluster"
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(local)],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    cluster.give_worker_the_warm_starts()
    sweep = subprocess.Popen(
        [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(out),
         "--executor", "ray", "--ray-address", cluster.address],
        cwd=REPO, env=cluster.env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "sweep.err", "w"),
    )  # fmt: skip
    runs = out / "span_loss" / "runs"
    deadline = time.monotonic() + 600

    def both_ranks_saved() -> bool:
        """Two tags with each rank's model and optimizer shard on the driver: the older one is whole
        (the newer may still be in flight, and is then set aside)."""
        shards = {f"zero_pp_rank_{r}_mp_rank_00_{k}_states.pt" for r in (0, 1) for k in ("model", "optim")}
        tags = [t for t in runs.glob("*/checkpoints/policy/step*") if shards <= {p.name for p in t.iterdir()}]
        return len(tags) >= 2

    while not both_ranks_saved():
        assert sweep.poll() is None, (tmp_path / "sweep.err").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint of both ranks reached the driver"
        time.sleep(0.2)
    cluster.worker.kill()
    shutil.rmtree(cluster.worker.home)
    cluster.ensure_worker()  # the node comes back, empty but for a copy of the warm starts
    cluster.give_worker_the_warm_starts()
    rc = sweep.wait(timeout=900)
    err = (tmp_path / "sweep.err").read_text()
    assert rc == 0, err[-3000:]
    (row,) = csv_rows(out / "span_loss" / "span_loss.csv")
    assert (row["status"], row["world_size"]) == ("ok", "2"), row["error"]
    run_dir = runs / row["cell_id"]
    attempts = _attempts(run_dir)
    assert [a["status"] for a in attempts] == ["node lost", "ok"], attempts
    assert len(set(attempts[1]["node"])) == 2  # again on two nodes
    assert json.loads((run_dir / "cell.json").read_text())["resume"] is True
    got, expected = _deterministic(run_dir), _deterministic(local / "span_loss" / "runs" / row["cell_id"])
    assert [r["step"] for r in got] == list(range(1, 13))
    assert _close(got, expected, rel=1e-6) == []
    assert _node_copies(cluster) == [], err[-2000:]  # the failed rank's on the head too
