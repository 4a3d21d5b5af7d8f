"""`torchrun --nnodes 2`: two launchers, one rank each, meeting at a rendezvous endpoint on the
loopback, each with its own `--out` (as two machines without a shared disk), against the same run as
2 processes of one `torchrun --standalone`. Rank 0's per-step metrics agree to 1e-6 relative (the
same sums in the same order; only the transport differs); rank 1 writes only its checkpoint shards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polgrad.sweep.slots import free_port

pytestmark = pytest.mark.cpu_matrix

REPO = Path(__file__).resolve().parents[2]
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
BINDINGS = [
    "train.steps = 4",
    "train.prompts_per_step = 2",
    "Algorithm.group_size = 4",
    "train.eval_every = 4",
    "train.eval_size = 8",
    "train.checkpoint_every = 2",
    "train.zero_stage = 3",
    "train.progress = False",
]


def _trainer(out: Path) -> list[str]:
    cmd = [
        "-m",
        "polgrad.train",
        str(REPO / "experiments" / "base_tiny.gin"),
        str(REPO / "registry" / "grpo.gin"),
    ]
    for b in BINDINGS:
        cmd += ["--bind", b]
    return [*cmd, "--out", str(out)]


def _curve(run_dir: Path) -> list[dict]:
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (k.startswith("time") or k in ("tokens_per_s", "peak_mem_mb"))}
            for r in rows]  # fmt: skip


def test_two_nodes_of_one_rank_equal_one_node_of_two(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        }
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    one = subprocess.run(
        [*torchrun, "--standalone", "--nproc_per_node", "2", *_trainer(tmp_path / "one_node")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            [
                *torchrun,
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(r),
                "--rdzv-endpoint",
                endpoint,
                *_trainer(tmp_path / f"node{r}"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    logs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [log[-2000:] for log in logs]
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    summary = json.loads((node0 / "summary.json").read_text())
    assert (summary["world_size"], summary["zero_stage"]) == (2, 3)
    # rank 1's folder on its own "machine": its ZeRO-3 shards, nothing of rank 0's record
    assert sorted(p.name for p in node1.iterdir()) == ["checkpoints"]
    assert any(p.name.startswith("zero_pp_rank_1_") for p in node1.rglob("*"))
    assert not any(p.name.startswith("zero_pp_rank_1_") for p in node0.rglob("*"))
    got, expected = _curve(node0), _curve(tmp_path / "one_node")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, expected, strict=True):
        assert set(a) == set(b)
        for k in a:
            if isinstance(a[k], float):
                assert abs(a[k] - b[k]) <= 1e-6 * max(abs(a[k]), abs(b[k]), 1e-12), (a["step"], k, a[k], b[k])
            else:
                assert a[k] == b[k], (a["step"], k)
