"""The subword tokenizer of the tiny preset (polgrad/models/subword.py): a byte-level BPE learnt from a
task's demonstrations, and a run that trains with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polgrad.errors import ConfigError
from polgrad.models import build_tiny, load_tokenizer
from polgrad.models.subword import PIECES, base_size, build_subword_tokenizer, task_subword_tokenizer
from polgrad.models.tiny import key_kwargs, resolved_model_kwargs
from polgrad.models.tokenizer import SPECIAL_TOKENS
from polgrad.registry import get

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task():
    return get("task", "running_sum")(min_terms=5, max_terms=5, checks=0.5)


@pytest.fixture(scope="module")
def tok(task):
    return task_subword_tokenizer(task, 256)


def test_every_task_text_round_trips_and_the_specials_keep_their_ids(task, tok):
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2) and tok.padding_side == "left"
    for prompt, response in task.demonstrations(300, 7):  # other draws than the tokenizer learnt from
        ids = tok(prompt + response)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == prompt + response
    # every character of the alphabet encodes, even alone and in an order the texts never had
    text = "".join(reversed(task.alphabet))
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_merges_shorten_the_texts_and_never_cross_a_piece(task, tok):
    """A learnt vocabulary of 256 entries (20 before any merge) encodes a worked answer in fewer tokens
    than characters; no token joins a digit to a sign or holds more than 3 digits (PIECES)."""
    assert len(tok) == 256 and base_size(task.alphabet) == 20  # 4 specials + 16 characters
    demos = task.demonstrations(200, 7)
    tokens = sum(len(tok(r, add_special_tokens=False)["input_ids"]) for _, r in demos)
    chars = sum(len(r) for _, r in demos)
    assert tokens < 0.75 * chars, (tokens, chars)
    for piece in tok.get_vocab():
        if piece in SPECIAL_TOKENS:
            continue
        text = tok.convert_tokens_to_string([piece])
        digits = sum(ch.isdigit() for ch in text)
        assert digits == 0 or (digits == len(text) and digits <= 3), (piece, text, PIECES)


def test_the_tokenizer_is_the_same_on_every_build_and_loads_back_as_saved(task, tok, tmp_path):
    again = task_subword_tokenizer(task, 256)
    assert again.get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    for prompt, response in task.demonstrations(50, 3):
        assert loaded(prompt + response)["input_ids"] == tok(prompt + response)["input_ids"]
    assert loaded.padding_side == "left"


@pytest.mark.parametrize("size", [19, 0, "256", True])
def test_a_vocabulary_too_small_for_the_alphabet_is_one_line(task, size):
    with pytest.raises(ConfigError, match=r"^subword_vocab = .*needs at least 20 entries .*use e\.g\. 256$"):
        build_subword_tokenizer(task.alphabet, ["1+2=3"], size)


def test_the_tiny_model_gets_one_embedding_row_per_entry(task):
    model, tokenizer = build_tiny(task, subword_vocab=64)
    assert len(tokenizer) == 64 and model.config.vocab_size == 64
    assert model.get_input_embeddings().weight.shape[0] == 64


def test_warm_starts_cached_before_the_option_keep_their_keys():
    """`subword_vocab` at its default (None) is left out of a warm start's cache key, so the key of
    every warm start cached before the option is what it was: the model kwargs as they were then."""
    assert key_kwargs(resolved_model_kwargs({})) == {
        "hidden": 128,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 256,
        "seed": 0,
    }
    assert key_kwargs(resolved_model_kwargs({"subword_vocab": 256}))["subword_vocab"] == 256


def test_a_run_trains_and_evaluates_with_the_subword_tokenizer(tmp_path):
    """The whole loop on the subword tokenizer: SFT warm start, sampling, rewards from decoded text,
    log-probs, update, held-out accuracy; the responses are counted in subword tokens (fewer than the
    characters of the answers they decode to)."""
    import gin

    from polgrad.config import parse_config
    from polgrad.train import run as train

    gin.clear_config()
    parse_config(
        [str(REPO / "registry" / "grpo.gin")],
        [
            "train.task = @task.running_sum",
            "task.running_sum.min_terms = 3",
            "task.running_sum.max_terms = 3",
            "train.model_kwargs = {'subword_vocab': 128}",
            "train.sft_steps = 30",
            "train.sft_stop_at_target = False",
            "train.steps = 2",
            "train.prompts_per_step = 4",
            "train.eval_every = 100",
            "train.eval_size = 16",
            "train.progress = False",
        ],
    )
    out = tmp_path / "run"
    train(str(out), resume=False)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["response_len"] > 0 for r in rows)
    saved = load_tokenizer(out / "final")
    assert len(saved) == 128
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
