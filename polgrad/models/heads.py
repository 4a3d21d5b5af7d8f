"""The scalar-head model (critic and reward model) and the reward model's per-sequence score."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from polgrad.errors import DataError
from polgrad.models.loading import check_dir, freeze, load_config, no_dropout
from polgrad.models.threads import seeded
from polgrad.models.tiny import ATTN_IMPLEMENTATION
from polgrad.models.tokenizer import position_ids_from_mask

HEAD_FILE = "value_head.safetensors"


class ScalarHeadModel(nn.Module):
    """A transformer backbone (`AutoModel`, no LM head) + Linear(hidden, 1): one scalar per position.

    `forward(input_ids [B,S], attention_mask [B,S], position_ids=None) -> [B,S]` fp32. Position ids
    default to `cumsum(attention_mask) - 1`, so left padding is harmless. Used as the critic (values
    V(s_t), read at the positions that predict each response token) and as the reward model (score
    read at the last attended token, the EOS; see `sequence_scores`).

    `save_pretrained(dir)` writes the backbone (config.json + model.safetensors) and the head
    (`value_head.safetensors`, keys 'weight' [1,hidden] and 'bias' [1]); `from_pretrained(dir)` reads
    both. `from_backbone(dir)` takes the backbone of any checkpoint (e.g. the SFT causal LM) and puts a
    fresh head on it: zeros by default (V = 0 everywhere at the start), or N(0, head_init_std^2).
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        self.config = backbone.config
        self.head = head if head is not None else nn.Linear(self.config.hidden_size, 1)
        if head is None:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()

    def init_head(self, *, std: float = 0.0, seed: int = 0) -> ScalarHeadModel:
        """Re-initialise the head: zeros if std == 0, else weight ~ N(0, std^2) (seeded), bias 0."""
        with torch.no_grad():
            self.head.bias.zero_()
            if std == 0:
                self.head.weight.zero_()
            else:
                g = torch.Generator().manual_seed(seed)
                self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=g) * std)
        return self

    def save_pretrained(self, path: str | os.PathLike) -> None:
        from safetensors.torch import save_file

        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        from polgrad.models.loading import save_model_dir

        save_model_dir(self.backbone, p)  # from any rank (transformers saves from rank 0 only)
        save_file(
            {"weight": self.head.weight.detach().contiguous(), "bias": self.head.bias.detach().contiguous()},
            str(p / HEAD_FILE),
        )

    @classmethod
    def from_backbone(cls, path: str | os.PathLike, *, head_init_std: float = 0.0, seed: int = 0):
        """The backbone of the checkpoint at `path` (causal LM or ScalarHeadModel) + a fresh head.

        Without dropout, like the policy (`loading.load_policy`)."""
        from transformers import AutoModel

        p = check_dir(path, "backbone")
        config = load_config(p, "backbone")
        no_dropout(config)
        backbone = AutoModel.from_pretrained(
            str(p), config=config, dtype=torch.float32, attn_implementation=ATTN_IMPLEMENTATION
        )
        return cls(backbone).init_head(std=head_init_std, seed=seed)

    @classmethod
    def from_config(cls, config, *, seed: int = 0, head_init_std: float = 0.0) -> ScalarHeadModel:
        """Same architecture as `config`, every weight freshly initialised (seeded)."""
        from transformers import AutoModel

        with seeded(seed):
            backbone = AutoModel.from_config(config, attn_implementation=ATTN_IMPLEMENTATION).to(
                torch.float32
            )
        return cls(backbone).init_head(std=head_init_std, seed=seed)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ScalarHeadModel:
        from safetensors.torch import load_file

        p = check_dir(path, "scalar-head")
        if not (p / HEAD_FILE).is_file():
            raise DataError(
                f"'{p}' has no {HEAD_FILE}: not a ScalarHeadModel (reward model / critic) checkpoint"
            )
        model = cls.from_backbone(p)
        state = load_file(str(p / HEAD_FILE))
        with torch.no_grad():
            model.head.weight.copy_(state["weight"])
            model.head.bias.copy_(state["bias"])
        return model


class FullRewardModel:
    """How `polgrad.pretrain.train_reward_model` trains a reward model by default: every weight of the
    ScalarHeadModel, saved whole (`lora.LoraRewardModel` is the LoRA form). Nothing enters the cache
    key (the keys of before the LoRA form)."""

    def key(self) -> dict:
        return {}

    def prepare(self, model: ScalarHeadModel) -> None:
        pass

    def save(self, model: ScalarHeadModel, folder: str | os.PathLike) -> None:
        model.save_pretrained(folder)  # backbone via save_model_dir, head beside it


def load_reward_model(path: str | os.PathLike) -> ScalarHeadModel:
    """The reward model at `path`, frozen (eval mode, requires_grad False)."""
    return freeze(ScalarHeadModel.from_pretrained(path))


def sequence_scores(
    model: ScalarHeadModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Scores [B] read at the last attended token of each row (the EOS, or the last token if truncated)."""
    values = model(input_ids, attention_mask)
    last = attention_mask.shape[1] - 1 - attention_mask.flip(-1).long().argmax(-1)
    return values.gather(1, last[:, None]).squeeze(1)
