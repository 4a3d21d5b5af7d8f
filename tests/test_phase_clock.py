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
