"""A user's own part: one module + one gin line (what CONTRIBUTING.md shows), end to end."""

from __future__ import annotations

import sys
import textwrap

import gin
import pytest
import torch

from polgrad import config_parts, registry
from polgrad.errors import RegistryError

USER_MODULE = textwrap.dedent('''
    import torch
    from polgrad.checks import check_b, check_bt
    from polgrad.registry import register


    @register("advantage", "median_baseline", level="sequence", needs_groups=True,
              formula="A_i = r_i - median_G(r)")
    def median_baseline(rewards, mask, *, group_ids=None, values=None, token_rewards=None,
                        baseline_rewards=None):
        """A_i = r_i - median of its group's rewards, broadcast over the response. [B] -> [B,T]."""
        b, _ = check_bt("advantage.median_baseline", mask)
        check_b("advantage.median_baseline", b, rewards=rewards, group_ids=group_ids)
        med = torch.stack([rewards[group_ids == g].median() for g in group_ids])
        return (rewards - med)[:, None] * mask, None
''')

GIN = """
import polgrad_user_estimators
Algorithm.name = 'median_pg'
Algorithm.advantage = @advantage.median_baseline
Algorithm.clip = @clip.none
Algorithm.aggregate = @aggregate.token_mean
Algorithm.group_size = 3
"""


def test_user_module_registers_an_estimator_used_from_gin(tmp_path, monkeypatch):
    (tmp_path / "polgrad_user_estimators.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "median_pg.gin"
    cfg.write_text(GIN)
    gin.parse_config_file(str(cfg))
    algo = config_parts.algorithm()
    assert algo.parts["Algorithm.advantage"].full_name == "advantage.median_baseline"
    assert algo.table_row()["core_loss"].endswith("A_i = r_i - median_G(r)")
    mask = torch.ones(6, 2, dtype=torch.float64)
    batch = {
        "scores": torch.tensor([0.0, 1, 5, 2, 2, 9], dtype=torch.float64),
        "mask": mask,
        "truncated": torch.zeros(6, dtype=torch.bool),
        "group_ids": torch.tensor([0, 0, 0, 1, 1, 1]),
        "old_logp": torch.zeros(6, 2, dtype=torch.float64),
    }
    out, _ = algo.prepare(batch, kl_coef=algo.kl_coef)
    # medians: group 0 -> 1, group 1 -> 2 ; A = r - median on every token
    torch.testing.assert_close(out["adv"][:, 0], torch.tensor([-1.0, 0, 4, 0, 0, 7], dtype=torch.float64))
    # importing it again (another gin file) must not re-register; a different module reusing the name fails
    with pytest.raises(RegistryError, match="already registered"):
        registry.register("advantage", "median_baseline")(lambda rewards, mask, **_: None)
    sys.modules.pop("polgrad_user_estimators", None)
