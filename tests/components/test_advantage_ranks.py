"""Batch statistics over data-parallel ranks: at world size 2 (gloo, two processes) every estimator
with a batch-spanning statistic (REINFORCE's baseline, the whitenings, grpo's batch std, rloo's
normalisation) gives each rank exactly the rows of the estimator on the concatenated batch."""

from __future__ import annotations

import pytest
import rank_stats_worker as w
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.cpu_matrix


def test_two_gloo_ranks_equal_the_concatenated_batch(tmp_path):
    mp.spawn(w.run, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    full = w.advantages(w.global_batch())  # one process, no group: the statistic of the whole batch
    halves = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for k, (name, _) in enumerate(w.CASES):
        got = torch.cat([halves[0][k], halves[1][k]])
        # the same sums, added in two parts instead of one: a few roundings of O(1) numbers
        torch.testing.assert_close(got, full[k], rtol=0, atol=1e-12, msg=name)
        # not vacuous: statistics of one half alone would give other numbers
        alone = torch.cat([w.advantages(w.share(w.global_batch(), r))[k] for r in range(2)])
        assert (alone - full[k]).abs().max() > 1e-3, name
