"""Chat templates: a tokenizer with one gets each prompt as a user message rendered by it, in sampling
and in training on fixed text; train.chat_template = False (load_tokenizer(chat_template=False)) and
the tiny default (no template) feed prompts raw, BOS first, as before."""

from __future__ import annotations

import pytest
import torch

import polgrad  # noqa: F401
from polgrad import models
from polgrad.errors import ConfigError
from polgrad.registry import get
from polgrad.rollout.hf import generate
from polgrad.tasks.base import Example
from polgrad.train_config import TrainConfig

# A template over the tiny tokenizer's own characters (every character must be in its alphabet):
# '[u]<prompt>[a]' per user message, then '[a]' as the generation prompt.
ALPHABET = "0123456789+=[]ua"
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'][0] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[a]{% endif %}"
)


def _tokenizer(template: str | None):
    tok = models.build_tokenizer(ALPHABET)
    tok.chat_template = template
    return tok


def _chars(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def test_prompt_rendered_through_the_chat_template():
    tok = _tokenizer(TEMPLATE)
    assert models.prompt_ids(tok, "23+58=") == _chars(tok, "[u]23+58=[a]")  # no BOS: the template's own
    raw = _tokenizer(None)
    assert models.prompt_ids(raw, "23+58=") == [raw.bos_token_id, *_chars(raw, "23+58=")]


def test_encode_prompts_and_sequences_use_the_template():
    tok = _tokenizer(TEMPLATE)
    ids, mask = models.encode_prompts(tok, ["1+2=", "10+20="])
    want = _chars(tok, "[u]1+2=[a]")
    assert ids[0, -len(want) :].tolist() == want and mask[0].sum() == len(want)
    assert ids[0, 0] == tok.pad_token_id and mask[0, 0] == 0  # left-padded to the longer prompt
    ids, attn, resp = models.encode_sequences(tok, ["1+2="], ["3"])
    prompt = _chars(tok, "[u]1+2=[a]")
    assert ids[0].tolist() == [*prompt, tok.convert_tokens_to_ids("3"), tok.eos_token_id]
    assert resp[0].tolist() == [0] * len(prompt) + [1, 1]  # the response and its EOS


def test_load_tokenizer_keeps_or_drops_the_template(tmp_path):
    _tokenizer(TEMPLATE).save_pretrained(tmp_path)
    assert models.load_tokenizer(tmp_path).chat_template == TEMPLATE
    off = models.load_tokenizer(tmp_path, chat_template=False)
    assert off.chat_template is None
    assert models.prompt_ids(off, "1+2=") == [off.bos_token_id, *_chars(off, "1+2=")]


def test_sampling_feeds_the_rendered_prompt():
    """The HF sampler's rollout starts from the rendered prompt (and the model sees it)."""

    class Task:
        alphabet, max_prompt_chars, max_response_chars = ALPHABET, 12, 4

    tok = _tokenizer(TEMPLATE)
    model, _ = models.build_tiny(Task())
    model.resize_token_embeddings(len(tok))
    out = generate(model, tok, [Example("1+2=", "3")], group_size=2, max_new_tokens=3, generator_seed=0)
    want = _chars(tok, "[u]1+2=[a]")
    assert out.prompt_ids.shape[1] == len(want)
    assert out.prompt_ids.tolist() == [want, want]
    assert torch.equal(out.prompt_mask, torch.ones_like(out.prompt_mask))


def test_train_chat_template_must_be_a_bool():
    with pytest.raises(ConfigError, match=r"train.chat_template must be None \(.*\), True or False"):
        TrainConfig(task=get("task", "add"), max_new_tokens=4, steps=1, chat_template="no").validate()


def test_the_reward_model_cache_follows_the_template_in_effect(tmp_path):
    """A cached reward model is reused only by runs that feed prompts the same way: a policy whose
    tokenizer has a chat template gets its own reward model; with train.chat_template = False it
    shares the one of the same weights without a template (whose key is that of before templates)."""
    from polgrad.pretrain import train_reward_model
    from polgrad.tasks.synthetic import Add

    task = Add(digits=1)
    model, tok = models.build_tiny(task)
    model.save_pretrained(tmp_path / "p")  # one policy: only its tokenizer's template changes below

    def rm(template, **kw):
        tok.chat_template = template
        tok.save_pretrained(tmp_path / "p")
        path, _ = train_reward_model(
            tmp_path / "p",
            task,
            steps=1,
            pairs=8,
            heldout_pairs=8,
            cache_dir=tmp_path / "c",
            progress=False,
            **kw,
        )
        return path

    plain, templated = rm(None), rm("={{ messages[0]['content'] }}+")
    assert plain != templated
    assert rm("={{ messages[0]['content'] }}+", chat_template=False) == plain
    assert rm(None, chat_template=False) == plain
