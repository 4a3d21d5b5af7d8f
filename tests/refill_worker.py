"""Worker of tests/loop/test_dynamic_sampling.py's two-rank test: DAPO's refill on two gloo ranks.

`run(rank, world, store, out)` joins a gloo group of 2 through the file `store`, replaces
`trainer.collect` by the scripted rounds of its rank (`ROUNDS[rank]`: 3 groups of 2 rows per
round, scores chosen so that which groups the zero-variance filter keeps is known), runs
`trainer.collect_kept` with prompts_per_step 3 and at most 3 rounds, and writes what it got to
`out/rank{rank}.pt`.
"""

from __future__ import annotations

import torch

NEED, MAX_ROUNDS = 3, 3
# Per rank, per round: the scores of its 3 groups (a group is kept iff its two scores differ).
ROUNDS = {
    0: [
        [(0, 1), (0, 1), (0, 1)],  # keeps 3: enough on its own ...
        [(0, 1), (1, 1), (0, 0)],  # ... but rank 1 is short, so both go on: keeps 1 (4 so far)
        [(1, 1), (1, 1), (1, 1)],  # keeps 0
    ],
    1: [
        [(0, 1), (0, 0), (1, 1)],  # keeps 1
        [(1, 1), (1, 0), (0, 0)],  # keeps 1 (2 so far)
        [(0, 0), (0, 0), (1, 1)],  # keeps 0: rounds run out with 2 < 3
    ],
}


def run(rank: int, world: int, store: str, out: str) -> None:
    import gin
    import torch.distributed as dist
    from test_dynamic_sampling import G, _batch, _Models

    from polgrad import config, trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        gin.clear_config()
        config.parse_config(
            ["registry/dapo.gin"],
            [
                f"Algorithm.group_size = {G}",
                f"Algorithm.max_sampling_rounds = {MAX_ROUNDS}",
                f"train.prompts_per_step = {NEED}",
                "Algorithm.reward_shaping = []",
            ],
        )
        cfg, algo, task = config.build()
        calls: list[int] = []

        def scripted(cfg_, algo_, m_, task_, seed):
            calls.append(seed)
            r = len(calls) - 1
            return _batch(ROUNDS[rank][r], r)

        trainer.collect = scripted
        got = trainer.collect_kept(cfg, algo, _Models(), task, 1000 + rank)
        torch.save(
            {
                "rounds": len(calls),
                "info": got.info,
                "texts": got.batch.rollout.texts,
                "size": got.batch.size,
            },
            f"{out}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
