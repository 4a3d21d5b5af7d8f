"""Full-vocabulary logits one chunk of positions at a time: what an exact-KL part reads.

At a real vocabulary the [B,T,V] logits of a batch are the largest tensors of a step (at B x T =
2,048 positions and V = 151,936, 1.24 GB in fp32), so an exact-KL part (`kl.full`, meta
needs_logits) does not take them whole: it takes a `LogitRows`, which hands out the logits of
positions [start, stop) of the flattened B x T as a [C,V] tensor when asked:

    TensorLogits(logits)                  logits already held, [B,T,V] (small vocabularies, the
                                          spec checks' probe, tests)
    HeadLogits(hidden, weight, bias,      logits made on demand from the last hidden states
               temperature)               [B,T,H] and the output projection W [V,H] (bias [V] or
                                          None): z = (h W^T + b), in fp32 (fp64 inputs stay fp64),
                                          / temperature (0 and 1 leave z as it is). Never held whole;
                                          differentiable wrt hidden, weight and bias.
    as_logit_rows(where, name, x)         a [B,T,V] tensor wrapped, a LogitRows as it is

`.to(dtype)` sets the dtype the chunks come in (the reference casts both sides to float64, as it
always did). `CHUNK_ELEMENTS` is the number of logits (C x V) a chunk holds, shared with the fused
log-prob path (polgrad/rollout/fused_logprobs.py): 2^24, 64 MiB per fp32 [C,V] block.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from polgrad.errors import ShapeError

CHUNK_ELEMENTS = 1 << 24


def chunk_rows(vocab: int, dtype: torch.dtype = torch.float32) -> int:
    """Positions per chunk at vocabulary size `vocab`: a [C,V] block of `dtype` takes at most the
    bytes of CHUNK_ELEMENTS fp32 values (C = CHUNK_ELEMENTS // vocab in fp32, half that in fp64),
    at least 1."""
    scale = max(1, torch.finfo(dtype).bits // 32)
    return max(1, CHUNK_ELEMENTS // (max(int(vocab), 1) * scale))


@dataclasses.dataclass(frozen=True)
class TensorLogits:
    """Logits already held: [B,T,V]; `rows` slices the flattened positions."""

    logits: Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.logits.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.logits.dtype

    def rows(self, start: int, stop: int) -> Tensor:
        return self.logits.reshape(-1, self.logits.shape[-1])[start:stop]

    def to(self, dtype: torch.dtype) -> TensorLogits:
        return TensorLogits(self.logits.to(dtype))

    def pieces(self, rows: int) -> list[Tensor]:
        """The flattened logits split into [rows,V] tensors (one split: its backward joins them once)."""
        return list(self.logits.reshape(-1, self.logits.shape[-1]).split(rows))


@dataclasses.dataclass(frozen=True)
class HeadLogits:
    """Logits made a chunk at a time from the last hidden states [B,T,H] and the projection [V,H]."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None
    temperature: float = 1.0
    out_dtype: torch.dtype | None = None  # None: fp32 (fp64 hidden states: fp64)

    def __post_init__(self) -> None:
        h, w = self.hidden, self.weight
        if h.dim() != 3 or w.dim() != 2 or h.shape[-1] != w.shape[1]:
            raise ShapeError(
                f"HeadLogits: hidden [B,T,H] and weight [V,H] with the same H, got {tuple(h.shape)} and "
                f"{tuple(w.shape)}"
            )
        if self.bias is not None and self.bias.shape != w.shape[:1]:
            raise ShapeError(f"HeadLogits: bias [V] with V = {w.shape[0]}, got {tuple(self.bias.shape)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.hidden.shape[:2], self.weight.shape[0])

    @property
    def dtype(self) -> torch.dtype:
        return self.out_dtype or torch.promote_types(self.hidden.dtype, torch.float32)

    def rows(self, start: int, stop: int) -> Tensor:
        h = self.hidden.reshape(-1, self.hidden.shape[-1])[start:stop]
        # as the plain path: the projection in the model's dtype, then fp32, then / temperature
        z = F.linear(h, self.weight, self.bias).to(torch.promote_types(h.dtype, torch.float32))
        if self.temperature not in (0.0, 1.0):
            z = z / self.temperature
        return z.to(self.dtype)

    def to(self, dtype: torch.dtype) -> HeadLogits:
        return dataclasses.replace(self, out_dtype=dtype)

    def pieces(self, rows: int) -> list[HeadLogits]:
        """Chunks of `rows` positions, each a HeadLogits of one [1,C,H] piece of the hidden states, its
        logits made when `piece_logits` is called on it. The hidden states are split once, here:
        slicing them inside each chunk's checkpoint would give every chunk's backward a zero-filled
        gradient of the whole [B,T,H] (time and heap traffic growing with chunks x positions)."""
        flat = self.hidden.reshape(-1, self.hidden.shape[-1])
        return [dataclasses.replace(self, hidden=h[None]) for h in flat.split(rows)]


LogitRows = TensorLogits | HeadLogits


def piece_logits(piece) -> Tensor:
    """The [C,V] logits of one of `pieces(rows)`: a held tensor as it is, a HeadLogits chunk made."""
    if isinstance(piece, Tensor):
        return piece
    return piece.rows(0, piece.hidden.shape[1])


def as_logit_rows(where: str, name: str, x) -> LogitRows:
    """`x` as a LogitRows: a [B,T,V] tensor wrapped, a LogitRows unchanged; anything else a ShapeError."""
    if isinstance(x, TensorLogits | HeadLogits):
        return x
    if isinstance(x, Tensor) and x.dim() == 3:
        return TensorLogits(x)
    got = f"shape {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
    raise ShapeError(f"{where}: {name} must be [B,T,V] logits (a tensor or a LogitRows), got {got}")
