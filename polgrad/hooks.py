"""Phase hooks: the trainer and the rollout backends name what they are doing; tools may listen.

The loop wraps each phase of a step in `with hooks.phase("name"):` and opens each step with
`hooks.event("step")`. Nobody listens by default and a phase then costs one list check, so the
library never pays for tooling. A benchmark or profiler listens through the public API instead of
patching polgrad's functions:

    with hooks.listen(on_phase=lambda path, seconds: ..., on_event=lambda name: ...):
        train(out_dir)

Phases nest; a listener gets the nested path, e.g. "sample/decode" (the rollout's decode loop
inside the trainer's sampling phase) or "eval/decode" (the same loop during evaluation).

Phases the trainer emits, per step: sample, reward, old_logp, ref, values, advantage,
policy_fwd, loss, backward, optim, sync, eval, checkpoint. The HF rollout emits decode inside
them (the sampled rows' decode and, for ReMax, the greedy baseline's). Each thread nests its own
phases: the async producer's decode (polgrad/producer.py) is reported as "decode", at the top.
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
