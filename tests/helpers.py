"""Small helpers the test files share (their fixtures are in conftest.py); tests/ is on sys.path
(conftest.py's folder), so a test anywhere under tests/ imports them as `from helpers import ...`."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def csv_rows(path: Path) -> list[dict[str, str]]:
    """The rows of a CSV as dicts of text."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """`rows` as a CSV at `path` (its folder made), the columns those of the first row."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def require(*names: str, env: str | None = None) -> None:
    """Skip the calling test module where a package of `names` is not installed, on a machine set up
    without the test extras (`bash .ci/setup` without --test): the one skip a contributor may see, and
    never a passing test. Where the set-up installed them it is a collection error instead:
    POLGRAD_REQUIRE_EXTRAS=1 (.ci/run sets it, as `.ci/setup --test` installs every package a module
    asks for here), or `env` set to 1 (POLGRAD_REQUIRE_VLLM, the older name the vLLM modules pass).
    Found without importing it (importlib.util.find_spec): each xdist worker collects every module,
    and importing vLLM, MLflow or W&B there (~1-6 CPU-s each) cost every worker what only the one that
    runs the module needs; the tests import them when they run."""
    import importlib.util
    import os

    import pytest

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if not missing:
        return
    for var in ("POLGRAD_REQUIRE_EXTRAS", env):
        if var and os.environ.get(var) == "1":
            raise ImportError(f"{', '.join(missing)} not installed, and {var}=1 requires it")
    pytest.skip(f"{', '.join(missing)} not installed", allow_module_level=True)


def built_run(tmp_path: Path, spec: str, name: str, bindings: Sequence[str], *, layers: int):
    """(cfg, algo, task, models) of registry/<spec>.gin as a run builds them (polgrad.build.build_models:
    policy, reference, critic, HF sampler), 8 prompts, a `layers`-layer tiny model and a value head
    drawn at random (seeded), so the critic's values depend on the backbone from the first step; built
    under the run's seed, so two builds start from the same weights. `name` is its folder in tmp_path."""
    import gin

    from polgrad import config
    from polgrad import distributed as dist_lib
    from polgrad.build import build_models
    from polgrad.config import parse_config
    from polgrad.sampling import step_seed

    repo = Path(__file__).resolve().parent.parent
    gin.clear_config()
    parse_config(
        [str(repo / "registry" / f"{spec}.gin")],
        [
            "train.steps = 1",
            "train.prompts_per_step = 8",
            "train.progress = False",
            f"train.model_kwargs = {{'layers': {layers}}}",
            "value_init.policy.head_init_std = 0.02",
            *bindings,
        ],
    )
    try:
        cfg, algo, task = config.build()
    finally:
        gin.clear_config()
    with dist_lib.session(seed=cfg.seed):
        m = build_models(
            cfg, algo, task, out_dir=str(tmp_path / name), seed_of=lambda s: step_seed(cfg.seed, s)
        )
    return cfg, algo, task, m
