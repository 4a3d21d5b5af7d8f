"""The `Rollout`: a batch of sampled responses, the layout every rollout backend returns.

Layout (see polgrad.rollout.hf for how the HF backend fills it): row b answers prompt
`group_ids[b]`; the prompt is left-padded (`prompt_ids`, `prompt_mask`), the response right-padded
after its EOS; `mask[b, t]` is 1 on generated tokens up to and including the EOS.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from polgrad.errors import ShapeError
from polgrad.tasks.base import Example


def group_offsets(group_ids: Sequence[Tensor]) -> list[int]:
    """What to add to each part's group ids so that the groups of different parts stay distinct
    when the parts are concatenated: part k's ids are moved just past every id of parts < k
    (whatever their sign; an empty part gets 0)."""
    offsets, end = [], 0
    for ids in group_ids:
        if ids.numel() == 0:
            offsets.append(0)
            continue
        low, high = int(ids.min()), int(ids.max())
        offsets.append(end - low)
        end += high - low + 1
    return offsets


@dataclass
class Rollout:
    """A batch of B = len(examples) * group_size sampled responses (shapes in the module docstring).

    prompt_ids [B,P] int64, prompt_mask [B,P] int64, response_ids [B,T] int64, mask [B,T] float,
    rollout_logp [B,T] float (0 where mask is 0), group_ids [B] int64, truncated [B] bool,
    response_lengths [B] int64 (generated tokens, EOS included; = mask.sum(1) as generated),
    texts (decoded responses without EOS/PAD), examples (the Example of each row), temperature (of
    the sampling, pass it to `response_logprobs`). With greedy_baseline, `baseline` is the greedy
    Rollout (one greedy decode per prompt, repeated for each of the prompt's rows, same group_ids)
    and `baseline_texts` its texts. `policy_logp_all` [B,T,V] float, optional: the temperature-scaled
    log-softmax each response token was drawn from (before any top-p cut; at temperature 0 the
    temperature-1 one), kept by the HF sampler when asked so that the exact KL to the reference
    needs no second policy forward; the loop drops it once used (`concat` of several parts drops it).
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    mask: Tensor
    rollout_logp: Tensor
    group_ids: Tensor
    truncated: Tensor
    response_lengths: Tensor
    texts: list[str]
    examples: list[Example]
    temperature: float = 1.0
    baseline_texts: list[str] | None = None
    baseline: Rollout | None = None
    policy_logp_all: Tensor | None = None

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        """[B,P+T] concat(prompt_ids, response_ids)."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """[B,P+T] 1 on the prompt and on the generated tokens up to the EOS (for scoring whole sequences).

        Built from `prompt_mask` and `response_lengths`, not from `mask`, so a trainer may zero `mask`
        (e.g. an overlong filter) without moving where a reward model reads its score.
        """
        t = self.response_ids.shape[1]
        resp = torch.arange(t, device=self.response_lengths.device)[None, :] < self.response_lengths[:, None]
        return torch.cat([self.prompt_mask, resp.to(self.prompt_mask.dtype)], dim=1)

    def select(self, index: Tensor | Sequence[int]) -> Rollout:
        """The rows `index` (bool mask or int indices), e.g. the groups a filter keeps."""
        idx = torch.as_tensor(index)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().squeeze(1)
        rows = idx.tolist()
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, Tensor):
                out[f.name] = v[idx]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in rows]
            elif isinstance(v, Rollout):
                out[f.name] = v.select(idx)
            else:
                out[f.name] = v
        return Rollout(**out)

    def to(self, device: torch.device | str) -> Rollout:
        changes = {
            f.name: getattr(self, f.name).to(device)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        if self.baseline is not None:
            changes["baseline"] = self.baseline.to(device)
        return dataclasses.replace(self, **changes)

    @staticmethod
    def concat(parts: Sequence[Rollout], pad_id: int) -> Rollout:
        """The rows of `parts` one after the other (e.g. the rounds of a refilled batch).

        Prompts are left-padded with `pad_id` (prompt_mask 0) and responses right-padded with
        `pad_id` (mask 0, log-prob 0) to the longest; the model's view of every row is unchanged
        (position ids come from the attention mask, padding after a response is never attended by
        it). Group ids are renumbered so that groups of different parts stay distinct: part k's
        ids are shifted past every id of parts 0..k-1.
        """
        if not parts:
            raise ShapeError("Rollout.concat needs at least one rollout")
        if len(parts) == 1:
            return parts[0]
        p_len = max(r.prompt_ids.shape[1] for r in parts)
        t_len = max(r.response_ids.shape[1] for r in parts)

        def left(x: Tensor, value: float) -> Tensor:
            return F.pad(x, (p_len - x.shape[1], 0), value=value)

        def right(x: Tensor, value: float) -> Tensor:
            return F.pad(x, (0, t_len - x.shape[1]), value=value)

        offsets = group_offsets([r.group_ids for r in parts])
        baselines = [r.baseline for r in parts]
        if any(b is None for b in baselines) and not all(b is None for b in baselines):
            raise ShapeError("Rollout.concat: either every part has a greedy baseline or none has")
        baseline = None
        if baselines[0] is not None:
            baseline = Rollout.concat(baselines, pad_id)
            baseline.group_ids = torch.cat([b.group_ids + o for b, o in zip(baselines, offsets, strict=True)])
        return Rollout(
            prompt_ids=torch.cat([left(r.prompt_ids, pad_id) for r in parts]),
            prompt_mask=torch.cat([left(r.prompt_mask, 0) for r in parts]),
            response_ids=torch.cat([right(r.response_ids, pad_id) for r in parts]),
            mask=torch.cat([right(r.mask, 0.0) for r in parts]),
            rollout_logp=torch.cat([right(r.rollout_logp, 0.0) for r in parts]),
            group_ids=torch.cat([r.group_ids + o for r, o in zip(parts, offsets, strict=True)]),
            truncated=torch.cat([r.truncated for r in parts]),
            response_lengths=torch.cat([r.response_lengths for r in parts]),
            texts=[t for r in parts for t in r.texts],
            examples=[e for r in parts for e in r.examples],
            temperature=parts[0].temperature,
            baseline_texts=None if baseline is None else list(baseline.texts),
            baseline=baseline,
        )
