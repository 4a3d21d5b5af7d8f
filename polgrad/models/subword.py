"""A subword tokenizer for the tiny preset: byte-level BPE trained offline on a task's own text.

The character tokenizer (polgrad/models/tokenizer.py) gives one token per character, so a worked
answer of 90 characters is 90 tokens and every vocabulary entry is a character. Real policies read
text in subword pieces (Qwen2.5's 151,936 entries, Llama-3's 128,256) learnt by byte-pair encoding
(Sennrich et al. 2016, "Neural Machine Translation of Rare Words with Subword Units"; byte-level as in
GPT-2, Radford et al. 2019). `build_subword_tokenizer` learns such a vocabulary with the `tokenizers`
library from the task's demonstrations, offline, in about a second:

    specials     PAD, BOS, EOS, UNK at ids 0-3, as the character tokenizer's
    alphabet     the byte-level symbols of every character of `task.alphabet` (so every text the task
                 can produce encodes without UNK), then those the training texts add
    merges       the most frequent adjacent pairs of the training texts, until `vocab_size` entries
                 (fewer if the texts run out of pairs seen at least twice)
    pre-split    before merging, text is cut into pieces no merge crosses: Qwen2's own rule
                 (transformers' PRETOKENIZE_REGEX: every digit a piece of its own, as Qwen2.5 reads
                 numbers; letters with one leading symbol; other symbols with one leading space;
                 newlines; whitespace), so that transformers' Qwen2Tokenizer, which
                 `AutoTokenizer.from_pretrained` picks for the tiny model (a Qwen2) and rebuilds from
                 the saved vocabulary and merges with that rule, encodes exactly as this tokenizer:
                 an exported policy or a vLLM engine reads the same tokens. Merges join signs,
                 spaces and '####', not digits: a worked running_sum answer is about as many tokens
                 as characters (0.96 per character at 256 entries), as Qwen2.5's would be
    pipeline     BOS prepended; a byte-level decoder, so decode(encode(t)) == t for every text

The texts are `SUBWORD_DEMOS` demonstrations (prompt + response) drawn with `SUBWORD_SEED`, the same
for every warm-start seed: like a real model's, the tokenizer is fixed before any training, and the
paired seeds of an experiment share it. Saved with the policy (`save_pretrained`), it loads back with
`load_tokenizer` as saved (a generic fast tokenizer), and with `AutoTokenizer` the same.

A sampled response may split a text in a way the tokenizer itself would not (a non-canonical
tokenization, e.g. '##' '##' for '####'); the policy's log-probs and a reward model both read the
sampled ids, as in RL on any subword model. The character tokenizer has one split per text.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from polgrad.checks import is_int
from polgrad.errors import ConfigError
from polgrad.models.tokenizer import BOS, SPECIAL_TOKENS, UNK, _byte_level, fast_tokenizer

SUBWORD_DEMOS = 4096  # demonstrations the tokenizer learns from
SUBWORD_SEED = 0  # their seed: one tokenizer per task configuration, whatever the warm start's seed


def base_size(alphabet: str) -> int:
    """The entries every subword vocabulary of `alphabet` holds before any merge: the 4 specials and
    the distinct byte-level symbols of its characters."""
    return len(SPECIAL_TOKENS) + len({s for c in dict.fromkeys(alphabet) for s in _byte_level(c)})


def build_subword_tokenizer(alphabet: str, texts: Sequence[str], vocab_size: int):
    """A byte-level BPE `PreTrainedTokenizerFast` of at most `vocab_size` entries learnt from `texts`
    (see the module docstring); `padding_side` 'left'. A `vocab_size` below `base_size(alphabet)`, an
    empty alphabet or no texts is a one-line ConfigError."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ConfigError("the task alphabet is empty: a tokenizer needs at least one character")
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if clash:
        raise ConfigError(
            f"the task alphabet contains special-token strings {clash}; remove them from the task's text"
        )
    need = base_size(alphabet)
    if not is_int(vocab_size):
        raise ConfigError(f"subword_vocab = {vocab_size!r} must be an int (entries), e.g. {max(256, need)}")
    if vocab_size < need:
        raise ConfigError(
            f"subword_vocab = {vocab_size}: a subword vocabulary of this task needs at least {need} "
            f"entries (4 specials and the {need - 4} byte symbols of its alphabet); use e.g. {max(256, need)}"
        )
    if not texts:
        raise ConfigError("build_subword_tokenizer: no texts to learn the merges from; pass the task's text")
    symbols = sorted({s for c in chars for s in _byte_level(c)})
    tok = Tokenizer(models.BPE(unk_token=UNK, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=symbols,
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    if tok.get_vocab_size() < vocab_size:  # the texts ran out of pairs seen twice
        print(
            f"warning: subword_vocab = {vocab_size}, but the task's text has merges for "
            f"{tok.get_vocab_size()} entries only; the vocabulary has {tok.get_vocab_size()} (a smaller "
            "subword_vocab gives the same tokenizer)",
            file=sys.stderr,
            flush=True,
        )
    return fast_tokenizer(tok)


def tokens_per_char(task, subword_vocab: int | None) -> int:
    """The most tokens one character of `task` can take: 1 with the character tokenizer, its most UTF-8
    bytes with a subword one (a character no merge covers is one token per byte)."""
    if subword_vocab is None:
        return 1
    return max((len(c.encode("utf-8")) for c in task.alphabet), default=1)


def task_subword_tokenizer(task, vocab_size: int):
    """`build_subword_tokenizer` of `task`: its alphabet, and the prompt + response of
    `SUBWORD_DEMOS` demonstrations drawn with `SUBWORD_SEED`."""
    demos = task.demonstrations(SUBWORD_DEMOS, SUBWORD_SEED)
    return build_subword_tokenizer(task.alphabet, [p + r for p, r in demos], vocab_size)
