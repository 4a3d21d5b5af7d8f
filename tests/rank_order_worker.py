"""Two gloo ranks for tests/loop/test_rank_zero_first.py: the order `collective.rank_zero_first` imposes,
and a checkpoint written by rank 1 (`models.loading.save_model_dir`)."""

from __future__ import annotations

import json
import time

import torch


def _group(rank: int, world: int, store: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)


def run_order(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from polgrad import collective

    _group(rank, world, store)
    try:
        with collective.rank_zero_first():
            start = time.monotonic()
            time.sleep(0.5)  # long enough for an overlap to show
            end = time.monotonic()
        with open(f"{out}/order{rank}.json", "w") as fh:
            json.dump({"start": start, "end": end}, fh)
    finally:
        dist.destroy_process_group()


def run_save(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    import polgrad
    from polgrad.models import build_tiny
    from polgrad.models.loading import save_model_dir

    _group(rank, world, store)
    try:
        if rank == 1:
            model, _ = build_tiny(polgrad.get("task", "add")(), seed=3)
            save_model_dir(model, f"{out}/by_rank1")
        dist.barrier()
    finally:
        dist.destroy_process_group()
