"""kl_controller.*: fixed and adaptive (Ziegler et al. 2019 proportional controller) KL coefficients."""

from __future__ import annotations

import gin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from polgrad.components import kl_controller
from polgrad.config_parts import part
from polgrad.errors import ConfigError, ShapeError

EPS = torch.finfo(torch.float64).eps


def _own_message(exc: BaseException) -> str:
    """The part's own message: gin appends "\n  In call to configurable ..." to what a part raises."""
    return str(exc).split("\n  In call to configurable")[0]


coefs = st.floats(1e-4, 10.0)
kls = st.floats(-1.0, 100.0)  # k1 estimates can be negative
n_steps = st.integers(0, 1999)  # 0.2 * n < horizon = 10000 (default) and < 400 (below)


@given(coef=coefs, kl=kls, n=n_steps)
def test_fixed_returns_coef(coef, kl, n):
    assert kl_controller.fixed(coef, kl, n) == coef


@pytest.mark.parametrize(
    ("kl", "expected"),
    [
        (12.0, 0.1 * (1 + 0.2 * 256 / 10000)),  # e = min(12/6 - 1, 0.2) = 0.2   -> 0.100512
        (6.6, 0.1 * (1 + 0.1 * 256 / 10000)),  # e = 6.6/6 - 1 = 0.1            -> 0.100256
        (5.4, 0.1 * (1 - 0.1 * 256 / 10000)),  # e = -0.1                       -> 0.099744
        (3.0, 0.1 * (1 - 0.2 * 256 / 10000)),  # e = max(3/6 - 1, -0.2) = -0.2 -> 0.099488
        (6.0, 0.1),  # e = 0: fixed point
    ],
)
def test_adaptive_known_values(kl, expected):
    # each side: a handful of roundings of numbers ~0.1; 6.6/6 - 1 cancels to 0.1 with an absolute
    # error ~ ulp(1.1) = 2.2e-16, i.e. relative 2.2e-15 on e, scaled by n/H = 0.0256 in the result.
    out = kl_controller.adaptive(0.1, kl, 256)
    assert out == pytest.approx(expected, rel=16 * EPS)
    assert out == pytest.approx({12.0: 0.100512, 6.6: 0.100256, 5.4: 0.099744, 3.0: 0.099488, 6.0: 0.1}[kl])


@given(coef=coefs, kl=kls, n=st.integers(1, 1999), target=st.floats(0.1, 20.0), horizon=st.floats(400.0, 1e5))
def test_adaptive_moves_toward_target_with_a_bounded_step(coef, kl, n, target, horizon):
    new = kl_controller.adaptive(coef, kl, n, target=target, horizon=horizon)
    ratio = new / coef
    # bounded: |beta'/beta - 1| = |e| n / H <= 0.2 n / H (+ roundings of 1 + e n/H and the division)
    assert abs(ratio - 1.0) <= 0.2 * n / horizon + 4 * EPS
    # toward the target: KL too high -> beta grows (stronger penalty), too low -> beta shrinks.
    # Strict once the step |e| n / H is far above EPS: |e| >= 1e-6 and n/H >= 1e-5 give >= 1e-11.
    if kl > target * (1 + 1e-6):
        assert new > coef
    elif kl < target * (1 - 1e-6):
        assert new < coef
    assert new > 0


@given(coef=coefs, target=st.floats(0.1, 20.0), n=n_steps)
def test_adaptive_fixed_point_at_target(coef, target, n):
    assert kl_controller.adaptive(coef, target, n, target=target) == coef  # target/target - 1 == 0 exactly


def test_adaptive_closes_the_loop():
    """A toy policy whose KL falls as beta rises (KL = 1.2 / beta): beta converges to 1.2 / target."""
    coef = 0.05  # KL starts at 24, 4x the target
    for _ in range(3000):
        coef = kl_controller.adaptive(coef, 1.2 / coef, 512)
    # each update shrinks |log(beta / beta*)| geometrically once |e| < 0.2 (rate ~1 - 512/10000):
    # after 3000 updates the error is far below 1e-9
    assert coef == pytest.approx(0.2, rel=1e-9)


def test_accepts_a_zero_dim_tensor_kl():
    assert kl_controller.adaptive(0.1, torch.tensor(12.0), 256) == pytest.approx(0.100512, rel=16 * EPS)
    assert kl_controller.fixed(0.1, torch.tensor(12.0), 256) == 0.1


def test_gin_binds_target_and_horizon():
    gin.parse_config(["kl_controller.adaptive.target = 0.5", "kl_controller.adaptive.horizon = 1000"])
    # e = min(1.0 / 0.5 - 1, 0.2) = 0.2; 0.1 * (1 + 0.2 * 100 / 1000) = 0.102
    assert part("kl_controller", "adaptive")(0.1, 1.0, 100) == pytest.approx(0.102, rel=16 * EPS)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target": 0.0}, r"^kl_controller\.adaptive\.target must be > 0"),
        ({"target": -1.0}, r"^kl_controller\.adaptive\.target must be > 0"),
        ({"target": float("nan")}, r"^kl_controller\.adaptive\.target must be > 0"),
        ({"horizon": 0}, r"^kl_controller\.adaptive\.horizon must be > 0"),
        ({"horizon": float("inf")}, r"^kl_controller\.adaptive\.horizon must be > 0"),
        ({"horizon": 100}, r"^kl_controller\.adaptive\.horizon must be > 0\.2 \* n_steps = 200"),
    ],
)
def test_bad_hyperparameters(kwargs, message):
    with pytest.raises(ConfigError, match=message) as e:
        kl_controller.adaptive(0.1, 6.0, 1000, **kwargs)
    assert "\n" not in _own_message(e.value)


@pytest.mark.parametrize("name", ["fixed", "adaptive"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0.1, float("nan"), 10), "measured_kl must be finite"),
        ((-0.1, 1.0, 10), "kl_coef must be a finite number >= 0"),
        ((0.1, 1.0, -1), "n_steps must be an int >= 0"),
        ((0.1, 1.0, 2.5), "n_steps must be an int >= 0"),
        ((0.1, torch.ones(3), 10), "kl_coef and measured_kl must be scalars"),
    ],
)
def test_bad_state(name, args, message):
    with pytest.raises(ShapeError, match=rf"^kl_controller\.{name}: {message}"):
        getattr(kl_controller, name)(*args)


def test_adaptive_ziegler_update_rule_by_hand_with_the_per_sequence_kl():
    # Ziegler et al. 2019, section 2.2: e = clip(KL / KL_target - 1, -0.2, 0.2),
    # beta' = beta * (1 + e * n / H), with the per-sequence KL. beta = 0.1, target 6, n = 64,
    # H = 10000 (so n / H = 0.0064):
    #   two responses of 3 valid tokens, log pi - log pi_ref = 3 nats on every token: per-sequence
    #   KL = mean(3+3+3, 3+3+3) = 9 -> e = clip(9/6 - 1 = 0.5) = +0.2 (upper clip)
    #   -> beta' = 0.1 * (1 + 0.2 * 0.0064) = 0.1 * 1.00128 = 0.100128
    #   (the per-token mean, 3 nats, would give e = clip(3/6 - 1) = -0.2: beta shrinks, wrongly)
    token_kl = torch.full((2, 3), 3.0, dtype=torch.float64)
    per_seq = float(token_kl.sum(-1).mean())
    assert per_seq == 9.0
    assert kl_controller.adaptive(0.1, per_seq, 64) == pytest.approx(0.100128, rel=4 * EPS)
    assert kl_controller.adaptive(0.1, float(token_kl.mean()), 64) == pytest.approx(0.099872, rel=4 * EPS)
    #   KL = 1: e = clip(1/6 - 1 = -0.8333) = -0.2 (lower clip) -> 0.1 * (1 - 0.00128) = 0.099872
    out = kl_controller.adaptive(0.1, 1.0, 64, target=6.0, horizon=10000)
    assert out == pytest.approx(0.099872, rel=4 * EPS)
    #   KL = 6.3: e = 6.3/6 - 1 = 0.05 (inside the clip) -> 0.1 * (1 + 0.05 * 0.0064) = 0.100032
    assert kl_controller.adaptive(0.1, 6.3, 64) == pytest.approx(0.100032, rel=16 * EPS)
