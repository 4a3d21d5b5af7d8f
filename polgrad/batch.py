"""The typed batch the loop carries from sampling to the update (names as in the tensor glossary).

One `Batch` holds B sampled sequences, row-aligned: every tensor's first dimension is B, and
`rollout` (the sampled ids, texts and examples) has the same rows. `select(rows)` takes rows of
all of them at once, so a filter or a micro-batch never loses track of which sequence is which
(no bookkeeping column). polgrad's own code reads it by attribute (`batch.adv`, None when not
computed); it is also a read-only mapping over the tensors that are set, so a user's part or a test
can read `batch["adv"]` and `batch.get("values")`, and `Algorithm.prepare` / `loss` accept a plain
mapping of field names (made a Batch first, `Batch.of`).

Shapes: [B] for scores, gold_scores, truncated, group_ids, baseline_scores, rewards; [B,T] for the others
except logits/ref_logits [B,T,V] (tensors, or LogitRows that make the logits a chunk of positions
at a time: polgrad/components/logit_rows.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from polgrad.errors import ShapeError
from polgrad.rollout.rollout import group_offsets


@dataclasses.dataclass(frozen=True, eq=False)
class Batch(Mapping):
    """B sequences and what the loop has computed about them so far (None: not computed)."""

    mask: Tensor  # [B,T] float 0/1 over response tokens
    group_ids: Tensor | None = None  # [B] which prompt each row answers (every sampled batch has it)
    old_logp: Tensor | None = None  # [B,T] log-probs under the policy that sampled (pi_old)
    scores: Tensor | None = None  # [B] the task's or reward model's score (the reward trained on)
    gold_scores: Tensor | None = None  # [B] the task verifier's score when a reward model gives `scores`
    truncated: Tensor | None = None  # [B] bool: hit max_new_tokens without EOS
    rollout_logp: Tensor | None = None  # [B,T] the sampler's own log-probs (off-policy corrections)
    baseline_scores: Tensor | None = None  # [B] score of the prompt's greedy response (ReMax)
    ref_logp: Tensor | None = None  # [B,T] reference policy
    kl_exact: Tensor | None = None  # [B,T] KL(pi_old || pi_ref) over the whole vocabulary (a metric)
    values: Tensor | None = None  # [B,T] critic
    old_values: Tensor | None = None  # [B,T] critic before the update
    rewards: Tensor | None = None  # [B] shaped scalar reward
    token_rewards: Tensor | None = None  # [B,T]
    adv: Tensor | None = None  # [B,T]
    returns: Tensor | None = None  # [B,T]
    logp: Tensor | None = None  # [B,T] current policy (with grad), per micro-batch
    entropy: Tensor | None = None  # [B,T]
    logits: Any = None  # [B,T,V]: a tensor or a LogitRows (polgrad/components/logit_rows.py)
    ref_logits: Any = None  # [B,T,V]: a tensor or a LogitRows
    rollout: Any = None  # the sampled sequences (polgrad.rollout.hf.Rollout), same rows

    def __post_init__(self) -> None:
        b = self.mask.shape[0]
        for name, value in self._tensors():
            if value.dim() == 0 or value.shape[0] != b:
                raise ShapeError(
                    f"Batch.{name} has shape {tuple(value.shape)}; its first dimension must be B={b}"
                )

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> Batch:
        """A Batch from a mapping of field names (a Batch is returned as is)."""
        if isinstance(data, Batch):
            return data
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ShapeError(f"unknown batch field(s) {unknown}; valid fields: {', '.join(sorted(fields))}")
        return cls(**data)

    @property
    def size(self) -> int:
        """B, the number of sequences."""
        return self.mask.shape[0]

    def _tensors(self) -> Iterator[tuple[str, Tensor]]:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                yield f.name, value

    def select(self, rows: Tensor) -> Batch:
        """The rows `rows` (bool mask or int indices) of every tensor and of the rollout."""
        changes: dict[str, Any] = {name: value[rows] for name, value in self._tensors()}
        if self.rollout is not None:
            changes["rollout"] = self.rollout.select(rows)
        return dataclasses.replace(self, **changes)

    @property
    def n_groups(self) -> int:
        """How many groups (prompts) the batch holds."""
        return int(self.group_ids.unique().numel())

    def first_groups(self, k: int) -> Batch:
        """The rows of the batch's first `k` groups (smallest group ids), each group whole."""
        return self.select(torch.isin(self.group_ids, self.group_ids.unique()[:k]))

    def without_faulty_groups(self) -> Batch:
        """The batch without the groups of its faulty rewards (NaN score or baseline score: what
        `train.reward_errors = 'skip_group'` makes of them), so no group statistic sees them."""
        bad = ~torch.isfinite(self.scores)
        if self.baseline_scores is not None:
            bad |= ~torch.isfinite(self.baseline_scores)
        if not bool(bad.any()):
            return self
        return self.select(~torch.isin(self.group_ids, self.group_ids[bad]))

    @classmethod
    def concat(cls, parts: list[Batch], pad_id: int) -> Batch:
        """The rows of `parts` one after the other: [B,T] tensors right-padded with 0 to the longest
        T (masked out), the rollouts concatenated by their own `concat` (prompts left-padded with
        `pad_id`), group ids renumbered so that groups of different parts stay distinct."""
        if not parts:
            raise ShapeError("Batch.concat needs at least one batch")
        if len(parts) == 1:
            return parts[0]
        t_len = max(p.mask.shape[1] for p in parts)
        changes: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            values = [getattr(p, f.name) for p in parts]
            if all(v is None for v in values):
                continue
            if any(v is None for v in values):
                raise ShapeError(f"Batch.concat: {f.name} is set in some parts only")
            if f.name == "rollout":
                changes[f.name] = type(values[0]).concat(values, pad_id)
            elif values[0].dim() == 1:
                changes[f.name] = torch.cat(values)
            elif values[0].dim() == 2:
                changes[f.name] = torch.cat([F.pad(v, (0, t_len - v.shape[1])) for v in values])
            else:
                raise ShapeError(f"Batch.concat: cannot pad {f.name} of shape {tuple(values[0].shape)}")
        shifted = zip(parts, group_offsets([p.group_ids for p in parts]), strict=True)
        changes["group_ids"] = torch.cat([p.group_ids + o for p, o in shifted])
        return dataclasses.replace(parts[0], **changes)

    def replace(self, **changes: Any) -> Batch:
        return dataclasses.replace(self, **changes)

    # read-only mapping over the tensors that are set
    def __getitem__(self, name: str) -> Tensor:
        value = getattr(self, name, None) if isinstance(name, str) else None
        if not isinstance(value, Tensor):
            raise KeyError(name)
        return value

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._tensors())

    def __len__(self) -> int:
        return sum(1 for _ in self._tensors())
