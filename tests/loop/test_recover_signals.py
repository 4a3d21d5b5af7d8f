"""^C / SIGTERM during training: the step finishes, its checkpoint is written, the run says how to
resume and exits 130 / 143; the resumed run ends where an uninterrupted one ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from polgrad import stopping

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the flag (unit)
def _sleep_for_signal():
    for _ in range(100):  # the handler runs between bytecodes of the main thread
        time.sleep(0.01)


def test_before_the_loop_a_signal_stops_at_once():
    with pytest.raises(KeyboardInterrupt), stopping.on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        _sleep_for_signal()
    assert stopping.exit_code() == 143


def test_in_the_loop_a_signal_waits_for_the_end_of_the_step(capsys):
    before = signal.getsignal(signal.SIGINT)
    with stopping.on_signals():
        stopping.arm()
        assert not stopping.requested()
        os.kill(os.getpid(), signal.SIGINT)
        _sleep_for_signal()  # no KeyboardInterrupt: the step goes on
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM (the sweep's grace) waits too
        _sleep_for_signal()
        assert stopping.requested()
        with pytest.raises(stopping.Stopped) as e:
            stopping.stop_if(stopping.requested(), 7)
        assert (e.value.exit_code, e.value.step, str(e.value)) == (130, 7, "stopped by SIGINT after step 7")
        with pytest.raises(KeyboardInterrupt):  # a second ^C: at once
            os.kill(os.getpid(), signal.SIGINT)
            _sleep_for_signal()
    assert "SIGINT: stopping after this step, with a checkpoint of it" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # restored
    stopping.arm()  # outside on_signals: arming does nothing, a ^C is Python's again
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        _sleep_for_signal()


# ----------------------------------------------------------------------------- the real trainer
BINDS = [
    "train.steps = 4",
    "train.prompts_per_step = 4",
    "train.eval_every = 100",
    "train.eval_size = 16",
    "train.checkpoint_every = 100",  # no periodic checkpoint before the end: the stop writes the only one
]


def _command(out: Path, *extra: str) -> list[str]:
    binds = [a for b in BINDS for a in ("--bind", b)]
    spec = str(REPO / "registry" / "grpo.gin")
    return [sys.executable, "-m", "polgrad.train", spec, *binds, "--out", str(out), "--no-progress", *extra]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", POLGRAD_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _rows(out: Path) -> list[dict]:
    timing = {"time_gen", "time_ref", "time_values", "time_adv", "time_update", "tokens_per_s", "time_s"}
    skip = timing | {"peak_mem_mb", "eval_accuracy"}
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if k not in skip} for r in rows]


def _stop_after_the_first_step(out: Path, sig: int) -> tuple[int, str]:
    proc = subprocess.Popen(
        _command(out), env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_the_last_step_and_the_resumed_run_ends_like_an_uninterrupted_one(
    tmp_path, sig, code
):
    out = tmp_path / "cut"
    rc, err = _stop_after_the_first_step(out, sig)
    assert rc == code, err
    rows = _rows(out)
    last = rows[-1]["step"]
    assert 1 <= last < 4  # stopped in the middle, after the step it was in
    tag = out / "checkpoints" / "policy" / f"step{last}"
    assert sorted(p.name for p in (out / "checkpoints" / "policy").iterdir()) == ["latest", f"step{last}"]
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("Loading", "Writing", "["))]
    assert lines[-1] == (
        f"stopped by {signal.Signals(sig).name} after step {last}, with its checkpoint {tag}; to continue, "
        "run the same command with --resume (a sweep: run the sweep again)"
    ), err
    assert not (out / "summary.json").exists()

    resumed = subprocess.run(
        _command(out, "--resume"), env=_env(), capture_output=True, text=True, timeout=600
    )
    assert resumed.returncode == 0, resumed.stderr
    if sig == signal.SIGINT:  # once is enough: the uninterrupted run to compare with
        full = tmp_path / "full"
        done = subprocess.run(_command(full), env=_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
        assert _rows(out) == _rows(full)
    else:
        assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_stopping_a_sweep_lets_its_running_cell_checkpoint_its_step(tmp_path):
    """SIGTERM to the sweep (or ^C): it stops its trainers with SIGTERM, each writes a checkpoint of
    the step it was in; the re-run resumes the cell from there (no step is redone)."""
    exp = tmp_path / "stop.gin"
    exp.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\n"
        + "".join(f"{b}\n" for b in BINDS)
        + f"Sweep.specs = ['{REPO / 'registry' / 'grpo.gin'}']\nSweep.seeds = [0]\n"
    )
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "polgrad.sweep", str(exp), "--results", str(out)]
    sweep_proc = subprocess.Popen(
        cmd, env=_env(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            found = list((out / "stop" / "runs").glob("*/metrics.jsonl")) if (out / "stop").exists() else []
            if found and found[0].read_text().strip():
                break
            assert sweep_proc.poll() is None, sweep_proc.stderr.read()
            assert time.monotonic() < deadline, "the cell never logged a step"
            time.sleep(0.05)
        sweep_proc.send_signal(signal.SIGTERM)
        _, err = sweep_proc.communicate(timeout=300)
    finally:
        if sweep_proc.poll() is None:
            sweep_proc.kill()
    assert sweep_proc.returncode == 130, err
    run = found[0].parent
    last = _rows(run)[-1]["step"]
    assert (run / "checkpoints" / "policy" / f"step{last}").is_dir(), err
    log = (run / "stdout.log").read_text()
    assert f"stopped by SIGTERM after step {last}, with its checkpoint" in log
    assert "interrupted; re-run the same command to resume" in err

    again = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert json.loads((run / "cell.json").read_text())["resume"] is True
    assert [r["step"] for r in _rows(run)] == [1, 2, 3, 4]
