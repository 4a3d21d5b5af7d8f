"""Built-in value_init parts: where the critic (value network) starts.

Call signature: `polgrad.registry.kinds.ValueInitFn`; each returns a ScalarHeadModel, a trainable
module `(input_ids [B,S], attention_mask [B,S]) -> values [B,S]` (train mode, requires_grad on). The
loop reads V(s_t) at the positions that predict each response token
(`polgrad.rollout.hf.response_values`). Extra keyword-only hyperparameters are gin-bound
(`value_init.policy.head_init_std = 0.02`).

Source: RLHF book, policy-gradient chapter, "value network initialisation": the learned value network
of PPO-style algorithms can start from a different model of the same architecture or from random
weights, and the choice can matter a lot. The standard set by InstructGPT (Ouyang et al. 2022), and
reused for RLVR by Tülu 3 (Lambert et al. 2024), initialises it from the reward model used for RLHF;
others take the checkpoint RL starts from (usually the SFT model) with a randomly initialised value
head; re-initialising the whole model is rarer (RL takes longer to converge) but works.

polgrad.models sits below the components and imports transformers only inside its functions, so
importing polgrad.components stays light.
"""

from __future__ import annotations

from polgrad.errors import ConfigError
from polgrad.models.heads import ScalarHeadModel
from polgrad.registry import register


def _trainable(model: ScalarHeadModel) -> ScalarHeadModel:
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@register("value_init", "reward_model", needs_reward_model=True, needs_task="preference_pairs")
def reward_model(*, policy_path: str, reward_model_path: str | None) -> ScalarHeadModel:
    """Critic = a trainable copy of the reward model (backbone and scalar head).

    InstructGPT's choice, reused by Tülu 3: the reward model already maps a sequence to a scalar
    on the reward's scale, so V starts close to the score the episode will get. Needs a reward model
    in the run; without one it raises a one-line ConfigError naming the binding.

    Shapes: the returned module maps (input_ids [B,S], attention_mask [B,S]) -> values [B,S].
    """
    if reward_model_path is None:
        raise ConfigError(
            "Algorithm.value_init = @value_init.reward_model needs a reward model, but this run has none "
            "(its reward is the task's verifier); use @value_init.policy or @value_init.random"
        )
    return _trainable(ScalarHeadModel.from_pretrained(reward_model_path))


@register("value_init", "policy")
def policy(
    *, policy_path: str, reward_model_path: str | None = None, head_init_std: float = 0.0, seed: int = 0
) -> ScalarHeadModel:
    """Critic = the policy checkpoint's backbone (its own copy) + a fresh scalar head.

    The head (Linear(hidden, 1)) starts at zero by default, so V = 0 at every position at step 0
    whatever the backbone's features are and the first advantages are the plain returns; gradients
    still flow (the head's own gradient is non-zero, the backbone's follows from the next step).
    `head_init_std > 0` draws the weight from N(0, head_init_std^2) instead (seeded by `seed`), bias 0.
    `reward_model_path` is ignored.

    Shapes: the returned module maps (input_ids [B,S], attention_mask [B,S]) -> values [B,S].
    """
    _check_std("policy", head_init_std)
    return _trainable(ScalarHeadModel.from_backbone(policy_path, head_init_std=head_init_std, seed=seed))


@register("value_init", "random")
def random(
    *, policy_path: str, reward_model_path: str | None = None, head_init_std: float = 0.0, seed: int = 0
) -> ScalarHeadModel:
    """Critic = the policy's architecture (read from its config) with every weight re-initialised.

    The backbone gets the model's own initialisation (normal, std = config.initializer_range) under
    `torch.manual_seed(seed)`; the head as in `value_init.policy` (zero unless head_init_std > 0).
    No weights are read from `policy_path`, only its config. `reward_model_path` is ignored.

    Shapes: the returned module maps (input_ids [B,S], attention_mask [B,S]) -> values [B,S].
    """
    from transformers import AutoConfig

    _check_std("random", head_init_std)
    config = AutoConfig.from_pretrained(policy_path)
    return _trainable(ScalarHeadModel.from_config(config, seed=seed, head_init_std=head_init_std))


def _check_std(name: str, std: float) -> None:
    if not std >= 0:
        raise ConfigError(f"value_init.{name}.head_init_std = {std} must be >= 0")


@register("value_init", "shared_lora", lora=True)
def shared_lora(
    *,
    policy_path: str,
    reward_model_path: str | None = None,
    policy=None,
    head_init_std: float = 0.0,
    seed: int = 0,
):
    """Critic = the actor itself (backbone + the actor's LoRA adapter) + a fresh value head.

    The actor and the critic differ only by their heads: V(s_t) = w . h_L(s_t) + b on the last hidden
    state of the backbone with the actor's adapter W + (alpha/r) B A (Hu et al. 2021, "LoRA:
    Low-Rank Adaptation of Large Language Models"). Policy and value losses go through one optimizer
    step of the policy's engine, so the value loss's gradient reaches the shared adapter (the head
    at train.critic_lr, the adapter at train.lr). Needs train.lora_r > 0; the head starts as in
    `value_init.policy` (zero unless head_init_std > 0). No second copy of the backbone.

    Shapes: the returned LoraCritic maps (input_ids [B,S], attention_mask [B,S]) -> values [B,S].
    """
    _check_std("shared_lora", head_init_std)
    return _lora_critic("shared_lora", policy, own_adapter=False, head_init_std=head_init_std, seed=seed)


@register("value_init", "lora", lora=True)
def lora(
    *,
    policy_path: str,
    reward_model_path: str | None = None,
    policy=None,
    head_init_std: float = 0.0,
    seed: int = 0,
):
    """Critic = the policy's frozen backbone + its OWN LoRA adapter ('critic') + a fresh value head.

    Same backbone weights as the actor (one copy in memory), a second adapter with the actor's
    rank, alpha and target modules (W + (alpha/r) B_c A_c, Hu et al. 2021) that only the critic's
    forward uses: the value loss's gradient reaches the critic's adapter and head and never the
    actor's adapter. Trained in the policy's engine (one optimizer, the critic's parameters at
    train.critic_lr; gradient clipping is over the joint gradient). Needs train.lora_r > 0.

    Shapes: the returned LoraCritic maps (input_ids [B,S], attention_mask [B,S]) -> values [B,S].
    """
    _check_std("lora", head_init_std)
    return _lora_critic("lora", policy, own_adapter=True, head_init_std=head_init_std, seed=seed)


def _lora_critic(name: str, policy, *, own_adapter: bool, head_init_std: float, seed: int):
    from polgrad.models import lora as lora_lib

    return lora_lib.add_critic(
        policy, own_adapter=own_adapter, head_init_std=head_init_std, seed=seed, part=f"value_init.{name}"
    )
