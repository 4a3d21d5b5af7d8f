"""polgrad.collective on one process (the world-size-2 behaviour is in tests/loop/test_data_parallel.py)."""

from __future__ import annotations

import torch

from polgrad import collective


def test_moments_known_values():
    # [1, 2, 3, 4]: mean 2.5, deviations -1.5 -0.5 0.5 1.5, squares sum 2.25+0.25+0.25+2.25 = 5,
    # so the population variance is 5/4 and Bessel's 5/3 (exact in float64 up to one rounding).
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    n, centred, var = collective.moments(x)
    assert n == 4.0 and centred.tolist() == [-1.5, -0.5, 0.5, 1.5] and float(var) == 1.25
    _, _, bessel = collective.moments(x, ddof=1)
    assert abs(float(bessel) - 5 / 3) <= 2**-52 * 5 / 3
