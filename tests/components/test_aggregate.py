"""aggregate.*: step-level denominators (micro-batching, permutation, padding invariance) and the
chapter's worked numbers (RLHF book, policy-gradient chapter, "loss aggregation")."""

from __future__ import annotations

import functools

import gin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from polgrad.components import aggregate
from polgrad.config_parts import part
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import StepCounts, get, lookup

EPS = torch.finfo(torch.float64).eps  # 2.22e-16; the unit roundoff u is EPS / 2
F64 = torch.float64
NAMES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm", "token_sum"]


def _own_message(exc: BaseException) -> str:
    """The part's own message: gin appends "\n  In call to configurable ..." to what a part raises."""
    return str(exc).split("\n  In call to configurable")[0]


def _fn(name: str, max_len: int = 10):
    fn = get("aggregate", name)
    return functools.partial(fn, max_len=max_len) if name == "seq_mean_token_sum_norm" else fn


# ---------------------------------------------------------------------------------------------
# Property tests. Losses are dyadic (k/8, |k| <= 80), so every masked sum of at most 48 of them
# is exact in float64; the only roundings are the divisions and the final sums of quotients.
# Bound (Higham, sum of n floats: error <= (n-1) u sum|x_i|): with A the same aggregate applied
# to |loss| (= sum of |terms| / denominator), the full-batch value carries <= (B + 1) u A and the
# sum of K micro-batch values <= (B + 2K) u A, so |difference| <= 2 (B + K + 1) u A = (B+K+1) EPS A.
# A per-micro-batch denominator (the bug guarded against) is off by O(A), not O(EPS A).
# ---------------------------------------------------------------------------------------------


@st.composite
def batches(draw):
    b = draw(st.integers(1, 6))
    t = draw(st.integers(1, 8))
    k = draw(st.lists(st.integers(-80, 80), min_size=b * t, max_size=b * t))
    m = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    m[draw(st.integers(0, b * t - 1))] = True  # the step has at least one valid token
    loss = torch.tensor(k, dtype=F64).reshape(b, t) / 8
    mask = torch.tensor(m, dtype=F64).reshape(b, t)
    perm = draw(st.permutations(range(b)))
    cuts = sorted(draw(st.sets(st.integers(1, b - 1)))) if b > 1 else []
    bounds = [0, *cuts, b]
    micro = [
        torch.tensor(perm[lo:hi], dtype=torch.long) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    max_len = draw(st.integers(1, 16))
    return loss, mask, micro, max_len


def _tol(fn, loss, mask, n_micro) -> float:
    a = float(fn(loss.abs(), mask, StepCounts.of_step(mask)))
    return (loss.shape[0] + n_micro + 1) * EPS * a


@pytest.mark.parametrize("name", NAMES)
@given(batch=batches())
def test_micro_batching_and_permutation_give_the_full_batch_loss_and_gradient(name, batch):
    loss, mask, micro, max_len = batch
    fn = _fn(name, max_len)
    leaf = loss.clone().requires_grad_(True)
    full = fn(leaf, mask, StepCounts.of_step(mask))
    (g_full,) = torch.autograd.grad(full, leaf)

    counts = StepCounts.of_step([mask[idx] for idx in micro])  # every micro-batch mask of the step
    total = sum(fn(leaf[idx], mask[idx], counts) for idx in micro)
    (g_micro,) = torch.autograd.grad(total, leaf)

    assert abs(total.item() - full.item()) <= _tol(fn, loss, mask, len(micro))
    # Each gradient entry is the same chain of IEEE operations on the same operands in both paths
    # (1/denominator, then /len_i for seq_mean_token_mean, times the 0/1 mask), hence bit-equal.
    assert torch.equal(g_micro, g_full)
    assert torch.equal(g_full[mask == 0], torch.zeros_like(g_full[mask == 0]))


@pytest.mark.parametrize("name", NAMES)
@given(batch=batches(), pad_cols=st.integers(0, 4), pad_rows=st.integers(0, 3))
def test_padding_with_masked_columns_or_rows_changes_nothing(name, batch, pad_cols, pad_rows):
    loss, mask, _, max_len = batch
    fn = _fn(name, max_len)
    b, t = loss.shape
    padded = torch.full((b + pad_rows, t + pad_cols), float("nan"), dtype=F64)  # garbage, even NaN
    padded[: b // 2 + 1, t:] = float("-inf")
    padded[:b, :t] = loss
    pmask = torch.zeros(b + pad_rows, t + pad_cols, dtype=F64)
    pmask[:b, :t] = mask

    leaf = padded.clone().requires_grad_(True)
    out = fn(leaf, pmask, StepCounts.of_step(pmask))
    (grad,) = torch.autograd.grad(out, leaf)
    ref_leaf = loss.clone().requires_grad_(True)
    ref = fn(ref_leaf, mask, StepCounts.of_step(mask))
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf)

    assert torch.isfinite(out)
    assert abs(out.item() - ref.item()) <= _tol(fn, loss, mask, 1)
    assert torch.equal(grad[:b, :t], ref_grad)
    assert torch.equal(grad[b:], torch.zeros_like(grad[b:]))
    assert torch.equal(grad[:, t:], torch.zeros_like(grad[:, t:]))


@given(
    b=st.integers(1, 6),
    t=st.integers(1, 8),
    data=st.data(),
)
def test_token_mean_equals_seq_mean_token_mean_when_all_lengths_are_equal(b, t, data):
    length = data.draw(st.integers(1, t))
    # every row has `length` valid tokens, at random positions (holes allowed)
    mask = torch.zeros(b, t, dtype=F64)
    for i in range(b):
        cols = data.draw(st.lists(st.integers(0, t - 1), min_size=length, max_size=length, unique=True))
        mask[i, cols] = 1.0
    k = data.draw(st.lists(st.integers(-80, 80), min_size=b * t, max_size=b * t))
    loss = torch.tensor(k, dtype=F64).reshape(b, t) / 8
    counts = StepCounts.of_step(mask)
    tm = aggregate.token_mean(loss, mask, counts)
    sm = aggregate.seq_mean_token_mean(loss, mask, counts)
    # sum(l)/(B L) vs sum_i (S_i/L)/B: <= B + 2 roundings on each side, each <= u * A
    a = float(aggregate.token_mean(loss.abs(), mask, counts))
    assert abs(float(tm) - float(sm)) <= (b + 3) * EPS * a


# Hand numbers on the chapter's two sequences below (LOSS, MASK; token sums 14 and 19, lengths 5
# and 10), one micro-batch per row: (full-batch value, sum of the rows' values each with its OWN
# counts). With the step's counts the two rows' shares must add up to the first number.
#   token_mean:              33/15 = 2.2      vs 14/5 + 19/10 = 4.7
#   seq_mean_token_mean:     (2.8 + 1.9)/2 = 2.35 vs 2.8 + 1.9 = 4.7
#   seq_mean_token_sum:      (14 + 19)/2 = 16.5   vs 14 + 19 = 33
#   seq_mean_token_sum_norm: (1.4 + 1.9)/2 = 1.65 vs 1.4 + 1.9 = 3.3   (L_max = 10)
PER_MICRO_BATCH = {
    "token_mean": (2.2, 4.7),
    "seq_mean_token_mean": (2.35, 4.7),
    "seq_mean_token_sum": (16.5, 33.0),
    "seq_mean_token_sum_norm": (1.65, 3.3),
}


# token_sum divides by no count, so a per-micro-batch count cannot change it: not in this test.
@pytest.mark.parametrize("name", [n for n in NAMES if n != "token_sum"])
def test_per_microbatch_counts_would_change_the_loss(name):
    """Non-vacuity of the micro-batching invariance above, against per-micro-batch denominators.

    It must fail when the library computes a micro-batch's denominator from that micro-batch
    alone, either in an aggregator (dividing by its own mask's sum) or in StepCounts.of_step
    (counting one mask of the list). So the step-count path is the library's own: the rows' shares
    computed with StepCounts.of_step over BOTH micro-batch masks add up to the full-batch value,
    and the per-micro-batch sum is far from it (farther than the invariance test's tolerance).
    """
    full_value, per_micro_value = PER_MICRO_BATCH[name]
    fn = _fn(name, 10)
    rows = [slice(0, 1), slice(1, 2)]
    counts = StepCounts.of_step([MASK[r] for r in rows])
    shares = sum(fn(LOSS[r], MASK[r], counts) for r in rows)
    wrong = sum(fn(LOSS[r], MASK[r], StepCounts.of_step(MASK[r])) for r in rows)
    # quotients of small integers and a sum of two of them: a few roundings of <= EPS * value.
    assert float(shares) == pytest.approx(full_value, rel=4 * EPS, abs=0)
    assert float(wrong) == pytest.approx(per_micro_value, rel=4 * EPS, abs=0)
    assert abs(float(wrong) - full_value) > _tol(fn, LOSS, MASK, len(rows))


# ---------------------------------------------------------------------------------------------
# Known values: the chapter's two sequences with per-token losses [1,1,1,1,10] and
# [1,1,1,1,1,1,1,1,1,10]. Exact quotients of small integers: one rounding each, so 4 EPS * value.
# ---------------------------------------------------------------------------------------------

LOSS = torch.tensor([[1.0, 1, 1, 1, 10, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 10]], dtype=F64)
MASK = torch.tensor([[1.0] * 5 + [0.0] * 5, [1.0] * 10], dtype=F64)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("seq_mean_token_mean", 2.35),  # (14/5 + 19/10) / 2 = (2.8 + 1.9) / 2
        ("token_mean", 2.2),  # (14 + 19) / 15
        ("seq_mean_token_sum", 16.5),  # (14 + 19) / 2
        ("seq_mean_token_sum_norm", 1.65),  # (14/10 + 19/10) / 2 = (1.4 + 1.9) / 2, L_max = 10
        ("token_sum", 33.0),  # 14 + 19, no denominator (verl's "token-sum")
    ],
)
def test_chapter_worked_example(name, expected):
    out = _fn(name, 10)(LOSS, MASK, StepCounts.of_step(MASK))
    assert out.dim() == 0 and out.dtype == F64
    assert float(out) == pytest.approx(expected, rel=4 * EPS)


def test_chapter_worked_example_per_sequence_sum_norm():
    counts = StepCounts.of_step(MASK)
    # one sequence at a time, each scaled by the step's 2 sequences: 1.4 / 2 and 1.9 / 2
    rows = [
        float(aggregate.seq_mean_token_sum_norm(LOSS[i : i + 1], MASK[i : i + 1], counts, max_len=10))
        for i in range(2)
    ]
    assert rows == pytest.approx([1.4 / 2, 1.9 / 2], rel=4 * EPS)


def _chapter_gradient(name, *, with_adv=True, max_len=7):
    """The chapter's gradient script: ratio = ones [2,7], adv = 2, masks of lengths 4 and 7."""
    ratio = torch.ones(2, 7, dtype=F64, requires_grad=True)
    mask = torch.tensor([[1.0] * 4 + [0.0] * 3, [1.0] * 7], dtype=F64)
    loss = ratio * 2.0 if with_adv else ratio
    out = _fn(name, max_len)(loss, mask, StepCounts.of_step(mask))
    (grad,) = torch.autograd.grad(out, ratio)
    return grad, mask


def test_chapter_gradient_seq_mean_token_mean():
    grad, mask = _chapter_gradient("seq_mean_token_mean")
    expected = torch.tensor([[0.25] * 4 + [0.0] * 3, [2 / 14] * 7], dtype=F64)  # 2 * 1/2 * 1/|a_i|
    torch.testing.assert_close(grad, expected, rtol=4 * EPS, atol=0)
    assert float(grad[1, 0]) == pytest.approx(0.142857, abs=5e-7)  # the chapter's printed digits


def test_chapter_gradient_seq_mean_token_sum_norm():
    grad, mask = _chapter_gradient("seq_mean_token_sum_norm", max_len=7)
    expected = mask * (2 / 14)  # 2 * 1/2 * 1/L_max on every valid token, whatever the length
    torch.testing.assert_close(grad, expected, rtol=4 * EPS, atol=0)


def test_chapter_gradient_token_mean_of_ratio():
    grad, mask = _chapter_gradient("token_mean", with_adv=False)
    torch.testing.assert_close(grad, mask / 11, rtol=4 * EPS, atol=0)  # 1/11 = 0.0909 per token
    assert float(grad[0, 0]) == pytest.approx(0.0909, abs=5e-5)


def test_chapter_gradient_token_sum():
    # d/dratio of sum(2 * ratio * mask) = 2 on every valid token, 0 on padding: no 1/N at all
    grad, mask = _chapter_gradient("token_sum")
    assert torch.equal(grad, 2.0 * mask)


@given(batch=batches())
def test_token_sum_is_n_tokens_times_token_mean_and_n_seqs_times_seq_mean_token_sum(batch):
    # token_sum = sum(l m); token_mean = sum(l m) / N_tok; seq_mean_token_sum = sum(l m) / N_seq.
    # The dyadic sum is exact; each quotient is one rounding and the product one more: <= 2 u * A
    # relative to A = token_sum(|loss|), so 2 EPS * A covers it.
    loss, mask, _, _ = batch
    counts = StepCounts.of_step(mask)
    ts = float(aggregate.token_sum(loss, mask, counts))
    a = float(aggregate.token_sum(loss.abs(), mask, counts))
    assert ts == float((loss * mask).sum())  # exact: dyadic terms
    assert abs(counts.num_tokens * float(aggregate.token_mean(loss, mask, counts)) - ts) <= 2 * EPS * a
    assert abs(counts.num_seqs * float(aggregate.seq_mean_token_sum(loss, mask, counts)) - ts) <= 2 * EPS * a


def test_rows_without_valid_tokens_contribute_zero():
    loss = torch.tensor([[3.0, 5.0], [7.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]], dtype=F64)
    counts = StepCounts.of_step(mask)
    assert counts.num_seqs == 1.0
    assert float(aggregate.seq_mean_token_mean(loss, mask, counts)) == 4.0
    assert float(aggregate.seq_mean_token_mean(loss[1:], mask[1:], counts)) == 0.0


# ---------------------------------------------------------------------------------------------
# Registry, gin, errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "denominator"),
    [
        ("token_mean", "tokens"),
        ("seq_mean_token_mean", "sequences"),
        ("seq_mean_token_sum", "sequences"),
        ("seq_mean_token_sum_norm", "sequences*L_max"),
        ("token_sum", "none"),
    ],
)
def test_registry_metadata(name, denominator):
    entry = lookup("aggregate", name)
    assert entry.meta["denominator"] == denominator
    assert isinstance(entry.meta["formula"], str) and entry.meta["formula"]
    assert entry.fn is getattr(aggregate, name)


def test_gin_binds_max_len():
    gin.parse_config("aggregate.seq_mean_token_sum_norm.max_len = 20")
    out = part("aggregate", "seq_mean_token_sum_norm")(LOSS, MASK, StepCounts.of_step(MASK))
    assert float(out) == pytest.approx(33 / 40, rel=4 * EPS)


def test_max_len_is_required():
    with pytest.raises(TypeError, match="max_len"):
        aggregate.seq_mean_token_sum_norm(LOSS, MASK, StepCounts.of_step(MASK))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None, "10"])
def test_bad_max_len(bad):
    with pytest.raises(ConfigError, match=r"^aggregate\.seq_mean_token_sum_norm\.max_len must be > 0") as e:
        aggregate.seq_mean_token_sum_norm(LOSS, MASK, StepCounts.of_step(MASK), max_len=bad)
    assert "\n" not in _own_message(e.value)


def test_step_counts_cannot_be_built_directly():
    with pytest.raises(ShapeError, match="StepCounts.of_step"):
        StepCounts(num_tokens=15.0, num_seqs=2.0)


@pytest.mark.parametrize("name", NAMES)
def test_counts_are_required(name):
    with pytest.raises(TypeError):
        _fn(name)(LOSS, MASK)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [None, 15, {"num_tokens": 15, "num_seqs": 2}])
def test_counts_must_be_step_counts(name, bad):
    with pytest.raises(
        ShapeError, match=rf"^aggregate\.{name}: counts must be a StepCounts.*StepCounts\.of_step"
    ):
        _fn(name)(LOSS, MASK, bad)


@pytest.mark.parametrize("name", NAMES)
def test_shape_mismatch(name):
    counts = StepCounts.of_step(MASK)
    with pytest.raises(ShapeError, match=rf"^aggregate\.{name}: loss must have the shape of mask"):
        _fn(name)(LOSS[:, :4], MASK, counts)
    with pytest.raises(ShapeError, match=rf"^aggregate\.{name}: mask must be a \[B,T\] tensor"):
        _fn(name)(LOSS, MASK[0], counts)
