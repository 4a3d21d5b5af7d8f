"""The collapse rule: when a finished run's held-out accuracy says it failed, whatever its status.

A run **collapsed** when its held-out accuracy (eval_accuracy) ended at 0, or fell below
COLLAPSE_FRACTION (half) of its own warm start's accuracy (eval_accuracy_init) where that warm start's
accuracy is at least COLLAPSE_MIN_INIT (0.1): below it, a fall to half (e.g. 0.024 to 0.01, a few
questions of the eval set) is within the noise of the eval set, not a collapse.

One rule, two readers: the trainer reports a collapsed run itself (summary.json's `collapsed` beside
its status, and the `done:` line; polgrad/summary.py), and a sweep's results name collapsed runs as
failures of their configuration (polgrad/results/health.py), from the CSV's columns.
"""

from __future__ import annotations

import math

COLLAPSE_FRACTION = 0.5
COLLAPSE_MIN_INIT = 0.1  # a warm start below this accuracy: a fall to half of it is eval-set noise
RULE = (
    f"held-out accuracy ended at 0, or below {COLLAPSE_FRACTION:g} of its warm start's where that is at "
    f"least {COLLAPSE_MIN_INIT:g}"
)


def _number(value: object) -> float:
    """`value` as a float; NaN for None or anything that is not a number (a missing eval)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def collapse_reason(accuracy: object, initial: object) -> str | None:
    """Why a run with final held-out accuracy `accuracy` and warm-start accuracy `initial` collapsed
    ('held-out accuracy ended at 0 (from 0.34)', 'held-out accuracy fell from 0.5 to 0.2'), or None when
    it did not or its accuracy is unknown (None, NaN, a blank CSV cell)."""
    acc, init = _number(accuracy), _number(initial)
    if not math.isfinite(acc):
        return None
    if acc <= 0.0:
        return f"held-out accuracy ended at {acc:.3g}" + (f" (from {init:.3g})" if init > 0 else "")
    if init >= COLLAPSE_MIN_INIT and acc < COLLAPSE_FRACTION * init:
        return f"held-out accuracy fell from {init:.3g} to {acc:.3g}"
    return None
