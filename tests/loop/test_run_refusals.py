"""Bad run configurations refused in one line before any work (the trainer, its config and model loading).

Each test builds the bad input and calls the function that refuses it: no model is trained here.
"""

from __future__ import annotations

import json

import gin
import pytest

from polgrad import build, config, models, pretrain
from polgrad.errors import ConfigError, DataError
from polgrad.layout import FullCopies

PPO, GRPO = (str(config.resolve(f"registry/{spec}.gin")) for spec in ("ppo", "grpo"))


# ----------------------------------------------------------------------------- include cycles
def test_a_gin_file_that_includes_itself_is_one_line_naming_it(tmp_path):
    me = tmp_path / "self.gin"
    me.write_text(f"include '{me}'\n")
    with pytest.raises(ConfigError) as err:
        config.parse_config([str(me)], [], base=None)
    assert str(err.value) == (
        f"{me}: include cycle {me} -> {me} (line 1 of {me} includes {me} again); remove that include"
    )


def test_an_include_cycle_through_two_files_names_both(tmp_path):
    a, b = tmp_path / "a.gin", tmp_path / "b.gin"
    a.write_text("train.steps = 3\ninclude 'b.gin'\n")  # found beside the including file
    b.write_text("\n\ninclude 'a.gin'\n")
    with pytest.raises(ConfigError) as err:
        config.parse_config([str(a)], [], base=None)
    assert str(err.value) == (
        f"{a}: include cycle {a} -> {tmp_path / 'b.gin'} -> {tmp_path / 'a.gin'} (line 3 of "
        f"{tmp_path / 'b.gin'} includes {tmp_path / 'a.gin'} again); remove that include"
    )


def test_a_file_included_twice_without_a_cycle_is_no_cycle(tmp_path):
    """a includes b and c, which both include d: d is parsed twice (later bindings win), no cycle."""
    d = tmp_path / "d.gin"
    d.write_text("train.steps = 3\n")
    for name in ("b", "c"):
        (tmp_path / f"{name}.gin").write_text(f"include '{d}'\n")
    a = tmp_path / "a.gin"
    a.write_text(f"include '{tmp_path / 'b.gin'}'\ninclude '{tmp_path / 'c.gin'}'\n")
    config.parse_config([str(a)], [], base=None)
    assert gin.query_parameter("train.steps") == 3


# ----------------------------------------------------------------------------- critic warm-up
@pytest.mark.parametrize("warmup", [3, 4])
def test_a_critic_warm_up_as_long_as_the_run_is_one_line_naming_both_bindings(warmup):
    config.parse_config([PPO], ["train.steps = 3", f"train.critic_warmup_steps = {warmup}"])
    with pytest.raises(ConfigError) as err:
        config.build()
    assert str(err.value) == (
        f"train.critic_warmup_steps = {warmup} is not below train.steps = 3: every step would train the "
        "critic alone and ppo would never update the policy; bind train.critic_warmup_steps below 3, or "
        "raise train.steps"
    )


def test_a_critic_warm_up_shorter_than_the_run_builds():
    config.parse_config([PPO], ["train.steps = 3", "train.critic_warmup_steps = 2"])
    cfg, _, _ = config.build()
    assert (cfg.critic_warmup_steps, cfg.steps) == (2, 3)


# ----------------------------------------------------------------------------- train.eval_size
def test_an_eval_size_above_the_tasks_held_out_prompts_is_refused_before_any_is_drawn(monkeypatch):
    """task.add (digits 2) has 1,008 held-out prompts of its 10,000: counted by hashing, never drawn."""
    from polgrad.tasks import synthetic

    def no_draw(*args, **kwargs):
        raise AssertionError("drew examples before refusing the eval size")

    config.parse_config([GRPO], ["train.eval_size = 100000"])
    monkeypatch.setattr(synthetic._Generated, "_draw", no_draw)
    with pytest.raises(ConfigError) as err:
        config.build()
    assert str(err.value) == (
        "train.eval_size = 100000 is more than the 1,008 distinct held-out prompts task.add can make; bind "
        "train.eval_size to at most 1008, or to None to evaluate on all of them"
    )
    monkeypatch.undo()
    gin.clear_config()
    config.parse_config([GRPO], ["train.eval_size = 1008"])  # every held-out prompt: builds
    assert config.build()[0].eval_size == 1008


def test_a_file_tasks_eval_size_is_checked_against_its_distinct_held_out_prompts(tmp_path):
    from polgrad.tasks.files import file_task

    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = file_task(path=str(path), answer_format="exact", eval_fraction=0.5)
    n = task.eval_split_size()
    assert 0 < n == len(task.eval_examples(None)) < 40
    with pytest.raises(ConfigError) as err:
        task.eval_examples(n + 1)
    assert str(err.value) == (
        f"train.eval_size = {n + 1} is more than the {n} distinct held-out prompts task.file ({path}) can "
        f"make; bind train.eval_size to at most {n}, or to None to evaluate on all of them"
    )


# ----------------------------------------------------------------------------- the tiny default's positions
def _long_prompt_task(tmp_path, chars: int = 5003) -> str:
    """A task file whose longest prompt is `chars` characters (the rest short), as a --bind list."""
    rows = [{"prompt": "1" * chars, "answer": "1"}] + [
        {"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(30)
    ]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["train.task = @task.file", f"task.file.path = '{path}'", "task.file.answer_format = 'exact'"]


def test_the_tiny_defaults_positions_are_capped():
    from polgrad.tasks.synthetic import Add

    class Long:
        alphabet, max_prompt_chars, max_response_chars = "0123456789+=", 5003, 4

    assert models.tiny_positions(Add()) == 128  # 2 + 6 + 3 + 1 = 12 tokens: the floor, as before
    assert models.tiny_positions(Long()) == models.tiny.MAX_POSITIONS == 1024  # was 8,192
    model, _ = models.build_tiny(Long())
    assert model.config.max_position_embeddings == 1024


def test_a_prompt_longer_than_the_tiny_defaults_positions_is_refused_before_the_warm_start(
    tmp_path, monkeypatch, capfd
):
    def no_training(*args, **kwargs):
        raise AssertionError("the warm start trained before the length check")

    monkeypatch.setattr(pretrain, "warm_start", no_training)
    config.parse_config([GRPO], _long_prompt_task(tmp_path))
    cfg, algo, task = config.build()
    with pytest.raises(ConfigError) as err:
        build.build_models(cfg, algo, task, out_dir=str(tmp_path), seed_of=lambda s: s)
    assert str(err.value) == (
        f"task.file: the prompt '{'1' * 60}...' is 5004 tokens, so with train.max_new_tokens = "
        f"{cfg.max_new_tokens} a sequence needs {5004 + cfg.max_new_tokens} positions, but the tiny default "
        "model (train.policy_path = None) has 1024 (max_position_embeddings); shorten the task's prompts (or "
        "drop the longest), or use a model with more positions"
    )
    assert "Token indices" not in capfd.readouterr().err  # no transformers warning before the one line


def test_a_prompt_that_fits_the_capped_positions_goes_on_to_the_warm_start(tmp_path, monkeypatch):
    class Trained(Exception):
        pass

    def warm_start(*args, **kwargs):
        raise Trained

    monkeypatch.setattr(pretrain, "warm_start", warm_start)
    config.parse_config([GRPO], _long_prompt_task(tmp_path, chars=900))  # 901 + max_new_tokens <= 1024
    cfg, algo, task = config.build()
    assert 901 + cfg.max_new_tokens <= 1024
    with pytest.raises(Trained):
        build.build_models(cfg, algo, task, out_dir=str(tmp_path), seed_of=lambda s: s)


# ----------------------------------------------------------------------------- train.chat_template
def test_chat_template_true_with_a_tokenizer_without_one_is_refused_naming_its_path(tmp_path):
    from polgrad.tasks.synthetic import Add

    models.build_tokenizer(Add().alphabet).save_pretrained(tmp_path)  # the tiny default's: no template
    assert models.load_tokenizer(tmp_path).chat_template is None  # None (the default): raw prompts
    assert models.load_tokenizer(tmp_path, chat_template=False).chat_template is None
    with pytest.raises(ConfigError) as err:
        models.load_tokenizer(tmp_path, chat_template=True)
    assert str(err.value) == (
        f"train.chat_template = True but the tokenizer of {tmp_path} has no chat template; bind "
        "train.chat_template = None (a template when the tokenizer has one) or False (raw prompts), or use a "
        "model whose tokenizer has one"
    )
    tok = models.build_tokenizer(Add().alphabet)
    tok.chat_template = "{{ messages[0]['content'] }}="
    tok.save_pretrained(tmp_path)
    assert models.load_tokenizer(tmp_path, chat_template=True).chat_template == tok.chat_template


def test_chat_template_true_with_the_tiny_default_is_refused_at_config_time():
    config.parse_config([GRPO], ["train.chat_template = True"])
    with pytest.raises(ConfigError) as err:
        config.build()
    assert str(err.value) == (
        "train.chat_template = True needs a tokenizer with a chat template, and the tiny default "
        "(train.policy_path = None) has none; bind train.chat_template = None (a template when the tokenizer "
        "has one) or False, or train.policy_path to a model whose tokenizer has one"
    )
    gin.clear_config()
    config.parse_config([GRPO], [])
    assert config.build()[0].chat_template is None  # the default: the template if there is one


# ----------------------------------------------------------------------------- a policy_path's config.json
def _transformers_version() -> str:
    from transformers import __version__

    return __version__


@pytest.mark.parametrize(
    "text, problem",
    [
        ("garbage{", "is not valid JSON (Expecting value at line 1 column 1)"),
        ("[1, 2]", "holds a JSON list, not an object"),
        ('{"hidden_size": 8}', "has no 'model_type', so it is not a model config"),
        (
            '{"model_type": "nosuchmodel"}',
            "names model_type 'nosuchmodel', which transformers {v} does not know (a typo, or a model newer "
            "than this transformers)",
        ),
    ],
    ids=["not-json", "not-an-object", "no-model-type", "unknown-model-type"],
)
def test_a_config_json_that_is_no_models_config_is_one_line_naming_the_file(tmp_path, text, problem):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(DataError) as err:
        models.load_policy(tmp_path)
    problem = problem.format(v=_transformers_version())
    assert str(err.value) == (
        f"policy checkpoint '{tmp_path}': its config.json {problem}; pass a save_pretrained directory of a "
        "transformers model"
    )


def test_a_config_json_whose_values_transformers_refuses_is_one_line_before_the_tokenizer_loads(tmp_path):
    """The tokenizer's loader reads config.json too: the run's policy is checked before either loads."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2", "hidden_size": "abc"}')
    config.parse_config([GRPO], [f"train.policy_path = '{tmp_path}'"])
    cfg, _, task = config.build()
    with pytest.raises(DataError) as err:
        build._policy(cfg, task, str(tmp_path), FullCopies())
    msg = str(err.value)
    assert (
        msg.startswith(f"policy checkpoint '{tmp_path}': its config.json does not load: ") and "\n" not in msg
    )
    assert "hidden_size" in msg


def test_an_empty_held_out_split_is_left_to_the_tasks_own_error_not_called_at_most_0():
    """A task whose held-out split is empty (eval_split_size() == 0, e.g. eval_fraction 0) has its own
    error to give; 'bind train.eval_size to at most 0' would be no fix. A split of 5 still refuses 6."""
    from types import SimpleNamespace

    from polgrad.tasks.base import check_eval_size

    check_eval_size(SimpleNamespace(name="t", eval_split_size=lambda: 0), 16)  # no refusal here
    with pytest.raises(ConfigError, match="at most 5"):
        check_eval_size(SimpleNamespace(name="t", eval_split_size=lambda: 5), 6)
