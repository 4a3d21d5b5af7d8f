"""The tiny preset: a freshly initialised Qwen2ForCausalLM (~0.6M parameters, fp32, head_dim 32) and
its character tokenizer (or, with `subword_vocab`, a byte-level BPE learnt from the task's text:
polgrad/models/subword.py), built from a task (no model hub)."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from polgrad.checks import is_int
from polgrad.errors import ConfigError
from polgrad.models.threads import seeded
from polgrad.models.tokenizer import build_tokenizer

# Measured on this CPU (tiny model, 1 thread): sdpa 49 ms vs eager 53 ms per SFT step of 64, and 14.0k vs
# 12.9k tokens/s for an RL rollout of 512 rows; with 2 threads the two are equal. sdpa it is.
ATTN_IMPLEMENTATION = "sdpa"
# The tiny default's most positions. They follow the task's longest prompt and response, so without a cap
# a 5,003-character prompt made an 8,192-position model whose SFT batches (64 rows of 5,004 tokens) the
# OOM killer stopped at 24 GB: attention keeps 64 x heads (4) x S^2 fp32 scores per layer, 25.6 GB at
# S = 5,004 and 1 GiB at S = 1,024. A longer prompt is refused by models.check_inputs (its one line).
MAX_POSITIONS = 1024


def tiny_positions(task, per_char: int = 1) -> int:
    """The tiny default's `max_position_embeddings` for `task`: BOS + the longest prompt + the longest
    response + EOS, rounded up to a power of two, at least 128 and at most MAX_POSITIONS; `per_char`:
    the most tokens a character takes (subword.tokens_per_char: 1 but for a subword tokenizer of a
    non-ASCII alphabet)."""
    need = 2 + per_char * (int(task.max_prompt_chars) + int(task.max_response_chars)) + 1
    return min(MAX_POSITIONS, max(128, 2 ** math.ceil(math.log2(need))))


def build_tiny(
    task,
    *,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    subword_vocab: int | None = None,
    seed: int = 0,
):
    """A freshly initialised Qwen2ForCausalLM for `task` and its tokenizer: (model, tokenizer).

    Defaults give 596k parameters (4 layers, hidden 128, 4 query / 2 key-value heads of head_dim 32,
    SwiGLU width 256, tied input/output embeddings), fp32, sdpa attention. head_dim = hidden / heads
    must be >= 32 (vLLM's CPU kernels need it). `max_position_embeddings` is `tiny_positions(task,
    tokens_per_char(task, subword_vocab))`.

    `subword_vocab` (None: the character tokenizer) = a vocabulary size: the tokenizer is a byte-level
    BPE of that many entries learnt from the task's demonstrations (`task_subword_tokenizer`), and the
    model's embedding has one row per entry.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden % heads or heads % kv_heads:
        raise ConfigError(
            f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})"
        )
    if hidden // heads < 32:
        raise ConfigError(
            f"head_dim = hidden / heads = {hidden // heads} must be >= 32 (vLLM CPU); lower heads"
        )
    from polgrad.models.subword import task_subword_tokenizer, tokens_per_char

    if subword_vocab is None:
        tokenizer = build_tokenizer(task.alphabet)
    else:
        tokenizer = task_subword_tokenizer(task, subword_vocab)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        max_position_embeddings=tiny_positions(task, tokens_per_char(task, subword_vocab)),
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attention_dropout=0.0,
        use_cache=True,
    )
    config._attn_implementation = ATTN_IMPLEMENTATION
    with seeded(seed):
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def resolved_model_kwargs(model_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """build_tiny's defaults overlaid with `model_kwargs` (so {} and the explicit defaults share a key)."""
    params = inspect.signature(build_tiny).parameters
    defaults = {k: p.default for k, p in params.items() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(model_kwargs or {}) - set(defaults))
    if unknown:
        raise ConfigError(f"unknown model kwargs {unknown}; valid: {', '.join(sorted(defaults))}")
    out = {**defaults, **(model_kwargs or {})}
    vocab = out["subword_vocab"]
    if vocab is not None and (not is_int(vocab) or vocab < 1):
        raise ConfigError(
            f"train.model_kwargs['subword_vocab'] = {vocab!r}: None (the character tokenizer) or the "
            "subword vocabulary's size, an int, e.g. 256"
        )
    return out


# model kwargs added after warm starts were cached, with the default that leaves the model as before:
# left out of a cache key at that default, so those warm starts keep their keys (`key_kwargs`)
LATER_KWARGS = {"subword_vocab": None}


def key_kwargs(model_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Resolved model kwargs as a cache key holds them: a `LATER_KWARGS` entry at its default left out."""
    return {k: v for k, v in model_kwargs.items() if not (k in LATER_KWARGS and v == LATER_KWARGS[k])}
