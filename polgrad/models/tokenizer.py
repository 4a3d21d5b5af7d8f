"""The character-level tokenizer and the token layout shared with polgrad.rollout.

A prompt is encoded as BOS + one token per character, left-padded with PAD; a response is one token
per character followed by EOS and right-padded with PAD. Position ids always count attended tokens
(`cumsum(attention_mask) - 1`), so left padding never changes a result.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

import torch

from polgrad.errors import ConfigError, DataError

PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0, 1, 2, 3; the alphabet follows from id 4


def build_tokenizer(alphabet: str, vocab_size: int | None = None):
    """A character-level `PreTrainedTokenizerFast` over `alphabet` (order kept, duplicates dropped).

    `vocab_size` (None: the specials and the characters only) pads the vocabulary with filler
    tokens `<|t{i}|>` up to that many entries, for a model at a real vocabulary size (the bench's
    32,000 and 151,936): text encodes exactly as without them (the pre-tokenizer splits text into
    single characters, and no filler is one character), and a sampled filler decodes as its name.

    Built with the `tokenizers` library in the byte-level BPE form that Hugging Face's own Qwen2,
    Llama-3 and GPT-2 tokenizers use, so that `AutoTokenizer.from_pretrained` of a saved policy
    (which picks the model type's class, Qwen2Tokenizer for the tiny model, and rebuilds its
    pipeline from the vocabulary and merges) encodes and decodes exactly as this one:

        vocabulary   specials first (ids 0-3), then one entry per character in alphabet order,
                     spelled as its UTF-8 bytes in the byte-level alphabet (' ' is 'Ġ'); a
                     character of several bytes also needs its byte pieces, which come after the
                     characters (an ASCII alphabet has none), then the fillers
        merges       only those that join the bytes of one multi-byte character, so no merge
                     crosses two characters
        pipeline     every character isolated, then byte-level; BOS prepended; a byte-level decoder

    Characters outside the alphabet encode as UNK here (Qwen2Tokenizer, which has no UNK, drops
    them). `padding_side` is 'left' (prompts are left-padded). Save with `save_pretrained(dir)`,
    reload with `load_tokenizer(dir)` or `AutoTokenizer.from_pretrained(dir)`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ConfigError("the task alphabet is empty; a character tokenizer needs at least one character")
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if clash:
        raise ConfigError(f"the task alphabet contains special-token strings {clash}")
    spelled = [_byte_level(c) for c in chars]
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *spelled])}
    merges = []
    for word in spelled:  # a multi-byte character: its bytes, joined left to right
        for k in range(1, len(word)):
            left, right = word[:k], word[k]
            for piece in (left, right):
                vocab.setdefault(piece, len(vocab))
            if (left, right) not in merges:
                merges.append((left, right))
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ConfigError(
                f"vocab_size = {vocab_size} is below the {len(vocab)} special tokens and characters "
                "of this alphabet; pass None or at least that many"
            )
        vocab.update({f"<|t{i}|>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=UNK, fuse_unk=True, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return fast_tokenizer(tok)


def fast_tokenizer(tok):
    """A `tokenizers.Tokenizer` with polgrad's specials (PAD, BOS, EOS, UNK) as a left-padding
    `PreTrainedTokenizerFast`: the form of the character and the subword tokenizers alike."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=4096,
    )


def _byte_level_form(tok):
    """`tok` rebuilt by `build_tokenizer` when it is a character tokenizer in the earlier word-level
    form and the rebuilt one gives every token the same id with the same vocabulary size; else `tok`."""
    backend = tok.backend_tokenizer
    if type(backend.model).__name__ != "WordLevel":
        return tok
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
    if [vocab.get(t) for t in SPECIAL_TOKENS] != list(range(len(SPECIAL_TOKENS))):
        return tok
    chars = [
        t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if len(t) == 1 and i >= len(SPECIAL_TOKENS)
    ]
    if not chars:
        return tok
    padded = len(vocab) > len(SPECIAL_TOKENS) + len(chars)  # fillers <|t{i}|>
    rebuilt = build_tokenizer("".join(chars), vocab_size=len(vocab) if padded else None)
    new = rebuilt.get_vocab()
    same = len(new) == len(vocab) and all(
        new.get(_byte_level(t) if len(t) == 1 else t) == i for t, i in vocab.items()
    )
    return rebuilt if same else tok


def _byte_level(text: str) -> str:
    """`text`'s UTF-8 bytes in the byte-level alphabet (GPT-2's: printable bytes as themselves, the
    others shifted to printable symbols; ' ' -> 'Ġ', newline -> 'Ċ')."""
    return "".join(_BYTE_SYMBOLS[b] for b in text.encode("utf-8"))


def _byte_symbols() -> list[str]:
    """GPT-2's bytes-to-unicode table: byte b -> its symbol."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


_BYTE_SYMBOLS = _byte_symbols()


# tokenizer_config.json's class of a tokenizer saved from a `PreTrainedTokenizerFast` (build_tokenizer):
# its tokenizer.json is the whole tokenizer, loaded as saved.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | os.PathLike, *, chat_template: bool | None = None):
    """The tokenizer saved in a checkpoint directory, left-padding. `chat_template` (train.chat_template):
    None keeps its chat template if it has one; False drops it, so prompts are fed raw (`prompt_ids`);
    True requires one: a tokenizer without it is a one-line ConfigError (not raw prompts under a
    config that says True).

    A generic fast tokenizer (polgrad's character tokenizer) is loaded exactly as saved: transformers
    5's `AutoTokenizer` picks the class of the model type instead (Qwen2Tokenizer for the tiny
    model). `build_tokenizer`'s byte-level form encodes the same under both, but a character
    tokenizer saved in the earlier word-level form (a warm start cached before it) does not: there
    Qwen2Tokenizer drops the space of 'sort 31524=' that SFT trained with. Any other tokenizer (a hub
    model's GPT2Tokenizer, ...) through `AutoTokenizer.from_pretrained`.

    A character tokenizer in the word-level form whose every token keeps its id in the byte-level form
    (an ASCII alphabet: every built-in task's) comes back in the byte-level form, so that what a run
    saves from it (final/, checkpoints) loads the standard way too; it encodes every text as before.

    A tokenizer without a pad token (GPT-2 style) pads with its EOS token, with a one-line warning
    on stderr: padding is always masked out (prompts by their attention mask, responses after
    their EOS), so the two may share an id. One with neither is a one-line DataError.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = os.path.join(str(path), "tokenizer_config.json")
    saved_class = json.load(open(config)).get("tokenizer_class") if os.path.isfile(config) else None
    loader = PreTrainedTokenizerFast if saved_class in _GENERIC_CLASSES else AutoTokenizer
    tok = loader.from_pretrained(str(path))
    if saved_class in _GENERIC_CLASSES:
        tok = _byte_level_form(tok)
    tok.padding_side = "left"
    if chat_template is False:
        tok.chat_template = None
    elif chat_template is True and not getattr(tok, "chat_template", None):
        raise ConfigError(
            f"train.chat_template = True but the tokenizer of {path} has no chat template; bind "
            "train.chat_template = None (a template when the tokenizer has one) or False (raw prompts), or "
            "use a model whose tokenizer has one"
        )
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise DataError(
                f"the tokenizer of {path} has neither a pad nor an EOS token; add them "
                "(tokenizer.add_special_tokens({'eos_token': ..., 'pad_token': ...})) and save it again"
            )
        tok.pad_token = tok.eos_token
        print(
            f"warning: the tokenizer of {path} has no pad token; padding with its EOS token "
            f"{tok.eos_token!r} (id {tok.eos_token_id})",
            file=sys.stderr,
            flush=True,
        )
    return tok


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids a prompt is fed as: with a chat template (`tokenizer.chat_template`), the prompt as
    one user message rendered by `apply_chat_template(..., add_generation_prompt=True)` (the template
    writes its own special tokens), as TRL renders a message-list prompt (TRL leaves a string raw);
    without one (the tiny default's character tokenizer, or a run with train.chat_template = False,
    whose tokenizer `load_tokenizer` loads without it), the tokenizer's own encoding: BOS + the
    prompt's tokens.

    Without transformers' warning for a prompt longer than the tokenizer's `model_max_length` (the
    tiny default's says 4096, whatever its positions): polgrad checks prompts against the model's own
    positions (models.check_inputs), so a too-long prompt gets that check's one line and no other."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=True, verbose=False)["input_ids"])


def encode_prompts(tokenizer, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's `prompt_ids` (BOS + characters for the tiny default), left-padded:
    (prompt_ids [B,P] int64, prompt_mask [B,P] int64 0/1)."""
    rows = [prompt_ids(tokenizer, p) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r) :] = 1
    return ids, mask


def encode_sequences(
    tokenizer, prompts: Sequence[str], responses: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`prompt_ids` (BOS + prompt) + response + EOS, right-padded (for training on fixed text).

    Returns (input_ids [B,S], attention_mask [B,S], response_mask [B,S]) where response_mask is 1 on
    the response characters and the EOS (the tokens that SFT is trained to predict).
    """
    if len(prompts) != len(responses):
        raise DataError(f"{len(prompts)} prompts but {len(responses)} responses")
    seqs = []
    for p, r in zip(prompts, responses, strict=True):
        tail = tokenizer(r, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append((prompt_ids(tokenizer, p), tail))
    return _right_padded(seqs, tokenizer.pad_token_id)


def _right_padded(
    seqs: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompt ids, response ids) pairs as right-padded (input_ids, attention_mask, response_mask) [B,S],
    the response mask 1 on each response's ids."""
    width = max(len(h) + len(t) for h, t in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    resp = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (h, t) in enumerate(seqs):
        ids[i, : len(h) + len(t)] = torch.tensor(h + t, dtype=torch.long)
        attn[i, : len(h) + len(t)] = 1
        resp[i, len(h) : len(h) + len(t)] = 1
    return ids, attn, resp


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _pair_ids(
    tokenizer, prompt: str, responses: Sequence[str], as_chat: bool
) -> tuple[list[int], list[list[int]]]:
    """One preference row's prompt ids and its responses' ids, tokenised as TRL's DPOTrainer
    (`_prepare_dataset`, TRL 1.16) does: see `encode_pairs`."""
    messages = getattr(prompt, "messages", None)
    if getattr(tokenizer, "chat_template", None) and (messages is not None or as_chat):
        head_turns = messages if messages is not None else [{"role": "user", "content": str(prompt)}]

        def ids(turns, **kw):
            out = tokenizer.apply_chat_template(turns, tokenize=True, return_dict=True, **kw)["input_ids"]
            return list(out)

        head = ids(head_turns, add_generation_prompt=True)
        turns = [
            getattr(r, "messages", None) or [{"role": "assistant", "content": str(r)}] for r in responses
        ]
        fulls = [ids(head_turns + t) for t in turns]
    else:
        eos = tokenizer.eos_token
        if eos is None:
            raise DataError(
                "the tokenizer has no EOS token, which ends every response of a string preference pair (as "
                "in TRL); add one (tokenizer.add_special_tokens({'eos_token': ...})) and save it again"
            )
        head = list(tokenizer(str(prompt), verbose=False)["input_ids"])
        texts = [str(r) if str(r).endswith(eos) else str(r) + eos for r in responses]
        fulls = [list(tokenizer(str(prompt) + t, verbose=False)["input_ids"]) for t in texts]
    # The responses start where the prompt alone and prompt + response first differ (a template may
    # render the prompt alone otherwise, a merge may cross the boundary): TRL's common prefix.
    n = min(_common_prefix(head, f) for f in fulls)
    return head[:n], [f[n:] for f in fulls]


def encode_pairs(
    tokenizer, pairs: Sequence[tuple[str, str, str]], as_chat: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Preference pairs (prompt, chosen, rejected) tokenised as TRL's DPOTrainer does (TRL 1.16): the
    pairs' chosen sequences in rows 0..n-1, their rejected ones in rows n..2n-1.

        conversational row (a `polgrad.tasks.base.Chat` prompt) and a tokenizer with a chat template:
            prompt = apply_chat_template(prompt, add_generation_prompt=True); each response is what
            apply_chat_template(prompt + response turns) adds after it, so it ends with the
            template's end-of-turn text (no EOS added);
        string row (or no template): prompt = tokenizer(prompt) (its BOS if the tokenizer adds one; a
            chat template is not applied to a string prompt, as in TRL), response = what
            tokenizer(prompt + response + EOS) adds after it.

    `as_chat` (train.chat_template = True) reads a string row as one user and one assistant message,
    so it too goes through the template. Where prompt + response tokenise across the boundary, the
    response starts at their common prefix with the prompt alone (TRL's `common_prefix_length`). For
    a character tokenizer this is BOS + prompt, then the response's characters and EOS, exactly
    `encode_sequences`'s rows.

    Returns (input_ids [2n,S], attention_mask [2n,S], response_mask [2n,S]) right-padded, the
    response mask 1 on each response's tokens (its EOS or end-of-turn text included).
    """
    prompts, rows = [], []
    for prompt, chosen, rejected in pairs:
        head, (c, r) = _pair_ids(tokenizer, prompt, (chosen, rejected), as_chat)
        prompts.append(head)
        rows.append((c, r))
    seqs = [(h, c) for h, (c, _) in zip(prompts, rows, strict=True)]
    seqs += [(h, r) for h, (_, r) in zip(prompts, rows, strict=True)]
    return _right_padded(seqs, tokenizer.pad_token_id)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count attended tokens only: cumsum(mask) - 1, clamped at 0 on left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
