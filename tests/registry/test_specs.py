"""Every spec in registry/ parses on its own (gin cleared between files) and builds an Algorithm."""

from __future__ import annotations

import glob
import os

import gin
import pytest

from polgrad.config import comparison_table, load_spec, table_row_from_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = sorted(glob.glob(os.path.join(REPO, "registry", "*.gin")))
BASE = os.path.join(REPO, "experiments", "base_tiny.gin")


def test_the_registry_holds_these_specs():
    names = {os.path.splitext(os.path.basename(p))[0] for p in SPECS}
    assert names == {
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


@pytest.mark.parametrize("path", SPECS, ids=lambda p: os.path.basename(p))
def test_spec_parses_and_builds(path):
    gin.clear_config()
    algo = load_spec(path)
    assert algo.name == os.path.splitext(os.path.basename(path))[0]
    header = open(path).read().splitlines()
    assert header[0].startswith("#"), "a spec starts with a header comment"
    assert "Source:" in "\n".join(header[:12]), "the header cites its source"
    assert algo.source


@pytest.mark.parametrize("path", SPECS, ids=lambda p: os.path.basename(p))
def test_spec_with_base_config(path):
    """With the base config first (as every run parses it) the spec still builds, and specs leave
    the generation budget to the base config."""
    import polgrad.trainer  # noqa: F401  (registers train.*)

    gin.clear_config()
    gin.parse_config_files_and_bindings([BASE, path], [])
    assert load_spec(path, base=BASE).name == os.path.splitext(os.path.basename(path))[0]
    assert "MAX_NEW_TOKENS" not in open(path).read().split("\n# ")[-1]


def test_table_rows_follow_the_parts():
    rows = {os.path.splitext(os.path.basename(p))[0]: table_row_from_file(p) for p in SPECS}
    # The chapter's Table 5: PPO needs a value function and a reference; GRPO a reference only;
    # REINFORCE and RLOO neither.
    assert rows["ppo"]["value_function"] == "Yes" and rows["ppo"]["reference_policy"] == "Yes"
    assert rows["grpo"]["value_function"] == "No" and rows["grpo"]["reference_policy"] == "Yes"
    for name in ("reinforce", "rloo"):
        assert rows[name]["value_function"] == "No" and rows[name]["reference_policy"] == "No"
    # DPO learns from fixed preference pairs: the chapter's one Off-policy row
    assert all(r["type"] == "On-policy" for n, r in rows.items() if n != "dpo")
    assert rows["dpo"]["type"] == "Off-policy"
    assert "in loss" in rows["grpo"]["core_loss"] and "in reward" in rows["ppo"]["core_loss"]


def test_comparison_table_markdown():
    md = comparison_table(os.path.join(REPO, "registry"))
    lines = md.splitlines()
    assert lines[0].startswith(
        "| Method | Type | Reward model | Value function | Reference policy | Core loss |"
    )
    assert len(lines) == 2 + len(SPECS)


def test_table_row_follows_a_cells_bindings():
    """A sweep cell that swaps parts shows the core loss it trained with, not the spec's default."""
    grpo = os.path.join(REPO, "registry", "grpo.gin")
    row = table_row_from_file(grpo, ["Algorithm.kl = @kl.k2", "Algorithm.kl_placement = 'reward'"])
    assert "r − β·KL in reward (k2 = x^2/2, β=0.04)" in row["core_loss"]
    assert "k3" not in row["core_loss"]
