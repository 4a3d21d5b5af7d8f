"""Loading checkpoints: the trainable policy, the frozen reference, and the directory check."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from polgrad.errors import DataError
from polgrad.models.tiny import ATTN_IMPLEMENTATION


def check_dir(path: str | os.PathLike, what: str) -> Path:
    """`path` as a Path if it holds a config.json (a save_pretrained dir); else a DataError naming `what`."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise DataError(f"{what} checkpoint '{p}' has no config.json; pass a save_pretrained directory")
    return p


def load_policy(path: str | os.PathLike):
    """The causal LM saved at `path` (fp32, sdpa), in train mode with gradients on."""
    from transformers import AutoModelForCausalLM

    p = check_dir(path, "policy")
    model = AutoModelForCausalLM.from_pretrained(
        str(p), dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
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
