"""Threads and seeding for training on a shared CPU: the thread default, a scoped thread count, a
scoped RNG seed."""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator

import torch


def default_num_threads() -> int:
    """Threads for SFT / reward-model training: `$POLGRAD_NUM_THREADS`, else 1.

    One thread is the right default for the tiny model on a shared CPU: its matrices are too small to
    gain much from a second thread, and when several processes (sweep cells, other users) each run
    OpenMP with every core, training slows down 10-40x (measured here: 80 ms vs 1-3 s per SFT step).
    """
    return max(1, int(os.environ.get("POLGRAD_NUM_THREADS", "1")))


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run a block with `torch.set_num_threads(n)` (None: leave as is), restoring the old count after."""
    old = torch.get_num_threads()
    if n is not None and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block under torch/python RNG state `seed`, restoring the callers' state afterwards."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            yield
        finally:
            random.setstate(state)
