"""The registry: one name per part in code, gin and CSVs; one-line errors; the CLI."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import gin
import pytest

import polgrad
from polgrad import registry
from polgrad.errors import RegistryError

TESTS = os.path.dirname(os.path.abspath(__file__))
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


def test_registered_part_is_a_gin_configurable_under_kind_dot_name():
    @registry.register("kl_controller", "test_halve", formula="beta/2")
    def halve(coef, measured_kl, n_steps, *, factor=0.5):
        """Multiply the coefficient by `factor`."""
        return coef * factor

    assert registry.get("kl_controller", "test_halve") is halve
    assert registry.entry_of(halve).full_name == "kl_controller.test_halve"
    assert registry.lookup("kl_controller", "test_halve").summary == "Multiply the coefficient by `factor`."
    gin.parse_config("kl_controller.test_halve.factor = 0.25")
    assert halve(1.0, 0.0, 1) == 0.25  # the gin binding applies through the registry's callable


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
        "clip": {"none", "ppo", "dual_clip", "gspo", "cispo", "tis"},
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
    return "\n".join(open(os.path.join(TESTS, f)).read() for f in os.listdir(TESTS) if f.endswith(".py"))


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


def test_cli_table_prints_the_eleven_specs():
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
    }


def test_package_exports():
    assert polgrad.get("advantage", "rloo") is registry.get("advantage", "rloo")
