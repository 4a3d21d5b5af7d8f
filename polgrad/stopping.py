"""^C and SIGTERM during training: finish the step, checkpoint it, stop (no step is redone on resume).

`python -m polgrad.train` runs `train()` inside `on_signals()`. Once the loop has started (`arm()`,
at the end of `polgrad.run.start_or_resume`), the first SIGINT or SIGTERM only sets a flag and
says so; the loop asks `requested()` after every step (one max over the ranks, so that a signal
that reached one rank stops them all at the same step), saves a checkpoint of that step, and
`stop_if` raises `Stopped`, which the entry point turns into one line and exit code 130 (SIGINT)
or 143 (SIGTERM). A second ^C does not wait: KeyboardInterrupt at once (no new checkpoint; the
last periodic one stays). A second SIGTERM (the sweep sends one more with its grace period) waits
like the first. Before the loop starts, and outside `on_signals()` (a library caller), signals
behave as Python's defaults.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

from polgrad import collective

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state: dict[str, int | bool | None] = {"installed": False, "armed": False, "signum": None, "last": None}


class Stopped(Exception):
    """A stop was requested by `signum` and honoured after `step` (whose checkpoint is written)."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = signum, step
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _handler(signum, frame) -> None:
    _state["last"] = signum
    if not _state["armed"] or (_state["signum"] is not None and signum == signal.SIGINT):
        raise KeyboardInterrupt  # not in the loop yet, or a second ^C: stop at once
    if _state["signum"] is None:
        _state["signum"] = signum
        print(
            f"{signal.Signals(signum).name}: stopping after this step, with a checkpoint of it "
            "(^C again to stop at once, without one)",
            file=sys.stderr,
            flush=True,
        )


@contextlib.contextmanager
def on_signals() -> Iterator[None]:
    """SIGINT / SIGTERM request a stop after the current step instead of killing the run."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers live in the main thread only
        return
    old = {s: signal.signal(s, _handler) for s in SIGNALS}
    _state.update(installed=True, armed=False, signum=None, last=None)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _state.update(installed=False, armed=False, signum=None)


def exit_code() -> int:
    """128 + the number of the last signal `on_signals` caught (130 for ^C, also when none was)."""
    return 128 + int(_state["last"] or signal.SIGINT)


def arm() -> None:
    """The loop starts: from now on a signal waits for the end of the step (if `on_signals` is on)."""
    _state["armed"] = bool(_state["installed"])


def requested() -> bool:
    """True on every rank if any rank was asked to stop (collective: every rank calls it every step)."""
    import torch

    mine = float(_state["signum"] or 0)
    signum = int(collective.all_max(torch.tensor(mine, dtype=torch.float64)))
    if signum and _state["signum"] is None:
        _state["signum"] = signum  # another rank's signal
    return bool(signum)


def stop_if(stop: bool, step: int) -> None:
    """Raise `Stopped` after the checkpoint of `step` when a stop was requested."""
    if stop:
        raise Stopped(int(_state["signum"] or signal.SIGTERM), step)
