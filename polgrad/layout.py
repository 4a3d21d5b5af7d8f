"""The model layout: where a run's roles keep their weights, chosen once when the models are built.

    FullCopies     train.lora_r = 0: every role its own copy of the weights. The policy trains every
                   weight; the reference is a frozen copy of the warm start; a reward model and a
                   critic are models of their own.
    LoraBackbone   train.lora_r > 0: one frozen backbone (polgrad/models/lora.py). The policy trains
                   its adapter; the reference is the same module with its adapter disabled; a reward
                   model the run trains for scoring is an adapter + head on the backbone; a `lora`
                   value_init part's critic is one too, trained in the policy's engine.

What the two differ in, and the only place they differ (`layout_for` picks one; the rest of polgrad
calls these methods without asking which layout it has):

    policy(model)                              the trained module built on the warm start
    reference(policy, policy_path, bf16=)      the frozen reference module
    reward_model_form()                        how polgrad.pretrain trains the run's reward model(s)
    reward_model(policy, path, member)         a trained reward model as a scoring module
    critic(algo, policy, policy_path, ...)     (critic module, trained in the policy's engine?, the
                                               extra param groups of the policy's engine)
    vllm_options()                             what the vLLM engine is started with
    sync_vllm(vllm, module)                    the policy's weights into vLLM: all, or the adapter
    load_vllm(vllm, weights, module)           a snapshot (the async producer's version) into vLLM
    write_model_files(policy, critic, root)    what an export needs besides weights (LoRA: the
                                               adapters' peft configs, `lora.LORA_FILE`)
    save_final(policy, critic, final)          final/: the policy (LoRA: merged, + its adapter and a
                                               LoRA critic); collective (ZeRO-3 gathers)

`export_saved` writes a checkpoint's policy in the layout its run saved (polgrad.export).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Protocol

import torch

from polgrad import collective, models
from polgrad.errors import ConfigError
from polgrad.io import atomic_write_text
from polgrad.models import lora
from polgrad.models.heads import FullRewardModel

# vLLM's `max_lora_rank` takes one of these; an adapter of rank r is served under the smallest >= r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Layout(Protocol):
    def policy(self, model: torch.nn.Module) -> torch.nn.Module: ...
    def reference(self, policy: torch.nn.Module, policy_path: str, *, bf16: bool) -> torch.nn.Module: ...
    def reward_model_form(self) -> Any: ...
    def reward_model(self, policy: torch.nn.Module, path: str, member: int) -> torch.nn.Module: ...
    def critic(
        self, algo: Any, policy: torch.nn.Module, policy_path: str, rm_path: str | None, critic_lr: float
    ) -> tuple[Any, bool, tuple]: ...
    def vllm_options(self) -> dict[str, Any]: ...
    def sync_vllm(self, vllm: Any, module: torch.nn.Module) -> float: ...
    def load_vllm(self, vllm: Any, weights: dict[str, torch.Tensor], module: torch.nn.Module) -> float: ...
    def write_model_files(self, policy: torch.nn.Module, critic: Any, root: Path) -> None: ...
    def save_final(self, policy: torch.nn.Module, critic: Any, final: Path) -> None: ...


def layout_for(cfg: Any, algo: Any) -> Layout:
    """The run's layout: LoraBackbone with train.lora_r > 0, else FullCopies. A spec whose value_init
    part reads the reward model's own checkpoint (`algo.needs_reward_model`) gets the full reward model
    under LoRA too (the part loads it whole)."""
    spec = cfg.lora
    if spec is None:
        return FullCopies()
    return LoraBackbone(spec, reward_on_backbone=not algo.needs_reward_model)


@dataclasses.dataclass(frozen=True)
class FullCopies:
    """Every role its own copy of the weights (module docstring)."""

    def policy(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def reference(self, policy: torch.nn.Module, policy_path: str, *, bf16: bool) -> torch.nn.Module:
        """A frozen copy of the warm start. In bf16 it is the policy's engine module at step 0 exactly
        (KL 0, as in fp32): DeepSpeed's bf16 casts the parameters only (buffers such as RoPE's
        inv_freq stay fp32, as in a bf16 HF load), and so is this copy cast."""
        reference = models.load_reference(policy_path)
        if bf16:
            for p in reference.parameters():
                p.data = p.data.to(torch.bfloat16)
        return reference

    def reward_model_form(self) -> Any:
        return FullRewardModel()

    def reward_model(self, policy: torch.nn.Module, path: str, member: int) -> torch.nn.Module:
        return models.load_reward_model(path)

    def critic(
        self, algo: Any, policy: torch.nn.Module, policy_path: str, rm_path: str | None, critic_lr: float
    ) -> tuple[Any, bool, tuple]:
        """The spec's value_init part's critic, a model of its own trained by an engine of its own (a
        `lora` part is refused without LoRA when the config is built)."""
        return algo.value_init(policy_path=policy_path, reward_model_path=rm_path), False, ()

    def vllm_options(self) -> dict[str, Any]:
        return {}

    def sync_vllm(self, vllm: Any, module: torch.nn.Module) -> float:
        return vllm.sync_weights(module)

    def load_vllm(self, vllm: Any, weights: dict[str, torch.Tensor], module: torch.nn.Module) -> float:
        return vllm.load_weights(weights)

    def write_model_files(self, policy: torch.nn.Module, critic: Any, root: Path) -> None:
        pass  # the policy's config and tokenizer, which export.py writes for every layout, suffice

    def save_final(self, policy: torch.nn.Module, critic: Any, final: Path) -> None:
        save_gathered(policy, final)


FULL_COPIES = FullCopies()  # the default layout (frozen, no fields: one instance serves every run)


@dataclasses.dataclass(frozen=True)
class LoraBackbone:
    """One frozen backbone for every role (module docstring; polgrad/models/lora.py). `spec` is the
    policy's adapter (train.lora_*); `reward_on_backbone`: a reward model the run trains is a LoRA
    adapter + head on the backbone (else the full model, which a value_init part reads)."""

    spec: lora.LoraSpec
    reward_on_backbone: bool = True

    def policy(self, model: torch.nn.Module) -> torch.nn.Module:
        return lora.add_policy_adapter(model, lora.lora_config(**self.spec.settings()))

    def reference(self, policy: torch.nn.Module, policy_path: str, *, bf16: bool) -> torch.nn.Module:
        return lora.AdapterDisabled(policy)  # no second copy; bit for bit the backbone

    def reward_model_form(self) -> Any:
        if self.reward_on_backbone:
            return lora.LoraRewardModel(self.spec)
        return FullCopies().reward_model_form()

    def reward_model(self, policy: torch.nn.Module, path: str, member: int) -> torch.nn.Module:
        if self.reward_on_backbone:
            return lora.add_reward_model(policy, path, member=member)
        return FullCopies().reward_model(policy, path, member)

    def critic(
        self, algo: Any, policy: torch.nn.Module, policy_path: str, rm_path: str | None, critic_lr: float
    ) -> tuple[Any, bool, tuple]:
        """A part with the `lora` metadata builds the critic on the peft policy: its head (and own
        adapter) train in the policy's engine at the critic's lr. Any other part: as FullCopies."""
        if not algo.parts["Algorithm.value_init"].meta.get("lora", False):
            return FullCopies().critic(algo, policy, policy_path, rm_path, critic_lr)
        critic = algo.value_init(policy_path=policy_path, reward_model_path=rm_path, policy=policy)
        return critic, True, ((lora.critic_parameters(policy), critic_lr),)

    def vllm_options(self) -> dict[str, Any]:
        """The engine keeps the frozen base (the warm start) and samples with one adapter at a time,
        the policy's latest version."""
        rank = next((k for k in VLLM_LORA_RANKS if k >= self.spec.r), None)
        if rank is None:
            raise ConfigError(
                f"train.lora_r = {self.spec.r}: vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]}"
            )
        return dict(enable_lora=True, max_loras=1, max_lora_rank=rank)

    def sync_vllm(self, vllm: Any, module: torch.nn.Module) -> float:
        return vllm.sync_adapter(module)

    def load_vllm(self, vllm: Any, weights: dict[str, torch.Tensor], module: torch.nn.Module) -> float:
        """The policy adapter cut out of the snapshot `weights` (the peft module's state dict) with the
        module's peft config; the module is read for that config only, never its weights."""
        from peft import get_peft_model_state_dict

        peft_model = lora.unwrap_peft(module)
        adapter = get_peft_model_state_dict(peft_model, state_dict=weights, adapter_name=lora.POLICY_ADAPTER)
        return vllm.load_adapter(adapter, peft_model.peft_config[lora.POLICY_ADAPTER].to_dict())

    def write_model_files(self, policy: torch.nn.Module, critic: Any, root: Path) -> None:
        """RUN_DIR/model/lora.json: the adapters' configs and the LoRA critic's adapter (if any), to
        merge them into the weights on export."""
        saved = {"adapters": lora.peft_configs(policy), "critic_adapter": getattr(critic, "adapter", None)}
        atomic_write_text(str(root / lora.LORA_FILE), json.dumps(saved, indent=2, sort_keys=True))

    def save_final(self, policy: torch.nn.Module, critic: Any, final: Path) -> None:
        """The policy with its adapter merged (W + (alpha/r) B A; loads with AutoModelForCausalLM), the
        adapter itself in final/adapter/ (peft's format) and, with a LoRA critic, final/critic/ (its
        adapter merged into a backbone copy + its head). Gathered under ZeRO-3."""
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(policy.parameters()), modifier_rank=None):
            if collective.rank() == 0:
                state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
                policy.save_pretrained(str(final / "adapter"), selected_adapters=[lora.POLICY_ADAPTER])
        if collective.rank() == 0:
            configs = lora.peft_configs(policy)
            write_lora_model(
                policy.config,
                state,
                configs,
                getattr(critic, "adapter", None),
                policy.generation_config,
                final,
            )


# --------------------------------------------------------------------------- writing the weights
def save_gathered(module: torch.nn.Module, path: Path) -> None:
    """`module.save_pretrained(path)` on rank 0 with every parameter whole (ZeRO-3: gathered on all ranks)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        if collective.rank() == 0:
            module.save_pretrained(path)


def write_lora_model(config, state, configs: dict, critic_adapter: str | None, generation_config, dest: Path):
    """`dest`: the policy adapter merged into the weights (save_pretrained of a plain causal LM) and,
    with `critic_adapter`, dest/critic/ as a ScalarHeadModel (that adapter merged + the value head)."""
    merged = lora.merged_causal_lm(config, state, configs, lora.POLICY_ADAPTER)
    if generation_config is not None:
        merged.generation_config = generation_config
    merged.save_pretrained(str(dest))
    if critic_adapter is not None:
        backbone = lora.merged_causal_lm(config, state, configs, critic_adapter).base_model
        critic = models.ScalarHeadModel(backbone)
        with torch.no_grad():
            critic.head.weight.copy_(state[f"{lora.VALUE_HEAD}.weight"])
            critic.head.bias.copy_(state[f"{lora.VALUE_HEAD}.bias"])
        critic.save_pretrained(dest / "critic")


def export_saved(
    files: Path, state: dict[str, torch.Tensor], generation_config: Any, dest: Path, load
) -> None:
    """A checkpoint's policy into `dest` in the layout its run saved: with RUN_DIR/model/lora.json (a
    LoRA run) its adapter(s) merged from the peft module's state dict `state`; else a causal LM of
    files/policy's config that `load(model, state)` fills (polgrad.export's checked load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(files / "policy")
    lora_file = files / lora.LORA_FILE
    if lora_file.is_file():
        saved = json.loads(lora_file.read_text())
        write_lora_model(config, state, saved["adapters"], saved["critic_adapter"], generation_config, dest)
        return
    policy = AutoModelForCausalLM.from_config(config)
    load(policy, state)
    if generation_config is not None:
        policy.generation_config = generation_config
    policy.save_pretrained(dest)
