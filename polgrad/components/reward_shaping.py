"""Built-in reward_shaping parts: what happens to the sequence scores before advantages.

Call signature: `polgrad.registry.kinds.RewardShapingFn`. `truncated[i]` is True when response i
ended without EOS inside the token budget. The parts compose: the Algorithm applies a list of them
in order (e.g. eos_only, then clip, then whiten), so each takes and returns the same [B] vector and
ignores the inputs it does not need.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from polgrad import collective
from polgrad.checks import check_b, check_bt, is_int, is_real
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import register


def _enter(where: str, scores: Tensor, mask: Tensor, truncated: Tensor) -> None:
    b, _ = check_bt(where, mask)
    check_b(where, b, scores=scores, truncated=truncated)
    if not scores.is_floating_point():
        raise ShapeError(f"{where}: scores must be a float tensor, got {scores.dtype}")
    if truncated.dtype != torch.bool:
        raise ShapeError(
            f"{where}: truncated must be a bool tensor (True = no EOS in budget), got {truncated.dtype}"
        )


def _real(x) -> bool:
    return is_real(x, abc=True) and not math.isnan(x)


def _positive_int(x) -> bool:
    return is_int(x, abc=True) and x > 0


@register("reward_shaping", "clip", formula="clip(r, low, high)")
def clip(
    scores: Tensor, mask: Tensor, *, truncated: Tensor, low: float = -10.0, high: float = 10.0
) -> Tensor:
    """Clamp each score into [low, high], so that no outlier score dominates the batch.

        r' = min(max(r, low), high)

    Source: OpenRLHF reward clipping (`clip_reward_value`); DeepSpeed-Chat clamps reward scores
    to +-5 (`torch.clamp(reward_score, -clip, clip)`).

    Shapes: scores [B] float, mask [B,T], truncated [B] bool -> scores [B].
    """
    if not _real(low) or not _real(high) or not low < high:
        raise ConfigError(
            f"reward_shaping.clip.low must be < reward_shaping.clip.high, got low={low!r}, high={high!r}"
        )
    _enter("reward_shaping.clip", scores, mask, truncated)
    return scores.clamp(min=float(low), max=float(high))


@register("reward_shaping", "whiten", formula="(r - mean(r)) / (std(r) + eps)")
def whiten(scores: Tensor, mask: Tensor, *, truncated: Tensor, eps: float = 1e-8) -> Tensor:
    """Whiten the scores over the batch: zero mean, unit (population) standard deviation.

        r' = (r - mean_B(r)) / (std_B(r) + eps),  std_B = sqrt(mean_B((r - mean_B r)^2))

    The population std (divide by B, not B-1) is used so that one-sequence batches are defined
    (they map to 0) and the output has exactly unit population variance up to eps. The statistics
    are those of the whole rollout batch: the [B] vector handed in, and at world size > 1 every
    rank's (sums reduced by polgrad.collective, so each rank's rows are whitened as rows of the
    concatenated batch). Call it on a rollout batch, not per micro-batch.

    Source: RLHF book, policy-gradient chapter (implementation details, "reward whitening");
    OpenRLHF's and DeepSpeed-Chat's RLHF-PPO pipelines (zero mean and unit variance).

    Shapes: scores [B] float, mask [B,T], truncated [B] bool -> scores [B].
    """
    if not _real(eps) or not 0 < eps < math.inf:
        raise ConfigError(f"reward_shaping.whiten.eps must be > 0 and finite, got {eps!r}")
    _enter("reward_shaping.whiten", scores, mask, truncated)
    _, centred, var = collective.moments(scores)
    return centred / (var.sqrt() + eps)


@register("reward_shaping", "eos_only", formula="r if EOS else penalty")
def eos_only(scores: Tensor, mask: Tensor, *, truncated: Tensor, penalty: float = -1.0) -> Tensor:
    """Score only responses that ended with EOS; a truncated response gets `penalty` instead.

        r'_i = penalty  if truncated_i  else r_i

    A reward model scores a truncated response off its training distribution, so its score is
    replaced by a fixed penalty that teaches the policy to finish inside the budget.

    Source: RLHF book, policy-gradient chapter (implementation details: run the reward model only
    on `eos_token`, otherwise penalise the overlong generation); the reward model scores at the
    EOS token as in OpenRLHF's and DeepSpeed-Chat's reward models.

    Shapes: scores [B] float, mask [B,T], truncated [B] bool -> scores [B].
    """
    if not _real(penalty) or math.isinf(penalty):
        raise ConfigError(f"reward_shaping.eos_only.penalty must be a finite number, got {penalty!r}")
    _enter("reward_shaping.eos_only", scores, mask, truncated)
    return torch.where(truncated, torch.full_like(scores, float(penalty)), scores)


@register("reward_shaping", "overlong", formula="r + clip(((L_max - L_cache) - |y|) / L_cache, -1, 0)")
def overlong(scores: Tensor, mask: Tensor, *, truncated: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO soft overlong punishment, added to the score; |y| = mask.sum(-1), the response length.

        R_len(y) = 0                                  if |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                 = -1                                 if L_max < |y|
        r' = r + R_len(y)          (L_max = max_len, L_cache = cache_len)

    Equivalently R_len = clip(((L_max - L_cache) - |y|) / L_cache, -1, 0): the penalty ramps
    linearly from 0 to -1 across the last `cache_len` tokens of the budget. Both lengths are
    required (no default): they must match the generation budget of the run; DAPO uses
    L_max = 20480 and L_cache = 4096.

    Source: Yu et al. 2025 (DAPO), eq. 13, "overlong reward shaping".

    Shapes: scores [B] float, mask [B,T], truncated [B] bool -> scores [B].
    """
    if not _positive_int(max_len):
        raise ConfigError(f"reward_shaping.overlong.max_len must be an int > 0, got {max_len!r}")
    if not _positive_int(cache_len) or cache_len > max_len:
        raise ConfigError(
            f"reward_shaping.overlong.cache_len must be an int in [1, max_len={max_len}], got {cache_len!r}"
        )
    _enter("reward_shaping.overlong", scores, mask, truncated)
    length = (mask != 0).sum(-1).to(scores.dtype)
    penalty = (((max_len - cache_len) - length) / cache_len).clamp(min=-1.0, max=0.0)
    return scores + penalty
