"""The one config pipeline: gin errors explained in one line with the valid names, build() checks."""

from __future__ import annotations

import os

import gin
import pytest
import torch

from polgrad import config, config_parts
from polgrad.batch import Batch
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import get
from polgrad.trainer import step_seed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "registry", "grpo.gin")

# A mistake a user makes -> what the one-line error must say (the fix and, for a typo, the name meant).
TYPOS = [
    ("Algorithm.advantage = @advantage.rlooo", "unknown advantage 'rlooo'.*did you mean 'rloo'"),
    ("Algorithm.kl_coeff = 0.1", "'Algorithm' has no parameter 'kl_coeff'.*did you mean 'kl_coef'"),
    ("trian.steps = 3", "unknown configurable 'trian'.*did you mean 'train'"),
    ("train.task = @task.addd", "unknown task 'addd'.*did you mean 'add'"),
    ("train.stepz = 3", "'train' has no parameter 'stepz'.*did you mean 'steps'"),
    ("include 'experiments/nope.gin'", "include 'experiments/nope.gin' not found"),
    ("import no_such_module_xyz", "cannot import 'no_such_module_xyz'.*PYTHONPATH"),
    # a part's parameters the loop passes are not bindable: only its hyperparameters are listed
    (
        "advantage.grpo.epz = 0.1",
        r"'advantage.grpo' has no parameter 'epz'; valid parameters: eps, scale; did you mean 'eps'",
    ),
    (
        "advantage.reinforce.eps = 0.1",
        r"'advantage.reinforce' has no parameter 'eps'; valid parameters: \(none\)",
    ),
]


@pytest.mark.parametrize("binding, message", TYPOS, ids=[t[0] for t in TYPOS])
def test_a_typo_in_a_binding_gets_the_valid_names_and_the_closest(binding, message):
    gin.clear_config()
    with pytest.raises(ConfigError, match=message) as err:
        config.parse_config([GRPO], [binding])
    assert "\n" not in str(err.value)
    assert binding in str(err.value)  # names the binding


def test_a_typo_in_a_file_names_the_file_and_line(tmp_path):
    spec = tmp_path / "mine.gin"
    spec.write_text(f"include '{GRPO}'\n\nAlgorithm.kl_coeff = 0.1\n")
    gin.clear_config()
    with pytest.raises(ConfigError, match=r"mine.gin: line 3: 'Algorithm' has no parameter 'kl_coeff'"):
        config.parse_config([str(spec)], [])


def test_a_missing_include_inside_a_file_is_named(tmp_path):
    spec = tmp_path / "mine.gin"
    spec.write_text("include 'experiments/nope.gin'\n")
    gin.clear_config()
    with pytest.raises(ConfigError, match=r"mine.gin: line 1: include 'experiments/nope.gin' not found"):
        config.parse_config([str(spec)], [])


BAD_VALUES = [
    ("clip.ppo.eps_low = -0.1", r"Algorithm.clip = @clip.ppo: clip.ppo.eps_low must be"),
    ("Algorithm.kl = 'k3'", r"Algorithm.kl must be a registered kl part"),
    ("Algorithm.group_size = 1", r"set Algorithm.group_size >= 2"),
    ("train.lr = -1.0", r"train.lr must be a finite number > 0"),
    ("train.steps = 0", r"train.steps must be a positive integer"),
    ("train.top_p = 1.5", r"train.top_p must be in \(0, 1\]"),
    ("train.zero_stage = 4", r"train.zero_stage must be one of 0, 1, 2, 3"),
    ("train.reward_source = 'oracle'", r"train.reward_source must be one of"),
    ("train.task = @advantage.grpo", r"train.task must be a registered task"),
    # issue 14: a bad learning rate is blamed on its binding (not on distributed.make_engine) ...
    ("train.lr = 0.0", r"^train.lr must be a finite number > 0, got 0.0$"),
    ("train.critic_lr = -1e-4", r"^train.critic_lr must be a finite number > 0, got -0.0001$"),
    ("train.critic_lr = 1e400", r"^train.critic_lr must be a finite number > 0, got inf$"),
    # issue 40: refused by the build (the dry run), not at the part's first call or by the engine
    ("clip.ppo.eps_high = %NO_SUCH_MACRO", r"^clip.ppo.eps_high has no value: bind it in a gin file or with"),
    ("train.grad_clip = 1e400", r"^train.grad_clip must be a finite number > 0 or None \(off\), got inf$"),
    ("train.grad_clip = 0.0", r"^train.grad_clip must be a finite number > 0 or None \(off\), got 0.0$"),
    # ... a task parameter without a default names its binding ...
    ("train.task = @task.file", r"^task.file.path is required \(train.task = @task.file\): bind it"),
    # ... and the reward-fault policy lists its choices
    (
        "train.reward_errors = 'ignore'",
        r"^train.reward_errors must be one of \('raise', 'zero', 'skip_group'\), got 'ignore'$",
    ),
    # train.compile: a bool, and not with ZeRO-3 or LoRA
    ("train.compile = 1", r"^train.compile must be True or False, got 1$"),
    (
        "train.compile = True\ntrain.zero_stage = 3",
        r"^train.compile = True needs train.zero_stage 0, 1 or 2 and",
    ),
    ("train.compile = True\ntrain.lora_r = 4", r"got zero_stage 0 and lora_r 4: compiling ZeRO-3's"),
    # train.gradient_checkpointing: a bool, and not compiled
    (
        "train.gradient_checkpointing = 'yes'",
        r"^train.gradient_checkpointing must be True or False, got 'yes'$",
    ),
    (
        "train.gradient_checkpointing = True\ntrain.zero_stage = 3",
        r"^train.gradient_checkpointing = True with train.zero_stage = 3 is not tested",
    ),
    (
        "train.gradient_checkpointing = True\ntrain.compile = True",
        r"^train.compile = True with train.gradient_checkpointing = True is not compiled or tested",
    ),
]


@pytest.mark.parametrize("binding, message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_build_rejects_a_bad_value_in_one_line(binding, message):
    gin.clear_config()
    config.parse_config([GRPO], [binding])
    with pytest.raises(ConfigError, match=message) as err:
        config.build()
    assert "\n" not in str(err.value)


def test_an_ambiguous_name_says_so(tmp_path):
    import gin as gin_

    @gin_.configurable("grpo", module="mine_test_ambiguous")
    def mine(eps=0.1):
        return eps

    gin.clear_config()
    with pytest.raises(ConfigError, match=r"Ambiguous selector 'grpo'.*write the full name"):
        config.parse_config([GRPO], ["grpo.eps = 0.3"])


def test_a_required_binding_left_unset_is_named():
    gin.clear_config()
    config.parse_config([GRPO], [], base=None)  # the spec alone: no train.task, no max_new_tokens
    with pytest.raises(ConfigError, match=r"^train.task is required: bind it"):
        config.build()


def test_build_of_every_spec_gives_the_spec_and_the_train_config():
    gin.clear_config()
    config.parse_config([GRPO], [])
    cfg, algo, _ = config.build()
    assert algo.name == "grpo" and cfg.task_name == "add"
    assert cfg.task_kwargs()["digits"] == 2  # the base config's binding, on top of the default


def test_the_algorithm_is_immutable():
    gin.clear_config()
    config.parse_config([GRPO], [])
    _, algo, _ = config.build()
    with pytest.raises(AttributeError, match="immutable"):
        algo.kl_coef = 1.0
    # the controller returns the next coefficient instead of moving the spec's
    assert algo.next_kl_coef(0.3, measured_kl=0.1, n_steps=1) == 0.3  # grpo: fixed controller
    assert algo.kl_coef == 0.04


def test_prepare_and_loss_use_the_loop_s_kl_coefficient():
    gin.clear_config()
    gin.parse_config(
        "Algorithm.name = 'x'\nAlgorithm.advantage = @advantage.reinforce\nAlgorithm.clip = @clip.none\n"
        "Algorithm.aggregate = @aggregate.token_mean\nAlgorithm.kl = @kl.k1\n"
        "Algorithm.kl_placement = 'reward'\nAlgorithm.kl_coef = 0.1"
    )
    algo = config_parts.algorithm()
    mask = torch.ones(2, 3, dtype=torch.float64)
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    batch = dict(
        mask=mask,
        group_ids=torch.arange(2),
        old_logp=old,
        ref_logp=old - 0.5,
        scores=torch.tensor([1.0, 0.0], dtype=torch.float64),
        truncated=torch.zeros(2, dtype=torch.bool),
    )
    assert algo.kl_coef == 0.1  # the spec's: where the loop state's coefficient starts
    a, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
    b, _ = algo.prepare(batch, kl_coef=0.3)
    # k1 = old - ref = 0.5 per token, 3 tokens: rewards = score - beta * 1.5
    torch.testing.assert_close(
        a["rewards"], torch.tensor([1.0 - 0.15, -0.15], dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        b["rewards"], torch.tensor([1.0 - 0.45, -0.45], dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_step_seeds_differ_by_rank_and_step():
    seeds = {step_seed(0, s, r) for s in range(50) for r in range(4)}
    assert len(seeds) == 200
    # Rank 0 keeps the seeds of the single-process runs recorded before ranks were seeded apart
    # (the formula those runs used), so the committed leaderboards reproduce on one process.
    for seed, step in ((0, 0), (3, 7), (2, 59)):
        assert step_seed(seed, step, 0) == (seed * 1_000_003 + step * 7919 + 17) % (2**31 - 1)


def test_batch_selects_every_field_and_checks_rows():
    b = Batch(
        mask=torch.ones(3, 2),
        group_ids=torch.tensor([0, 0, 1]),
        old_logp=torch.zeros(3, 2),
        scores=torch.tensor([1.0, 2.0, 3.0]),
    )
    s = b.select(torch.tensor([2, 0]))
    assert s["scores"].tolist() == [3.0, 1.0] and s.group_ids.tolist() == [1, 0]
    assert set(s) == {"mask", "group_ids", "old_logp", "scores"}
    with pytest.raises(ShapeError, match="first dimension must be B=3"):
        b.replace(scores=torch.ones(2))
    with pytest.raises(ShapeError, match="unknown batch field"):
        Batch.of(
            {"mask": torch.ones(1, 1), "group_ids": torch.zeros(1), "old_logp": torch.zeros(1, 1), "row": 0}
        )


def test_a_polgrad_error_raised_inside_a_configurable_stays_one_line_without_patching_gin():
    """gin re-raises an exception from inside a configurable as a subclass of its type made on the
    spot, whose message gains "In call to configurable ..." lines. A polgrad error keeps its one line
    (and its message as args and repr); any other exception keeps gin's context; gin is not patched."""
    from gin import utils as gin_utils

    from polgrad.errors import ConfigError

    augment = gin_utils.augment_exception_message_and_reraise

    @gin.configurable("probe_polgrad_error")
    def ours(x=1):
        raise ConfigError("Algorithm.thing must be >= 1, got 0")

    @gin.configurable("probe_other_error")
    def other(x=1):
        raise ValueError("plain")

    with pytest.raises(ConfigError) as info:
        ours()
    assert str(info.value) == "Algorithm.thing must be >= 1, got 0"
    assert info.value.args == ("Algorithm.thing must be >= 1, got 0",)
    assert repr(info.value) == "ConfigError('Algorithm.thing must be >= 1, got 0')"
    with pytest.raises(ValueError) as info:
        other()
    assert "In call to configurable 'probe_other_error'" in str(info.value)
    assert gin_utils.augment_exception_message_and_reraise is augment


@pytest.mark.parametrize("stop, want", [(True, {}), (False, {"target_accuracy": None})])
def test_sft_stop_at_target_reaches_the_warm_start(monkeypatch, stop, want):
    """train.sft_stop_at_target = False runs every SFT step (target_accuracy None); the default passes
    nothing, so the warm start's own default (and every cached key) is unchanged."""
    from polgrad import build, pretrain
    from polgrad.train_config import TrainConfig

    seen = {}
    monkeypatch.setattr(pretrain, "warm_start", lambda *a, **kw: seen.update(kw) or "dir")
    cfg = TrainConfig(task=get("task", "add"), max_new_tokens=4, steps=1, sft_stop_at_target=stop)
    assert build.warm_start(cfg) == "dir"
    assert {k: v for k, v in seen.items() if k == "target_accuracy"} == want
    with pytest.raises(ConfigError, match="train.sft_stop_at_target must be True or False"):
        TrainConfig(task=get("task", "add"), max_new_tokens=4, steps=1, sft_stop_at_target=0)


def test_the_defaults_ship_inside_the_package_and_read_the_same_from_any_directory(tmp_path, monkeypatch):
    """The base config every run starts from is package data: an absolute path inside polgrad/, named
    by pyproject.toml's package-data (so a wheel carries it), parsed the same from any working
    directory. experiments/base_tiny.gin, which the experiments include, holds no binding of its own."""
    import fnmatch
    from pathlib import Path

    import polgrad

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (CI's); pyproject allows 3.10
    pkg = Path(polgrad.__file__).resolve().parent
    base = Path(config.DEFAULT_BASE)
    assert base.is_absolute() and base.is_file() and base.is_relative_to(pkg)
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        globs = tomllib.load(fh)["tool"]["setuptools"]["package-data"]["polgrad"]
    assert any(fnmatch.fnmatch(str(base.relative_to(pkg)), g) for g in globs)
    lab = Path(REPO, "experiments", "base_tiny.gin").read_text().splitlines()
    statements = [ln for ln in lab if ln.strip() and not ln.lstrip().startswith("#")]
    assert statements == ["include 'polgrad/defaults/base_tiny.gin'"]  # the defaults once
    monkeypatch.chdir(tmp_path)  # no checkout here: the defaults come from the package
    for files, base in (
        ([GRPO], config.DEFAULT_BASE),
        ([os.path.join(REPO, "experiments", "base_tiny.gin"), GRPO], None),
    ):
        gin.clear_config()
        config.parse_config(files, [], base=base)
        cfg, _, _ = config.build()
        assert (cfg.task_name, cfg.max_new_tokens, cfg.steps, cfg.micro_batch_size) == ("add", 8, 60, 64)
    gin.clear_config()
