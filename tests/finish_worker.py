"""Worker for tests/loop/test_distributed.py's test of `distributed.finish`: two gloo ranks, rank 0 still
busy (as when it writes the final model) when rank 1 is done; each writes when it entered and left
`finish` and whether its group was gone after it."""

from __future__ import annotations

import json
import os
import time


def run(rank: int, world: int, port: int, out: str, busy_s: float) -> None:
    import torch.distributed as tdist

    from polgrad import distributed

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    if rank == 0:
        time.sleep(busy_s)
    entered = time.time()
    distributed.finish()
    left = time.time()
    with open(os.path.join(out, f"finish{rank}.json"), "w") as fh:
        json.dump({"entered": entered, "left": left, "up": tdist.is_initialized()}, fh)
