"""Parts are resolved at the config boundary: a built run calls plain functions with fixed values.

`config.build()` hands every part over as a `registry.Bound` (polgrad.config_parts): gin's values
read once, at the build. So rebinding or clearing gin afterwards changes nothing in a step, bit
for bit; and the same rebinding before the build does change it (the paired control: without it,
a test of "nothing changed" could pass on a rebinding that never mattered).
"""

from __future__ import annotations

import pickle

import gin
import pytest
import torch

from polgrad import config, config_parts, registry
from polgrad.registry import StepCounts

F64 = torch.float64
GRPO = str(config.REPO_ROOT) + "/registry/grpo.gin"

# Two groups of two responses, 3 tokens each (row 3's last token is padding). The new log-probs sit
# 0.4-0.6 above the old ones, so every ratio exp(0.4..0.6) = 1.49..1.82 is beyond PPO's 1 + 0.2 and
# inside 1 + 0.9: clip.ppo.eps_high decides the loss, as do the KL (k3 against REF) and GRPO's eps.
MASK = torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=F64)
OLD = torch.tensor(
    [[-1.0, -0.5, -2.0], [-0.25, -1.0, -1.5], [-0.75, -0.5, -1.0], [-1.0, -2.0, -7.0]], dtype=F64
)
NEW = OLD + torch.tensor([[0.5, 0.4, 0.6], [0.4, 0.5, 0.4], [0.6, 0.5, 0.4], [0.5, 0.6, 0.0]], dtype=F64)
REF = OLD - 0.25
SCORES = torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=F64)


def _step(algo) -> list[torch.Tensor]:
    """prepare + loss of one micro-batch with the built algorithm: every number it produces."""
    batch = {
        "scores": SCORES,
        "mask": MASK,
        "truncated": torch.zeros(4, dtype=torch.bool),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "old_logp": OLD,
        "ref_logp": REF,
    }
    out, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
    mb = {**{k: out[k] for k in ("mask", "old_logp", "ref_logp", "adv")}, "logp": NEW}
    counts = StepCounts.of_step([MASK])
    policy, _, metrics = algo.loss(mb, counts, kl_coef=algo.kl_coef)
    return [out["adv"], policy, *(metrics[k] for k in sorted(metrics))]


def _build(*bindings: str):
    config.parse_config([GRPO], bindings)
    cfg, algo, _ = config.build()
    return cfg, algo


REBINDINGS = (
    "clip.ppo.eps_high = 0.9",
    "advantage.grpo.eps = 0.5",
    "kl.k3.max_log_ratio = 0.01",
    "Algorithm.kl_coef = 0.5",
)


@pytest.mark.parametrize("rebinding", REBINDINGS)
def test_rebinding_gin_after_the_build_changes_nothing_in_a_step(rebinding):
    _, algo = _build()
    before = _step(algo)
    gin.parse_config(rebinding)
    after_rebinding = _step(algo)
    gin.clear_config()
    after_clearing = _step(algo)
    for a, b, c in zip(before, after_rebinding, after_clearing, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)  # bit for bit: the same calls on the same values
    # The paired control: the same binding before the build does move the step.
    _, rebuilt = _build(rebinding)
    assert any(not torch.equal(a, b) for a, b in zip(before, _step(rebuilt), strict=True)), rebinding


def test_every_part_of_a_built_run_is_bound():
    cfg, algo = _build("train.loggers = ['tensorboard']")
    parts = [algo.part(b) for b in algo.parts] + [cfg.ensemble_combine, *cfg.trackers().values()]
    assert all(isinstance(p, registry.Bound) for p in parts), [type(p) for p in parts]
    assert algo.clip.hparams == {"eps_low": 0.2, "eps_high": 0.2}  # the spec's values
    assert algo.kl_controller.entry.full_name == "kl_controller.fixed"  # a default part, bound too
    # the run's operative config names each part's values
    text = config.record(cfg, algo).operative
    assert "clip.ppo.eps_high = 0.2" in text and "advantage.grpo.eps = 1e-06" in text


def test_a_bound_part_pickles_as_its_name_and_values():
    _, algo = _build("clip.ppo.eps_high = 0.3")
    clip = pickle.loads(pickle.dumps(algo.clip))
    assert clip.entry is algo.clip.entry and clip.hparams == {"eps_low": 0.2, "eps_high": 0.3}


def test_a_part_referenced_in_a_scope_takes_the_scopes_values():
    gin.parse_config("Algorithm.clip = @wide/clip.ppo\nwide/clip.ppo.eps_high = 0.7\nclip.ppo.eps_low = 0.1")
    part = config_parts.bind(gin.query_parameter("Algorithm.clip").scoped_configurable_fn)
    assert part.hparams == {"eps_low": 0.1, "eps_high": 0.7}


def test_a_registered_function_is_returned_plain_and_bound_from_gin():
    @registry.register("kl_controller", "test_halve", formula="beta/2")
    def halve(coef, measured_kl, n_steps, *, factor=0.5, floor):
        """Multiply the coefficient by `factor`, no lower than `floor`."""
        return max(coef * factor, floor)

    assert registry.get("kl_controller", "test_halve") is halve
    assert registry.entry_of(halve).full_name == "kl_controller.test_halve"
    gin.parse_config("kl_controller.test_halve.factor = 0.25\nF = 0.0\nkl_controller.test_halve.floor = %F")
    assert halve(1.0, 0.0, 1, floor=0.0) == 0.5  # the function itself reads no gin
    bound = config_parts.bind(gin.get_configurable("kl_controller.test_halve"))
    assert bound.hparams == {"factor": 0.25, "floor": 0.0} and bound(1.0, 0.0, 1) == 0.25
    gin.clear_config()
    gin.parse_config("kl_controller.test_halve.floor = %UNSET")
    unset = config_parts.bind(gin.get_configurable("kl_controller.test_halve"))
    assert unset.unbound == ("floor",)  # a macro without a value: left to a config parsed later
    with pytest.raises(registry.ConfigError, match=r"kl_controller.test_halve.floor has no value"):
        unset(1.0, 0.0, 1)


@registry.register("kl_controller", "test_scaled")
def _scaled(coef, measured_kl, n_steps, *, factor=1.0):
    """coef * factor."""
    return coef * factor


@registry.register("kl_controller", "test_nested")
def _nested(coef, measured_kl, n_steps, *, inner=None):
    """The inner controller's value (coef without one)."""
    return coef if inner is None else inner(coef, measured_kl, n_steps)


def test_a_part_bound_to_a_parts_hyperparameter_is_bound_in_the_outer_scope():
    """gin calls `@s/kl_controller.test_nested` inside scope s, so its inner part reads s's values;
    the bound part must hold the same (5.0, not the unscoped 2.0)."""
    gin.parse_config(
        "Algorithm.kl_controller = @s/kl_controller.test_nested\n"
        "s/kl_controller.test_nested.inner = @kl_controller.test_scaled\n"
        "kl_controller.test_scaled.factor = 2.0\n"
        "s/kl_controller.test_scaled.factor = 5.0\n"
    )
    scoped = gin.query_parameter("Algorithm.kl_controller").scoped_configurable_fn
    bound = config_parts.bind(scoped)
    assert bound.hparams["inner"].hparams == {"factor": 5.0}
    assert bound(1.0, 0.0, 1) == scoped(1.0, 0.0, 1) == 5.0  # what gin's own call gives
    # both parts' values are in the operative config
    assert "kl_controller.test_scaled.factor = 5.0" in config_parts.part_blocks([bound])


@gin.configurable("test_boom")
def _boom():
    raise ValueError("boom: a reference that fails when evaluated")


def test_an_error_evaluating_a_hyperparameter_is_not_taken_for_a_missing_value():
    gin.parse_config("clip.ppo.eps_high = @test_boom()")
    with pytest.raises(ValueError, match="boom"):
        config_parts.part("clip", "ppo")


class GinReadAtRunTime(AssertionError):
    pass


def _no_gin(monkeypatch) -> None:
    """From here on, any gin lookup raises: a configurable's call (`gin.config._get_bindings`, what
    every gin wrapper asks for its values), a query, the config text, the registry."""
    import gin.config as gin_config

    def refuse(*args, **kwargs):
        raise GinReadAtRunTime("gin was read during the run")

    monkeypatch.setattr(gin_config, "_get_bindings", refuse)
    for name in ("query_parameter", "config_str", "operative_config_str", "get_configurable"):
        monkeypatch.setattr(gin, name, refuse)
        monkeypatch.setattr(gin_config, name, refuse)


def _run_without_gin(tmp_path, monkeypatch, spec: str):
    from polgrad import hooks
    from polgrad.trainer import train

    config.parse_config(
        [str(config.REPO_ROOT) + f"/registry/{spec}.gin"],
        ["train.steps = 2", "train.eval_every = 2", "train.eval_size = 8", "train.prompts_per_step = 2",
         "Algorithm.group_size = 4", "train.progress = False"],
    )  # fmt: skip
    cfg, algo, task = config.build()
    record = config.record(cfg, algo)
    _no_gin(monkeypatch)
    return hooks, lambda: train(cfg, algo, task, str(tmp_path / spec), record=record)


@pytest.mark.parametrize("spec", ["grpo", "ppo"])
def test_a_built_run_trains_without_reading_gin(tmp_path, monkeypatch, spec):
    """The loop reads no gin at all (not only the parts): after the build every gin lookup raises,
    and a whole run (warm start, reference or critic, steps, evaluation, checkpoint, summary, final/)
    still ends ok. The planted control: one gin read inside a step's phase is caught."""
    hooks, run = _run_without_gin(tmp_path, monkeypatch, spec)
    assert run()["status"] == "ok"


@gin.configurable("test_planted")
def _planted(x=1):
    return x


@pytest.mark.parametrize("read", [lambda: gin.query_parameter("train.steps"), lambda: _planted()])
def test_a_gin_read_inside_the_step_is_caught(tmp_path, monkeypatch, read):
    """Planted violations: a query, and a call of a gin configurable (what a part was before it was
    bound), in one of the step's phases."""
    hooks, run = _run_without_gin(tmp_path, monkeypatch, "grpo")
    with hooks.listen(on_phase=lambda path, dt: read()), pytest.raises(GinReadAtRunTime):
        run()
