"""reward_shaping.*: clip, whiten, EOS-only scoring, DAPO soft overlong punishment (eq. 13)."""

from __future__ import annotations

import gin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from polgrad.components import reward_shaping
from polgrad.config_parts import part
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import get, lookup

EPS = torch.finfo(torch.float64).eps
F64 = torch.float64
NAMES = ["clip", "whiten", "eos_only", "overlong"]
LENGTH_KW = {"max_len": 10, "cache_len": 4}


def _own_message(exc: BaseException) -> str:
    """The part's own message: gin appends "\n  In call to configurable ..." to what a part raises."""
    return str(exc).split("\n  In call to configurable")[0]


def _mask(lengths, t):
    """[B,T] float mask with the first lengths[i] tokens of row i valid."""
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


def _call(name, scores, mask, truncated, **kw):
    if name == "overlong":
        kw = {**LENGTH_KW, **kw}
    return get("reward_shaping", name)(scores, mask, truncated=truncated, **kw)


# ------------------------------------------------------------------------------------------ clip


def test_clip_known_values():
    s = torch.tensor([-20.0, -3.0, 0.0, 7.0, 15.0], dtype=F64)
    m, tr = torch.ones(5, 3, dtype=F64), torch.zeros(5, dtype=torch.bool)
    assert torch.equal(
        reward_shaping.clip(s, m, truncated=tr), torch.tensor([-10.0, -3, 0, 7, 10], dtype=F64)
    )
    out = reward_shaping.clip(s, m, truncated=tr, low=-5.0, high=5.0)  # OpenRLHF's clip_reward_value = 5
    assert torch.equal(out, torch.tensor([-5.0, -3, 0, 5, 5], dtype=F64))


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=16), st.floats(-50, 0), st.floats(0.001, 50))
def test_clip_is_a_projection(values, low, width):
    s = torch.tensor(values, dtype=F64)
    m, tr = torch.ones(len(values), 2, dtype=F64), torch.zeros(len(values), dtype=torch.bool)
    out = reward_shaping.clip(s, m, truncated=tr, low=low, high=low + width)
    assert bool((out >= low).all() and (out <= low + width).all())
    inside = (s >= low) & (s <= low + width)
    assert torch.equal(out[inside], s[inside])  # untouched inside [low, high]
    assert torch.equal(reward_shaping.clip(out, m, truncated=tr, low=low, high=low + width), out)


# ---------------------------------------------------------------------------------------- whiten


def test_whiten_known_values():
    # [1,2,3,4]: mean 2.5, population std sqrt(1.25) -> (+-1.5, +-0.5) / sqrt(1.25)
    s = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=F64)
    out = reward_shaping.whiten(s, torch.ones(4, 2, dtype=F64), truncated=torch.zeros(4, dtype=torch.bool))
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=F64) / 1.25**0.5
    # eps = 1e-8 in the denominator shifts each value by a relative 1e-8 / 1.118 ~ 9e-9
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=0)
    assert out.tolist() == pytest.approx([-1.3416408, -0.4472136, 0.4472136, 1.3416408], abs=1e-7)


# Rounding bound for whitening B values with |s| <= S and population std sigma: the computed mean
# is off by <= B EPS S, which shifts every centred value and hence every output by <= B EPS S/sigma;
# the std and the final division add O(B EPS) relative on outputs of size <= sqrt(B). So every
# check below carries 4 B EPS (S/sigma + sqrt(B)), and eps's own effect is stated where it enters.
def _round_tol(b, big, std):
    return 4 * b * EPS * (big / std + b**0.5)


values = st.lists(st.floats(-100, 100), min_size=2, max_size=32).filter(lambda v: max(v) - min(v) >= 1e-3)


@given(values)
def test_whiten_gives_zero_mean_and_unit_std(vals):
    s = torch.tensor(vals, dtype=F64)
    b, std = len(vals), float(s.std(correction=0))  # std >= spread / sqrt(2B) >= 1.25e-4
    out = reward_shaping.whiten(s, torch.ones(b, 1, dtype=F64), truncated=torch.zeros(b, dtype=torch.bool))
    tol = _round_tol(b, 100.0, std)
    assert abs(float(out.mean())) <= tol
    # population std of the output = sigma / (sigma + eps), i.e. 1 - O(eps / sigma)
    assert float(out.std(correction=0)) == pytest.approx(std / (std + 1e-8), rel=tol, abs=0)


@given(values, st.floats(-1e3, 1e3), st.floats(0.01, 100))
def test_whiten_removes_a_change_of_units(vals, shift, scale):
    s = torch.tensor(vals, dtype=F64)
    b, std = len(vals), float(s.std(correction=0))
    m, tr = torch.ones(b, 1, dtype=F64), torch.zeros(b, dtype=torch.bool)
    # eps = 1e-300 takes eps's own (unit-dependent) effect out, leaving the roundings of each side
    # (for the shifted batch S = |shift| + 100 scale and std = scale * sigma).
    out = reward_shaping.whiten(s, m, truncated=tr, eps=1e-300)
    again = reward_shaping.whiten(s * scale + shift, m, truncated=tr, eps=1e-300)
    tol = _round_tol(b, 100.0, std) + _round_tol(b, abs(shift) + 100 * scale, scale * std)
    torch.testing.assert_close(again, out, rtol=0, atol=tol)


@pytest.mark.parametrize("values", [[3.0], [2.5, 2.5, 2.5]])
def test_whiten_constant_batch_is_zero(values):
    s = torch.tensor(values, dtype=F64)
    b = len(values)
    out = reward_shaping.whiten(s, torch.ones(b, 2, dtype=F64), truncated=torch.zeros(b, dtype=torch.bool))
    assert torch.equal(out, torch.zeros(b, dtype=F64))  # 0 / (0 + eps), no NaN for B = 1


# -------------------------------------------------------------------------------------- eos_only


def test_eos_only_known_values():
    s = torch.tensor([0.5, 2.0, -3.0, 7.0], dtype=F64)
    tr = torch.tensor([False, True, True, False])
    m = _mask([2, 4, 4, 3], 4)
    assert torch.equal(
        reward_shaping.eos_only(s, m, truncated=tr), torch.tensor([0.5, -1.0, -1.0, 7.0], dtype=F64)
    )
    out = reward_shaping.eos_only(s, m, truncated=tr, penalty=-5.0)
    assert torch.equal(out, torch.tensor([0.5, -5.0, -5.0, 7.0], dtype=F64))


@given(st.lists(st.tuples(st.floats(-10, 10), st.booleans()), min_size=1, max_size=16), st.floats(-10, 0))
def test_eos_only_replaces_exactly_the_truncated(rows, penalty):
    s = torch.tensor([r[0] for r in rows], dtype=F64)
    tr = torch.tensor([r[1] for r in rows])
    out = reward_shaping.eos_only(s, torch.ones(len(rows), 3, dtype=F64), truncated=tr, penalty=penalty)
    assert out.dtype == F64
    assert torch.equal(out[~tr], s[~tr])
    assert torch.equal(out[tr], torch.full_like(s[tr], penalty))


# -------------------------------------------------------------------------------------- overlong


def test_overlong_known_values():
    # L_max = 10, L_cache = 4: free up to 6 tokens, then -1/4 per token, -1 beyond 10
    lengths = [0, 6, 7, 8, 9, 10, 11, 12]
    s = torch.arange(8, dtype=F64)
    out = reward_shaping.overlong(
        s, _mask(lengths, 12), truncated=torch.zeros(8, dtype=torch.bool), **LENGTH_KW
    )
    penalty = torch.tensor([0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0], dtype=F64)
    assert torch.equal(out, s + penalty)  # quarters: exact


def test_overlong_counts_valid_tokens_not_the_span():
    mask = torch.tensor([[1.0, 0, 1, 0, 1, 0, 1, 0, 1, 1, 1, 1]], dtype=F64)  # 8 valid tokens in 12
    out = reward_shaping.overlong(
        torch.zeros(1, dtype=F64), mask, truncated=torch.zeros(1, dtype=torch.bool), **LENGTH_KW
    )
    assert out.tolist() == [-0.5]


def _dapo_eq13(length, max_len, cache_len):
    """Eq. 13 of DAPO written as its three cases."""
    if length <= max_len - cache_len:
        return 0.0
    if length <= max_len:
        return ((max_len - cache_len) - length) / cache_len
    return -1.0


@given(data=st.data(), max_len=st.integers(1, 40))
def test_overlong_matches_eq13_piecewise(data, max_len):
    cache_len = data.draw(st.integers(1, max_len))
    lengths = data.draw(st.lists(st.integers(0, max_len + 5), min_size=1, max_size=12))
    scores = data.draw(st.lists(st.floats(-10, 10), min_size=len(lengths), max_size=len(lengths)))
    s = torch.tensor(scores, dtype=F64)
    tr = torch.zeros(len(lengths), dtype=torch.bool)
    out = reward_shaping.overlong(
        s, _mask(lengths, max_len + 5), truncated=tr, max_len=max_len, cache_len=cache_len
    )
    expected = torch.tensor(
        [sc + _dapo_eq13(n, max_len, cache_len) for sc, n in zip(scores, lengths, strict=True)], dtype=F64
    )
    # the same quotient (integer / integer, one rounding) and one addition on both sides: bit-equal
    assert torch.equal(out, expected)
    assert bool(((out - s) <= 0).all() and ((out - s) >= -1).all())


# ------------------------------------------------------------------------------ composition, meta


def test_parts_compose_in_order():
    s = torch.tensor([30.0, 2.0, -3.0, 1.0], dtype=F64)
    tr = torch.tensor([False, True, False, False])
    m = _mask([3, 12, 9, 4], 12)
    out = s
    for name in ["eos_only", "overlong", "clip"]:
        out = _call(name, out, m, tr)
    # eos_only: [30, -1, -3, 1]; overlong (free to 6, -1/4 per token): [30, -2, -3.75, 1]; clip: 30 -> 10
    assert torch.equal(out, torch.tensor([10.0, -2.0, -3.75, 1.0], dtype=F64))
    assert out.shape == s.shape


@pytest.mark.parametrize("name", NAMES)
def test_registered_with_a_formula(name):
    entry = lookup("reward_shaping", name)
    assert entry.fn is getattr(reward_shaping, name)
    assert entry.meta["formula"]


def test_gin_binds_hyperparameters():
    gin.parse_config(
        [
            "reward_shaping.clip.high = 1.0",
            "reward_shaping.eos_only.penalty = -2.0",
            "reward_shaping.overlong.max_len = 4",
            "reward_shaping.overlong.cache_len = 2",
        ]
    )
    s, m, tr = torch.tensor([5.0], dtype=F64), _mask([3], 4), torch.tensor([True])
    assert part("reward_shaping", "clip")(s, m, truncated=tr).tolist() == [1.0]
    assert part("reward_shaping", "eos_only")(s, m, truncated=tr).tolist() == [-2.0]
    assert part("reward_shaping", "overlong")(s, m, truncated=tr).tolist() == [4.5]  # (2 - 3) / 2 = -0.5


def test_overlong_lengths_are_required():
    s, m, tr = torch.zeros(1, dtype=F64), _mask([3], 4), torch.tensor([False])
    with pytest.raises(TypeError, match="max_len"):
        reward_shaping.overlong(s, m, truncated=tr, cache_len=2)
    with pytest.raises(TypeError, match="cache_len"):
        reward_shaping.overlong(s, m, truncated=tr, max_len=4)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        (
            "clip",
            {"low": 1.0, "high": 1.0},
            r"reward_shaping\.clip\.low must be < reward_shaping\.clip\.high",
        ),
        (
            "clip",
            {"low": 2.0, "high": -2.0},
            r"reward_shaping\.clip\.low must be < reward_shaping\.clip\.high",
        ),
        ("clip", {"low": float("nan")}, r"reward_shaping\.clip\.low must be < reward_shaping\.clip\.high"),
        ("whiten", {"eps": 0.0}, r"reward_shaping\.whiten\.eps must be > 0"),
        ("whiten", {"eps": -1e-8}, r"reward_shaping\.whiten\.eps must be > 0"),
        (
            "eos_only",
            {"penalty": float("-inf")},
            r"reward_shaping\.eos_only\.penalty must be a finite number",
        ),
        ("eos_only", {"penalty": None}, r"reward_shaping\.eos_only\.penalty must be a finite number"),
        ("overlong", {"max_len": 0}, r"reward_shaping\.overlong\.max_len must be an int > 0"),
        ("overlong", {"max_len": 8.0}, r"reward_shaping\.overlong\.max_len must be an int > 0"),
        (
            "overlong",
            {"cache_len": 0},
            r"reward_shaping\.overlong\.cache_len must be an int in \[1, max_len=10\]",
        ),
        (
            "overlong",
            {"cache_len": 11},
            r"reward_shaping\.overlong\.cache_len must be an int in \[1, max_len=10\]",
        ),
    ],
)
def test_bad_hyperparameters(name, kwargs, message):
    s, m, tr = torch.zeros(2, dtype=F64), _mask([1, 2], 3), torch.tensor([False, True])
    with pytest.raises(ConfigError, match="^" + message) as e:
        _call(name, s, m, tr, **kwargs)
    assert "\n" not in _own_message(e.value)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("scores", "mask", "truncated", "message"),
    [
        (
            torch.zeros(3, 1, dtype=F64),
            _mask([1, 2, 3], 4),
            torch.zeros(3, dtype=torch.bool),
            "scores must be a",
        ),
        (
            torch.zeros(2, dtype=F64),
            _mask([1, 2, 3], 4),
            torch.zeros(3, dtype=torch.bool),
            "scores must be a",
        ),
        (
            torch.zeros(3, dtype=F64),
            _mask([1, 2, 3], 4),
            torch.zeros(2, dtype=torch.bool),
            "truncated must be a",
        ),
        (
            torch.zeros(3, dtype=F64),
            _mask([1, 2, 3], 4),
            torch.zeros(3, dtype=F64),
            "truncated must be a bool",
        ),
        (
            torch.zeros(3, dtype=torch.long),
            _mask([1, 2, 3], 4),
            torch.zeros(3, dtype=torch.bool),
            "scores must be",
        ),
        (
            torch.zeros(3, dtype=F64),
            torch.ones(3, dtype=F64),
            torch.zeros(3, dtype=torch.bool),
            "mask must be",
        ),
    ],
)
def test_shape_errors(name, scores, mask, truncated, message):
    with pytest.raises(ShapeError, match=rf"^reward_shaping\.{name}: {message}"):
        _call(name, scores, mask, truncated)
