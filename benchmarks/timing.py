"""Per-step phase clocks and the per-run summary both frameworks' runs report.

polgrad's phases reach a `PhaseClock` through `polgrad.hooks` (benchmarks/polgrad_run.py); TRL has no
such hooks, so its functions are wrapped with `PhaseClock.timed` and `patched` (benchmarks/trl_run.py).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from benchmarks.workload import PHASES, Workload


class PhaseClock:
    """Per-step phase seconds: `new_step()` opens a bucket, `add(phase, dt)` accumulates into it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.step_ends: list[float] = []
        self.extra: dict[str, float] = {}

    def new_step(self) -> None:
        self.steps.append({})

    def add(self, phase: str, dt: float) -> None:
        if not self.steps:
            self.extra[phase] = self.extra.get(phase, 0.0) + dt
            return
        bucket = self.steps[-1]
        bucket[phase] = bucket.get(phase, 0.0) + dt

    def timed(self, phase: str | Callable[..., str | None], fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` wrapped to add its wall time to `phase` (or to phase(*args, **kwargs); None: untimed)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = phase(*args, **kwargs) if callable(phase) else phase
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if name is not None:
                    self.add(name, time.perf_counter() - t0)

        return wrapper


@contextlib.contextmanager
def patched(patches: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set obj.name = value for each patch; restore (or delete instance attributes) afterwards.

    For the peer framework's objects only (TRL): polgrad is timed through its hooks.
    """
    saved = []
    for obj, name, value in patches:
        had = name in vars(obj) if hasattr(obj, "__dict__") else True
        saved.append((obj, name, getattr(obj, name, None), had))
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def peak_rss_mb() -> float:
    """The worker's own peak RSS in MiB (polgrad.machine.peak_rss_mib: not the bench driver's, which
    `ru_maxrss` would carry across the worker's exec)."""
    from polgrad.machine import peak_rss_mib

    return peak_rss_mib()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def summarise(
    framework: str, w: Workload, intervals: list[float], buckets: list[dict[str, float]], tokens: list[float]
) -> dict[str, Any]:
    """Medians over the measured steps (intervals[i] is the step whose phases are buckets[i]).

    `step_phases` keeps every measured step's phases (with `other` = step - the rest, `sample`
    excluded since it is inside `gen`).
    """
    phase_rows = []
    for dt, b in zip(intervals, buckets, strict=True):
        row = {p: b.get(p, 0.0) for p in PHASES if p != "other"}
        row["other"] = dt - sum(v for p, v in row.items() if p != "sample")
        phase_rows.append(row)
    s_per_step = median(intervals)
    tok = median(tokens)
    sample_s = median([r["sample"] for r in phase_rows])
    return {
        "framework": framework,
        "s_per_step": s_per_step,
        "step_times": intervals,
        "step_phases": phase_rows,
        "tokens_per_step": tok,
        "tokens_per_completion": tok / w.batch,
        "tokens_per_s": tok / s_per_step,
        "gen_tokens_per_s": tok / sample_s if sample_s > 0 else float("nan"),
        "phases": {p: median([r[p] for r in phase_rows]) for p in PHASES},
        "peak_rss_mb": peak_rss_mb(),
        "threads": torch_threads(),
    }
