"""Shared test set-up: float64 by default for identities, a hypothesis profile, clean gin state."""

from __future__ import annotations

import os

import gin
import pytest
import torch
from hypothesis import HealthCheck, settings

# One profile for every property test: enough examples to find the corner cases of masks and
# groups, no deadline (the machine is shared and noisy; timings belong in benchmarks).
# POLGRAD_HYPOTHESIS_EXAMPLES raises or lowers the count for a deeper or a quicker local run.
settings.register_profile(
    "polgrad",
    max_examples=int(os.environ.get("POLGRAD_HYPOTHESIS_EXAMPLES", "200")),
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("polgrad")


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): small
    models run faster and bit-reproducibly on one thread, and the thread count is restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _clean_gin():
    """Every test starts and ends with an empty gin config (registrations stay; bindings go)."""
    gin.clear_config()
    yield
    gin.clear_config()
