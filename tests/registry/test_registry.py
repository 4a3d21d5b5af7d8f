"""The registry: one name per part in code, gin and CSVs; one-line errors; the CLI."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import gin
import pytest

import polgrad
from polgrad import registry
from polgrad.errors import RegistryError
from polgrad.registry import contract, kinds

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


def test_lookup_unknown_name_is_one_line_with_valid_names_and_closest_match():
    with pytest.raises(RegistryError) as e:
        registry.lookup("advantage", "rlo")
    msg = str(e.value)
    assert "\n" not in msg
    assert "unknown advantage 'rlo'" in msg
    assert "did you mean 'rloo'?" in msg
    for name in ("gae", "grpo", "dr_grpo", "rloo", "reinforce"):
        assert name in msg


def test_unknown_kind_lists_kinds():
    with pytest.raises(RegistryError, match=r"unknown kind 'advantages'.*did you mean 'advantage'"):
        registry.lookup("advantages", "rloo")


def test_duplicate_registration_raises():
    with pytest.raises(RegistryError, match=r"advantage\.rloo is already registered"):

        @registry.register("advantage", "rloo")
        def again(rewards, mask, **_):  # pragma: no cover - never registered
            return rewards


def test_name_must_be_identifier():
    with pytest.raises(RegistryError, match="not a Python identifier"):
        registry.register("kl", "k-9")


def test_every_kind_has_builtins():
    expected = {
        "advantage": {
            "gae",
            "mc",
            "reinforce",
            "reinforce_pp",
            "reinforce_pp_baseline",
            "grpo",
            "dr_grpo",
            "rloo",
            "remax",
        },
        "kl": {"k1", "k2", "k3", "abs", "full", "k1_st", "k3_st", "abs_st"},
        "clip": {"none", "ppo", "dual_clip", "gspo", "cispo", "tis", "icepop"},
        "aggregate": {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"},
        "value_init": {"reward_model", "policy", "random"},
        "value_loss": {"clipped", "mse"},
        "kl_controller": {"fixed", "adaptive"},
        "reward_shaping": {"clip", "whiten", "eos_only", "overlong"},
        "filter": {"zero_variance_groups"},
    }
    for kind, names in expected.items():
        assert names <= set(registry.names(kind)), (kind, names - set(registry.names(kind)))
    assert len(registry.names("task")) >= 2


def test_every_builtin_part_has_a_docstring_with_a_source():
    for e in registry.entries():
        if not e.fn.__module__.startswith("polgrad."):
            continue  # parts registered by tests
        doc = e.fn.__doc__ or ""
        assert len(doc.strip()) > 40, f"{e.full_name} needs a docstring with formula, source, shapes"


def _test_text() -> str:
    """Every .py file under tests/ (its folders too), one text."""
    return "\n".join(p.read_text() for p in sorted(Path(TESTS).rglob("*.py")))


def test_every_registered_name_is_exercised_by_a_test():
    """Each built-in name appears in some test file as `kind.name`, a registry lookup, or a call.

    A textual check: it cannot prove the test is good, only that no part was forgotten.
    """
    text = _test_text()
    missing = []
    for e in registry.entries():
        if not e.fn.__module__.startswith("polgrad."):
            continue
        patterns = [rf"\b{e.kind}\.{e.name}\b", rf"[\"']{e.name}[\"']", rf"\b{e.name}\("]
        if not any(re.search(p, text) for p in patterns):
            missing.append(e.full_name)
    assert not missing, f"no test mentions: {missing}"


def test_cli_lists_every_kind_and_name():
    out = subprocess.run(
        [sys.executable, "-m", "polgrad.registry"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    for e in registry.entries():
        if e.fn.__module__.startswith("polgrad."):
            assert e.full_name in out
    assert "needs_groups=True" in out  # metadata is shown


def test_cli_table_prints_every_spec():
    out = subprocess.run(
        [sys.executable, "-m", "polgrad.registry", "--table"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| Method")]
    methods = {line.split("|")[1].strip() for line in rows}
    assert methods == {
        "reinforce",
        "rloo",
        "ppo",
        "grpo",
        "dr_grpo",
        "reinforce_pp",
        "reinforce_pp_baseline",
        "remax",
        "dapo",
        "gspo",
        "cispo",
        "dpo",
        "ppo_lora",
    }


def test_package_exports():
    assert polgrad.get("advantage", "rloo") is registry.get("advantage", "rloo")


# ---------------------------------------------------------------------------------------------
# The contract (polgrad.registry.kinds) and the checks register() makes against it
# ---------------------------------------------------------------------------------------------


def _refused(kind: str, name: str, fn, **meta) -> str:
    """register() must refuse `fn` with a one-line message naming the part and this file:line;
    and nothing may be left registered (neither in polgrad's table nor in gin)."""
    with pytest.raises(RegistryError) as e:
        registry.register(kind, name, **meta)(fn)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{kind}.{name} (tests.test_registry:") or msg.startswith(
        f"{kind}.{name} (test_registry:"
    ), msg
    assert name not in registry.names(kind)
    with pytest.raises(ValueError):  # not a gin configurable either
        gin.get_configurable(f"{kind}.{name}")
    return msg


def test_unknown_metadata_key_is_refused_with_did_you_mean():
    def part(rewards, mask, *, group_ids, values, token_rewards, baseline_rewards):
        return rewards

    msg = _refused("advantage", "t_typo_meta", part, level="sequence", needs_group=True)
    assert "unknown metadata key 'needs_group'; did you mean 'needs_groups'?" in msg
    assert "needs_critic" in msg  # lists the kind's keys
    # a key of another kind is unknown here too
    clip = lambda logp, old_logp, adv, mask, *, rollout_logp: 0  # noqa: E731
    msg = _refused("clip", "t_wrong_kind_meta", clip, needs_logits=True)
    assert "unknown metadata key 'needs_logits'" in msg


def test_metadata_values_are_checked():
    def part(rewards, mask, **_):
        return rewards

    assert "level='tokens' must be one of 'token', 'sequence'" in _refused(
        "advantage", "t_bad_level", part, level="tokens"
    )
    msg = _refused("advantage", "t_bad_bool", part, needs_groups="yes")
    assert "needs_groups='yes' must be a bool" in msg


def test_narrower_signature_is_refused():
    def part(logp, old_logp, adv, *, rollout_logp=None):
        return logp, {}

    msg = _refused("clip", "t_narrow", part)
    assert "accepts 3 positional parameters (logp, old_logp, adv) but the loop passes 4" in msg
    assert "(logp, old_logp, adv, mask)" in msg


def test_missing_keyword_is_refused():
    def no_logits(logp, ref_logp, mask):
        return logp

    msg = _refused("kl", "t_no_logits", no_logits)
    assert "the loop passes keyword 'logits' and the part does not accept it" in msg

    def positional_group_ids(rewards, group_ids, mask=None, **_):
        return rewards

    msg = _refused("advantage", "t_pos_kw", positional_group_ids)
    assert "keyword 'group_ids' and the part takes it positionally" in msg


def test_keyword_the_loop_may_omit_needs_a_default():
    def part(logp, ref_logp, mask, *, logits, ref_logits):
        return logp

    assert "the loop may omit keyword 'logits'; give it a default" in _refused("kl", "t_omit", part)


def test_extra_parameter_without_default_that_is_not_keyword_only_is_refused():
    def part(values, old_values, returns, mask, scale):
        return values

    msg = _refused("value_loss", "t_extra", part)
    assert "parameter 'scale' is not passed by the loop and has no default; make it keyword-only" in msg

    def task(n_digits):
        return None

    assert "parameter 'n_digits'" in _refused("task", "t_positional_task", task)

    def critic(policy_path, reward_model_path):  # keyword-passed: fine by name
        return None

    contract.check_signature("value_init", "value_init.t_critic_by_name", "here", critic)

    def critic_missing(*, policy_path):
        return None

    assert "keyword 'reward_model_path'" in _refused("value_init", "t_critic_missing", critic_missing)


def test_accepted_signatures():
    """Hyperparameters: keyword-only (bound by gin, even without a default), defaulted, or
    gin.REQUIRED; the loop's keywords may arrive through **kwargs and positionals through *args."""

    @registry.register("clip", "t_ok_hparams")
    def ok(logp, old_logp, adv, mask, scale=1.0, *, rollout_logp, eps, power=gin.REQUIRED):
        return logp, {}

    @registry.register("kl", "t_ok_var")
    def ok_var(*args, **kwargs):
        return args[0]

    def ok_task(*, path, n=3):  # checked, not registered: tests/tasks/test_tasks.py covers every task
        return None

    contract.check_signature("task", "task.t_ok_task", "here", ok_task)

    assert [p.name for p in contract.hyperparameters("clip", ok)] == ["scale", "eps", "power"]


def test_every_registered_part_passes_the_checks():
    """Built-ins and the parts tests/ registers (sweep_plugin, test_user_module's module text)."""
    sys.path.insert(0, TESTS)
    try:
        import sweep_plugin  # noqa: F401
    finally:
        sys.path.remove(TESTS)
    for e in registry.entries():
        contract.check_meta(e.kind, e.full_name, e.where, e.meta)
        contract.check_signature(e.kind, e.full_name, e.where, inspect.unwrap(e.fn))
    assert registry.lookup("kl", "sweeptest_k1")
    spec = importlib.util.spec_from_file_location(
        "t_user_module_text", Path(TESTS) / "loop" / "test_user_module.py"
    )
    user = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(user)  # its module text (the file is not on sys.path when run alone)
    USER_MODULE = user.USER_MODULE

    ns: dict = {"__name__": "t_user_module"}
    exec(compile(USER_MODULE.replace('"median_baseline"', '"t_user_copy"'), "user_module", "exec"), ns)
    assert registry.lookup("advantage", "t_user_copy")


def test_kinds_signatures_and_keys_are_generated_from_the_protocols():
    assert set(registry.KINDS) == set(kinds.PROTOCOLS) == set(kinds.META_KEYS)
    for kind, proto in kinds.PROTOCOLS.items():
        assert registry.KINDS[kind] == kinds.signature_text(kind)
        assert kinds.returns(kind), kind  # every Protocol says what it returns
        sig = inspect.signature(proto.__call__)
        for p in list(sig.parameters.values())[1:]:
            assert p.name in registry.KINDS[kind] or kind == "task", (kind, p.name)
        for key, spec in kinds.META_KEYS[kind].items():
            assert spec.meaning, (kind, key)
    assert registry.KINDS["kl"] == (
        "(logp[B,T], ref_logp[B,T], mask[B,T], *, logits[B,T,V]|None=None, ref_logits[B,T,V]|None=None)"
        " -> kl[B,T]"
    )
    # written once: no second module restates the Protocols
    import importlib.util

    assert importlib.util.find_spec("polgrad.components.protocols") is None


def test_component_docstrings_point_to_their_protocol_instead_of_restating_it():
    import importlib

    for kind, proto in kinds.PROTOCOLS.items():
        if kind == "task":
            continue
        mod = importlib.import_module(f"polgrad.components.{kind}")
        assert f"polgrad.registry.kinds.{proto.__name__}" in mod.__doc__, kind


def test_registry_package_imports_nothing_above_layer_0():
    import ast

    allowed = ("polgrad.errors", "polgrad.registry")
    for f in ("__init__.py", "kinds.py"):
        tree = ast.parse(open(os.path.join(REPO, "polgrad", "registry", f)).read())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            for m in mods:
                if m == "polgrad" or m.startswith("polgrad."):
                    assert m.startswith(allowed), (f, m)


def test_cli_prints_module_line_and_the_declared_keys():
    out = subprocess.run(
        [sys.executable, "-m", "polgrad.registry"], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    for e in registry.entries():
        if not e.fn.__module__.startswith("polgrad."):
            continue
        line = next(x for x in out.splitlines() if x.split()[:1] == [e.full_name])
        assert e.where in line, (e.full_name, line)
        module, lineno = e.where.split(":")
        src = open(os.path.join(REPO, *module.split(".")) + ".py").read().splitlines()
        assert src[int(lineno) - 1].startswith(("@register", "def ")), e.where
    for key in ("level", "ratio", "unbiased", "denominator"):  # the descriptive keys are shown
        assert f"    meta {key}: descriptive:" in out
        assert f"{key}=" in out


def test_public_checks_module_docstring_example_runs():
    import textwrap

    import torch

    import polgrad.checks

    assert set(polgrad.checks.__all__) == {"check_b", "check_bt", "is_int", "is_real", "require", "zero_pad"}
    src = polgrad.checks.__doc__.split("later:\n")[1].split("`check_bt(")[0]
    ns: dict = {"__name__": "t_user_module"}
    exec(textwrap.dedent(src).replace('"median_baseline"', '"t_doc_median"'), ns)
    adv, returns = ns["median_baseline"](
        torch.tensor([0.0, 1, 5, 2, 2, 9]),
        torch.ones(6, 2),
        group_ids=torch.tensor([0, 0, 0, 1, 1, 1]),
        values=None,
        token_rewards=None,
        baseline_rewards=None,
    )
    assert adv[:, 0].tolist() == [-1.0, 0, 4, 0, 0, 7] and returns is None


def test_a_reward_part_with_a_hyperparameter_is_refused():
    """A task calls its reward by name while it scores, so no gin binding would reach a reward's
    hyperparameter: registering one is refused in one line instead of silently ignoring its binding."""
    with pytest.raises(RegistryError, match=r"a reward part takes no hyperparameters \('tolerance'\)"):

        @registry.register("reward", "test_close_enough")
        def close_enough(answer, response, *, tolerance=0.1):
            return float(abs(float(answer) - float(response)) <= tolerance)

    assert "test_close_enough" not in registry.names("reward")
