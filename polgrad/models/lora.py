"""LoRA through peft: one frozen backbone carries the actor, the reference, and the critic.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3) freezes each
adapted weight W [d_out, d_in] and learns a low-rank update beside it:

    h = W x + (alpha / r) B A x,     A [r, d_in] ~ Kaiming-uniform (peft's default), B [d_out, r] = 0

so at step 0 the adapted model is the backbone exactly (B = 0), and only A and B (2 r (d_in + d_out)
numbers per adapted matrix) are trained. `train.lora_r`, `train.lora_alpha`,
`train.lora_target_modules` and `train.lora_dropout` choose r, alpha, the adapted Linear layers and
the adapter's dropout (polgrad.train_config).

One run holds ONE copy of the backbone's weights:

    actor       the backbone + adapter 'policy' (+ the backbone's own, frozen, LM head): `add_policy_adapter`
    reference   the same module with every adapter disabled (peft's `disable_adapter()`):
                `AdapterDisabled`; its forward is the backbone's, bit for bit
    critic      `LoraCritic`: the backbone with the actor's adapter ('shared', the actor and the critic
                differ only by their heads) or with its own adapter 'critic' on the same backbone,
                + a value head Linear(hidden, 1) registered on the policy module (so the policy's
                DeepSpeed engine trains it)
    reward      `add_reward_model`: the backbone + the frozen adapter 'reward' and regression head of a
                reward model trained as LoRA (polgrad.pretrain.train_reward_model(form=LoraRewardModel(...)))

`merged_causal_lm` folds an adapter into the weights (peft `merge_and_unload` on a copy built from
a state dict), the form `final/` is written in.

peft toggles `requires_grad` when it switches or disables adapters (a disabled or inactive adapter is
frozen); the engines decide once, at their creation, what they train, so every switch here restores
the flags it found (`_same_requires_grad`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from polgrad.checks import is_int, is_real
from polgrad.errors import ConfigError
from polgrad.models.tokenizer import position_ids_from_mask

POLICY_ADAPTER = "policy"
CRITIC_ADAPTER = "critic"
REWARD_ADAPTER = "reward"
VALUE_HEAD = "value_head"  # the critic's head, a submodule of the peft policy module
REWARD_HEAD = "reward_head"  # the LoRA reward model's head, frozen, on the peft policy module
REWARD_FILE = "reward_adapter.safetensors"  # a LoRA reward model's adapter (decoder-relative names)
LORA_FILE = "lora.json"  # RUN_DIR/model/lora.json: the adapters' peft configs, for polgrad.export


# --------------------------------------------------------------------------- the settings
@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """The policy's LoRA adapter, one object for every role built on the LoRA backbone: the actor's
    adapter, a LoRA reward model's, and the critic a `lora` value_init part puts on it.
    `TrainConfig.lora` makes it from train.lora_* (`spec`); None is LoRA off."""

    r: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float

    def settings(self) -> dict[str, Any]:
        """The keywords of `lora_config` (also the reward model's cache key)."""
        return dict(
            r=self.r, alpha=self.alpha, target_modules=list(self.target_modules), dropout=self.dropout
        )


def spec(cfg: Any) -> LoraSpec | None:
    """train.lora_* of the TrainConfig `cfg` as a LoraSpec, or None when LoRA is off (lora_r = 0)."""
    if not cfg.lora_r:
        return None
    return LoraSpec(cfg.lora_r, cfg.lora_alpha, tuple(cfg.lora_target_modules), cfg.lora_dropout)


def check_settings(cfg: Any) -> None:
    """train.lora_* of the TrainConfig `cfg`: one-line errors for a bad value or what LoRA does not run
    with (asynchronous rollouts at ZeRO-3; train.compile).

    Every ZeRO stage runs with LoRA (0-3 at world size 1, 2 and 3 at world size 2 checked; the
    frozen backbone is partitioned like any parameter at stage 3), and bf16 too."""
    if not is_int(cfg.lora_r) or cfg.lora_r < 0:
        raise ConfigError(f"train.lora_r must be an integer >= 0 (0: LoRA off), got {cfg.lora_r!r}")
    if not is_real(cfg.lora_alpha) or not 0 < cfg.lora_alpha < math.inf:
        raise ConfigError(f"train.lora_alpha must be a finite number > 0, got {cfg.lora_alpha!r}")
    mods = cfg.lora_target_modules
    if isinstance(mods, str) or not mods or not all(isinstance(m, str) and m for m in mods):
        raise ConfigError(
            f"train.lora_target_modules must be a non-empty list of layer names, e.g. ['q_proj', 'v_proj'], "
            f"got {mods!r}"
        )
    if not is_real(cfg.lora_dropout) or not 0 <= cfg.lora_dropout < 1:
        raise ConfigError(f"train.lora_dropout must be in [0, 1), got {cfg.lora_dropout!r}")
    if cfg.lora_r == 0:
        return
    if cfg.asynchronous and cfg.zero_stage == 3:
        raise ConfigError(
            "train.lora_r > 0 with train.max_staleness > 0 needs train.zero_stage 0, 1 or 2, got 3 (the "
            "producer's copy of a partitioned peft model: not implemented)"
        )
    if cfg.compile is True:
        raise ConfigError(compile_refusal(cfg))


def compile_refusal(cfg: Any) -> str:
    """train.compile's one line for ZeRO-3 or LoRA (train_config's check and `check_settings` share it)."""
    return (
        f"train.compile = True needs train.zero_stage 0, 1 or 2 and train.lora_r = 0, got zero_stage "
        f"{cfg.zero_stage} and lora_r {cfg.lora_r}: compiling ZeRO-3's partitioned weights or peft's "
        "adapters is not supported"
    )


def check_value_init(cfg: Any, value_init: Any, spec_name: str) -> None:
    """A `lora` value_init part (its registry metadata `lora=True`) builds the critic on the LoRA
    backbone and trains it in the policy's engine: it needs train.lora_r > 0, and it has no warm-up
    (train.critic_warmup_steps trains a critic with an engine of its own). `value_init` is the spec's
    part, or None without a critic."""
    if value_init is None or not value_init.meta.get("lora"):
        return
    if cfg.critic_warmup_steps:
        raise ConfigError(
            f"train.critic_warmup_steps = {cfg.critic_warmup_steps}: {spec_name} trains its critic "
            f"(@{value_init.full_name}) in the policy's engine; a warm-up needs a critic with its own "
            "engine (e.g. Algorithm.value_init = @value_init.policy), or bind it to 0"
        )
    if not cfg.lora_r:
        raise ConfigError(
            f"Algorithm.value_init = @{value_init.full_name} needs a LoRA policy: bind train.lora_r > 0 "
            "(or use @value_init.policy)"
        )


def lora_config(*, r: int, alpha: float, target_modules: Sequence[str], dropout: float):
    """peft's LoraConfig for a causal LM: scaling alpha / r, no bias, B = 0 at the start."""
    from peft import LoraConfig

    return LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        lora_dropout=dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_policy_adapter(model: nn.Module, config) -> nn.Module:
    """The causal LM `model` wrapped by peft with the adapter 'policy' (trainable), backbone frozen.

    Every backbone parameter (LM head included) gets requires_grad False; the adapter's A and B are
    the only trainable parameters. A `target_modules` entry that matches no layer is a ConfigError."""
    from peft import get_peft_model

    try:
        peft_model = get_peft_model(model, config, adapter_name=POLICY_ADAPTER)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"train.lora_target_modules = {list(config.target_modules)}: {str(e).splitlines()[0]} "
            f"(Linear layers of this model: {', '.join(names)})"
        ) from None
    peft_model.train()
    return peft_model


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def unwrap_peft(model: torch.nn.Module) -> torch.nn.Module:
    """The peft model inside a DeepSpeed engine or DDP wrapper, else `model`."""
    while not hasattr(model, "peft_config") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


@contextlib.contextmanager
def _same_requires_grad(module: nn.Module) -> Iterator[None]:
    """Restore every parameter's requires_grad on exit (peft flips them when it switches adapters)."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@contextlib.contextmanager
def adapter_active(peft_model: nn.Module, name: str) -> Iterator[None]:
    """Inside: only adapter `name` takes part in the forward (the others are skipped); then 'policy'."""
    if name == POLICY_ADAPTER:
        yield
        return
    with _same_requires_grad(peft_model):
        peft_model.base_model.set_adapter(name)
        try:
            yield
        finally:
            peft_model.base_model.set_adapter(POLICY_ADAPTER)


class AdapterDisabled(nn.Module):
    """The reference policy: the peft policy module's forward with every adapter disabled.

    `forward(**kwargs)` is `with policy.disable_adapter(): policy(**kwargs)`: each adapted layer
    computes W x only (peft's LoraLayer skips the adapter branch), the same ops as the backbone
    alone, so its logits equal the backbone's bit for bit whatever the adapter has learned. It holds
    no weights of its own (the policy module is kept outside the module tree, so `parameters()` is
    empty and nothing here is trained or copied). Under ZeRO-3 the policy module's forward hooks
    gather its partitioned weights as for any forward of `engine.module`."""

    def __init__(self, peft_model: nn.Module):
        super().__init__()
        self._policy = (peft_model,)  # a tuple: not a submodule
        self.config = peft_model.config

    def forward(self, *args, **kwargs):
        policy = self._policy[0]
        with _same_requires_grad(policy), policy.disable_adapter():
            return policy(*args, **kwargs)


class LoraCritic(nn.Module):
    """V(s_t) = w . h_L(s_t) + b: the policy backbone's last hidden state (adapter `adapter` active)
    through the value head Linear(hidden, 1) registered on the policy module as `value_head`.

    `adapter` is 'policy' (shared: the value loss trains the actor's adapter too, in the policy's
    engine) or 'critic' (its own adapter on the same backbone: the value loss reaches only that
    adapter and the head; the actor's adapter is skipped in the critic's forward, so its gradient
    from the value loss is exactly zero). `forward(input_ids [B,S], attention_mask [B,S],
    position_ids=None) -> [B,S]` fp32, as `ScalarHeadModel`.

    It has no weights of its own (the head and adapters live in the policy module, which the policy's
    engine trains): `module` returns itself, so the loop reads it as it reads a critic engine's
    module; it is not a DeepSpeed engine (polgrad/critic.py `PolicyEngineCritic`)."""

    def __init__(
        self, peft_model: nn.Module, adapter: str, head_name: str = VALUE_HEAD, frozen: bool = False
    ):
        super().__init__()
        self._policy = (peft_model,)
        self.adapter = adapter
        self.head_name = head_name
        self.frozen = frozen  # a reward model: no graph (its adapter and head never train)
        self.config = peft_model.config

    @property
    def module(self) -> LoraCritic:
        return self

    @property
    def head(self) -> nn.Linear:
        return getattr(self._policy[0], self.head_name)

    def forward(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        policy = self._policy[0]
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        backbone = policy.get_base_model().base_model  # e.g. Qwen2Model: no LM head
        no_grad = torch.no_grad() if self.frozen else contextlib.nullcontext()
        with no_grad, adapter_active(policy, self.adapter):
            hidden = backbone(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()


def add_critic(
    peft_model: nn.Module | None,
    *,
    own_adapter: bool,
    head_init_std: float = 0.0,
    seed: int = 0,
    part: str = "value_init.lora",
) -> LoraCritic:
    """Put a fresh value head (zeros, or N(0, head_init_std^2) seeded; bias 0) on the peft policy, and
    with `own_adapter` a second adapter 'critic' (the policy's LoraConfig, its own fresh A and B).
    `part` names the value_init part in the one-line error for a policy that is not a peft model."""
    if peft_model is None or not is_peft(peft_model):
        raise ConfigError(
            f"Algorithm.value_init = @{part} needs a LoRA policy: bind train.lora_r > 0 "
            "(or use @value_init.policy)"
        )
    hidden = peft_model.config.hidden_size
    head = nn.Linear(hidden, 1, dtype=next(peft_model.parameters()).dtype)
    with torch.no_grad():
        head.bias.zero_()
        if head_init_std == 0:
            head.weight.zero_()
        else:
            g = torch.Generator().manual_seed(seed)
            head.weight.copy_(torch.randn(head.weight.shape, generator=g) * head_init_std)
    peft_model.add_module(VALUE_HEAD, head)
    if own_adapter:
        with _same_requires_grad(peft_model):  # add_adapter leaves the new adapter frozen (inactive)
            peft_model.add_adapter(CRITIC_ADAPTER, peft_model.peft_config[POLICY_ADAPTER])
        for name, p in peft_model.named_parameters():
            if f".{CRITIC_ADAPTER}." in name:
                p.requires_grad_(True)
    return LoraCritic(peft_model, CRITIC_ADAPTER if own_adapter else POLICY_ADAPTER)


def adapter_state(decoder: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """Adapter `adapter`'s A and B, keyed by their names in `decoder` (the transformer without LM
    head, e.g. Qwen2Model: 'layers.0.self_attn.q_proj.lora_A.reward.weight'), so that a reward
    model trained on an AutoModel backbone loads into the causal LM's decoder."""
    return {n: p.detach().clone().contiguous() for n, p in decoder.named_parameters() if f".{adapter}." in n}


def add_reward_model(peft_model: nn.Module, path, member: int = 0) -> LoraCritic:
    """The reward model at `path` (trained as LoRA: REWARD_FILE + the head's value_head.safetensors)
    on the policy's backbone: adapter 'reward' (the policy's LoraConfig, the trained A and B) and head
    `reward_head`, both frozen (requires_grad False: no engine trains them). Its forward maps
    (input_ids [B,S], attention_mask [B,S]) -> scores [B,S] under no_grad; read at the EOS by
    `heads.sequence_scores`. Member k > 0 of an ensemble (train.rm_ensemble) gets adapter 'reward_k'
    and head `reward_head_k`, so K reward models share the one backbone."""
    from pathlib import Path

    from safetensors.torch import load_file

    from polgrad.models.heads import HEAD_FILE

    p = Path(path)
    adapter = REWARD_ADAPTER if not member else f"{REWARD_ADAPTER}_{member}"
    head_name = REWARD_HEAD if not member else f"{REWARD_HEAD}_{member}"
    weights, head_state = load_file(str(p / REWARD_FILE)), load_file(str(p / HEAD_FILE))
    weights = {k.replace(f".{REWARD_ADAPTER}.", f".{adapter}."): v for k, v in weights.items()}
    with _same_requires_grad(peft_model):
        peft_model.add_adapter(adapter, peft_model.peft_config[POLICY_ADAPTER])
    decoder = peft_model.get_base_model().base_model
    own = dict(decoder.named_parameters())
    if set(weights) != {n for n in own if f".{adapter}." in n}:
        raise ValueError(f"{p / REWARD_FILE}: its adapter does not match train.lora_* of this run")
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)
            own[name].requires_grad_(False)
    head = nn.Linear(peft_model.config.hidden_size, 1, dtype=next(peft_model.parameters()).dtype)
    with torch.no_grad():
        head.weight.copy_(head_state["weight"])
        head.bias.copy_(head_state["bias"])
    head.requires_grad_(False)
    peft_model.add_module(head_name, head)
    return LoraCritic(peft_model, adapter, head_name=head_name, frozen=True)


class LoraRewardModel:
    """How `polgrad.pretrain.train_reward_model` trains a reward model as LoRA (`heads.FullRewardModel`
    is the other form): the backbone frozen, adapter 'reward' + the head trained; the folder then holds
    the adapter (REWARD_FILE), the head and the config, no backbone weights, and loads onto a LoRA
    policy with `add_reward_model` (one backbone in the run). `key()` enters the cache key."""

    def __init__(self, spec: LoraSpec):
        self.spec = spec

    def key(self) -> dict[str, Any]:
        return {"lora": self.spec.settings()}

    def prepare(self, model: nn.Module) -> None:
        """The ScalarHeadModel `model`'s backbone wrapped by peft with the adapter 'reward' (seeded by
        the RNG in effect: an ensemble member's own seed)."""
        from peft import get_peft_model

        cfg = lora_config(**self.spec.settings())
        cfg.task_type = None  # an AutoModel backbone (no LM head)
        model.backbone = get_peft_model(model.backbone, cfg, adapter_name=REWARD_ADAPTER)

    def save(self, model: nn.Module, folder: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        from polgrad.models.heads import HEAD_FILE

        decoder = model.backbone.get_base_model()
        save_file(adapter_state(decoder, REWARD_ADAPTER), os.path.join(folder, REWARD_FILE))
        head = {
            "weight": model.head.weight.detach().contiguous(),
            "bias": model.head.bias.detach().contiguous(),
        }
        save_file(head, os.path.join(folder, HEAD_FILE))
        decoder.config.save_pretrained(folder)


def critic_parameters(peft_model: nn.Module) -> list[nn.Parameter]:
    """The parameters only the critic trains: its head and its own adapter (if any)."""
    return [
        p
        for name, p in peft_model.named_parameters()
        if name.startswith(f"{VALUE_HEAD}.") or f".{CRITIC_ADAPTER}." in name
    ]


def peft_configs(peft_model: nn.Module) -> dict[str, dict]:
    """{adapter name: its LoraConfig as a JSON-able dict} (what `merged_causal_lm` needs)."""
    out = {}
    for name, cfg in peft_model.peft_config.items():
        d = cfg.to_dict()
        out[name] = {k: (sorted(v) if isinstance(v, set) else v) for k, v in d.items()}
    return out


def merged_causal_lm(config, state: dict[str, torch.Tensor], configs: dict[str, dict], adapter: str):
    """A plain causal LM whose adapted weights are W + (alpha / r) B A of adapter `adapter`.

    Built on a copy: a fresh model of `config` gets the peft module's state dict `state` (keys as
    `peft_model.state_dict()`, gathered under ZeRO-3; the value head is ignored), then peft's own
    `merge_and_unload(adapter_names=[adapter])` folds the adapter in. Loads back with
    `AutoModelForCausalLM.from_pretrained` after `save_pretrained`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model = None
    for name, cfg in configs.items():
        lcfg = LoraConfig(**{k: v for k, v in cfg.items() if k in LoraConfig.__dataclass_fields__})
        if model is None:
            model = get_peft_model(base, lcfg, adapter_name=name)
        else:
            model.add_adapter(name, lcfg)
    heads = (f"{VALUE_HEAD}.", f"{REWARD_HEAD}.", f"{REWARD_HEAD}_")  # reward_head_k: ensemble members
    weights = {k: v.float() for k, v in state.items() if not k.startswith(heads)}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {"base_model.model.lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(
            f"LoRA state dict does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    merged = model.merge_and_unload(adapter_names=[adapter])
    merged.eval()
    return merged
