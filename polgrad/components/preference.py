"""Built-in preference parts: the per-pair loss of offline preference optimisation (DPO and kin).

Call signature: `polgrad.registry.kinds.PreferenceFn`. Each part takes the two log-ratios of a
pair, summed over the response's tokens,

    chosen_logratio   [P] = log pi_theta(y_w|x) - log pi_ref(y_w|x)
    rejected_logratio [P] = log pi_theta(y_l|x) - log pi_ref(y_l|x)

and returns (loss [P], chosen_reward [P], rejected_reward [P]): each pair's loss (the loop
averages it over the step's pairs) and the implicit rewards beta * logratio, detached (logged as
reward accuracy and margin). Every part is a function of the margin m = chosen_logratio -
rejected_logratio alone; the rewards are those of DPO for every part (as TRL logs them).

Hyperparameters are keyword-only and bound by gin (`preference.dpo.beta = 0.1`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from polgrad.checks import is_real
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import register


def _pairs(where: str, chosen_logratio: Tensor, rejected_logratio: Tensor) -> Tensor:
    """Check both log-ratios are 1-D float tensors of one length P >= 1, all finite; return the margin."""
    for name, x in (("chosen_logratio", chosen_logratio), ("rejected_logratio", rejected_logratio)):
        if not isinstance(x, Tensor) or x.dim() != 1 or not x.is_floating_point():
            desc = f"shape {list(x.shape)} ({x.dtype})" if isinstance(x, Tensor) else type(x).__name__
            raise ShapeError(f"{where}: {name} must be a 1-D float tensor [P], got {desc}")
    if chosen_logratio.shape != rejected_logratio.shape or chosen_logratio.numel() == 0:
        raise ShapeError(
            f"{where}: chosen_logratio and rejected_logratio must have the same length P >= 1, got "
            f"{list(chosen_logratio.shape)} and {list(rejected_logratio.shape)}"
        )
    for name, x in (("chosen_logratio", chosen_logratio), ("rejected_logratio", rejected_logratio)):
        if not bool(torch.isfinite(x).all()):
            raise ShapeError(f"{where}: {name} must be finite, got {x.detach().tolist()}")
    return chosen_logratio - rejected_logratio


def _positive(where: str, beta) -> float:
    """beta must be a finite real number > 0."""
    if not is_real(beta, abc=True) or not 0 < beta < math.inf:
        raise ConfigError(f"{where}.beta must be a number > 0 and finite, got {beta!r}")
    return float(beta)


def _rewards(beta: float, chosen_logratio: Tensor, rejected_logratio: Tensor) -> tuple[Tensor, Tensor]:
    """The implicit rewards beta * logratio (DPO eq. 5's r(x, y) up to beta log Z(x)), detached."""
    return beta * chosen_logratio.detach(), beta * rejected_logratio.detach()


@register("preference", "dpo", method="dpo", needs_task="preference_pairs", formula="-log σ(β·m)")
def dpo(
    chosen_logratio: Tensor, rejected_logratio: Tensor, *, beta: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """Direct Preference Optimization: loss = -log sigmoid(beta * m).

        m    = chosen_logratio - rejected_logratio
        loss = -log sigmoid(beta * m)          (computed as -logsigmoid, stable for any m)
        dloss/dm = -beta * sigmoid(-beta * m)

    Source: Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is
    Secretly a Reward Model", eq. 7 (the Bradley-Terry likelihood of the implicit reward
    beta * log pi_theta/pi_ref of eq. 5); beta = 0.1 as in TRL's DPOConfig. TRL 1.16's
    `loss_type="sigmoid"` computes the same per pair (DPOTrainer._compute_loss).

    Shapes: chosen_logratio [P], rejected_logratio [P] -> loss [P], chosen_reward [P],
    rejected_reward [P] (beta * logratio, detached).
    """
    beta = _positive("preference.dpo", beta)
    m = _pairs("preference.dpo", chosen_logratio, rejected_logratio)
    return (-F.logsigmoid(beta * m), *_rewards(beta, chosen_logratio, rejected_logratio))


@register("preference", "ipo", method="ipo", needs_task="preference_pairs", formula="(m - 1/(2β))²")
def ipo(
    chosen_logratio: Tensor, rejected_logratio: Tensor, *, beta: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """Identity Preference Optimization: loss = (m - 1/(2 beta))^2, minimised at m = 1/(2 beta).

        m    = chosen_logratio - rejected_logratio
        loss = (m - 1 / (2 * beta))^2          (dloss/dm = 2 (m - 1/(2 beta)), curvature 2)

    Source: Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences" (arXiv 2310.12036), eq. 17, the empirical IPO loss (h_pi(y_w, y_l) - tau^-1 / 2)^2
    with beta playing tau. A squared loss instead of DPO's logistic one: the margin is regressed
    to a finite target rather than pushed to infinity on deterministic preferences.

    Deviation from TRL 1.16: polgrad applies eq. 17 to the log-ratios as given (summed over the
    response's tokens, per the kind's contract). TRL's `loss_type="ipo"` first divides each side's
    log-ratio by its completion length (`completion_mask.sum(1).clamp(min=1)`; a choice its
    comment says the IPO authors confirmed), so with the same beta the two agree only when the
    log-ratios passed here are TRL's length-averaged ones (tests/components/test_preference.py checks that).

    Shapes: chosen_logratio [P], rejected_logratio [P] -> loss [P], chosen_reward [P],
    rejected_reward [P] (beta * logratio, detached, as TRL logs them for every loss).
    """
    beta = _positive("preference.ipo", beta)
    m = _pairs("preference.ipo", chosen_logratio, rejected_logratio)
    return ((m - 1 / (2 * beta)) ** 2, *_rewards(beta, chosen_logratio, rejected_logratio))


@register(
    "preference",
    "cdpo",
    method="cdpo",
    needs_task="preference_pairs",
    formula="-(1-ε)·log σ(β·m) - ε·log σ(-β·m)",
)
def cdpo(
    chosen_logratio: Tensor, rejected_logratio: Tensor, *, beta: float = 0.1, label_smoothing: float = 0.1
) -> tuple[Tensor, Tensor, Tensor]:
    """Conservative (label-smoothed) DPO: DPO's loss on labels flipped with probability eps.

        m    = chosen_logratio - rejected_logratio,  eps = label_smoothing in [0, 0.5)
        loss = -(1 - eps) * log sigmoid(beta * m) - eps * log sigmoid(-beta * m)
        dloss/dm = beta * (sigmoid(beta * m) - (1 - eps)): zero at beta * m = log((1 - eps) / eps)

    The expected DPO loss when each preference label is wrong with probability eps: the margin
    stops growing at log((1-eps)/eps) / beta instead of diverging. eps = 0 is DPO exactly.

    Source: Mitchell 2023, "A note on DPO with noisy preferences & relationship to IPO"
    (ericmitchell.ai/cdpo.pdf), eq. 3; TRL up to 0.x applied it as `loss_type="sigmoid"` with
    `label_smoothing`; TRL 1.16's sigmoid ignores label_smoothing and computes this expression
    only inside `loss_type="aot"` / `"aot_unpaired"` (after sorting the batch's margins, so per
    pair it is this loss when P = 1). TRL's `"robust"` is a different loss (rDPO, Chowdhury et
    al. 2024: the flipped term enters with a + sign and the sum is divided by 1 - 2 eps).

    Default eps = 0.1: with 0 the part would be `preference.dpo` under another name; 0.1 is the
    flip rate TRL's DPOConfig cites as typical for noisy-label DPO (rDPO's recommendation).
    eps >= 0.5 is refused: at 0.5 the loss no longer prefers the chosen response.

    Shapes: chosen_logratio [P], rejected_logratio [P] -> loss [P], chosen_reward [P],
    rejected_reward [P] (beta * logratio, detached).
    """
    beta = _positive("preference.cdpo", beta)
    eps = label_smoothing
    if not is_real(eps, abc=True) or not 0 <= eps < 0.5:
        raise ConfigError(f"preference.cdpo.label_smoothing must be in [0, 0.5), got {eps!r}")
    m = _pairs("preference.cdpo", chosen_logratio, rejected_logratio)
    loss = -F.logsigmoid(beta * m) * (1 - eps) - F.logsigmoid(-beta * m) * eps
    return (loss, *_rewards(beta, chosen_logratio, rejected_logratio))
