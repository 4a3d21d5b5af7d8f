"""The lean decode step (polgrad/rollout/static_decode.py) against the Hugging Face forward it replaces.

The static cache, fused q|k|v / gate|up matmuls, GQA without K/V copies and the RoPE table must give
the logits of the HF forward with a DynamicCache, token by token, teacher-forced on the same tokens,
for Qwen2 (q/k/v biases, GQA) and Llama (no biases, MHA and GQA, an odd RoPE base), with left-padded
prompts of different lengths. Tolerance 1e-5 in fp32: the two paths run the same arithmetic per
element but may sum in another order (logits are O(1), fp32 epsilon 1.2e-7, a few hundred terms).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import polgrad
from polgrad.models import build_tiny, encode_prompts, position_ids_from_mask
from polgrad.rollout import hf
from polgrad.rollout.static_decode import StaticDecoder

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def task():
    return polgrad.get("task", "add")()


@pytest.fixture(scope="module")
def model_and_tokenizer(task):
    model, tokenizer = build_tiny(task, seed=5)
    return model.eval(), tokenizer


def _llama(vocab: int, kv_heads: int) -> LlamaForCausalLM:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=kv_heads,
        head_dim=32,
        max_position_embeddings=128,
        rope_theta=5000.0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def _teacher_forced_gap(model, prompt_ids, prompt_mask, steps: int, seed: int) -> float:
    """Max |logit difference| between StaticDecoder.step and the HF forward over `steps` random tokens."""
    b, p = prompt_ids.shape
    attn = prompt_mask.long()
    pos = position_ids_from_mask(attn)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(
            input_ids=prompt_ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True
        )
        dec = StaticDecoder(model, b, p + steps)
        dec.load_prefill(cache, prompt_mask)
        g = torch.Generator().manual_seed(seed)
        next_pos = pos[:, -1] + 1
        gap = 0.0
        for _ in range(steps):
            token = torch.randint(0, model.config.vocab_size, (b,), generator=g)
            lean = dec.step(token, next_pos)
            attn = torch.cat([attn, torch.ones(b, 1, dtype=attn.dtype)], 1)
            ref = model(
                input_ids=token[:, None],
                attention_mask=attn,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            ).logits[:, -1]
            assert lean.shape == ref.shape
            gap = max(gap, float((lean - ref).abs().max()))
            next_pos = next_pos + 1
    return gap


def _prompts(tokenizer, task):
    examples = [polgrad.tasks.Example("3+4=", "7"), *task.examples("train", 5, seed=1)]
    return encode_prompts(tokenizer, [ex.prompt for ex in examples])


def test_qwen2_logits_match_the_hf_forward(model_and_tokenizer, task):
    model, tokenizer = model_and_tokenizer
    assert StaticDecoder.unsupported(model) is None
    ids, pmask = _prompts(tokenizer, task)
    assert (pmask == 0).any(), "the prompts must include left padding"
    assert _teacher_forced_gap(model, ids, pmask, steps=12, seed=0) < TOL


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_llama_logits_match_the_hf_forward(model_and_tokenizer, task, kv_heads):
    _, tokenizer = model_and_tokenizer
    model = _llama(len(tokenizer), kv_heads)
    assert StaticDecoder.unsupported(model) is None
    ids, pmask = _prompts(tokenizer, task)
    assert _teacher_forced_gap(model, ids, pmask, steps=10, seed=1) < TOL


def test_a_wrong_cache_is_caught(model_and_tokenizer, task):
    """The comparison can fail: a decoder whose cache misses the prompt gives other logits."""
    model, tokenizer = model_and_tokenizer
    ids, pmask = _prompts(tokenizer, task)
    original = StaticDecoder.load_prefill

    def forgetful(self, cache, prompt_mask):
        original(self, cache, prompt_mask)
        for lay in self.layers:
            lay["k"].zero_()

    StaticDecoder.load_prefill = forgetful
    try:
        assert _teacher_forced_gap(model, ids, pmask, steps=3, seed=0) > 1e-3
    finally:
        StaticDecoder.load_prefill = original


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_generate_lean_and_generic_paths_agree(model_and_tokenizer, task, temperature):
    model, tokenizer = model_and_tokenizer
    examples = task.examples("train", 6, seed=2)
    kw = dict(group_size=3, max_new_tokens=10, generator_seed=7, temperature=temperature)
    lean = hf.generate(model, tokenizer, examples, **kw)
    generic = hf.generate(model, tokenizer, examples, lean_decode=False, **kw)
    # Same logits up to float reassociation; the draws use the same generator, so the tokens agree
    # unless a draw lands within ~1e-6 of a boundary between two tokens (not for this seed).
    assert torch.equal(lean.response_ids, generic.response_ids)
    assert torch.allclose(lean.rollout_logp, generic.rollout_logp, atol=TOL, rtol=0)
    assert torch.equal(lean.mask, generic.mask)


def test_unsupported_models_fall_back(model_and_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=1, vocab_size=20))
    assert "GPT2LMHeadModel" in StaticDecoder.unsupported(gpt2)
    model, _ = model_and_tokenizer
    scaled = type(model)(
        model.config.__class__(
            **{**model.config.to_dict(), "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
        )
    )
    assert "rope_type linear" in (StaticDecoder.unsupported(scaled) or "")


def test_generic_models_still_generate(model_and_tokenizer, task):
    """A model the lean step does not cover decodes through its own forward (the generic loop)."""
    _, tokenizer = model_and_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=32, n_head=1, vocab_size=len(tokenizer), n_positions=64)
    ).eval()
    examples = task.examples("train", 2, seed=3)
    out = hf.generate(gpt2, tokenizer, examples, group_size=2, max_new_tokens=5, generator_seed=0)
    again = hf.response_logprobs(gpt2, out)
    assert torch.allclose(again * out.mask, out.rollout_logp, atol=TOL, rtol=0)


def test_decode_threads_policy(model_and_tokenizer, monkeypatch):
    """One thread for small decode steps only when OpenMP threads sleep; torch's setting otherwise."""
    model, _ = model_and_tokenizer
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
        assert hf.decode_threads(model, 64) == 1
        # 2 x rows x params >= 1 GFLOP per token: both threads pay off
        rows = int(1e9 / (2 * sum(p.numel() for p in model.parameters()))) + 1
        assert hf.decode_threads(model, rows) == 2
        monkeypatch.setenv("OMP_WAIT_POLICY", "active")
        assert hf.decode_threads(model, 64) == 2
        monkeypatch.delenv("OMP_WAIT_POLICY")
        assert hf.decode_threads(model, 64) == 2
    finally:
        torch.set_num_threads(old)


def test_generate_restores_the_thread_count(model_and_tokenizer, task, monkeypatch):
    model, tokenizer = model_and_tokenizer
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        hf.generate(
            model,
            tokenizer,
            task.examples("train", 2, seed=0),
            group_size=2,
            max_new_tokens=3,
            generator_seed=0,
        )
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
