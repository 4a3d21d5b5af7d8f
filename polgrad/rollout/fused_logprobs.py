"""Token log-probs and entropy from the last hidden states, without the full logits.

At a real vocabulary the logits, not the layers, decide memory: for N scored positions and V tokens
the plain path (`hf.response_logprobs`) holds the [N,V] logits in fp32, a [N,V] log-softmax and, for
the entropy, a third [N,V] product, all kept for the backward (at N = 2,048, V = 151,936: 1.24 GB
each). `token_logprobs` computes the same quantities from the hidden states h [N,H] and the output
projection W [V,H] (the LM head, bias b [V] if any) a chunk of rows at a time, keeps for the backward
only h, W, b, the targets and the [N] entropy, and there recomputes each chunk's logits (the
chunk-and-recompute idea of fused linear-cross-entropy kernels; Liger's computes the gradients in its
forward instead). Extra memory: a few [C,V] fp32 blocks for a chunk of C rows, and in the backward an
fp32 [V,H] accumulator for W's gradient (0.54 GB at V = 151,936, H = 896). The returned entropy is
saved for the backward: modifying it in place makes autograd refuse the backward.

Per row n with z = (h_n W^T + b) / tau (tau = temperature; 0 and 1 leave z as it is), computed in
fp32 (fp64 stays fp64):

    log p_n = log_softmax(z)[y_n]                         (y_n the target token)
    H_n     = -sum_v p_v log p_v                           (entropy of the tempered distribution)

and their gradients, per row, with p = softmax(z) and upstream g (for log p) and e (for H):

    dL/dz_v = g (1[v = y_n] - p_v)  -  e p_v (log p_v + H_n)

(the second term: dH/dz_v = -p_v (z_v - E_p[z]) = -p_v (log p_v + H_n)), then dz / tau to the raw
logits, and through the projection: dL/dh = (dL/dlogits) W, dL/dW = sum_n (dL/dlogits_n)^T h_n
(accumulated in fp32 over the chunks), dL/db = sum_n dL/dlogits_n.

Shapes: hidden [N,H] (any float dtype), weight [V,H] (same dtype), bias [V] or None, targets [N]
int64 in [0, V). Returns (logp [N], entropy [N] or None), fp32 (fp64 for fp64 inputs).

The model's side (used by `hf.response_logprobs` and the offline path): `output_projection(model)`
finds the Linear that makes the logits through the run's wrappers (DeepSpeed engine, peft, the
adapter-disabled LoRA reference), or None where fusing would be wrong or impossible (another model
family, a compiled forward, LoRA on the output layer, ZeRO-3's partitioned weight: those keep the
plain full-logits path); `head_inputs(model, head, ...)` runs the model's own forward with the
projection skipped and returns its input, the last hidden states; `scored_logprobs` (what
`hf.response_logprobs` and the offline path call) takes the fused path where `fuses` says so and the
plain one otherwise.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from polgrad.components import logit_rows
from polgrad.components.logit_rows import HeadLogits, LogitRows, TensorLogits
from polgrad.errors import ShapeError
from polgrad.models.compiled import is_compiled


def default_chunk_rows(vocab: int) -> int:
    """Rows per chunk at vocabulary size `vocab`: `logit_rows.CHUNK_ELEMENTS` (2^24 logits, 64 MiB
    per fp32 [C,V] block; the exact-KL part chunks by the same number) // vocab, at least 1."""
    return logit_rows.chunk_rows(vocab)


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """(logp [N], entropy [N] or None) of `targets` under softmax((hidden W^T + bias) / temperature),
    a chunk of `chunk_rows` rows at a time (None: `default_chunk_rows(V)`), the logits recomputed in
    the backward (module docstring)."""
    where = "token_logprobs"
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ShapeError(
            f"{where}: hidden [N,H] and weight [V,H] with the same H, got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1] or targets.dtype != torch.long:
        raise ShapeError(
            f"{where}: targets [N] int64 with N = {hidden.shape[0]}, got {tuple(targets.shape)} "
            f"{targets.dtype}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ShapeError(f"{where}: bias [V] with V = {weight.shape[0]}, got {tuple(bias.shape)}")
    rows = default_chunk_rows(weight.shape[0]) if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ShapeError(f"{where}: chunk_rows must be >= 1, got {chunk_rows}")
    scale = 1.0 if temperature in (0.0, 1.0) else float(temperature)
    logp, entropy = _TokenLogprobs.apply(hidden, weight, bias, targets, scale, rows, bool(with_entropy))
    return logp, (entropy if with_entropy else None)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # bf16/fp16/fp32 -> fp32, fp64 stays


class _Blocks:
    """Two [C,V] work blocks of the compute dtype, allocated once per call and reused by every chunk
    (fresh [C,V] tensors per chunk fragment the C allocator's heap: the process's peak grew with the
    number of chunks), plus a [C,V] block of the model's dtype when that is narrower (bf16)."""

    def __init__(self, rows: int, hidden: Tensor, weight: Tensor):
        dtype = _compute_dtype(hidden.dtype)
        shape = (min(rows, hidden.shape[0]), weight.shape[0])
        self.a = torch.empty(shape, dtype=dtype, device=hidden.device)
        self.b = torch.empty(shape, dtype=dtype, device=hidden.device)
        self.narrow = (
            None if hidden.dtype == dtype else torch.empty(shape, dtype=hidden.dtype, device=hidden.device)
        )

    def log_softmax(self, h: Tensor, weight: Tensor, bias: Tensor | None, scale: float) -> Tensor:
        """log_softmax(z) of one chunk in block a, z = (h W^T + b) / scale computed as the plain path
        computes the logits: the projection in the model's dtype, then the compute dtype (fp32; fp64
        inputs stay fp64), then / temperature; then z - logsumexp(z) in place."""
        c = h.shape[0]
        z = self.a[:c]
        if self.narrow is None:
            torch.matmul(h, weight.t(), out=z)
            if bias is not None:
                z.add_(bias)
        elif bias is None:
            z.copy_(torch.matmul(h, weight.t(), out=self.narrow[:c]))
        else:  # F.linear rounds h W^T + b once to the model's dtype, as the plain path does
            z.copy_(F.linear(h, weight, bias))
        if scale != 1.0:
            z.div_(scale)
        return z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))


class _TokenLogprobs(torch.autograd.Function):
    # Memory: two [C,V] blocks of the compute dtype for the whole call (a third of the model's dtype
    # for bf16), every step in place in them.
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, rows, with_entropy):
        n = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.zeros(n, dtype=dtype, device=hidden.device)
        blocks = _Blocks(rows, hidden, weight)
        for s in range(0, n, rows):
            lp = blocks.log_softmax(hidden[s : s + rows], weight, bias, scale)
            logp[s : s + rows] = lp.gather(-1, targets[s : s + rows, None]).squeeze(-1)
            if with_entropy:  # -sum p log p, p log p in block b
                p = torch.exp(lp, out=blocks.b[: lp.shape[0]])
                entropy[s : s + rows] = -p.mul_(lp).sum(-1)
        del blocks
        ctx.save_for_backward(hidden, weight, bias, targets, entropy)
        ctx.scale, ctx.rows, ctx.with_entropy = scale, rows, with_entropy
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, targets, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        dtype = _compute_dtype(hidden.dtype)
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        rows = ctx.rows
        with torch.no_grad():
            blocks = _Blocks(rows, hidden, weight)
            for s in range(0, hidden.shape[0], rows):
                h = hidden[s : s + rows]
                lp = blocks.log_softmax(h, weight, bias, ctx.scale)  # block a
                p = torch.exp(lp, out=blocks.b[: h.shape[0]])  # block b
                g = g_logp[s : s + rows].to(dtype)[:, None]
                if ctx.with_entropy and g_entropy is not None:
                    # e p (log p + H), in block a (log p is not needed after it)
                    e = g_entropy[s : s + rows].to(dtype)[:, None]
                    term = lp.add_(entropy[s : s + rows, None]).mul_(p).mul_(e)
                else:
                    term = None
                dz = p.mul_(-g)  # -p g, in block b
                dz.scatter_add_(-1, targets[s : s + rows, None], g)
                if term is not None:
                    dz.sub_(term)
                if ctx.scale != 1.0:
                    dz.div_(ctx.scale)
                # dz is the gradient wrt the chunk's logits in the compute dtype; the model's dtype
                # (bf16) rounds it for dL/dh as the plain path's cast would, while W's gradient
                # accumulates from the unrounded dz in the compute dtype (no [V,H] temporary)
                if need_h:
                    d_logits = dz if blocks.narrow is None else blocks.narrow[: h.shape[0]].copy_(dz)
                    d_hidden[s : s + rows] = d_logits @ weight
                if need_w:
                    d_weight.addmm_(dz.t(), h.to(dtype))
                if need_b:
                    d_bias += dz.sum(0)
            del blocks
        return (
            d_hidden,
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None else d_bias.to(bias.dtype),
            None,
            None,
            None,
            None,
        )


# --------------------------------------------------------------------------- the model's side
# Model families whose causal-LM logits are exactly `lm_head(last hidden state)` (no logit
# soft-capping, logit scale or extra term after the projection): for them `response_logprobs` fuses
# the projection with the log-softmax (polgrad/rollout/fused_logprobs.py). Other families take the
# plain path, which is correct for any model and holds the [B,T,V] logits.
FUSED_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral"})


def _wrapped(model) -> list:
    """The chain of wrappers down to the Hugging Face model: a DeepSpeed engine or DDP (`.module`),
    the LoRA reference (`AdapterDisabled`, its policy), a peft model (`.base_model.model`)."""
    chain = [model]
    while True:
        m = chain[-1]
        inner = getattr(m, "_policy", None)  # polgrad.models.lora.AdapterDisabled
        inner = inner[0] if isinstance(inner, tuple) else getattr(m, "module", None)
        if not isinstance(inner, torch.nn.Module):
            base = getattr(m, "base_model", None)  # peft: PeftModel -> LoraModel -> the HF model
            inner = getattr(base, "model", None) if isinstance(base, torch.nn.Module) else None
        if not isinstance(inner, torch.nn.Module) or any(inner is c for c in chain):
            return chain
        chain.append(inner)


def fuses(head: torch.nn.Linear | None, rows: int) -> bool:
    """Whether `rows` scored positions go through `token_logprobs` with `head` (from
    `output_projection`): only when their logits exceed one chunk (rows x V >
    logit_rows.CHUNK_ELEMENTS). Below that the plain path holds no more memory than one chunk
    would, and it keeps autograd's own log-softmax backward, so runs at a small vocabulary (the
    tiny model's 16 tokens) are bit for bit what they were before the fused path existed."""
    return head is not None and rows * head.out_features > logit_rows.CHUNK_ELEMENTS


def output_projection(model) -> torch.nn.Linear | None:
    """The Linear layer that makes `model`'s logits, when `hf.response_logprobs` can fuse it with the
    log-softmax; None when the plain path must hold the logits (`plain_reason` says why):

    - the family is not in FUSED_MODEL_TYPES (its logits may be more than the projection);
    - a compiled forward (`train.compile`: the graph includes the projection);
    - the projection is not a plain `nn.Linear` (LoRA on the output layer: its weight alone is not
      the layer's map);
    - its weight is a ZeRO-3 partition (gathered only inside the model's own forward).

    Tied embeddings (the tiny model's) are fine: the weight's gradient adds to the embedding's."""
    head, _reason = _projection(model)
    return head


def plain_reason(model) -> str | None:
    """Why `output_projection(model)` is None, in words a user can act on; None when it is not."""
    return _projection(model)[1]


def _projection(model) -> tuple[torch.nn.Linear | None, str | None]:
    chain = _wrapped(model)
    hf_model = chain[-1]
    model_type = getattr(getattr(hf_model, "config", None), "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return None, (
            f"its model type {model_type!r} is not one whose logits are the output layer's product alone "
            f"(polgrad.rollout.fused_logprobs.FUSED_MODEL_TYPES: {', '.join(sorted(FUSED_MODEL_TYPES))})"
        )
    if any(is_compiled(m) for m in chain if isinstance(m, torch.nn.Module)):
        return None, "train.compile = True compiles the output layer into the model's forward"
    get = getattr(hf_model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is not torch.nn.Linear:
        return None, (
            f"its output layer is a {type(head).__name__}, not a plain Linear (LoRA on lm_head: drop "
            "'lm_head' from train.lora_target_modules)"
        )
    if hasattr(head.weight, "ds_id"):
        return None, "ZeRO-3 partitions its output layer (train.zero_stage = 3; ZeRO-2 does not)"
    return head, None


_WARNED: set[str] = set()  # the reasons already printed in this process


def _warn_plain(model, reason: str, rows: int) -> None:
    """One `warning:` line per reason and process when the plain path holds logits of more than one
    chunk: the memory the fused path would have saved, and why it was not taken."""
    if reason in _WARNED:
        return
    config = getattr(_wrapped(model)[-1], "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if rows * vocab <= logit_rows.CHUNK_ELEMENTS:
        return
    _WARNED.add(reason)
    print(
        f"warning: log-probs at V = {vocab} hold the [B,T,V] logits ({rows * vocab * 4 / 2**20:.0f} MiB per "
        f"fp32 copy for {rows} positions, several copies with their graph) because {reason}; the fused "
        "path computes them a chunk at a time instead",
        file=sys.stderr,
        flush=True,
    )


def head_inputs(
    model, head: torch.nn.Linear, input_ids: Tensor, attn: Tensor, pos: Tensor, keep: int
) -> Tensor:
    """The last hidden states [B,keep,H] the model feeds `head`, from one forward through `model`
    (every wrapper: the engine, peft, the disabled adapter) whose projection is skipped: a pre-hook
    takes the projection's input and hands it an empty sequence, so no logits are computed."""
    seen: list[Tensor] = []

    def take(_module, args):
        seen.append(args[0] if args else None)
        return (args[0][:, :0],) if args else None

    handle = head.register_forward_pre_hook(take)
    try:
        model(
            input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=keep
        )
    finally:
        handle.remove()
    if len(seen) != 1 or seen[0] is None or seen[0].dim() != 3 or seen[0].shape[1] != keep:
        raise RuntimeError(
            f"response_logprobs: the model called its output projection {len(seen)} times "
            f"(expected once on [B,{keep},H]); remove {type(_wrapped(model)[-1]).__name__}'s model_type "
            "from polgrad.rollout.fused_logprobs.FUSED_MODEL_TYPES"
        )
    return seen[0]


class TokenLogprobs(NamedTuple):
    """What `response_logprobs` returns when entropy or logits are asked for (None if not asked):
    logits [B,T,V] for `return_logits`, a LogitRows (polgrad/components/logit_rows.py) for
    `logit_rows`."""

    logp: Tensor
    entropy: Tensor | None
    logits: Tensor | LogitRows | None


def scored_logprobs(
    model,
    input_ids: Tensor,
    attn: Tensor,
    pos: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    return_logits: bool = False,
    logit_rows: bool = False,
) -> Tensor | TokenLogprobs:
    """`response_logprobs` on a whole sequence: input_ids, attn, pos [B,S] and the last T tokens'
    `targets` [B,T] (T < S), token t predicted at sequence position S - T - 1 + t. The offline (DPO)
    path scores every token after the first with it (targets = input_ids[:, 1:])."""
    b, t = targets.shape
    head, reason = (None, None) if return_logits else _projection(model)
    if reason is not None:
        _warn_plain(model, reason, b * t)
    if fuses(head, b * t):
        hidden = head_inputs(model, head, input_ids, attn, pos, t + 1)[:, :-1]
        logp, entropy = token_logprobs(
            hidden.reshape(b * t, -1),
            head.weight,
            targets.reshape(-1),
            bias=head.bias,
            temperature=temperature,
            with_entropy=with_entropy,
        )
        logp = logp.float().view(b, t)
        if not (with_entropy or logit_rows):
            return logp
        rows = HeadLogits(hidden, head.weight, head.bias, temperature) if logit_rows else None
        return TokenLogprobs(logp, entropy.float().view(b, t) if with_entropy else None, rows)
    logits = (
        model(
            input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=False, logits_to_keep=t + 1
        )
        .logits[:, :-1]
        .float()
    )
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    if not (with_entropy or return_logits or logit_rows):
        return logp
    entropy = -(logp_all.exp() * logp_all).sum(-1) if with_entropy else None
    kept = logits if return_logits else TensorLogits(logits) if logit_rows else None
    return TokenLogprobs(logp, entropy, kept)
