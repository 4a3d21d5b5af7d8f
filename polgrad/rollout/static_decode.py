"""A lean single-token decode step for Qwen2/Llama-style models: the hot loop of `hf.generate`.

Why. On the bench workload (64 rows, 4 layers, hidden 128) one token of the Hugging Face forward
costs 3.5-5 ms while its matmuls are ~0.1 GFLOP: the step is overhead-bound (results/bench/profile.md).
`DynamicCache` grows by `torch.cat` every token (O(L^2) copying per rollout), grouped-query K/V are
re-expanded by `repeat_kv` every token, a 4-D mask is rebuilt and RoPE cos/sin are recomputed.

What. `StaticDecoder(model, batch, max_len)` reads the model's own parameters (no copy except the
concatenated q|k|v and gate|up weights, rebuilt per rollout so they always match the trained weights)
and decodes with

    a K/V cache preallocated as [B, n_kv, max_len, head_dim] per layer and written in place,
    one q|k|v matmul and one gate|up matmul per layer,
    SDPA with enable_gqa=True (no K/V copies), a boolean key mask built once, a RoPE table built once.

The arithmetic is that of the HF layer (RMSNorm in fp32 then cast, rotate_half RoPE scaled by the
rotary's attention_scaling, softmax(QK^T/sqrt(d)) V, SwiGLU), so the logits equal the HF forward's up
to float reassociation (tests/rollout/test_rollout.py compares them step by step, teacher-forced).
The prompt is prefilled by the HF forward itself and its K/V copied into the static cache.

When. `StaticDecoder.unsupported(model)` returns why the lean path cannot be used (another
architecture, RoPE scaling other than the default, sliding-window attention, ZeRO-3-partitioned or
meta parameters, ...) or None; `hf.generate` then falls back to the generic HF loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Architectures whose decoder layer is exactly: x += o(attn(rope(q), rope(k), v)) on RMSNorm(x),
# x += down(silu(gate) * up) on RMSNorm(x), with optional q/k/v biases and no q/k norms.
SUPPORTED_ARCHITECTURES = ("Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")


class StaticDecoder:
    """Decode state for one rollout: the static K/V cache, the key mask and the RoPE table."""

    @staticmethod
    def unsupported(model) -> str | None:
        """Why `model` cannot use the lean decode step, or None if it can."""
        name = type(model).__name__
        if name not in SUPPORTED_ARCHITECTURES:
            return f"architecture {name} (lean decode supports {', '.join(SUPPORTED_ARCHITECTURES)})"
        cfg = model.config
        rope = getattr(cfg, "rope_scaling", None) or getattr(cfg, "rope_parameters", None) or {}
        if isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) != "default":
            return f"rope_type {rope.get('rope_type', rope.get('type'))}"
        if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
            return "sliding-window attention"
        if getattr(cfg, "hidden_act", "silu") != "silu":
            return f"hidden_act {cfg.hidden_act}"
        if getattr(model.lm_head, "bias", None) is not None:
            return "lm_head has a bias"
        mlp = model.model.layers[0].mlp
        if any(getattr(mlp, n).bias is not None for n in ("gate_proj", "up_proj", "down_proj")):
            return "MLP biases"
        for p in model.parameters():
            if hasattr(p, "ds_id") or p.is_meta or p.numel() == 0:
                return "parameters are partitioned (ZeRO-3) or on the meta device"
        return None

    def __init__(self, model, batch: int, max_len: int, compiled: bool = False):
        """`compiled`: `step` runs `step_fixed` compiled by torch.compile (train.compile)."""
        cfg = model.config
        self.compiled = compiled
        self.m = model.model
        self.lm_head = model.lm_head.weight
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nh
        self.eps = cfg.rms_norm_eps
        self.dtype = self.lm_head.dtype
        device = self.lm_head.device
        self.layers = []
        for layer in self.m.layers:
            a, mlp = layer.self_attn, layer.mlp
            biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
            self.layers.append(
                {
                    "ln1": layer.input_layernorm.weight,
                    "ln2": layer.post_attention_layernorm.weight,
                    "wqkv": torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
                    "bqkv": None if biases[0] is None else torch.cat(biases).detach(),
                    "wo": a.o_proj.weight,
                    "bo": a.o_proj.bias,
                    "wgu": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                    "wd": mlp.down_proj.weight,
                    "k": torch.zeros(batch, self.nkv, max_len, self.hd, dtype=self.dtype, device=device),
                    "v": torch.zeros(batch, self.nkv, max_len, self.hd, dtype=self.dtype, device=device),
                }
            )
        rotary = self.m.rotary_emb
        freqs = torch.outer(
            torch.arange(max_len, dtype=torch.float32, device=device), rotary.inv_freq.float()
        )
        emb = torch.cat([freqs, freqs], -1)
        scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.cos = (emb.cos() * scale).to(self.dtype)
        self.sin = (emb.sin() * scale).to(self.dtype)
        self.max_len = max_len
        self.mask = torch.zeros(batch, 1, 1, max_len, dtype=torch.bool, device=device)
        self.t = 0
        # step_fixed's per-layer arguments, built once per rollout (the same tensors as self.layers)
        self.fixed_layers = [
            (a["ln1"], a["ln2"], a["wqkv"], a["bqkv"], a["wo"], a["bo"], a["wgu"], a["wd"], a["k"], a["v"])
            for a in self.layers
        ]

    def load_prefill(self, cache, prompt_mask: Tensor, rows: Tensor | None = None) -> None:
        """Copy the HF prefill's K/V into the static cache: row b gets the cache's row `rows[b]`.

        `cache` is a DynamicCache over [U,P] prompts, `prompt_mask` [B,P] the rows' prompt masks,
        `rows` [B] the prompt of each row (None: the cache has one row per row).
        """
        p = prompt_mask.shape[1]
        for lay, cl in zip(self.layers, cache.layers, strict=True):
            lay["k"][:, :, :p] = cl.keys if rows is None else cl.keys[rows]
            lay["v"][:, :, :p] = cl.values if rows is None else cl.values[rows]
        self.mask[:, 0, 0, :p] = prompt_mask.bool()
        self.t = p

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        return _rms(x, w, self.eps)

    @staticmethod
    def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin

    @torch.no_grad()
    def step(self, token: Tensor, position: Tensor) -> Tensor:
        """Append `token` [B] at `position` [B] (RoPE position: count of attended tokens) -> logits [B,V]."""
        b, t = token.shape[0], self.t
        if t >= self.max_len:
            raise RuntimeError(f"StaticDecoder: cache of {self.max_len} positions is full")
        if self.compiled:
            logits = _compiled_step()(
                token,
                position,
                torch.tensor([t], device=token.device),
                self.m.embed_tokens.weight,
                self.fixed_layers,
                self.mask,
                self.cos,
                self.sin,
                self.m.norm.weight,
                self.lm_head,
                (self.nh, self.nkv, self.hd, self.eps),
            )
            self.t = t + 1
            return logits
        self.mask[:, 0, 0, t] = True
        x = F.embedding(token, self.m.embed_tokens.weight)[:, None]  # [B,1,H]
        cos, sin = self.cos[position][:, None], self.sin[position][:, None]  # [B,1,D]
        nq, nk, nh = self.nh * self.hd, self.nkv * self.hd, self.nh + self.nkv
        keys = self.mask[..., : t + 1]
        for lay in self.layers:
            qkv = F.linear(self._norm(x, lay["ln1"]), lay["wqkv"], lay["bqkv"])
            qk = self._rope(qkv[:, 0, : nq + nk].view(b, nh, self.hd), cos, sin)  # q and k heads together
            q = qk[:, : self.nh, None]  # [B,nh,1,D]
            lay["k"][:, :, t] = qk[:, self.nh :]
            lay["v"][:, :, t] = qkv[:, 0, nq + nk :].view(b, self.nkv, self.hd)
            o = F.scaled_dot_product_attention(
                q,
                lay["k"][:, :, : t + 1],
                lay["v"][:, :, : t + 1],
                attn_mask=keys,
                enable_gqa=self.nh != self.nkv,
            )
            x = x + F.linear(o.transpose(1, 2).reshape(b, 1, nq), lay["wo"], lay["bo"])
            gate, up = F.linear(self._norm(x, lay["ln2"]), lay["wgu"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, lay["wd"])
        self.t = t + 1
        return F.linear(self._norm(x, self.m.norm.weight)[:, 0], self.lm_head)


def step_fixed(
    token: Tensor,
    position: Tensor,
    t: Tensor,
    embed: Tensor,
    layers: list[tuple[Tensor | None, ...]],
    mask: Tensor,
    cos_table: Tensor,
    sin_table: Tensor,
    norm_w: Tensor,
    lm_head: Tensor,
    dims: tuple[int, int, int, float],
) -> Tensor:
    """`StaticDecoder.step`'s arithmetic with fixed shapes, for torch.compile: the token is written at
    cache index `t` (a [1] tensor, not a Python int, so no recompile per token) and attention runs
    over the whole cache under the key mask (positions not yet written are masked out), so every
    token of a rollout has the same shapes. A pure function of its arguments (the caches and the
    mask are updated in place), so one compiled graph serves every StaticDecoder of a shape."""
    nh, nkv, hd, eps = dims
    b = token.shape[0]
    mask.index_fill_(3, t, True)
    x = F.embedding(token, embed)[:, None]  # [B,1,H]
    cos, sin = cos_table[position][:, None], sin_table[position][:, None]  # [B,1,D]
    nq, nk = nh * hd, nkv * hd
    for ln1, ln2, wqkv, bqkv, wo, bo, wgu, wd, k_cache, v_cache in layers:
        qkv = F.linear(_rms(x, ln1, eps), wqkv, bqkv)
        qk = StaticDecoder._rope(qkv[:, 0, : nq + nk].view(b, nh + nkv, hd), cos, sin)
        k_cache.index_copy_(2, t, qk[:, nh:, None])
        v_cache.index_copy_(2, t, qkv[:, 0, nq + nk :].view(b, nkv, 1, hd))
        o = F.scaled_dot_product_attention(
            qk[:, :nh, None], k_cache, v_cache, attn_mask=mask, enable_gqa=nh != nkv
        )
        x = x + F.linear(o.transpose(1, 2).reshape(b, 1, nq), wo, bo)
        gate, up = F.linear(_rms(x, ln2, eps), wgu).chunk(2, -1)
        x = x + F.linear(F.silu(gate) * up, wd)
    return F.linear(_rms(x, norm_w, eps)[:, 0], lm_head)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


_COMPILED: list = []


def _compiled_step():
    """`step_fixed` compiled once per process (static shapes: one graph per batch and cache size)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(step_fixed, dynamic=False))
    return _COMPILED[0]
