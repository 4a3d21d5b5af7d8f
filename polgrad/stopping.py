"""When the loop stops: ^C / SIGTERM after the step (checkpointed), and the sampling budget.

^C and SIGTERM during training: finish the step, checkpoint it, stop (no step is redone on resume).

`python -m polgrad.train` runs `train()` inside `on_signals()`. Once the loop has started (`arm()`,
at the end of `polgrad.loop_state.start_or_resume`), the first SIGINT or SIGTERM only sets a flag and
says so; the loop asks `requested()` after every step (one max over the ranks, so that a signal
that reached one rank stops them all at the same step), saves a checkpoint of that step, and
`stop_if` raises `Stopped`, which the entry point turns into one line and exit code 130 (SIGINT)
or 143 (SIGTERM). A second ^C does not wait: KeyboardInterrupt at once (no new checkpoint; the
last periodic one stays). A second SIGTERM (the sweep sends one more with its grace period) waits
like the first. Before the loop starts, and outside `on_signals()` (a library caller), signals
behave as Python's defaults.

The budget: the loop state counts, cumulatively over the run and every rank, what the run has
sampled (`COUNTERS`): `sampled_sequences` (every sequence a step sampled: all of DAPO's refill
rounds, the groups a faulty reward drops, and ReMax's greedy baseline, one per prompt),
`kept_sequences` (those the update trained on, after the filters) and `generated_tokens` (the
response tokens of the sampled sequences, EOS included, the greedy ones too). A preference spec
(DPO) samples nothing: it counts the sequences it trains on (2 per pair) and their response tokens.
`done` ends the run after the step at which the count reaches `train.max_sampled_sequences` or
`train.max_generated_tokens` (the sweep's `Sweep.budget` sets them, polgrad/sweep/budget.py), or
at `train.steps`, whichever comes first: a spec that samples more per step (DAPO's refill) stops
after fewer optimizer steps, and the last step may overshoot the total by at most its own sampling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Iterator

from polgrad import collective

SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The loop state's cumulative counters (polgrad.loop_state.LoopState), logged in every row and summary.
COUNTERS = ("sampled_sequences", "kept_sequences", "generated_tokens")
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


# --------------------------------------------------------------------------- the sampling budget
def sampled(rollout) -> tuple[float, float]:
    """(sequences, generated tokens) of one sampling call's rows on this rank: every row of `rollout`
    (a greedy baseline's responses are its own role's to count: `greedy_sampled`)."""
    return float(len(rollout)), float(rollout.mask.sum())


def greedy_sampled(baseline) -> tuple[float, float]:
    """(sequences, generated tokens) of a greedy baseline rollout (ReMax): one greedy response per
    prompt (the baseline repeats it on each row of the prompt's group, so only the first row of each
    group is counted)."""
    ids = baseline.group_ids.tolist()
    first = [ids.index(g) for g in dict.fromkeys(ids)]
    return float(len(first)), float(baseline.mask[first].sum())


def counted(state, sampled: float, kept: float, tokens: float):
    """The loop state (a dataclass with the `COUNTERS` fields) after a step that sampled `sampled`
    sequences of `tokens` generated tokens and trained on `kept` (each summed over the ranks)."""
    return dataclasses.replace(
        state,
        sampled_sequences=state.sampled_sequences + round(sampled),
        kept_sequences=state.kept_sequences + round(kept),
        generated_tokens=state.generated_tokens + round(tokens),
    )


def counts(state) -> dict[str, int]:
    """The cumulative counters of the loop state, as a metrics row and the summary record them."""
    return {k: int(getattr(state, k)) for k in COUNTERS}


def done(cfg, state) -> bool:
    """The run has done its `train.steps`, or spent its sampling budget (`train.max_sampled_sequences`,
    `train.max_generated_tokens`; None: no such limit)."""
    limits = (
        (cfg.max_sampled_sequences, state.sampled_sequences),
        (cfg.max_generated_tokens, state.generated_tokens),
    )
    return state.step >= cfg.steps or any(limit is not None and used >= limit for limit, used in limits)
