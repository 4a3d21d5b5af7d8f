"""Running one cell: the trainer's processes and their outcome (stopping them: polgrad/sweep/processes.py).

`run_cell` starts the trainer for a cell (the command prefix comes from `polgrad.sweep.slots`:
plain python, or a launcher starting several ranks) and waits for it. A one-process cell runs in
the sweep's process group, so killing the sweep's group stops it too. A cell of several ranks gets
a process group of its own, because a launcher does not always pass a signal on to its ranks
(DeepSpeed's local runner dies of SIGTERM and leaves them running): a timeout or ^C signals that
whole group, and then kills whatever process still carries the cell's `--out <run dir>` (torchrun
starts each rank in a session of its own). The same search stops the processes of a cell left
running by a sweep that was killed alone, before the cell starts again.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import re
import shlex
import signal
import subprocess
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.run_folder import RunFolder
from polgrad.sweep import processes
from polgrad.sweep.grid import Cell
from polgrad.sweep.slots import GpuSlot, bind_flag, free_port, launch_command, ranks

# --------------------------------------------------------------------------------------------
# Running one cell in a fresh process
# --------------------------------------------------------------------------------------------


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        summary = RunFolder(run_dir).read_summary()
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


# The statuses of a run that ended with a result (a re-run skips these cells): polgrad.results.record.
FINISHED = _results.FINISHED


def is_finished(run_dir: Path) -> bool:
    summary = read_summary(run_dir)
    return summary is not None and summary.get("status") in FINISHED


def has_checkpoints(run_dir: Path) -> bool:
    ckpt = RunFolder(run_dir).checkpoints
    return ckpt.is_dir() and any(ckpt.iterdir())


def _cell_params(cell: Cell) -> str:
    """$POLGRAD_CELL_PARAMS: the spec, the swept bindings as the experiment file writes them, the seed."""
    return json.dumps({"spec": cell.spec_name, **dict(cell.swept), "seed": cell.seed})


# A launcher's report of a rank that died of a signal: torchrun's "Signal 9 (SIGKILL) received by PID
# n", DeepSpeed's "... exits with return code = -9".
_RANK_SIGNAL = re.compile(r"Signal (\d+) \(\w+\) received by PID|exits with return code = -(\d+)")
# A progress bar's line (tqdm: "Loading weights: 100%|####| 3/3 [00:01<00:00, 2.9it/s]", or without a
# total "12it [00:01, 9.8it/s]"), for a bar that reached stderr without its carriage returns.
_PROGRESS_BAR = re.compile(r"\d+%\||\[\d+:\d\d(?::\d\d)?(?:<[\d:?]+)?, ")


def is_progress(line: str, after_cr: bool) -> bool:
    """True for a line of stderr that is a progress bar's update, never a failure's reason: one ending
    in a bare carriage return, one right after such a line (the same terminal line redrawn, e.g. a
    bar's final state before its newline), or one in tqdm's format."""
    return after_cr or (line.endswith("\r") and not line.endswith("\r\n")) or bool(_PROGRESS_BAR.search(line))


def killed_by(signum: int) -> str:
    """How a process killed by signal `signum` is reported; SIGKILL from outside is, on a machine
    running cells side by side, usually the kernel's out-of-memory killer."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"killed by signal {signum}"
    if signum == signal.SIGKILL:
        return (
            "killed by SIGKILL, usually the kernel's out-of-memory killer (dmesg says so): "
            "run fewer cells at a time (a lower --parallel)"
        )
    return f"killed by {name}"


def _error_line(first_error: str | None, stderr_tail: Sequence[str], returncode: int) -> str:
    """The trainer's one-line error: its first `error: ...` line (with several ranks, the first rank to
    fail; the others' errors are mostly its consequence, e.g. a closed connection), else the signal that
    killed it (or, under a launcher, one of its ranks), else the last line of stderr (`stderr_tail`
    holds no progress bar's line: `is_progress`), else its exit code."""
    if first_error is not None:
        return first_error[len("error:") :].strip()
    if returncode < 0:
        return killed_by(-returncode)
    lines = [ln.strip() for ln in stderr_tail if ln.strip()]
    for ln in lines:
        rank = _RANK_SIGNAL.search(ln)
        if rank:
            return f"a rank {killed_by(int(rank.group(1) or rank.group(2)))}"
    if lines:
        return lines[-1]
    return f"exit code {returncode}"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _timed_out(timeout_s: float | None) -> str:
    return f"timed out after {timeout_s:g} s (Sweep.timeout_s)"


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
    processes: int = 1,
    environment: dict[str, Any] | None = None,
    where: dict[str, Any] | None = None,
    die_with_parent: int = 0,
    extra_env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run the trainer for `cell` into `run_dir` and wait; return its outcome (status, error, summary).

    `threads` is the cell's share of the cores, split between its ranks: one rank per GPU of `slot`,
    else `processes` (Sweep.processes_per_cell) ranks on CPU, started by `launcher`. `environment`
    (commit, diff) is taken from the run folder's checkout unless given (a Ray node runs the
    driver's code: polgrad/sweep/ray_cells.py); `where` goes into cell.json as is (e.g. the node);
    `die_with_parent` (a signal number, 0: none) is the signal the kernel sends the trainer when the
    thread that started it dies; `extra_env` is added to the trainer's environment (e.g. RANK).
    """
    run_dir = Path(run_dir).resolve()
    resume = _prepare_run_dir(run_dir)
    if environment is None:
        environment = _results.cell_environment(run_dir, experiment)
    n_ranks = ranks(slot, processes)
    cmd, env, env_changes = _command(
        cell, run_dir, train_module, slot, launcher, processes, n_ranks, threads, experiment, resume
    )
    env.update(extra_env or {})
    info = {
        "experiment": experiment,
        "cell": dataclasses.asdict(cell),
        "command": shlex.join(cmd),
        "cwd": os.getcwd(),
        "env": {k: env_changes.get(k, env.get(k)) for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")},
        "ranks": n_ranks,
        # the commit (and diff.patch when the tree differs), the experiment's own outputs left out
        "environment": environment,
        "started_at": _now(),
        "resume": resume,
        **(where or {}),
    }
    _results.atomic_write_text(run_dir / "cell.json", json.dumps(info, indent=2, default=str) + "\n")
    rc, first_error, tail, timed_out = _run_trainer(
        cell, run_dir, cmd, env, n_ranks, timeout_s, info, die_with_parent=die_with_parent
    )
    summary = read_summary(run_dir)
    if timed_out:
        status, error = "failed", _timed_out(timeout_s)
    elif rc == 0 and summary is not None and summary.get("status") in FINISHED:
        status, error = summary["status"], str(summary.get("unstable", ""))  # why it is unstable
    elif rc == 0:
        status, error = "failed", "trainer exited 0 without a summary.json with status ok"
    else:
        status, error = "failed", _error_line(first_error, tail, rc)
    return {
        "cell_id": cell.id,
        "status": status,
        "error": error,
        "returncode": rc,
        "summary": summary,
        "resumed": resume,
        "world_size": n_ranks,
        # where and with which code the cell ran: taken when it started (cell.json's copy, which the
        # CSV's rebuild from the run folders reads), not now, when a commit may have landed meanwhile
        "environment": info["environment"],
    }


def _prepare_run_dir(run_dir: Path) -> bool:
    """Make the cell's folder ready to (re)start the trainer in it; True when it resumes a checkpoint.

    A trainer still running there from a dead sweep is stopped first; a fresh start must not append to
    a dead attempt's curves, and a resume gets a new summary."""
    run_dir.mkdir(parents=True, exist_ok=True)
    processes.kill_stale_trainer(run_dir)
    resume = has_checkpoints(run_dir)
    if not resume:
        RunFolder(run_dir).forget_attempt()  # metrics, evaluations, summary, config of the dead attempt
    else:
        RunFolder(run_dir).summary.unlink(missing_ok=True)
    return resume


def _command(
    cell: Cell,
    run_dir: Path,
    train_module: str,
    slot: GpuSlot | None,
    launcher: str,
    processes: int,
    n_ranks: int,
    threads: int,
    experiment: str,
    resume: bool,
) -> tuple[list[str], dict[str, str], dict[str, str | None]]:
    """The trainer's command line, its environment, and the launcher's changes to that environment."""
    prefix, env_changes = launch_command(
        train_module, slot, launcher=launcher, master_port=free_port(), processes=processes
    )
    cmd = [*prefix, *cell.config_files]
    for b in cell.bindings:
        cmd += [bind_flag(launcher, n_ranks), b]
    cmd += ["--out", str(run_dir)] + (["--resume"] if resume else [])
    env = dict(os.environ)
    threads = max(1, int(threads) // n_ranks)  # per rank
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "POLGRAD_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "POLGRAD_CELL_ID": cell.id,
            # what the run's trackers (train.loggers) call it: polgrad/tracking.py
            "POLGRAD_EXPERIMENT": experiment,
            "POLGRAD_CELL_PARAMS": _cell_params(cell),
        }
    )
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return cmd, env, env_changes


def _run_trainer(
    cell: Cell,
    run_dir: Path,
    cmd: list[str],
    env: dict[str, str],
    n_ranks: int,
    timeout_s: float | None,
    info: dict[str, Any],
    die_with_parent: int = 0,
) -> tuple[int | None, str | None, deque[str], bool]:
    """Start the trainer, log its output to stdout.log, wait for it (stopping it at `timeout_s`);
    (return code, its first `error:` line, the last lines of its stderr, whether it timed out)."""
    tail: deque[str] = deque(maxlen=30)
    first_error: list[str] = []
    resume = info["resume"]
    with open(run_dir / "stdout.log", "a", buffering=1) as log:
        log.write(f"=== {info['started_at']} {'resume' if resume else 'start'}: {shlex.join(cmd)}\n")
        log.flush()
        with processes.RUNNING_LOCK:
            if processes.STOPPING.is_set():
                raise KeyboardInterrupt
            # One process: the sweep's process group (killing the sweep's group stops it too).
            # Several ranks: a group of their own (see the module docstring).
            proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.PIPE,
                env=env,
                text=True,
                errors="replace",
                start_new_session=n_ranks > 1,
                preexec_fn=processes.parent_death_signal(die_with_parent) if die_with_parent else None,
            )
            # carriage returns kept, so that a progress bar's redrawn line is seen as one (`is_progress`)
            proc.stderr.reconfigure(newline="")
            running = processes.RUNNING[cell.id] = processes.Running(proc, run_dir, own_group=n_ranks > 1)
        (run_dir / "trainer.pid").write_text(f"{proc.pid}\n")

        def pump():
            after_cr = False  # the line before ended in a bare carriage return: a bar being redrawn
            for line in proc.stderr:
                log.write(line)
                if not is_progress(line, after_cr):
                    tail.append(line)
                after_cr = line.endswith("\r") and not line.endswith("\r\n")
                if not first_error and line.strip().startswith("error:"):
                    first_error.append(line.strip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
            running.end()
        except subprocess.TimeoutExpired:
            timed_out = True
            log.write(
                f"=== {_now()} timed out after {timeout_s:g} s (Sweep.timeout_s): stopping the trainer "
                "(SIGTERM, SIGKILL after 30 s); what it prints next answers that stop\n"
            )
            running.stop(grace=30)
        finally:
            with processes.RUNNING_LOCK:
                processes.RUNNING.pop(cell.id, None)
        reader.join(timeout=10)
        if timed_out:  # the log's last error line, as in the CSV (not the trainer's 'interrupted')
            log.write(f"error: {_timed_out(timeout_s)}; re-run the sweep to resume the cell\n")
    (run_dir / "trainer.pid").unlink(missing_ok=True)
    return proc.returncode, (first_error[0] if first_error else None), tail, timed_out
