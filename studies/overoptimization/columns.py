"""Which swept columns of an over-optimisation experiment are its KL control and which its reward-model
configuration (studies/overoptimization/analysis.py and gao_md.py)."""

from __future__ import annotations

from typing import Any

KL_COLUMNS = ("Algorithm.kl_coef", "Algorithm.kl_controller")  # the KL control: varies within a family
ENSEMBLE = "train.rm_ensemble"


def rm_columns(exp: Any) -> list[str]:
    """The swept columns that are neither the KL control nor the seed: what makes a reward-model
    configuration (e.g. train.rm_ensemble, train.rm_combine); with the spec, a family."""
    return [c for c in exp.swept_columns if c not in KL_COLUMNS]


def short(value: str) -> str:
    return value.replace("@kl_controller.", "").replace("@reward_ensemble.", "")
