"""filter.zero_variance_groups: DAPO dynamic sampling (drop groups whose rewards are all equal)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from polgrad.components import filter as filters
from polgrad.errors import ShapeError
from polgrad.registry import lookup

F64 = torch.float64


def _reference(rewards: list[float], groups: list[int]) -> list[bool]:
    """Per group, by hand: keep iff the group has two different rewards."""
    members: dict[int, set[float]] = {}
    for r, g in zip(rewards, groups, strict=True):
        members.setdefault(g, set()).add(r)
    return [len(members[g]) > 1 for g in groups]


def test_known_values():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 3.0, 0.5, 0.5, 0.5, 0.0], dtype=F64)
    groups = torch.tensor([5, 5, 7, 7, 9, 4, -2, -2, -2, -2])
    keep = filters.zero_variance_groups(rewards, groups)
    # 5: all 1 -> drop; 7: {0, 1} -> keep; 9 and 4: singletons -> drop; -2: {0.5, 0} -> keep
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, False, True, True, False, False, True, True, True, True]


def test_all_equal_group_dropped_others_kept():
    # GRPO-style batch of 3 prompts x 4 samples: all wrong, mixed, all correct
    rewards = torch.tensor([0.0] * 4 + [0.0, 1.0, 1.0, 0.0] + [1.0] * 4, dtype=F64)
    groups = torch.arange(3).repeat_interleave(4)
    assert filters.zero_variance_groups(rewards, groups).tolist() == [False] * 4 + [True] * 4 + [False] * 4


def test_equality_is_exact():
    one_ulp_apart = torch.tensor([1.0, math.nextafter(1.0, 2.0)], dtype=F64)
    assert filters.zero_variance_groups(one_ulp_apart, torch.tensor([0, 0])).tolist() == [True, True]


@given(
    st.lists(st.tuples(st.sampled_from([0.0, 0.5, 1.0]), st.integers(-3, 5)), min_size=1, max_size=40),
    st.randoms(use_true_random=False),
)
def test_matches_reference_on_mixed_groups_and_is_permutation_equivariant(rows, rng):
    rewards = [r for r, _ in rows]
    groups = [g for _, g in rows]
    keep = filters.zero_variance_groups(torch.tensor(rewards, dtype=F64), torch.tensor(groups))
    assert keep.tolist() == _reference(rewards, groups)
    perm = list(range(len(rows)))
    rng.shuffle(perm)
    p = torch.tensor(perm)
    again = filters.zero_variance_groups(torch.tensor(rewards, dtype=F64)[p], torch.tensor(groups)[p])
    assert torch.equal(again, keep[p])


@given(st.lists(st.integers(0, 1), min_size=1, max_size=30), st.integers(1, 6))
def test_integer_rewards_and_consecutive_groups(rewards, group_size):
    groups = [i // group_size for i in range(len(rewards))]  # G samples per prompt, as rollouts lay them out
    keep = filters.zero_variance_groups(torch.tensor(rewards), torch.tensor(groups, dtype=torch.int32))
    assert keep.tolist() == _reference([float(r) for r in rewards], groups)


def test_empty_batch():
    keep = filters.zero_variance_groups(torch.zeros(0, dtype=F64), torch.zeros(0, dtype=torch.long))
    assert keep.shape == (0,) and keep.dtype == torch.bool


def test_registered():
    entry = lookup("filter", "zero_variance_groups")
    assert entry.fn is filters.zero_variance_groups
    assert entry.meta["needs_groups"] is True


@pytest.mark.parametrize(
    ("rewards", "groups", "message"),
    [
        (torch.zeros(3, 1), torch.zeros(3, dtype=torch.long), "rewards must be a \\[B\\] vector"),
        (torch.zeros(3), torch.zeros(2, dtype=torch.long), "group_ids must be a \\[B\\]=\\[3\\] vector"),
        (torch.zeros(3), torch.zeros(3), "group_ids must be an integer tensor"),
        (torch.zeros(3), torch.zeros(3, dtype=torch.bool), "group_ids must be an integer tensor"),
        (torch.tensor([0.0, float("nan"), 1.0]), torch.zeros(3, dtype=torch.long), "rewards contain NaN"),
        ([0.0, 1.0], torch.zeros(2, dtype=torch.long), "rewards must be a \\[B\\] vector"),
    ],
)
def test_shape_errors(rewards, groups, message):
    with pytest.raises(ShapeError, match=rf"^filter\.zero_variance_groups: {message}"):
        filters.zero_variance_groups(rewards, groups)
