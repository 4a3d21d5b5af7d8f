"""Threads and seeding for training on a shared CPU: every thread decision of a run, and a scoped
RNG seed.

The thread counts a run uses, all decided here:

    apply_run_threads(train.threads)  the trainer's torch threads (None: torch's own default), set once
                                      when the run starts (polgrad/trainer.py)
    default_num_threads()             SFT warm start and reward-model training: $POLGRAD_NUM_THREADS,
                                      else 1 (the sweep sets it, with OMP_NUM_THREADS and
                                      MKL_NUM_THREADS, to each cell's share of the cores)
    decode_threads(model, rows)       the decode loop: the trainer's count, or 1 where that is faster
                                      (OpenMP threads that sleep between regions, small models)
    vLLM's engine                     its own `num_threads` (1; polgrad/rollout/vllm.py), scoped by
                                      `torch_threads` around each call

Each is a different job on purpose (measured below and in the modules named); changing one changes
the float summation order of what it runs, hence the numbers, so none is derived from another.
"""

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


def apply_run_threads(n: int | None) -> None:
    """The trainer's intra-op torch threads for the whole run (train.threads; None keeps torch's)."""
    if n:
        torch.set_num_threads(int(n))


# Decode steps below this many GFLOP per token (2 x rows x parameters) run on one CPU thread when
# OpenMP threads sleep between parallel regions (OMP_WAIT_POLICY=passive): waking the second thread
# for each of the ~20 small matmuls of a token costs more than it saves. Measured on this 2-core VM,
# 64 rows x 32 tokens, 2 threads vs 1 (ms per rollout): 0.08 GFLOP/token 150 vs 82, 0.3: 231 vs 181,
# 1.2: 502 vs 514. With spinning threads (the default policy) 2 threads win at every size (68 vs 82).
_SINGLE_THREAD_DECODE_GFLOP = 1.0


def decode_threads(model, rows: int) -> int:
    """Intra-op CPU threads for the decode loop: torch's setting, or 1 where that is faster (above)."""
    n = torch.get_num_threads()
    if n == 1 or next(model.parameters()).device.type != "cpu":
        return n
    if os.environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE":
        return n
    gflop = 2.0 * rows * sum(p.numel() for p in model.parameters()) / 1e9
    return 1 if gflop < _SINGLE_THREAD_DECODE_GFLOP else n


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
