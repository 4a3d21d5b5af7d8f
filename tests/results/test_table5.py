"""The chapter's Table 5, cell for cell: `python -m polgrad.registry --table` and each spec's row.

The expected cells below are typed from the chapter's Table 5 ("comparing policy-gradient
algorithms and related ones"), not taken from polgrad: type, reward model, value function and
reference policy (needed by the optimisation itself) of its five rows.
"""

from __future__ import annotations

import os

import gin
import pytest

from polgrad import config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAPTER = {  # method: (type, reward model, value function, reference policy)
    "reinforce": ("On-policy", "Yes", "No", "No"),
    "rloo": ("On-policy", "Yes", "No", "No"),
    "ppo": ("On-policy", "Yes", "Yes", "Yes"),
    "grpo": ("On-policy", "Yes", "No", "Yes"),
    "dpo": ("Off-policy", "No", "No", "Yes"),
}
CATEGORICAL = ("type", "reward_model", "value_function", "reference_policy")


def _spec(name: str) -> str:
    return os.path.join(REPO, "registry", f"{name}.gin")


@pytest.mark.parametrize("name", list(CHAPTER))
def test_the_chapter_rows_match_its_categorical_cells(name):
    row = config.table_row_from_file(_spec(name))
    assert tuple(row[c] for c in CATEGORICAL) == CHAPTER[name]


def test_the_table_prints_the_chapter_rows_first_each_with_its_deviation():
    lines = config.comparison_table().splitlines()
    body = [line.split(" | ") for line in lines[2:]]
    assert [cells[0].strip("| ") for cells in body[:5]] == list(CHAPTER)
    for cells in body[:5]:
        chapter = cells[-1].strip(" |")
        assert " — deviation: " in chapter or " — as the chapter" in chapter, chapter
    assert all(cells[-1].strip(" |") == "not in the chapter's table" for cells in body[5:])
    assert len(body) == len([f for f in os.listdir(os.path.join(REPO, "registry")) if f.endswith(".gin")])


def test_reference_policy_means_used_by_the_optimisation():
    """With beta = 0 and a constant controller the KL term never enters the loss: no reference,
    and the core loss does not show a KL term (it did before: '+ β·KL … β=0')."""
    row = config.table_row_from_file(_spec("grpo"), ["Algorithm.kl_coef = 0.0"])
    assert row["reference_policy"] == "No" and "KL" not in row["core_loss"]
    with_kl = config.table_row_from_file(_spec("grpo"))
    assert with_kl["reference_policy"] == "Yes" and "+ β·KL in loss" in with_kl["core_loss"]
    gin.clear_config()


@pytest.mark.parametrize(("part", "method"), [("dpo", "dpo"), ("ipo", "ipo"), ("cdpo", "cdpo")])
def test_a_preference_runs_method_follows_its_preference_part(part, method):
    """registry/dpo.gin (Algorithm.name = 'dpo') with IPO's or cDPO's loss is that method in Table 5
    (and so in the CSV's table5_method and the md); it used to say 'dpo' for all three."""
    row = config.table_row_from_file(_spec("dpo"), [f"Algorithm.preference = @preference.{part}"])
    assert row["method"] == method and row["type"] == "Off-policy"
    assert config.table_row_from_file(_spec("grpo"))["method"] == "grpo"
