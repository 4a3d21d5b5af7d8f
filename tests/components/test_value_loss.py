"""value_loss.*: PPO value clipping (RLHF book chapter's value-loss snippet, epsilon_v; seed 001)."""

from __future__ import annotations

import gin
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from polgrad.components import value_loss
from polgrad.config_parts import part
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import lookup

EPS = torch.finfo(torch.float64).eps
F64 = torch.float64


def _t(*rows):
    return torch.tensor(rows, dtype=F64)


def _own_message(exc: BaseException) -> str:
    """The part's own message: gin appends "\n  In call to configurable ..." to what a part raises."""
    return str(exc).split("\n  In call to configurable")[0]


# Known values with dyadic inputs and clip_eps = 0.25, so every operation is exact:
#   token | V     V_old | band           V_clip | R      | (V-R)^2  (V_clip-R)^2 | clipped  mse
#   0     | 0.0   0.5   | [0.25, 0.75]   0.25   | 0.5    | 1/4      1/16         | 1/8      1/8
#   1     | 0.5   0.375 | [0.125, 0.625] 0.5    | 1.0    | 1/4      1/4          | 1/8      1/8
#   2     | -0.5  0.0   | [-0.25, 0.25]  -0.25  | -0.75  | 1/16     1/4          | 1/8      1/32
#   3     | 2.0   0.0   | [-0.25, 0.25]  0.25   | 0.0    | 4        1/16         | 2        2
V = _t([0.0, 0.5, -0.5, 2.0])
V_OLD = _t([0.5, 0.375, 0.0, 0.0])
R = _t([0.5, 1.0, -0.75, 0.0])
M = torch.ones(1, 4, dtype=F64)


def test_clipped_known_values_and_gradient():
    v = V.clone().requires_grad_(True)
    loss = value_loss.clipped(v, V_OLD, R, M, clip_eps=0.25)
    assert torch.equal(loss.detach(), _t([1 / 8, 1 / 8, 1 / 8, 2.0]))
    (grad,) = torch.autograd.grad(loss.sum(), v)
    # tokens 0 and 3: V outside the band, the unclipped error larger: V - R = -0.5 and 2.
    # token 1: inside the band, both branches are V itself: V - R = -0.5.
    # token 2: V outside the band and the clipped error larger: zero gradient.
    assert torch.equal(grad, _t([-0.5, -0.5, 0.0, 2.0]))


def test_mse_known_values_and_gradient():
    v = V.clone().requires_grad_(True)
    loss = value_loss.mse(v, V_OLD, R, M)
    assert torch.equal(loss.detach(), _t([1 / 8, 1 / 8, 1 / 32, 2.0]))
    (grad,) = torch.autograd.grad(loss.sum(), v)
    assert torch.equal(grad, V - R)


def test_clipped_default_eps_is_0_2():
    # V = 1.0, V_old = 0.5 -> V_clip = 0.7; R = 0.9: max(0.1^2, 0.2^2) / 2 = 0.02. Each of 0.7 and
    # the residuals carries <= 2 ulps of a number < 1, so the result is within ~1e-16 * 0.2 * 4.
    out = value_loss.clipped(_t([1.0]), _t([0.5]), _t([0.9]), torch.ones(1, 1, dtype=F64))
    assert float(out) == pytest.approx(0.02, abs=8 * EPS * 0.2)
    assert lookup("value_loss", "clipped").fn is value_loss.clipped


finite = st.floats(-5.0, 5.0, allow_nan=False)


@given(old=finite, ret=finite, eps=st.floats(0.01, 1.0), frac=st.floats(-0.99, 0.99))
def test_clipped_equals_mse_inside_the_band(old, ret, eps, frac):
    # |V - V_old| <= 0.99 eps: the 0.01 eps >= 1e-4 margin dwarfs the roundings of V, V_old +- eps
    # (ulp(10) ~ 1.8e-15), so clamp returns V bit for bit and max(a, a) = a: exact equality.
    v = _t([old + frac * eps])
    args = (v, _t([old]), _t([ret]), torch.ones(1, 1, dtype=F64))
    assert torch.equal(value_loss.clipped(*args, clip_eps=eps), value_loss.mse(*args))


@given(
    old=finite,
    eps=st.floats(0.01, 1.0),
    gap=st.floats(1e-3, 2.0),
    extra=st.floats(1e-3, 2.0),
    side=st.sampled_from([-1.0, 1.0]),
)
def test_gradient_is_zero_when_the_clipped_branch_is_larger_outside_the_band(old, eps, gap, extra, side):
    # V beyond the band edge E = V_old + side*eps by `gap`; R beyond the midpoint of V and E, on
    # V's side, so |E - R| = gap/2 + extra > |V - R| = |gap/2 - extra|: the clipped branch wins.
    v = torch.tensor([[old + side * (eps + gap)]], dtype=F64, requires_grad=True)
    ret = _t([old + side * (eps + gap / 2 + extra)])
    v_old = _t([old])
    m = torch.ones(1, 1, dtype=F64)
    unclipped = 0.5 * (v.detach() - ret) ** 2
    clipped_branch = 0.5 * (v_old + side * eps - ret) ** 2
    assume(bool(clipped_branch > unclipped))  # the construction guarantees it up to roundings
    loss = value_loss.clipped(v, v_old, ret, m, clip_eps=eps)
    (grad,) = torch.autograd.grad(loss.sum(), v)
    assert torch.equal(grad, torch.zeros_like(grad))
    assert loss.item() > unclipped.item()  # and the loss is the pessimistic (clipped) one


@given(
    old=finite, ret=finite, eps=st.floats(0.01, 1.0), gap=st.floats(1e-3, 2.0), side=st.sampled_from([-1, 1])
)
def test_gradient_is_the_plain_one_when_the_unclipped_branch_is_larger(old, ret, eps, gap, side):
    v = torch.tensor([[old + side * (eps + gap)]], dtype=F64, requires_grad=True)
    v_old, r, m = _t([old]), _t([ret]), torch.ones(1, 1, dtype=F64)
    unclipped = (v.detach() - r) ** 2
    clipped_branch = (v_old + side * eps - r) ** 2
    assume(bool(unclipped > clipped_branch))
    (grad,) = torch.autograd.grad(value_loss.clipped(v, v_old, r, m, clip_eps=eps).sum(), v)
    assert torch.equal(grad, v.detach() - r)  # d/dV 0.5 (V-R)^2 = V - R; the factors 2, 0.5 are exact


@pytest.mark.parametrize("name", ["clipped", "mse"])
def test_masked_positions_are_zero_even_with_garbage(name):
    nan = float("nan")
    v = torch.tensor([[1.0, nan], [2.0, float("inf")]], dtype=F64, requires_grad=True)
    old = _t([1.0, nan], [2.0, 0.0])
    ret = _t([0.5, nan], [2.5, float("-inf")])
    m = _t([1.0, 0.0], [1.0, 0.0])
    loss = getattr(value_loss, name)(v, old, ret, m)
    assert torch.equal(loss.detach(), _t([0.125, 0.0], [0.125, 0.0]))
    (grad,) = torch.autograd.grad(loss.sum(), v)
    assert torch.equal(grad, _t([0.5, 0.0], [-0.5, 0.0]))


def test_gin_binds_clip_eps_and_a_huge_eps_is_mse():
    gin.parse_config("value_loss.clipped.clip_eps = 1e9")
    assert torch.equal(part("value_loss", "clipped")(V, V_OLD, R, M), value_loss.mse(V, V_OLD, R, M))


@pytest.mark.parametrize("bad", [0.0, -0.1, float("nan"), True, None, "0.2"])
def test_bad_clip_eps(bad):
    with pytest.raises(ConfigError, match=r"^value_loss\.clipped\.clip_eps must be > 0") as e:
        value_loss.clipped(V, V_OLD, R, M, clip_eps=bad)
    assert "\n" not in _own_message(e.value)


@pytest.mark.parametrize("name", ["clipped", "mse"])
@pytest.mark.parametrize("which", ["values", "old_values", "returns"])
def test_shape_mismatch(name, which):
    args = {"values": V, "old_values": V_OLD, "returns": R}
    args[which] = args[which][:, :3]
    with pytest.raises(ShapeError, match=rf"^value_loss\.{name}: {which} must have the shape of mask"):
        getattr(value_loss, name)(args["values"], args["old_values"], args["returns"], M)
