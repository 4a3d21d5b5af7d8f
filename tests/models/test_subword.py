"""The subword tokenizer of the tiny preset (polgrad/models/subword.py): a byte-level BPE learnt from a
task's demonstrations, and a run that trains with it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polgrad.errors import ConfigError
from polgrad.models import build_tiny, load_tokenizer
from polgrad.models.subword import base_size, build_subword_tokenizer, task_subword_tokenizer, tokens_per_char
from polgrad.models.tiny import key_kwargs, resolved_model_kwargs
from polgrad.models.tokenizer import SPECIAL_TOKENS
from polgrad.registry import get

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task():
    return get("task", "running_sum")(min_terms=5, max_terms=5, checks=0.5)


@pytest.fixture(scope="module")
def tok(task):
    return task_subword_tokenizer(task, 64)


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


def test_merges_shorten_the_texts_and_leave_every_digit_a_token_of_its_own(task, tok):
    """Qwen2's rule makes every digit, sign and newline a piece of its own: in running_sum's text only
    '####' has pieces to merge ('##', '####': 2 entries over the 20 a vocabulary of this alphabet starts
    with), so a worked answer is its characters less 3 tokens, and every token that holds a digit is
    that one digit."""
    assert base_size(task.alphabet) == 20 and len(tok) == 22  # 4 specials + 16 characters, + 2 merges
    for _, response in task.demonstrations(50, 7):
        ids = tok(response, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(response) - 3
    for piece in tok.get_vocab():
        text = tok.convert_tokens_to_string([piece])
        assert not any(ch.isdigit() for ch in text) or (len(text) == 1 and text.isdigit()), (piece, text)


def test_a_vocabulary_larger_than_the_text_can_fill_says_so(task, capsys):
    task_subword_tokenizer(task, 64)
    err = capsys.readouterr().err.strip()
    assert err == (
        "warning: subword_vocab = 64, but the task's text has merges for 22 entries only; the vocabulary "
        "has 22 (a smaller subword_vocab gives the same tokenizer)"
    ), err


def test_merges_join_the_letters_of_a_text_with_words():
    """On text with words, BPE merges letters into subwords (Qwen2's rule keeps a word, with the symbol
    before it, one piece): the words that repeat become single tokens."""
    texts = ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 20
    tok = build_subword_tokenizer("abcdefghijklmnopqrstuvwxyz ", texts, 60)
    assert tok.tokenize("the cat sat") == ["the", "Ġcat", "Ġsat"]
    assert tok.decode(tok("the dog sat on the log")["input_ids"], skip_special_tokens=True) == (
        "the dog sat on the log"
    )


def test_autotokenizer_reads_a_saved_policy_with_the_same_tokens(task, tok, tmp_path):
    """transformers' AutoTokenizer picks Qwen2Tokenizer for the tiny model (a Qwen2) and rebuilds the
    pipeline with Qwen2's own rules: what an exported policy or a vLLM engine reads. It must give the
    ids polgrad trained with."""
    from transformers import AutoTokenizer

    model, built = build_tiny(task, subword_vocab=64)
    model.save_pretrained(tmp_path)
    built.save_pretrained(tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path)
    for prompt, response in task.demonstrations(200, 11):
        assert auto(prompt + response)["input_ids"] == built(prompt + response)["input_ids"], prompt


def test_a_non_ascii_alphabet_gets_positions_for_a_token_per_byte():
    """A character no merge covers is one token per UTF-8 byte: positions and generation budgets count
    that many per character ('中' is 3 bytes), the character tokenizer one."""
    from types import SimpleNamespace

    from polgrad.models.tiny import tiny_positions

    odd = SimpleNamespace(alphabet="ab中", max_prompt_chars=100, max_response_chars=60)
    assert tokens_per_char(odd, None) == 1 and tokens_per_char(odd, 64) == 3
    assert tiny_positions(odd) == 256 and tiny_positions(odd, 3) == 512  # 2 + 160 + 1; 2 + 480 + 1
    chars = build_subword_tokenizer(odd.alphabet, ["ab", "ba"], 16)
    assert len(chars("中", add_special_tokens=False)["input_ids"]) == 3


def test_the_tokenizer_is_the_same_on_every_build_and_loads_back_as_saved(task, tok, tmp_path):
    again = task_subword_tokenizer(task, 64)
    assert again.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    for prompt, response in task.demonstrations(50, 3):
        assert loaded(prompt + response)["input_ids"] == tok(prompt + response)["input_ids"]
    assert loaded.padding_side == "left"


@pytest.mark.parametrize(
    "size, says",
    [
        (19, r"^subword_vocab = 19: .*needs at least 20 entries .*use e\.g\. 256$"),
        (0, r"^subword_vocab = 0: .*needs at least 20 entries"),
        ("256", r"^subword_vocab = '256' must be an int \(entries\), e\.g\. 256$"),
        (True, r"^subword_vocab = True must be an int"),
    ],
)
def test_a_vocabulary_too_small_or_not_a_number_is_one_line(task, size, says):
    with pytest.raises(ConfigError, match=says):
        build_subword_tokenizer(task.alphabet, ["1+2=3"], size)


@pytest.mark.parametrize("bad", ["256", 0, 2.5])
def test_a_bad_subword_vocab_binding_is_refused_before_any_warm_start(bad):
    with pytest.raises(
        ConfigError, match=r"^train\.model_kwargs\['subword_vocab'\] = .*: None .* e\.g\. 256$"
    ):
        resolved_model_kwargs({"subword_vocab": bad})


def test_the_tiny_model_gets_one_embedding_row_per_entry(task):
    model, tokenizer = build_tiny(task, subword_vocab=64)
    assert len(tokenizer) == 22 and model.config.vocab_size == 22  # the 22 entries the text fills
    assert model.get_input_embeddings().weight.shape[0] == 22


def _cache_name(monkeypatch, *args, **kw) -> str:
    """The cache entry `warm_start` would use, without training (its cache_entry stopped at once)."""
    from polgrad.pretrain import sft

    class Stop(Exception):
        pass

    seen = []

    def entry(folder, name):
        seen.append(name)
        raise Stop

    monkeypatch.setattr(sft, "cache_entry", entry)
    with pytest.raises(Stop):
        sft.warm_start(*args, **kw)
    return seen[0]


def test_warm_starts_cached_before_the_option_keep_their_keys(monkeypatch, task):
    """`subword_vocab` at its default is left out of a warm start's cache key: the default warm start of
    task.add (digits 2, seed 0) keeps the key it was cached under before the option (add-cfc982d83e686ad5,
    the entry of the committed experiments' warm starts; MODEL_CODE_VERSION 3). A subword one has a key
    of its own, which also covers the tokenizer as built (its digest)."""
    assert key_kwargs(resolved_model_kwargs({})) == {
        "hidden": 128,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "intermediate": 256,
        "seed": 0,
    }
    assert _cache_name(monkeypatch, "add", {"digits": 2}, None, seed=0) == "add-cfc982d83e686ad5"
    assert (
        _cache_name(monkeypatch, "add", {"digits": 2}, {"subword_vocab": 64}, seed=0)
        != "add-cfc982d83e686ad5"
    )


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
    built = task_subword_tokenizer(get("task", "running_sum")(min_terms=3, max_terms=3), 128)
    assert saved.backend_tokenizer.to_str() == built.backend_tokenizer.to_str()
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["eval_accuracy"] <= 1.0
