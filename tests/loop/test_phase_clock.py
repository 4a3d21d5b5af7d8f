"""The loop's one phase clock (polgrad.hooks.clock): the time_* metrics are sums of the step's
top-level phases in the trainer's thread, nothing else."""

from __future__ import annotations

import threading

from polgrad import hooks


def test_the_step_times_sum_each_groups_top_level_phases():
    clock = hooks.PhaseClock()
    for path, dt in [
        ("sample", 1.0),
        ("sample/decode", 0.75),  # inside sample's own seconds: not counted twice
        ("sample", 2.0),  # a second sampling round (DAPO's refill) adds to the first
        ("reward", 0.25),
        ("ref", 0.5),
        ("advantage", 0.125),
        ("policy_fwd", 1.0),
        ("backward", 2.0),
        ("optim", 0.5),
        ("eval", 9.0),  # not a step phase: in no time_* metric
    ]:
        clock(path, dt)
    assert set(clock.seconds) == {
        "sample",
        "reward",
        "ref",
        "advantage",
        "policy_fwd",
        "backward",
        "optim",
        "eval",
    }
    assert clock.step_times() == {
        "time_gen": 3.0,
        "time_ref": 0.75,
        "time_values": 0.0,  # no critic: the phase never ran
        "time_adv": 0.125,
        "time_update": 3.5,
    }


def test_phases_of_another_thread_are_not_the_steps():
    """The async producer decodes in its own thread while the trainer updates: its phases are
    reported at the top of its own stack ("decode") and must not reach the trainer's metrics."""
    with hooks.clock() as clock:
        with hooks.phase("sample"):
            pass

        def producer_decode():
            with hooks.phase("decode"):  # the producer's decode: top of its own thread's stack
                pass

        other = threading.Thread(target=producer_decode)
        other.start()
        other.join()
    assert list(clock.seconds) == ["sample"]
    assert clock.seconds["sample"] < 1.0
    # the listener is gone after the block: nothing listens by default
    assert not hooks._phase_listeners


def test_the_clock_counts_what_the_phases_report():
    """Non-vacuity: a phase run under the clock shows up in its seconds (and only its own)."""
    with hooks.clock() as clock:
        with hooks.phase("values"):
            sum(range(1000))
    assert set(clock.seconds) == {"values"} and clock.seconds["values"] >= 0.0
    assert clock.step_times()["time_values"] == clock.seconds["values"]


def test_the_clock_knows_the_blocks_wall_time():
    """tokens_per_s divides by the whole step (phases and the work between them), as it always has."""
    import time

    with hooks.clock() as clock:
        time.sleep(0.01)  # work outside any phase
    assert clock.seconds == {} and clock.wall >= 0.01


PHASE_FILES = ("trainer.py", "offline.py", "critic.py", "sampling.py")
LOOP_PHASES = {"eval", "checkpoint"}  # the loop's own, outside the step's clock


def test_every_phase_the_step_opens_is_in_a_time_metric():
    """A phase renamed or added in the step without a STEP_TIMES group would read 0.0 in every row
    (and every run comparison leaves the timing columns out): each `hooks.phase("name")` of the step's
    modules names a grouped phase, and each grouped phase is opened somewhere."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "polgrad"
    opened = set()
    for name in PHASE_FILES:
        for node in ast.walk(ast.parse((root / name).read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "phase"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                opened.add(node.args[0].value)
    grouped = {p for phases in hooks.STEP_TIMES.values() for p in phases}
    assert opened - LOOP_PHASES <= grouped, opened - LOOP_PHASES - grouped
    assert grouped <= opened, grouped - opened
