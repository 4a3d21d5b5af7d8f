"""Launching one cell: its GPU slot, its command line, the trainer process and its outcome.

`assign_gpu_slots` splits the visible GPUs into disjoint per-cell slots (local executor on a GPU
node; Ray assigns its own GPUs), `launch_command` builds the command prefix for a slot (plain
python, DeepSpeed or torchrun), and `run_cell` runs the trainer for a cell in a fresh process,
in the sweep's process group, and waits for it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.sweep.experiment import LAUNCHERS
from polgrad.sweep.grid import Cell


@dataclasses.dataclass(frozen=True)
class GpuSlot:
    """The GPUs one concurrently running cell owns."""

    index: int
    devices: tuple[int, ...]

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(d) for d in self.devices)


def assign_gpu_slots(
    n_gpus: int, gpus_per_cell: float, n_cells: int, devices: Sequence[int] | None = None
) -> list[GpuSlot]:
    """Split `n_gpus` GPUs (physical ids `devices`, default 0..n-1) into disjoint slots of `gpus_per_cell`.

    Returns min(n_cells, capacity) slots; cells run concurrently one per slot. gpus_per_cell = 1/k
    (k integer) packs k cells onto each GPU; GPUs left over (n_gpus not a multiple) stay idle.
    """
    devices = list(range(n_gpus)) if devices is None else [int(d) for d in devices]
    if len(devices) != n_gpus:
        raise ValueError(f"{len(devices)} device ids given for {n_gpus} GPUs")
    if gpus_per_cell <= 0:
        raise ValueError(f"gpus_per_cell must be > 0, got {gpus_per_cell}")
    if n_cells <= 0:
        return []
    if gpus_per_cell < 1:
        share = round(1 / gpus_per_cell)
        if not math.isclose(share * gpus_per_cell, 1.0):
            raise ValueError(f"a fraction of a GPU must be 1/k, got {gpus_per_cell}")
        groups = [(d,) for d in devices for _ in range(share)]
    else:
        k = int(gpus_per_cell)
        if k != gpus_per_cell:
            raise ValueError(f"gpus_per_cell above 1 must be whole, got {gpus_per_cell}")
        if k > n_gpus:
            raise ValueError(f"a cell needs {k} GPUs but only {n_gpus} are visible")
        groups = [tuple(devices[i : i + k]) for i in range(0, n_gpus - k + 1, k)]
    return [GpuSlot(i, g) for i, g in enumerate(groups[:n_cells])]


def launch_command(
    train_module: str,
    slot: GpuSlot | None,
    *,
    launcher: str = "deepspeed",
    master_port: int = 29500,
    python: str | None = None,
) -> tuple[list[str], dict[str, str | None]]:
    """(command prefix, environment changes; None = unset) to start the trainer on `slot`.

    No slot or one device: `python -m <train_module>` with CUDA_VISIBLE_DEVICES = the slot's device.
    Several devices: `deepspeed --include localhost:<ids> --master_port P --no_local_rank --module`
    (the DeepSpeed launcher picks GPUs by --include and wants CUDA_VISIBLE_DEVICES unset), or
    `torchrun --standalone --nproc_per_node k -m` with CUDA_VISIBLE_DEVICES = the slot.
    """
    python = python or sys.executable
    if slot is None:
        return [python, "-m", train_module], {}
    if len(slot.devices) <= 1:
        return [python, "-m", train_module], {"CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices}
    if launcher == "deepspeed":
        prefix = [
            python,
            "-m",
            "deepspeed.launcher.runner",
            "--include",
            f"localhost:{slot.cuda_visible_devices}",
            "--master_port",
            str(master_port),
            "--no_local_rank",
            "--module",
            train_module,
        ]
        return prefix, {"CUDA_VISIBLE_DEVICES": None}
    if launcher == "torchrun":
        prefix = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(len(slot.devices)),
            "-m",
            train_module,
        ]
        return prefix, {"CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices}
    raise ValueError(f"unknown launcher '{launcher}'; valid: {', '.join(LAUNCHERS)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> list[int]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(d) for d in env.split(",") if d.strip().isdigit()]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:
        return []


# --------------------------------------------------------------------------------------------
# Running one cell in a fresh process
# --------------------------------------------------------------------------------------------

_RUNNING: dict[str, subprocess.Popen] = {}
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set on ^C / SIGTERM: no new trainer may start


def allow_trainers() -> None:
    """A sweep starts: trainers may be launched again (clears the stop of an earlier interrupt)."""
    _STOPPING.clear()


def stop_trainers() -> None:
    """^C / SIGTERM: no new trainer may start; terminate the running ones, kill those that linger."""
    with _RUNNING_LOCK:
        _STOPPING.set()
        procs = list(_RUNNING.values())
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return summary if isinstance(summary, dict) else None
    except (OSError, ValueError):
        return None


def _failed(cell: Cell, where: str, error: BaseException, limit: int | None = None) -> dict[str, Any]:
    """The outcome of a cell whose runner raised `error` (recorded as failed; the sweep goes on)."""
    text = " ".join(str(error).split())
    return {
        "cell_id": cell.id,
        "status": "failed",
        "summary": None,
        "error": f"{where}: {type(error).__name__}: {text if limit is None else text[:limit]}",
    }


def is_finished(run_dir: Path) -> bool:
    summary = read_summary(run_dir)
    return summary is not None and summary.get("status") == "ok"


def has_checkpoints(run_dir: Path) -> bool:
    ckpt = run_dir / "checkpoints"
    return ckpt.is_dir() and any(ckpt.iterdir())


def last_step(run_dir: Path) -> int | None:
    """The step of the last complete line of metrics.jsonl (reads only the file's tail)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _kill_stale_trainer(run_dir: Path) -> None:
    """A trainer left running by a sweep that was killed alone (not its process group): stop it."""
    pid_file = run_dir / "trainer.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return
    if str(run_dir) not in cmdline:
        return  # the pid was reused by something else
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.1)


def _error_line(stderr_tail: Sequence[str], returncode: int) -> str:
    lines = [ln.strip() for ln in stderr_tail if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[len("error:") :].strip()
    if lines:
        return lines[-1]
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def run_cell(
    cell: Cell,
    run_dir: str | os.PathLike,
    *,
    train_module: str,
    threads: int,
    slot: GpuSlot | None = None,
    launcher: str = "deepspeed",
    timeout_s: float | None = None,
    experiment: str = "",
) -> dict[str, Any]:
    """Run the trainer for `cell` into `run_dir` and wait; return its outcome (status, error, summary)."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    _kill_stale_trainer(run_dir)
    resume = has_checkpoints(run_dir)
    if not resume:  # a fresh start must not append to a dead attempt's curves
        for stale in ("metrics.jsonl", "summary.json", "config.gin"):
            (run_dir / stale).unlink(missing_ok=True)
    else:
        (run_dir / "summary.json").unlink(missing_ok=True)
    prefix, env_changes = launch_command(train_module, slot, launcher=launcher, master_port=_free_port())
    cmd = [*prefix, *cell.config_files]
    for b in cell.bindings:
        cmd += ["--bind", b]
    cmd += ["--out", str(run_dir)] + (["--resume"] if resume else [])
    env = dict(os.environ)
    threads = max(1, int(threads))
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "POLGRAD_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "POLGRAD_CELL_ID": cell.id,
        }
    )
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    info = {
        "experiment": experiment,
        "cell": dataclasses.asdict(cell),
        "command": shlex.join(cmd),
        "cwd": os.getcwd(),
        "env": {k: env_changes.get(k, env.get(k)) for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")},
        "environment": _results.environment(),
        "started_at": started,
        "resume": resume,
    }
    _results.atomic_write_text(run_dir / "cell.json", json.dumps(info, indent=2, default=str) + "\n")
    tail: deque[str] = deque(maxlen=30)
    with open(run_dir / "stdout.log", "a", buffering=1) as log:
        log.write(f"=== {started} {'resume' if resume else 'start'}: {shlex.join(cmd)}\n")
        log.flush()
        with _RUNNING_LOCK:
            if _STOPPING.is_set():
                raise KeyboardInterrupt
            # Same process group as the sweep: killing the sweep's group stops its trainers too.
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.PIPE, env=env, text=True, errors="replace"
            )
            _RUNNING[cell.id] = proc
        (run_dir / "trainer.pid").write_text(f"{proc.pid}\n")

        def pump():
            for line in proc.stderr:
                log.write(line)
                tail.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(cell.id, None)
        reader.join(timeout=10)
    (run_dir / "trainer.pid").unlink(missing_ok=True)
    summary = read_summary(run_dir)
    rc = proc.returncode
    if timed_out:
        status, error = "failed", f"timed out after {timeout_s:g} s (Sweep.timeout_s)"
    elif rc == 0 and summary is not None and summary.get("status") == "ok":
        status, error = "ok", ""
    elif rc == 0:
        status, error = "failed", "trainer exited 0 without a summary.json with status ok"
    else:
        status, error = "failed", _error_line(tail, rc)
    return {
        "cell_id": cell.id,
        "status": status,
        "error": error,
        "returncode": rc,
        "summary": summary,
        "resumed": resume,
        "environment": _results.environment(),
    }
