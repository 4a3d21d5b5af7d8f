"""HF rollout backend: the Rollout layout (padding, mask up to and including EOS, truncation, groups),
determinism per seed, and that the one-forward recompute reproduces the sampling log-probs (fp32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import polgrad
from polgrad.errors import ConfigError, ShapeError
from polgrad.models import ScalarHeadModel, build_tiny, encode_prompts, sequence_scores
from polgrad.rollout import hf
from polgrad.rollout.hf import Rollout, TokenLogprobs

MAX_NEW = 8
TOL = 1e-5  # fp32, same model, one forward vs the KV-cache loop


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def task():
    return polgrad.get("task", "add")()


@pytest.fixture(scope="module")
def model_and_tokenizer(task):
    model, tokenizer = build_tiny(task, seed=3)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def examples(task):
    # Operands of 1 and 2 digits, so prompts of different lengths are left-padded.
    return [polgrad.tasks.Example("3+4=", "7"), *task.examples("train", 5, seed=0)]


@pytest.fixture(scope="module")
def rollout(model_and_tokenizer, examples):
    model, tokenizer = model_and_tokenizer
    return hf.generate(model, tokenizer, examples, group_size=4, max_new_tokens=MAX_NEW, generator_seed=0)


def test_shapes_groups_and_prompt_padding(rollout, examples, model_and_tokenizer):
    _, tok = model_and_tokenizer
    n, g = len(examples), 4
    b = n * g
    assert isinstance(rollout, Rollout) and len(rollout) == b
    p = max(len(e.prompt) for e in examples) + 1  # + BOS
    assert rollout.prompt_ids.shape == rollout.prompt_mask.shape == (b, p)
    t = rollout.response_ids.shape[1]
    assert 1 <= t <= MAX_NEW
    for name in ("mask", "rollout_logp"):
        assert getattr(rollout, name).shape == (b, t) and getattr(rollout, name).dtype == torch.float32
    assert rollout.group_ids.dtype == torch.int64
    assert torch.equal(rollout.group_ids, torch.arange(n).repeat_interleave(g))
    assert rollout.truncated.dtype == torch.bool and rollout.truncated.shape == (b,)
    assert rollout.examples == [e for e in examples for _ in range(g)]
    assert len(rollout.texts) == b and rollout.baseline is None and rollout.baseline_texts is None
    # left padding: PAD then BOS + characters; the last prompt column is always a real token
    for i, ex in enumerate(rollout.examples):
        k = len(ex.prompt) + 1
        assert rollout.prompt_mask[i].tolist() == [0] * (p - k) + [1] * k
        assert rollout.prompt_ids[i, : p - k].eq(tok.pad_token_id).all()
        assert rollout.prompt_ids[i, p - k] == tok.bos_token_id
        assert tok.decode(rollout.prompt_ids[i, p - k + 1 :].tolist()) == ex.prompt


def test_mask_eos_truncation_and_texts(rollout, model_and_tokenizer):
    _, tok = model_and_tokenizer
    eos, pad = tok.eos_token_id, tok.pad_token_id
    t = rollout.response_ids.shape[1]
    n_trunc = int(rollout.truncated.sum())
    assert 0 < n_trunc < len(rollout), "the fixture should give both finished and truncated rows"
    for i in range(len(rollout)):
        ids, m = rollout.response_ids[i].tolist(), rollout.mask[i].tolist()
        if rollout.truncated[i]:
            assert eos not in ids and m == [1.0] * t and t == MAX_NEW
            length = t
        else:
            length = ids.index(eos) + 1  # up to AND including the first EOS
            assert m == [1.0] * length + [0.0] * (t - length)
            assert ids[length:] == [pad] * (t - length)
        assert int(rollout.response_lengths[i]) == length
        assert rollout.texts[i] == tok.decode([x for x in ids[:length] if x != eos], skip_special_tokens=True)
        assert "<|" not in rollout.texts[i]
    assert (rollout.rollout_logp[rollout.mask == 0] == 0).all()
    assert (rollout.rollout_logp[rollout.mask == 1] < 0).all()


def test_same_seed_same_rollout_other_seed_differs(model_and_tokenizer, examples, rollout):
    model, tokenizer = model_and_tokenizer
    torch.manual_seed(12345)  # the global RNG must not matter
    again = hf.generate(model, tokenizer, examples, group_size=4, max_new_tokens=MAX_NEW, generator_seed=0)
    assert torch.equal(again.response_ids, rollout.response_ids)
    assert torch.equal(again.rollout_logp, rollout.rollout_logp)
    assert again.texts == rollout.texts
    other = hf.generate(model, tokenizer, examples, group_size=4, max_new_tokens=MAX_NEW, generator_seed=1)
    assert other.texts != rollout.texts


def test_a_synced_rank_cuts_the_padding_other_ranks_made_it_decode(
    model_and_tokenizer, examples, monkeypatch
):
    """ZeRO-3 at world size > 1: every rank runs a forward until the last rank's rows are done. The
    rows of a rank that finished first do not change, and its rollout is the one an unsynced decode of
    the same rows gives, tensor for tensor and width for width (a wider one made the update's matmuls
    round differently from the async producer's at the same weights: tests/loop/test_async_ranks.py)."""
    model, tokenizer = model_and_tokenizer
    budget = 16
    kwargs = dict(group_size=2, max_new_tokens=budget, keep_distribution=True)
    for seed in range(50):  # a draw whose rows all end before the budget (the random model rambles)
        alone = hf.generate(model, tokenizer, examples[:2], generator_seed=seed, **kwargs)
        if alone.response_ids.shape[1] < budget:
            break
    else:
        raise AssertionError("no seed in 0..49 gives responses that all end before 16 tokens")
    # Another rank still decoding: the all-ranks check says "not done" up to the budget.
    monkeypatch.setattr(hf, "_all_done", lambda done, synced: False)
    synced = hf.generate(model, tokenizer, examples[:2], generator_seed=seed, **kwargs)
    for name in ("response_ids", "mask", "rollout_logp", "truncated", "policy_logp_all"):
        assert torch.equal(getattr(synced, name), getattr(alone, name)), name
    assert synced.texts == alone.texts


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8), (0.0, 1.0)])
def test_recompute_equals_rollout_logp(model_and_tokenizer, examples, temperature, top_p):
    model, tokenizer = model_and_tokenizer
    r = hf.generate(
        model,
        tokenizer,
        examples,
        group_size=3,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=MAX_NEW,
        generator_seed=5,
    )
    assert r.temperature == temperature
    with torch.no_grad():
        logp = hf.response_logprobs(model, r, temperature=temperature)
    assert logp.shape == r.mask.shape
    err = ((logp - r.rollout_logp) * r.mask).abs().max().item()
    assert err < TOL, f"max |recompute - rollout_logp| = {err}"


def test_recompute_on_tensors_microbatch_and_padding_invariance(model_and_tokenizer, rollout):
    model, _ = model_and_tokenizer
    rows = torch.tensor([0, 5, 9, 22])
    sub = rollout.select(rows)
    with torch.no_grad():
        full = hf.response_logprobs(model, rollout)
        part = hf.response_logprobs(model, sub.prompt_ids, sub.prompt_mask, sub.response_ids)
        assert ((part - full[rows]) * sub.mask).abs().max() < TOL
        # one row alone, without any left padding, gives the same log-probs
        i = 0
        keep = rollout.prompt_mask[i].bool()
        alone = hf.response_logprobs(
            model,
            rollout.prompt_ids[i, keep][None],
            rollout.prompt_mask[i, keep][None],
            rollout.response_ids[i][None],
        )
    assert ((alone[0] - full[i]) * rollout.mask[i]).abs().max() < TOL


def test_entropy_and_logits(model_and_tokenizer, rollout):
    model, _ = model_and_tokenizer
    out = hf.response_logprobs(model, rollout, temperature=0.8, with_entropy=True, return_logits=True)
    assert isinstance(out, TokenLogprobs)
    b, t = rollout.mask.shape
    v = model.config.vocab_size
    assert out.logp.shape == out.entropy.shape == (b, t) and out.logits.shape == (b, t, v)
    lp_all = F.log_softmax(out.logits, -1)  # logits come back divided by the temperature
    assert torch.allclose(lp_all.gather(-1, rollout.response_ids[..., None]).squeeze(-1), out.logp, atol=1e-6)
    assert torch.allclose(out.entropy, -(lp_all.exp() * lp_all).sum(-1), atol=1e-6)
    assert (out.entropy >= 0).all() and (out.entropy <= torch.log(torch.tensor(float(v))) + 1e-5).all()
    out.logp.sum().backward()  # differentiable
    assert model.model.embed_tokens.weight.grad is not None
    model.zero_grad(set_to_none=True)
    only = hf.response_logprobs(model, rollout, with_entropy=True)
    assert only.logits is None and only.entropy is not None


def test_temperature_zero_and_tiny_top_p_are_greedy(model_and_tokenizer, examples):
    model, tokenizer = model_and_tokenizer
    greedy = hf.generate(
        model, tokenizer, examples, group_size=3, temperature=0.0, max_new_tokens=MAX_NEW, generator_seed=0
    )
    for gid in range(len(examples)):
        rows = greedy.response_ids[greedy.group_ids == gid]
        assert (rows == rows[0]).all()
    nucleus = hf.generate(
        model,
        tokenizer,
        examples,
        group_size=3,
        temperature=1.0,
        top_p=1e-6,
        max_new_tokens=MAX_NEW,
        generator_seed=4,
    )
    assert torch.equal(nucleus.response_ids, greedy.response_ids)


def test_greedy_baseline(model_and_tokenizer, examples):
    model, tokenizer = model_and_tokenizer
    r = hf.generate(
        model,
        tokenizer,
        examples,
        group_size=3,
        max_new_tokens=MAX_NEW,
        greedy_baseline=True,
        generator_seed=2,
    )
    plain = hf.generate(model, tokenizer, examples, group_size=3, max_new_tokens=MAX_NEW, generator_seed=2)
    assert torch.equal(r.response_ids, plain.response_ids)  # the baseline does not change the samples
    greedy = hf.generate(
        model, tokenizer, examples, group_size=1, temperature=0.0, max_new_tokens=MAX_NEW, generator_seed=0
    )
    assert r.baseline_texts == [greedy.texts[i] for i in r.group_ids.tolist()]
    assert isinstance(r.baseline, Rollout) and len(r.baseline) == len(r)
    assert torch.equal(r.baseline.group_ids, r.group_ids)
    assert r.baseline.texts == r.baseline_texts


def test_values_and_scores_positions(model_and_tokenizer, rollout):
    model, _ = model_and_tokenizer
    critic = ScalarHeadModel(model.model).init_head(std=0.5, seed=0).eval()
    p, t = rollout.prompt_ids.shape[1], rollout.response_ids.shape[1]
    with torch.no_grad():
        values = hf.response_values(critic, rollout)
        full = critic(
            rollout.input_ids, torch.cat([rollout.prompt_mask, torch.ones_like(rollout.response_ids)], 1)
        )
        assert values.shape == (len(rollout), t)
        assert torch.allclose(values, full[:, p - 1 : p + t - 1], atol=1e-6)  # V(s_t) predicts token t
        scores = hf.rollout_scores(critic, rollout)
        last = p + rollout.response_lengths - 1  # the EOS, or the last token when truncated
        attn = rollout.attention_mask
        each = torch.stack(
            [
                critic(rollout.input_ids[i : i + 1, : last[i] + 1], attn[i : i + 1, : last[i] + 1])[0, -1]
                for i in range(len(rollout))
            ]
        )
    assert scores.shape == (len(rollout),)
    assert torch.allclose(scores, each, atol=1e-5)
    # zeroing the loss mask (e.g. an overlong filter) does not move where the score is read
    zeroed = rollout.select(torch.ones(len(rollout), dtype=torch.bool))
    zeroed.mask = torch.zeros_like(zeroed.mask)
    with torch.no_grad():
        assert torch.allclose(sequence_scores(critic, zeroed.input_ids, zeroed.attention_mask), scores)


def test_select_and_to(rollout):
    keep = rollout.group_ids % 2 == 0
    sub = rollout.select(keep)
    assert len(sub) == int(keep.sum())
    assert torch.equal(sub.response_ids, rollout.response_ids[keep])
    assert sub.texts == [t for t, k in zip(rollout.texts, keep.tolist(), strict=True) if k]
    assert sub.examples == [e for e, k in zip(rollout.examples, keep.tolist(), strict=True) if k]
    moved = sub.to("cpu")
    assert torch.equal(moved.mask, sub.mask) and moved.texts == sub.texts


def test_bad_arguments(model_and_tokenizer, examples, rollout):
    model, tokenizer = model_and_tokenizer
    for kwargs in ({"group_size": 0}, {"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}):
        args = {"group_size": 2, "max_new_tokens": 4, "generator_seed": 0, **kwargs}
        with pytest.raises(ConfigError):
            hf.generate(model, tokenizer, examples, **args)
    with pytest.raises(ConfigError):
        hf.generate(model, tokenizer, [], group_size=2, max_new_tokens=4, generator_seed=0)
    with pytest.raises(ShapeError):
        hf.response_logprobs(model, rollout.prompt_ids)
    with pytest.raises(ShapeError):
        hf.response_logprobs(model, rollout.prompt_ids, rollout.prompt_mask[:, 1:], rollout.response_ids)


def test_prompts_encode_like_the_rollout(model_and_tokenizer, examples, rollout):
    _, tok = model_and_tokenizer
    ids, mask = encode_prompts(tok, [e.prompt for e in examples])
    assert torch.equal(ids.repeat_interleave(4, 0), rollout.prompt_ids)
    assert torch.equal(mask.repeat_interleave(4, 0), rollout.prompt_mask)
