"""`python -m polgrad.train` for tests/loop/test_async_ranks.py, run under torchrun; `--force-async` first
makes train.max_staleness = 0 run the producer (the synchronous loop otherwise), as
tests/rollout/test_async_rollouts.py forces it in one process.

    torchrun --standalone --nproc_per_node 2 tests/async_worker.py [--force-async] CONFIG ... --out DIR
"""

from __future__ import annotations

import sys

from polgrad import distributed, train
from polgrad.train_config import TrainConfig

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv and argv[0] == "--force-async":
        TrainConfig.asynchronous = property(lambda self: True)
        argv = argv[1:]
    distributed.leave(train.main(argv))
