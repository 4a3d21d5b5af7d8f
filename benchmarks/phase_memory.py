"""Peak RSS per phase of one framework's GRPO step (issue 41's profile).

    python -m benchmarks.phase_memory polgrad|trl PRESET [--bf16] [--gradient-checkpointing]

Runs the bench's own worker (`benchmarks/polgrad_run.py` or `benchmarks/trl_run.py`) on PRESET's
workload (1 warm-up + 2 measured steps + the final one) in this process, while a thread reads the
process's resident set (/proc/self/statm) every 2 ms; each sample is attributed to the phase the
bench's clock (`benchmarks.timing.PhaseClock`) was timing. Prints, per step and phase, the RSS at its
start, its maximum and its end, in MiB, and the process's peak. Memory only: the seconds printed are
the phases' wall time in this run, not a timing (use `python -m benchmarks.bench` for those).
"""

from __future__ import annotations

import argparse
import bisect
import os
import tempfile
import threading
import time

from benchmarks import timing
from benchmarks.workload import PRESET_WORKLOADS, PRESETS, Workload, make_model

POLL_S = 0.002


class Poller:
    """(perf_counter, RSS MiB) samples of this process, every POLL_S seconds while running."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with open("/proc/self/statm") as f:
            while not self._stop.is_set():
                f.seek(0)
                rss = int(f.read().split()[1]) * self._page / 2**20
                self.samples.append((time.perf_counter(), rss))
                time.sleep(POLL_S)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def phase_table(
    samples: list[tuple[float, float]], intervals: list[tuple[int, str, float, float]]
) -> list[str]:
    """One line per (step, phase, start, end) interval that holds samples: RSS at start, max, end."""
    ts = [t for t, _ in samples]

    def at(t: float) -> float:
        i = bisect.bisect_right(ts, t) - 1
        return samples[max(i, 0)][1]

    lines = []
    for step, phase, t0, t1 in intervals:
        inside = [r for _, r in samples[bisect.bisect_left(ts, t0) : bisect.bisect_right(ts, t1)]]
        if inside:
            lines.append(
                f"step {step:2d} {phase:11s} start {at(t0):8.0f} max {max(inside):8.0f} end {at(t1):8.0f}"
                f"  ({t1 - t0:7.2f} s)"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.phase_memory", description=__doc__.split("\n")[0])
    ap.add_argument("framework", choices=("polgrad", "trl"))
    ap.add_argument("preset", choices=sorted(PRESETS))
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=2, help="measured steps (after 1 warm-up)")
    args = ap.parse_args(argv)
    w = Workload(
        **{**PRESETS[args.preset], **PRESET_WORKLOADS.get(args.preset, {})},
        steps=args.steps,
        warmup=1,
        bf16=args.bf16,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    import torch

    torch.set_num_threads(w.threads)
    intervals: list[tuple[int, str, float, float]] = []
    add = timing.PhaseClock.add

    def recorded(self, phase: str, dt: float) -> None:
        now = time.perf_counter()
        intervals.append((len(self.steps), phase, now - dt, now))
        add(self, phase, dt)

    if args.framework == "polgrad":
        from benchmarks.polgrad_run import run_polgrad as run
    else:
        from benchmarks.trl_run import run_trl as run
    with tempfile.TemporaryDirectory(prefix="phase-memory-") as work:
        model_dir = make_model(os.path.join(work, "model"), w)["model_dir"]
        timing.PhaseClock.add = recorded
        try:
            with Poller() as poller:
                run(w, model_dir, work)
        finally:
            timing.PhaseClock.add = add
    setting = f"{w.precision}, gradient checkpointing {'on' if w.gradient_checkpointing else 'off'}"
    print(f"{args.framework} {args.preset} ({setting}): RSS MiB per phase")
    print("\n".join(phase_table(poller.samples, intervals)))
    t, peak = max(poller.samples, key=lambda s: s[1])
    print(f"peak {peak:.0f} MiB (the process's ru_maxrss: {timing.peak_rss_mb():.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
