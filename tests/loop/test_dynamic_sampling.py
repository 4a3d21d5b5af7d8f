"""DAPO's dynamic sampling in the loop (`trainer.collect_kept`): sample again until enough groups are kept.

`trainer.collect` is replaced by a scripted sampler: round r returns 3 groups of 2 rows whose scores
are chosen per round, so which groups the zero-variance filter keeps is known by construction.
"""

from __future__ import annotations

import sys
import time

import gin
import pytest
import torch

from polgrad import config, trainer
from polgrad.batch import Batch
from polgrad.build import NoBaseline
from polgrad.errors import ConfigError
from polgrad.rollout.rollout import Rollout
from polgrad.tasks.base import Example

G, PROMPTS = 2, 3
# Per round, the scores of its 3 groups (2 rows each). A group is kept iff its two scores differ.
ROUNDS = [
    [(1, 1), (0, 1), (0, 0)],  # keeps group 1            -> 1 kept so far
    [(0, 0), (1, 1), (1, 1)],  # keeps nothing            -> 1
    [(1, 0), (0, 1), (0, 1)],  # keeps all three          -> 4 >= 3: stop, take the first 3
    [(0, 1), (0, 1), (0, 1)],  # never reached
]


def _batch(scores: list[tuple[int, int]], tag: int) -> Batch:
    b = len(scores) * G
    flat = torch.tensor([s for pair in scores for s in pair], dtype=torch.float64)
    t = 2 + tag % 2  # rounds differ in response length: concat must pad
    mask = torch.ones(b, t, dtype=torch.float64)
    rollout = Rollout(
        prompt_ids=torch.full((b, 3), 5, dtype=torch.long),
        prompt_mask=torch.ones(b, 3, dtype=torch.long),
        response_ids=torch.full((b, t), 7, dtype=torch.long),
        mask=mask.float(),
        rollout_logp=torch.zeros(b, t),
        group_ids=torch.arange(len(scores)).repeat_interleave(G),
        truncated=torch.zeros(b, dtype=torch.bool),
        response_lengths=torch.full((b,), t),
        texts=[f"r{tag}-{i}" for i in range(b)],
        examples=[Example(prompt=f"p{tag}-{i // G}", answer="") for i in range(b)],
    )
    return Batch(
        mask=mask,
        group_ids=rollout.group_ids,
        old_logp=torch.zeros(b, t, dtype=torch.float64),
        scores=flat,
        truncated=rollout.truncated,
        rollout=rollout,
    )


class _Tok:
    pad_token_id = 0


class _Models:
    tokenizer = _Tok()
    baseline = NoBaseline()  # DAPO has no greedy baseline: a round drew its rows


def _collect_kept(monkeypatch, rounds: int):
    gin.clear_config()
    config.parse_config(
        ["registry/dapo.gin"],
        [
            f"Algorithm.group_size = {G}",
            f"Algorithm.max_sampling_rounds = {rounds}",
            f"train.prompts_per_step = {PROMPTS}",
            "Algorithm.reward_shaping = []",  # keep the scripted scores as they are
        ],
    )
    cfg, algo, task = config.build()
    seeds: list[int] = []

    def fake_collect(cfg_, algo_, m_, task_, seed):
        r = len(seeds)
        seeds.append(seed)
        return _batch(ROUNDS[r], r)

    monkeypatch.setattr(trainer, "collect", fake_collect)
    return trainer.collect_kept(cfg, algo, _Models(), task, 1234), seeds


def test_samples_until_the_batch_holds_prompts_per_step_kept_groups(monkeypatch):
    got, seeds = _collect_kept(monkeypatch, rounds=10)
    # three rounds were needed (1, then 1, then 4 kept groups), each with its own seed
    assert seeds == [trainer.round_seed(1234, r) for r in range(3)]
    assert len(set(seeds)) == 3 and seeds[0] == 1234
    # 4 of the 9 sampled groups kept: 8 of the 18 sampled rows (before the batch takes 3 groups)
    assert got.info == {"sampling_rounds": 3.0, "kept_frac": 4 / 9, "filtered_frac": 1 - 8 / 18}
    # the batch: the first 3 kept groups (round 0's group 1, round 2's groups 0 and 1), whole
    assert got.batch.size == PROMPTS * G
    assert got.batch.rollout.texts == ["r0-2", "r0-3", "r2-0", "r2-1", "r2-2", "r2-3"]
    assert got.batch.group_ids.unique().numel() == PROMPTS  # distinct after renumbering
    assert got.batch.scores.tolist() == [0, 1, 1, 0, 0, 1]
    assert got.batch.mask.shape == (6, 3) and got.batch.mask[:2, 2].tolist() == [0, 0]  # padded
    # everything sampled is kept for the reward metrics
    assert got.sampled.size == 3 * PROMPTS * G


def test_the_budget_counts_every_round_sampled_not_what_is_kept(monkeypatch):
    """DAPO's refill samples more than it keeps: the budget's counter (`Collected.counts`, this
    rank's sequences and generated tokens) sees all 3 rounds of 6 rows, whose responses are 2, 3 and
    2 tokens long (12 + 18 + 12), though the batch trains on 6 rows."""
    got, _ = _collect_kept(monkeypatch, rounds=10)
    assert got.counts == (18.0, 42.0)
    assert got.batch.size == 6


def test_the_budget_counts_the_groups_a_faulty_reward_drops(monkeypatch):
    """A NaN score ('skip_group') drops its group from the batch, but it was sampled: round 0 keeps
    groups 1 and 2 of its 3 (group 0 faulty), round 1 the other one needed; 2 rounds x 6 rows of 2
    and 3 tokens are counted (12 + 18 tokens)."""
    rounds = [[(float("nan"), 1.0), (0, 1), (1, 0)], [(0, 1), (0, 1), (0, 1)]]
    monkeypatch.setattr(sys.modules[__name__], "ROUNDS", rounds)
    got, seeds = _collect_kept(monkeypatch, rounds=10)
    assert len(seeds) == 2 and got.counts == (12.0, 30.0)
    assert got.sampled.size == 10  # the faulty group is out of the reward metrics


def test_stops_at_max_sampling_rounds_with_what_it_has(monkeypatch):
    got, seeds = _collect_kept(monkeypatch, rounds=2)
    assert len(seeds) == 2
    assert got.info == {"sampling_rounds": 2.0, "kept_frac": 1 / 6, "filtered_frac": 1 - 2 / 12}
    assert got.batch.rollout.texts == ["r0-2", "r0-3"]


def test_one_round_is_the_old_shrinking_filter(monkeypatch):
    got, seeds = _collect_kept(monkeypatch, rounds=1)
    assert len(seeds) == 1 and got.batch.size == G


def test_max_sampling_rounds_needs_a_filter_and_must_be_positive():
    gin.clear_config()
    config.parse_config(["registry/grpo.gin"], ["Algorithm.max_sampling_rounds = 3"])
    with pytest.raises(ConfigError, match="Algorithm.filters is empty"):
        config.build()
    gin.clear_config()
    config.parse_config(["registry/dapo.gin"], ["Algorithm.max_sampling_rounds = 0"])
    with pytest.raises(ConfigError, match="Algorithm.max_sampling_rounds must be >= 1"):
        config.build()


def test_concat_keeps_the_groups_of_different_parts_apart_whatever_their_ids():
    """Part k's ids are moved just past the ids of the parts before it: [3,3,5,5] becomes
    [0,0,2,2] (it spans 3 ids), then [-3,-3] becomes [3,3] and [0,0,1,1] becomes [4,4,5,5];
    groups never merge across parts and keep their rows together."""

    def part(ids):
        n = len(ids)
        return Batch(mask=torch.ones(n, 2), group_ids=torch.tensor(ids), old_logp=torch.zeros(n, 2))

    joined = Batch.concat([part([3, 3, 5, 5]), part([-3, -3]), part([0, 0, 1, 1])], pad_id=0)
    assert joined.group_ids.tolist() == [0, 0, 2, 2, 3, 3, 4, 4, 5, 5]


@pytest.mark.cpu_matrix
def test_two_ranks_sample_the_same_rounds_and_train_on_the_same_number_of_groups(tmp_path):
    """tests/refill_worker.py on two gloo ranks. Rank 0 keeps 3 groups in round 0 but rank 1 keeps
    only 1, so the stop decision (the fewest kept groups of any rank) makes both sample again; after
    the 3 rounds rank 0 has 4 kept groups and rank 1 has 2, so both train on 2 groups (the fewest
    any rank kept), rank 0 on its first two. Over both ranks 6 of the 18 sampled groups were kept
    (12 of 36 rows). A rank that stopped on its own count would leave the other waiting in a
    collective: the test fails on a timeout then, not a hang."""
    import refill_worker as w
    import torch.multiprocessing as mp

    ctx = mp.spawn(w.run, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    # join() returns after each process's exit (False while some still run) and raises on a failure
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail("the two ranks did not finish within 120 s (a collective mismatch?)")
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [g["rounds"] for g in got] == [3, 3]
    want_info = {"sampling_rounds": 3.0, "kept_frac": 6 / 18, "filtered_frac": 1 - 12 / 36}
    assert [g["info"] for g in got] == [want_info, want_info]
    assert [g["size"] for g in got] == [2 * G, 2 * G]
    assert got[0]["texts"] == ["r0-0", "r0-1", "r0-2", "r0-3"]  # rank 0: round 0's groups 0 and 1
    assert got[1]["texts"] == ["r0-0", "r0-1", "r1-2", "r1-3"]  # rank 1: round 0's group 0, round 1's 1
