"""polgrad/rollout/fused_logprobs.py: chunked log-probs and entropy from hidden states equal the plain
computation over the full logits, in value and gradient.

Tolerances: in float64 both sides run the same per-row ops (projection, / temperature,
log_softmax, gather, -sum p log p); only the matrix product's blocking differs with the chunk's row
count, a reordering of H-term sums of O(1) products: ~1e-15 relative, so 1e-10 absolute on values
of O(10) leaves five orders of margin and still fails on any real difference (a wrong row, target,
temperature or sign moves values by >= 1e-3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from polgrad.errors import ShapeError
from polgrad.rollout.fused_logprobs import default_chunk_rows, token_logprobs

TOL = 1e-10


def _plain(hidden, weight, targets, bias=None, temperature=1.0):
    """What hf.response_logprobs computes from the logits (in the inputs' dtype here: fp64)."""
    logits = F.linear(hidden, weight, bias)
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    lp = F.log_softmax(logits, dim=-1)
    return lp.gather(-1, targets[:, None]).squeeze(-1), -(lp.exp() * lp).sum(-1)


def _inputs(n, h, v, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64) * 2
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    b = torch.randn(v, generator=g, dtype=torch.float64) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0, 1.6])
@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 64])
def test_values_and_gradients_equal_the_plain_computation(temperature, chunk_rows):
    hidden, weight, bias, targets = _inputs(13, 8, 37, seed=chunk_rows)
    mask = (torch.arange(13) % 4 != 3).double()  # some positions masked out, as after an EOS
    a, b = torch.randn(13, dtype=torch.float64), torch.randn(13, dtype=torch.float64)

    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    logp, ent = token_logprobs(
        leaves[0], leaves[1], targets, bias=leaves[2], temperature=temperature, with_entropy=True,
        chunk_rows=chunk_rows,
    )  # fmt: skip
    (mask * (a * logp + b * ent)).sum().backward()

    ref = [t.clone().requires_grad_(True) for t in (hidden, weight, bias)]
    plogp, pent = _plain(ref[0], ref[1], targets, ref[2], temperature)
    (mask * (a * plogp + b * pent)).sum().backward()

    torch.testing.assert_close(logp, plogp, rtol=0, atol=TOL)
    torch.testing.assert_close(ent, pent, rtol=0, atol=TOL)
    for got, want in zip(leaves, ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=TOL)
    assert (leaves[0].grad[mask == 0] == 0).all()  # a masked position gets no gradient


def test_gradcheck_without_bias_and_logp_alone():
    hidden, weight, _, targets = _inputs(5, 4, 11, seed=1, bias=False)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def f(h, w):
        return token_logprobs(h, w, targets, temperature=0.9, chunk_rows=2)[0]

    assert torch.autograd.gradcheck(f, (hidden, weight))

    def g(h, w):
        logp, ent = token_logprobs(h, w, targets, temperature=0.9, chunk_rows=2, with_entropy=True)
        return logp + 0.3 * ent

    assert torch.autograd.gradcheck(g, (hidden, weight))


@given(n=st.integers(1, 20), rows=st.integers(1, 25), seed=st.integers(0, 10_000))
def test_the_chunking_does_not_change_the_result(n, rows, seed):
    """Any chunk size gives what one chunk of every row gives (values and entropy)."""
    hidden, weight, bias, targets = _inputs(n, 6, 19, seed)
    whole = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True, chunk_rows=n)
    parts = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True, chunk_rows=rows)
    for x, y in zip(whole, parts, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=TOL)


def test_a_frozen_output_projection_gets_no_gradient_and_the_hidden_states_do():
    """LoRA freezes the LM head: only the hidden states (and what made them) get a gradient."""
    hidden, weight, _, targets = _inputs(6, 4, 9, seed=2, bias=False)
    hidden.requires_grad_(True)
    logp, _ = token_logprobs(hidden, weight, targets, chunk_rows=4)
    logp.sum().backward()
    assert weight.grad is None and hidden.grad is not None and hidden.grad.abs().sum() > 0


def test_fp32_inputs_give_the_plain_fp32_values():
    """In fp32 (the model's dtype) both sides compute the logits in fp32 and agree to fp32 rounding of
    the projection's sum order (H = 16 terms of O(1): ~1e-6 absolute on the logits)."""
    hidden, weight, bias, targets = (t.float() if t.is_floating_point() else t for t in _inputs(9, 16, 50, 3))
    logp, ent = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True, chunk_rows=4)
    plogp, pent = _plain(hidden, weight, targets, bias)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(logp, plogp, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, pent, rtol=0, atol=1e-5)


def test_bad_shapes_are_one_line():
    hidden, weight, _, targets = _inputs(4, 3, 7, seed=0, bias=False)
    with pytest.raises(ShapeError, match=r"hidden \[N,H\] and weight \[V,H\]"):
        token_logprobs(hidden, weight[:, :2], targets)
    with pytest.raises(ShapeError, match=r"targets \[N\] int64"):
        token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ShapeError, match=r"bias \[V\]"):
        token_logprobs(hidden, weight, targets, bias=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ShapeError, match=r"chunk_rows must be >= 1"):
        token_logprobs(hidden, weight, targets, chunk_rows=0)


def test_default_chunk_holds_about_2_to_the_24_logits():
    assert default_chunk_rows(151_936) == (1 << 24) // 151_936 == 110
    assert default_chunk_rows(1 << 30) == 1


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_inputs_give_the_plain_paths_numbers(bias):
    """A bf16 model's hidden states and projection (the `narrow` block): the chunk's logits are the
    projection rounded once to bf16, as the plain path's `F.linear(...).float()` makes them (with a
    bias too), then fp32. Both sides then run fp32 log-softmaxes of the same bf16-rounded logits, so
    they differ by fp32 rounding only: 1e-5 on log-probs of O(10)."""
    hidden, weight, b, targets = _inputs(37, 16, 50, seed=3, bias=bias)
    hidden, weight = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    b = None if b is None else b.to(torch.bfloat16)
    logp, entropy = token_logprobs(hidden, weight, targets, bias=b, with_entropy=True, chunk_rows=8)
    z = F.linear(hidden, weight, b).float()
    lp = F.log_softmax(z, dim=-1)
    torch.testing.assert_close(logp, lp.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, -(lp.exp() * lp).sum(-1), rtol=0, atol=1e-5)
