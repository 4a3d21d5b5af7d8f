"""Fresh-process runs: each framework's run (and each numerics/composition job) in its own worker.

`run_worker(kind, ...)` starts `python -m benchmarks.bench --worker SPEC` from the repository root
with the workload's threads and OMP_WAIT_POLICY; `interleaved` runs the arms (framework x precision)
A B C D / D C B A so that machine drift cancels within each pair.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.workload import REPO_ROOT, Workload, arm

# Set by a launcher, or left behind by polgrad.distributed.setup() (LOCAL_RANK=0) in a process that
# trained in-process before; a worker is always one process, and accelerate (TRL) takes any of these
# for a launcher's and waits for an env:// rendezvous that never comes.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def worker_env(w: Workload) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "POLGRAD_NUM_THREADS"):
        env[var] = str(w.threads)
    if w.omp_wait_policy != "default":  # a labelled variant; 'default' keeps the user's environment
        env["OMP_WAIT_POLICY"] = w.omp_wait_policy.upper()
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_worker(
    kind: str, w: Workload, model_dir: str, log_dir: str, timeout: float = 1800.0, **extra: Any
) -> Any:
    """Run `kind` (a key of WORKERS) in a fresh `python -m benchmarks.bench --worker` process; its result.

    The process gets the workload's thread count and OMP_WAIT_POLICY in its environment; `extra` goes
    to the worker function as keyword arguments.
    """
    os.makedirs(log_dir, exist_ok=True)
    fd, spec_path = tempfile.mkstemp(suffix=".json", dir=log_dir)
    os.close(fd)
    out_path = spec_path[:-5] + ".out.json"
    log_path = spec_path[:-5] + ".log"
    with open(spec_path, "w") as f:
        json.dump(
            {"kind": kind, "workload": asdict(w), "model_dir": model_dir, "out": out_path, "extra": extra}, f
        )
    cmd = [sys.executable, "-m", "benchmarks.bench", "--worker", spec_path]
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                cmd, cwd=REPO_ROOT, env=worker_env(w), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = "".join(open(log_path).readlines()[-25:])
            raise RuntimeError(f"bench worker {kind} failed (exit {proc.returncode}):\n{tail}")
        with open(out_path) as f:
            return json.load(f)
    finally:
        for p in (spec_path, out_path, log_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)


def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without it
        return float("nan")


def env_omp_wait_policy() -> str:
    """What the headline runs with: the environment's OMP_WAIT_POLICY, or libgomp's default if unset."""
    return os.environ.get("OMP_WAIT_POLICY") or "unset (libgomp default)"


def interleaved(
    w: Workload,
    model_dir: str,
    log_dir: str,
    pairs: int,
    frameworks: Sequence[str],
    progress=print,
    precisions: Sequence[str] = ("fp32",),
) -> list[dict[str, Any]]:
    """`pairs` rounds over every arm (framework x precision), in order then reversed alternately.

    One dict per round ("pair") with each arm's result under its key (`arm(fw, precision)`), and
    per-round speedups: `speedup` (fp32) / `speedup_bf16` = TRL s/step / polgrad s/step, and
    `{fw}_bf16_over_fp32` = fp32 s/step / bf16 s/step of one framework.
    """
    arms = [(fw, p) for p in precisions for fw in frameworks]
    out = []
    for i in range(pairs):
        order = arms if i % 2 == 0 else arms[::-1]
        load_before = loadavg()
        res = {}
        for fw, p in order:
            res[arm(fw, p)] = run_worker(fw, w.replace(seed=w.seed + i, bf16=p == "bf16"), model_dir, log_dir)
        pair = {
            "pair": i + 1,
            "order": ",".join(arm(fw, p) for fw, p in order),
            "load_before": load_before,
            "load_after": loadavg(),
            **res,
        }
        pair.update(pair_speedups(res))
        out.append(pair)
        msg = f"  pair {i + 1}/{pairs} ({pair['order']}, load {load_before:.2f}->{pair['load_after']:.2f}): "
        msg += ", ".join(f"{k} {res[k]['s_per_step']:.3f} s/step" for k in res)
        msg += "".join(f", {k} {v:.2f}x" for k, v in pair_speedups(res).items())
        progress(msg)
    return out


def pair_speedups(res: dict[str, Any]) -> dict[str, float]:
    """The ratios of one round's arms (keys as in `interleaved`; higher is better for the later name)."""
    out = {}
    for p in ("fp32", "bf16"):
        a, b = arm("trl", p), arm("polgrad", p)
        if a in res and b in res:
            out["speedup" if p == "fp32" else f"speedup_{p}"] = res[a]["s_per_step"] / res[b]["s_per_step"]
    for fw in ("polgrad", "trl"):
        if fw in res and f"{fw}_bf16" in res:
            out[f"{fw}_bf16_over_fp32"] = res[fw]["s_per_step"] / res[f"{fw}_bf16"]["s_per_step"]
    return out
