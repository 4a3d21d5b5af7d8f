"""Shared test set-up: float64 by default for identities, a hypothesis profile, clean gin state."""

from __future__ import annotations

import os
import signal
import sys

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

# ^C is Python's in every test, however the suite was started: a shell without job control starts a
# background command (`pytest ... &`) with SIGINT ignored, which Python then keeps, and every
# subprocess inherits (the sweep's and the trainer's ^C tests would wait for a stop that never comes).
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Under pytest-xdist (`-n auto --dist loadfile`, the README's test command) the workers share the cores:
# each worker's own torch gets its share (cores // workers), so two workers do not both start a team
# of every core's threads (the trainer's default is torch's thread count). Processes a test starts set
# their own. `--dist loadfile` keeps a module's tests on one worker, in order, so its module-scoped
# fixtures (a trained run, a vLLM engine, a Ray cluster) are built once.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORKERS))


# The modules that take minutes, longest first (worker-seconds of the README test command on a 2-core
# AMD EPYC, AVX2: ray_cluster 765, async_ranks 355, compile 335, sweep_multiprocess 285, bench 255,
# recover_signals 180, multinode_torchrun 170, lora 140). xdist hands modules to its workers in
# collection order (`pytest_configure` turns off its own reordering by test count, which put these
# last): started first, the short modules fill in around them instead of one worker finishing alone.
# Order only: every test runs, in any order, alone or on any worker.
LONGEST_FIRST = (
    "test_ray_cluster.py",
    "test_async_ranks.py",
    "test_compile.py",
    "test_sweep_multiprocess.py",
    "test_bench.py",
    "test_recover_signals.py",
    "test_multinode_torchrun.py",
    "test_lora.py",
)


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --dist loadfile
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture(scope="module")
def tiny():
    """A random-init tiny Qwen2 (the base config's size) on `add`, and one fixed rollout of 4 x 4 rows
    (shared by the modules that compare two computations on the same model and batch)."""
    import polgrad  # noqa: F401  (registers the tasks)
    from polgrad import models
    from polgrad.registry import get
    from polgrad.rollout import hf

    task = get("task", "add")(digits=2)
    model, tok = models.build_tiny(task, seed=0)
    rollout = hf.generate(model, tok, task.examples("train", 4, seed=0), group_size=4,
                          max_new_tokens=12, generator_seed=1)  # fmt: skip
    return model, rollout


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


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_leaked_launcher_env():
    """TRL's accelerate (the bench's in-process numerics) writes RANK and WORLD_SIZE into os.environ;
    a later test's subprocess would take them for a launcher's and wait for an env:// rendezvous
    (MASTER_ADDR) that never comes. Each test ends with the launcher variables it started with.
    polgrad's own runs restore what they write (distributed.session; tests/project/test_layers.py checks it),
    and a test that calls distributed.setup directly leaves LOCAL_RANK=0, which this also undoes."""
    before = {k: os.environ.get(k) for k in LAUNCHER_VARS}
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def fake_trainer(monkeypatch):
    """Sweeps run tests/fake_train.py, a fast stand-in for polgrad.train; children find it on
    PYTHONPATH (use with `pytestmark = pytest.mark.usefixtures("fake_trainer")`)."""
    from polgrad.sweep.experiment import TRAIN_MODULE_ENV

    tests = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv(TRAIN_MODULE_ENV, "fake_train")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    if tests not in sys.path:
        monkeypatch.syspath_prepend(tests)


@pytest.fixture
def kl_sources(monkeypatch) -> list[bool]:
    """Per exact-KL computation of the loop (the reference's `collect`, polgrad/reference.py), in order:
    True when it read pi_theta from the rollout's sampling distributions, False when it ran the policy
    forward."""
    from polgrad import reference

    used: list[bool] = []
    real = reference.exact_kl

    def spy(policy, ref, rollout, **kwargs):
        used.append(rollout.policy_logp_all is not None)
        return real(policy, ref, rollout, **kwargs)

    monkeypatch.setattr(reference, "exact_kl", spy)
    return used
