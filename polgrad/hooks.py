"""Phase hooks: the trainer and the rollout backends name what they are doing; tools may listen.

The loop wraps each phase of a step in `with hooks.phase("name"):` and opens each step with
`hooks.event("step")`. Outside a step nobody listens by default and a phase costs one list check;
during a step the loop's own clock (`clock`, below) listens, so each phase costs two perf_counter
calls and a dict update (the phases are milliseconds to seconds long). A benchmark or profiler
listens through the public API instead of patching polgrad's functions:

    with hooks.listen(on_phase=lambda path, seconds: ..., on_event=lambda name: ...):
        polgrad.train.run(out_dir)  # or polgrad.trainer.train(cfg, algo, task, out_dir, record=...)

Phases nest; a listener gets the nested path, e.g. "sample/decode" (the rollout's decode loop
inside the trainer's sampling phase) or "eval/decode" (the same loop during evaluation).

Phases the trainer emits, per step: sample, reward, old_logp, ref, values, advantage,
policy_fwd, loss, backward, optim, sync, eval, checkpoint. The loop's own clock (`clock`) listens
the same way and turns them into the metrics row's time_* columns (`STEP_TIMES`). The HF rollout
emits decode inside them (the sampled rows' decode and, for ReMax, the greedy baseline's). Each
thread nests its own phases: the async producer's decode (polgrad/producer.py) is reported as
"decode", at the top.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

PhaseListener = Callable[[str, float], None]
EventListener = Callable[[str], None]

_phase_listeners: list[PhaseListener] = []
_event_listeners: list[EventListener] = []
_local = threading.local()  # each thread's open phases (the async producer decodes in its own)


def _stack() -> list[str]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase `name` (nested under the phases already open) for the listeners."""
    if not _phase_listeners:
        yield
        return
    stack = _stack()
    stack.append(name)
    path = "/".join(stack)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        stack.pop()
        for fn in list(_phase_listeners):
            fn(path, dt)


def event(name: str) -> None:
    """A point in time (e.g. "step": a new step begins) for the listeners."""
    for fn in list(_event_listeners):
        fn(name)


@contextlib.contextmanager
def listen(on_phase: PhaseListener | None = None, on_event: EventListener | None = None) -> Iterator[None]:
    """Register the listeners for the duration of the block."""
    if on_phase is not None:
        _phase_listeners.append(on_phase)
    if on_event is not None:
        _event_listeners.append(on_event)
    try:
        yield
    finally:
        if on_phase is not None:
            _phase_listeners.remove(on_phase)
        if on_event is not None:
            _event_listeners.remove(on_event)


# The step's time_* metrics: each is the sum of the seconds of these top-level phases of the
# trainer's thread (a phase's nested phases, e.g. sample/decode, are inside its own seconds).
STEP_TIMES = {
    "time_gen": ("sample",),
    "time_ref": ("reward", "old_logp", "ref"),
    "time_values": ("values",),
    "time_adv": ("advantage",),
    "time_update": ("policy_fwd", "loss", "backward", "optim", "sync"),
}


class PhaseClock:
    """Seconds per top-level phase of the thread that made it, summed over the block `clock()` opens;
    phases of other threads (the async producer's decode) are not its."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.wall = 0.0  # the block's wall time: phases plus what runs between them (set on exit)
        self._thread = threading.get_ident()

    def __call__(self, path: str, dt: float) -> None:
        if "/" not in path and threading.get_ident() == self._thread:
            self.seconds[path] = self.seconds.get(path, 0.0) + dt

    def step_times(self) -> dict[str, float]:
        """The step's time_* metrics (`STEP_TIMES`): 0.0 for a group of phases the step did not run."""
        return {k: sum(self.seconds.get(p, 0.0) for p in phases) for k, phases in STEP_TIMES.items()}


@contextlib.contextmanager
def clock() -> Iterator[PhaseClock]:
    """The one clock of the loop's phases: `with hooks.clock() as c: <one step>`, then
    `c.step_times()` are the step's time_* metrics and `c.wall` its wall time (tokens_per_s's
    denominator)."""
    c = PhaseClock()
    t0 = time.perf_counter()
    try:
        with listen(on_phase=c):
            yield c
    finally:
        c.wall = time.perf_counter() - t0
