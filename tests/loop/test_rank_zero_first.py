"""Work that fills a cache the ranks share runs on rank 0 first (`collective.rank_zero_first`), and a
checkpoint written by a rank other than 0 is whole (`models.loading.save_model_dir`). Found when two
ranks started under torchrun with an empty cache: rank 1 won the cache's lock, transformers' own
save_pretrained wrote nothing on rank 1, and the warm-start entry held only polgrad.json, which every
later run then failed to load."""

from __future__ import annotations

import json

import pytest
import rank_order_worker as w
import torch
import torch.multiprocessing as mp

import polgrad
from polgrad.models import build_tiny, load_policy

pytestmark = pytest.mark.cpu_matrix


def test_rank_0_runs_the_block_before_the_others(tmp_path):
    mp.spawn(w.run_order, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"order{r}.json").read_text()) for r in range(2))
    assert r1["start"] >= r0["end"]  # no overlap: rank 1 began after rank 0 was done


def test_a_checkpoint_written_by_rank_1_loads_with_the_weights_it_had(tmp_path):
    mp.spawn(w.run_save, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    expected, _ = build_tiny(polgrad.get("task", "add")(), seed=3)
    loaded = load_policy(str(tmp_path / "by_rank1"))
    want, got = expected.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
