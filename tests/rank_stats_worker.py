"""Worker of tests/components/test_advantage_ranks.py: the batch-statistics estimators on one rank's half.

`run(rank, world, store, out)` joins a gloo group of 2 through the file `store`, takes its share of
`global_batch()` (whole groups: group statistics are rank-local) and writes the advantages of every
case in `CASES` to `out/rank{rank}.pt`. The test compares them with the rows of the same
estimators run on the concatenated batch in one process.
"""

from __future__ import annotations

import torch

F64 = torch.float64
# (estimator, hyperparameters): every estimator with a statistic over the whole batch
CASES = [
    ("reinforce", {}),
    ("reinforce_pp", {"gamma": 0.9}),
    ("reinforce_pp_baseline", {"gamma": 1.0}),
    ("gae", {"whiten": True, "lam": 0.9}),
    ("grpo", {"scale": "batch"}),
    ("rloo", {"normalize": True}),
]
SIZES = [3, 2, 2, 3, 2]  # group sizes; rank 0 takes the first 2 groups (5 rows), rank 1 the rest
SPLIT = 5


def global_batch() -> dict[str, torch.Tensor]:
    """12 rows in 5 groups, T = 6, ragged lengths with holes, one fully masked row, float64."""
    g = torch.Generator().manual_seed(7)
    b, t = sum(SIZES), 6
    mask = (torch.rand(b, t, generator=g) < 0.75).to(F64)
    mask[2] = 0.0  # a fully masked row (its reward still counts in its group)
    mask[7, 0] = 1.0
    return {
        "rewards": torch.randint(0, 3, (b,), generator=g).to(F64) + torch.rand(b, generator=g, dtype=F64),
        "mask": mask,
        "group_ids": torch.repeat_interleave(torch.arange(len(SIZES)) * 11 + 3, torch.tensor(SIZES)),
        "values": torch.rand(b, t, generator=g, dtype=F64) * 2 - 1,
        "token_rewards": (torch.rand(b, t, generator=g, dtype=F64) - 0.5) * mask,
    }


def share(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    rows = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
    return {k: v[rows] for k, v in batch.items()}


def advantages(batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """adv [B,T] of every case on `batch` (collective when a process group is up)."""
    import polgrad.components.advantage  # noqa: F401  (registers the parts)
    from polgrad.registry import get

    out = []
    for name, hp in CASES:
        rest = {k: v for k, v in batch.items() if k not in ("rewards", "mask")}
        adv, _ = get("advantage", name)(batch["rewards"], batch["mask"], **rest, **hp)
        out.append(adv)
    return out


def run(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.save(advantages(share(global_batch(), rank)), f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
