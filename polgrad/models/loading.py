"""Loading checkpoints: the trainable policy (dropout off), the frozen reference, the directory check.

Any causal LM checkpoint works as `train.policy_path`: its dropout is switched off on load
(`no_dropout`), since RL compares log-probs of two forwards of the same policy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from polgrad.errors import ConfigError, DataError
from polgrad.models.tiny import ATTN_IMPLEMENTATION


def check_dir(path: str | os.PathLike, what: str) -> Path:
    """`path` as a Path if it holds a config.json (a save_pretrained dir) that reads as a transformers
    model config (`config_problem`); else a DataError naming `what`, the file and what is wrong (not
    transformers' traceback, which for any config.json it cannot read advises upgrading it)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise DataError(f"{what} checkpoint '{p}' has no config.json; pass a save_pretrained directory")
    problem = config_problem(p / "config.json")
    if problem:
        raise DataError(
            f"{what} checkpoint '{p}': its config.json {problem}; pass a save_pretrained directory of a "
            "transformers model"
        )
    return p


def config_problem(file: Path) -> str | None:
    """What keeps `file` from being a transformers model config, in a few words, or None: it must be a
    JSON object whose `model_type` this transformers knows."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        config = json.loads(file.read_text())
    except UnicodeDecodeError:
        return "is not text"
    except json.JSONDecodeError as e:
        return f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
    if not isinstance(config, dict):
        return f"holds a JSON {type(config).__name__}, not an object"
    kind = config.get("model_type")
    if not isinstance(kind, str) or not kind:
        return "has no 'model_type', so it is not a model config"
    if kind not in CONFIG_MAPPING:
        return (
            f"names model_type '{kind}', which transformers {__version__} does not know (a typo, or a model "
            "newer than this transformers)"
        )
    return None


def load_config(path: Path, what: str):
    """The transformers config of the checked directory `path` (`check_dir`): a value the config class
    refuses is a DataError naming the file and what it said (on one line, cut at 300 characters)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - any refusal of the config class, told in one line
        said = " ".join(str(e).split())[:300] or type(e).__name__
        raise DataError(f"{what} checkpoint '{path}': its config.json does not load: {said}") from None


def no_dropout(config) -> list[str]:
    """Set every dropout probability of a transformers config to 0 (attributes whose name contains
    'dropout' or ends in 'pdrop', float-valued: attention_dropout, resid_pdrop, embd_pdrop,
    attn_pdrop, summary_first_dropout, hidden_dropout_prob, ...), sub-configs included; returns
    the names it changed."""
    changed = []
    for key, value in list(config.to_dict().items()):
        sub = getattr(config, key, None)
        if hasattr(sub, "to_dict") and hasattr(sub, "model_type"):  # a nested config (text_config)
            changed += [f"{key}.{name}" for name in no_dropout(sub)]
        elif ("dropout" in key or key.endswith("pdrop")) and isinstance(value, float) and value != 0.0:
            setattr(config, key, 0.0)
            changed.append(key)
    return changed


def _zero_dropout_modules(model: nn.Module) -> None:
    """p = 0 on every nn.Dropout (for a model that does not take its rates from the config)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0


def load_policy(path: str | os.PathLike):
    """The causal LM saved at `path` (fp32, sdpa), in train mode with gradients on, without dropout.

    Dropout is switched off (`no_dropout` on the config before the model is built, and p = 0 on
    every dropout module): the RL losses compare log-probs of the same tokens under two forwards
    (the sampler's and the trainer's), and dropout in the training forward makes them differ
    on-policy (a GPT-2 with its 0.1 gives an approx_kl of ~2e-3 where it should be ~1e-14).
    """
    from transformers import AutoModelForCausalLM

    p = check_dir(path, "policy")
    config = load_config(p, "policy")
    no_dropout(config)
    model = AutoModelForCausalLM.from_pretrained(
        str(p), config=config, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    _zero_dropout_modules(model)
    model.train()
    for prm in model.parameters():
        prm.requires_grad_(True)
    return model


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode, requires_grad False on every parameter; returns the model."""
    model.eval()
    for prm in model.parameters():
        prm.requires_grad_(False)
    return model


def load_reference(path: str | os.PathLike):
    """The causal LM at `path`, frozen (eval mode, requires_grad False): the KL reference policy."""
    return freeze(load_policy(path))


def save_model_dir(model: nn.Module, path: str | os.PathLike) -> None:
    """`model.save_pretrained(path)`, from any rank. transformers writes nothing on a rank other than 0
    once torch.distributed is initialised (a checkpoint is rank 0's to write), so a cache entry built
    by another rank (its node's own cache, say) would hold no config and no weights: there the config,
    the generation config and the weights (safetensors, shared tensors once) are written directly."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_rank() == 0:
        model.save_pretrained(path)
        return
    from safetensors.torch import save_model

    os.makedirs(path, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    save_model(model, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def checkpoint_activations(model: nn.Module, what: str) -> int:
    """Activation (gradient) checkpointing on every Hugging Face model inside `model` (train
    .gradient_checkpointing): each decoder layer keeps only its input in the forward and recomputes
    its activations in the backward (Chen et al. 2016, arXiv 1604.06174), so a training forward holds
    one [B,S,hidden] tensor per layer instead of all of a layer's intermediates, for about one more
    forward's time. torch's non-reentrant checkpoint (`use_reentrant=False`, transformers' default).

    Hugging Face checkpoints only in train mode: the sampler's and the reference's forwards (eval mode,
    no grad) are unchanged, and the recomputed forward is the same computation, so values and
    gradients are those of the run without it. `model` is the policy, a peft model around it or a
    critic (its backbone); returns how many models were switched (an outer model switches the
    models inside it). Raises ConfigError when `model` holds no Hugging Face model that supports
    checkpointing (`what` names it in the line)."""
    from transformers import PreTrainedModel

    switched = 0
    for sub in model.modules():  # outer first: one call switches the inner models with it
        if isinstance(sub, PreTrainedModel) and sub.supports_gradient_checkpointing:
            if not sub.is_gradient_checkpointing:
                sub.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                switched += 1
    if not any(isinstance(s, PreTrainedModel) and s.is_gradient_checkpointing for s in model.modules()):
        raise ConfigError(
            f"train.gradient_checkpointing = True: the {what} ({type(model).__name__}) holds no Hugging "
            "Face model that supports gradient checkpointing; bind train.gradient_checkpointing = False"
        )
    return switched
