"""`python -m polgrad.train` for tests/loop/test_async_ranks.py, run under torchrun: one or more runs
in turn in the same ranks, separated by `--then`; `--force-async` first in a run makes
train.max_staleness = 0 run the producer (the synchronous loop otherwise), as
tests/rollout/test_async_rollouts.py forces it in one process.

    torchrun --standalone --nproc_per_node 2 tests/async_worker.py [--force-async] CONFIG ... --out DIR \
        [--then [--force-async] CONFIG ... --out DIR ...]

Each run is a whole `polgrad.train` run (its gin parsed afresh, its models built, trained, written)
in the process group the first one set up, as a second run in one process joins it
(`distributed.session`); only the last one ends the group (`distributed.finish`), the others end
together at a barrier as `finish` makes them, and keep the group. A launch of two ranks costs ~14
CPU-s before its first step (torchrun, two interpreters importing torch, transformers and DeepSpeed,
the group's rendezvous), a second run in the same ranks ~2.5: runs that need not start from a fresh
process share one.
"""

from __future__ import annotations

import sys

from polgrad import distributed, train
from polgrad.train_config import TrainConfig


def _runs(argv: list[str]) -> list[list[str]]:
    runs: list[list[str]] = [[]]
    for arg in argv:
        if arg == "--then":
            runs.append([])
        else:
            runs[-1].append(arg)
    return runs


def _between_runs() -> None:
    """The ranks end a run together, as `distributed.finish` does, and keep the group for the next."""
    import torch.distributed as tdist

    if tdist.is_initialized() and tdist.get_world_size() > 1:
        tdist.barrier()


if __name__ == "__main__":
    runs = _runs(sys.argv[1:])
    unpatched = TrainConfig.asynchronous
    finish = distributed.finish
    code = 0
    for i, argv in enumerate(runs):
        force = bool(argv) and argv[0] == "--force-async"
        TrainConfig.asynchronous = property(lambda self: True) if force else unpatched
        distributed.finish = finish if i == len(runs) - 1 else _between_runs
        code = train.main(argv[1:] if force else argv)
        if code:
            break
    distributed.leave(code)
