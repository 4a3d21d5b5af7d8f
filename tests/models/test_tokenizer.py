"""The character tokenizer saved with a policy loads the standard way: `AutoTokenizer.from_pretrained`
(which, for a Qwen2 model, picks Qwen2Tokenizer and rebuilds its pipeline from the saved vocabulary
and merges) encodes and decodes every text exactly as polgrad's `load_tokenizer` and the tokenizer as
built, on alphabets with spaces, newlines, tabs and characters of 2 to 4 UTF-8 bytes, padded to a
real vocabulary or not; a tokenizer cached in the earlier word-level form comes back in the byte-level
form with every token's id unchanged."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer, Qwen2Config

from polgrad.models.tokenizer import SPECIAL_TOKENS, build_tokenizer, load_tokenizer

ALPHABETS = {
    "sort": "sort 0123456789=",
    "ascii": "".join(chr(c) for c in range(32, 127)) + "\n\t",
    "unicode": "0123456789+= abcxyz\n×÷−éß中😀",
}


def _saved(tmp_path, tok):
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)  # as a policy folder: model_type qwen2
    return tmp_path


def _texts(alphabet: str, n: int = 400) -> list[str]:
    """Texts of the alphabet's characters (outside it, polgrad's tokenizer gives UNK and Qwen2Tokenizer,
    which has none, drops the character: the one difference, stated in build_tokenizer)."""
    rng = random.Random(0)
    fixed = [t for t in ("sort 31524=", "") if set(t) <= set(alphabet)]
    return [*fixed, *("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(n))]


@pytest.mark.parametrize("vocab_size", [None, 300], ids=["chars", "padded"])
@pytest.mark.parametrize("name", list(ALPHABETS))
def test_auto_tokenizer_encodes_and_decodes_as_polgrad(tmp_path, name, vocab_size):
    alphabet = ALPHABETS[name]
    built = build_tokenizer(alphabet, vocab_size=vocab_size)
    path = _saved(tmp_path, built)
    standard, own = AutoTokenizer.from_pretrained(path), load_tokenizer(path)
    assert type(standard).__name__ == "Qwen2Tokenizer"  # what transformers picks: the test's point
    for text in _texts(alphabet):
        ids = built(text).input_ids
        assert standard(text).input_ids == own(text).input_ids == ids, text
        assert (
            standard.decode(ids, skip_special_tokens=True)
            == own.decode(ids, skip_special_tokens=True)
            == text
        )
    # one id per character after BOS, in alphabet order from 4, and the specials first
    assert built("sort").input_ids[1:] == [built.convert_tokens_to_ids(c) for c in "sort"]
    assert [built.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert built(alphabet[0]).input_ids == [1, 4]
    assert len(built) == (vocab_size or len(built))


def _word_level(alphabet: str):
    """The character tokenizer as polgrad built it before the byte-level form: WordLevel, a Fuse decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *dict.fromkeys(alphabet)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[3]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKENS[1]} $A", special_tokens=[(SPECIAL_TOKENS[1], 1)]
    )
    pad, bos, eos, unk = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=pad, bos_token=bos, eos_token=eos, unk_token=unk, padding_side="left"
    )


def test_a_cached_word_level_tokenizer_comes_back_byte_level_with_the_same_ids(tmp_path):
    """A warm start cached before the byte-level form: `load_tokenizer` encodes every text as the cached
    tokenizer did, and what the run saves from it loads the standard way (before, AutoTokenizer dropped
    the space of 'sort 31524=')."""
    old = _word_level(ALPHABETS["sort"])
    path = _saved(tmp_path / "cached", old)
    assert AutoTokenizer.from_pretrained(path)("sort 3=").input_ids != old("sort 3=").input_ids  # the bug
    loaded = load_tokenizer(path)
    for text in _texts(ALPHABETS["sort"]):
        assert loaded(text).input_ids == old(text).input_ids, text
    again = _saved(tmp_path / "final", loaded)
    assert AutoTokenizer.from_pretrained(again)("sort 31524=").input_ids == old("sort 31524=").input_ids


def test_a_word_level_tokenizer_whose_ids_would_move_stays_as_it_was(tmp_path):
    """Non-ASCII characters need byte pieces the word-level vocabulary has no ids for: kept as cached
    (it still encodes as it did), not rebuilt with other ids."""
    old = _word_level(ALPHABETS["unicode"])
    loaded = load_tokenizer(_saved(tmp_path, old))
    assert len(loaded) == len(old) and loaded("×é 1").input_ids == old("×é 1").input_ids
    assert loaded.backend_tokenizer.decoder.__class__.__name__ == "Fuse"
