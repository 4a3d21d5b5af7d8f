"""Built-in reward_ensemble parts: how the scores of K reward models become the one score trained on.

Call signature: `polgrad.registry.kinds.RewardEnsembleFn`. With `train.rm_ensemble = K` (K > 1) a run
trains K Bradley-Terry reward models that differ only in their initialisation seed (the head's random
init and the order of the same training pairs; polgrad.pretrain.reward_model) and scores every sampled
response with each of them, member_scores [K,B]; the part bound to `train.rm_combine` reduces them to
scores [B]. The three rules are those of Coste et al. 2024, "Reward Model Ensembles Help Mitigate
Overoptimization" (ICLR), section 3: mean, worst-case (WCO) and uncertainty-weighted (UWO).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from polgrad.checks import is_real
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import register


def _enter(where: str, member_scores: Tensor) -> None:
    if not isinstance(member_scores, Tensor) or member_scores.dim() != 2:
        got = (
            tuple(member_scores.shape) if isinstance(member_scores, Tensor) else type(member_scores).__name__
        )
        raise ShapeError(f"{where}: member_scores must be [K,B] (K reward models x B sequences), got {got}")
    k, b = member_scores.shape
    if k < 1 or b < 1:
        raise ShapeError(
            f"{where}: member_scores needs K >= 1 reward models and B >= 1 sequences, got [{k},{b}]"
        )
    if not member_scores.is_floating_point():
        raise ShapeError(f"{where}: member_scores must be a float tensor, got {member_scores.dtype}")


@register("reward_ensemble", "mean", formula="mean_k r_k")
def mean(member_scores: Tensor) -> Tensor:
    """The ensemble mean of the members' scores.

        r(x, y) = (1/K) sum_k r_k(x, y)

    Source: Coste et al. 2024 ("Reward Model Ensembles Help Mitigate Overoptimization"), section 3,
    "mean optimization". With K = 1 it is the single reward model's score, exactly.

    Shapes: member_scores [K,B] float -> scores [B].
    """
    _enter("reward_ensemble.mean", member_scores)
    return member_scores.mean(0)


@register("reward_ensemble", "worst", formula="min_k r_k")
def worst(member_scores: Tensor) -> Tensor:
    """Worst-case optimisation (WCO): the lowest score any member gives.

        r(x, y) = min_k r_k(x, y)

    Source: Coste et al. 2024, section 3, "worst-case optimization": a response scores well only if
    every member agrees, so the policy cannot exploit one member's error.

    Shapes: member_scores [K,B] float -> scores [B].
    """
    _enter("reward_ensemble.worst", member_scores)
    return member_scores.min(0).values


@register("reward_ensemble", "uncertainty", formula="mean_k r_k - lam * var_k r_k")
def uncertainty(member_scores: Tensor, *, lam: float = 0.5) -> Tensor:
    """Uncertainty-weighted optimisation (UWO): the mean penalised by the members' disagreement.

        r(x, y) = (1/K) sum_k r_k  -  lam * (1/K) sum_k (r_k - (1/K) sum_j r_j)^2

    The variance is the population (1/K) variance over the K members, as in Coste et al. 2024,
    section 3, "uncertainty-weighted optimization" (their lambda is a per-task hyperparameter; 0.5
    here is a default to be tuned, not theirs). lam = 0 is `mean`.

    Shapes: member_scores [K,B] float -> scores [B].
    """
    if not is_real(lam, abc=True) or not 0 <= lam < math.inf:
        raise ConfigError(f"reward_ensemble.uncertainty.lam must be a finite number >= 0, got {lam!r}")
    _enter("reward_ensemble.uncertainty", member_scores)
    mu = member_scores.mean(0)
    var = torch.square(member_scores - mu).mean(0)
    return mu - float(lam) * var
