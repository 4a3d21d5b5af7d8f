"""Built-in value_loss parts: the critic's per-token regression loss toward the returns.

Call signature: `polgrad.registry.kinds.ValueLossFn`; the loss is zero where mask is 0. An
aggregate part turns it into the scalar, with the step's denominators, exactly like the policy loss.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from polgrad.checks import check_bt, is_real, zero_pad
from polgrad.errors import ConfigError
from polgrad.registry import register


def _masked(mask: Tensor, *xs: Tensor) -> tuple[Tensor, ...]:
    """Each x where mask is set, exactly 0 elsewhere. Zeroing the INPUTS (not only the loss) keeps
    a non-finite value in padding from turning the loss or its gradient into NaN (0 * inf)."""
    keep = mask != 0
    return tuple(zero_pad(keep, x) for x in xs)


@register("value_loss", "clipped", formula="0.5*max((V-R)^2, (clip(V, V_old-eps, V_old+eps)-R)^2)")
def clipped(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip_eps: float = 0.2
) -> Tensor:
    """PPO value clipping: the critic may not profit from moving more than eps from V_old.

        V_clip = clip(V, V_old - eps, V_old + eps)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)          (eps = clip_eps)

    Taking the max (pessimistic) means that outside the band, when the clipped error is the
    larger one, the gradient is zero, as for the policy's clipped surrogate.

    Source: RLHF book, policy-gradient chapter, the PPO value-loss snippet (`epsilon_v`);
    OpenRLHF ValueLoss (`value_clip`, default 0.2); verl's clipped value loss (`cliprange_value`).

    Shapes: values, old_values, returns, mask [B,T] -> loss [B,T], zero where mask is 0.
    """
    if not is_real(clip_eps, abc=True) or math.isnan(clip_eps) or clip_eps <= 0:
        raise ConfigError(f"value_loss.clipped.clip_eps must be > 0, got {clip_eps!r}")
    check_bt("value_loss.clipped", mask, values=values, old_values=old_values, returns=returns)
    values, old_values, returns = _masked(mask, values, old_values, returns)  # masked tokens: loss 0
    v_clip = torch.clamp(values, old_values - clip_eps, old_values + clip_eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)


@register("value_loss", "mse", formula="0.5*(V-R)^2")
def mse(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Unclipped squared error (old_values is accepted for the common signature and ignored).

        loss = 0.5 * (V - R)^2

    Source: RLHF book, policy-gradient chapter (the PPO/GRPO loss snippet, `vf_loss`).

    Shapes: values, old_values, returns, mask [B,T] -> loss [B,T], zero where mask is 0.
    """
    check_bt("value_loss.mse", mask, values=values, old_values=old_values, returns=returns)
    values, returns = _masked(mask, values, returns)  # masked tokens: loss 0
    return 0.5 * (values - returns) ** 2
