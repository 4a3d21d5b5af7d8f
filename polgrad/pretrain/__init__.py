"""Training the models RL starts from: the SFT warm start and the Bradley-Terry reward model.

    warm_start(...)          SFT on task.demonstrations -> cached HF checkpoint dir (policy and reference)
    train_reward_model(...)  Bradley-Terry on task.preference_pairs -> (cached ScalarHeadModel dir, accuracy)

Both sample with polgrad.rollout.hf and build tasks from the registry, so they sit above polgrad.models
(which only builds, saves and loads models) and polgrad.rollout. Cache keys: polgrad.models.cache.
"""

from polgrad.pretrain.reward_model import (
    RM_BATCH_SIZE,
    RM_HELDOUT_PAIRS,
    RM_LR,
    RM_PAIRS,
    RM_STEPS,
    pairwise_accuracy,
    train_reward_model,
)
from polgrad.pretrain.sft import (
    SFT_BATCH_SIZE,
    SFT_EVAL_EXAMPLES,
    SFT_LR,
    SFT_PROBE_EVERY,
    SFT_PROBE_EXAMPLES,
    SFT_STEPS,
    SFT_TARGET_ACCURACY,
    SFT_WARMUP_STEPS,
    accuracy,
    heldout_accuracy,
    make_task,
    warm_start,
)

__all__ = [
    "RM_BATCH_SIZE",
    "RM_HELDOUT_PAIRS",
    "RM_LR",
    "RM_PAIRS",
    "RM_STEPS",
    "SFT_BATCH_SIZE",
    "SFT_EVAL_EXAMPLES",
    "SFT_LR",
    "SFT_PROBE_EVERY",
    "SFT_PROBE_EXAMPLES",
    "SFT_STEPS",
    "SFT_TARGET_ACCURACY",
    "SFT_WARMUP_STEPS",
    "accuracy",
    "heldout_accuracy",
    "make_task",
    "pairwise_accuracy",
    "train_reward_model",
    "warm_start",
]
