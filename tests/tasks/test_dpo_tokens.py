"""DPO's tokenisation equals TRL's DPOTrainer's (TRL 1.16, `DPOTrainer._prepare_dataset` and
`DataCollatorForPreference`, run on the same rows): string and conversational preference data, with
and without a chat template, on a subword tokenizer where merges cross the prompt/response boundary.

TRL's rule: a conversational row is rendered through the chat template (the prompt with the
generation prompt; each response is what the whole conversation adds after it, so it ends with the
template's end-of-turn text, no EOS); a string row is tokenised raw (no template) with EOS appended;
the response starts at the common prefix of the prompt alone and prompt + response."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from polgrad import models
from polgrad.tasks.base import Chat
from polgrad.tasks.files import read_preferences

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer", reason="TRL is a test extra (bash .ci/setup --test)")
datasets = pytest.importorskip("datasets")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS, PAD = "<|endoftext|>", "<|pad|>"

CORPUS = [
    "The answer is 42. The answer isn't 41.",
    "What is two plus two? Two plus two is four, not five.",
    "Paris is the capital of France. Berlin isn't.",
] * 20


@pytest.fixture(scope="module")
def subword():
    """A byte-level BPE tokenizer trained offline on a few sentences (merges such as ' is', 'n't'
    cross the prompt/response boundary of the rows below), with a ChatML-style template whose
    end of turn (<|im_end|>) is not its EOS (<|endoftext|>), as in Qwen2.5's base tokenizer (the
    Instruct one's EOS is <|im_end|>): the two must not be confused."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tk_models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(tk_models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = [PAD, EOS, "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS, pad_token=PAD)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    assert len(tok("The answer is")["input_ids"]) < len("The answer is")  # it merges
    return tok


STRING_ROWS = [
    {"prompt": "The answer", "chosen": " is 42.", "rejected": " isn't 42."},
    {"prompt": "The answer is", "chosen": "n't 41.", "rejected": " 41."},  # 'is' + "n't" merge
    {"prompt": "What is two plus two?", "chosen": " Two plus two is four.", "rejected": " Five."},
]
CHAT_ROWS = [
    {
        "prompt": [{"role": "user", "content": "What is two plus two?"}],
        "chosen": [{"role": "assistant", "content": "Four."}],
        "rejected": [{"role": "assistant", "content": "Five, not four."}],
    },
    {  # multi-turn: TRL renders each turn
        "prompt": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "The capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Germany?"},
        ],
        "chosen": [{"role": "assistant", "content": "Berlin."}],
        "rejected": [{"role": "assistant", "content": "Paris isn't."}],
    },
]


def _trl(tok, rows):
    """TRL's own processing of `rows`: (input_ids, attention_mask, completion_mask), chosen rows first."""
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, truncation_mode="keep_start")
    owner = SimpleNamespace(_tokenizer=tok)
    data = trl_dpo.DPOTrainer._prepare_dataset(owner, datasets.Dataset.from_list(rows), tok, args, "train")
    batch = trl_dpo.DataCollatorForPreference(pad_token_id=tok.pad_token_id).torch_call(list(data))
    return batch["input_ids"], batch["attention_mask"], batch["completion_mask"]


def _ours(tok, tmp_path, rows, as_chat=False):
    """polgrad's: the rows written as a JSON-lines preference file, read as task.file reads it."""
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return models.encode_pairs(tok, read_preferences(path, "train"), as_chat=as_chat)


def _assert_same(ours, theirs):
    for name, a, b in zip(
        ("input_ids", "attention_mask", "response/completion mask"), ours, theirs, strict=True
    ):
        assert a.shape == b.shape and torch.equal(a, b.to(a.dtype)), f"{name} differs:\n{a}\n{b}"


def test_string_rows_are_raw_with_eos_as_in_trl_with_and_without_a_template(subword, tmp_path):
    ours = _ours(subword, tmp_path, STRING_ROWS)
    _assert_same(ours, _trl(subword, STRING_ROWS))
    assert ours[0][0, ours[2][0].bool()].tolist()[-1] == subword.eos_token_id  # the chosen ends with EOS
    im_start = subword.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in ours[0].tolist()[0]  # no template on a string prompt (TRL leaves it raw)
    subword_raw = models.load_tokenizer(_saved(subword, tmp_path), chat_template=False)
    _assert_same(_ours(subword_raw, tmp_path, STRING_ROWS), _trl(subword_raw, STRING_ROWS))
    # Row 1 merges across the boundary ('is' + "n't"): the prompt alone does not prefix prompt + response,
    # so the response starts where they part, inside the prompt's own tokens.
    head = subword("The answer is")["input_ids"]
    joint = subword("The answer is" + "n't 41." + EOS)["input_ids"]
    assert joint[: len(head)] != head
    prompt_len = int((ours[1][1] - ours[2][1]).sum())  # attended, not response
    assert prompt_len < len(head) and ours[0][1, :prompt_len].tolist() == joint[:prompt_len]


def test_conversational_rows_go_through_the_template_and_end_with_its_end_of_turn(subword, tmp_path):
    ours = _ours(subword, tmp_path, CHAT_ROWS)
    _assert_same(ours, _trl(subword, CHAT_ROWS))
    chosen = ours[0][0, ours[2][0].bool()].tolist()
    assert subword.decode(chosen) == "Four.<|im_end|>\n"  # the template's end of turn, not EOS
    assert subword.eos_token_id not in chosen


def test_conversational_rows_without_a_template_are_their_text_as_a_string_row_in_trl(subword, tmp_path):
    """TRL cannot render a conversation without a template; polgrad reads it as its text (a lone user
    message is its content, a response its assistant contents), which TRL tokenises as a string row."""
    raw = models.load_tokenizer(_saved(subword, tmp_path), chat_template=False)
    columns = ("prompt", "chosen", "rejected")
    as_text = [
        {k: str(v) for k, v in zip(columns, pair, strict=True)} for pair in _pairs(tmp_path, CHAT_ROWS)
    ]
    assert as_text[0] == {"prompt": "What is two plus two?", "chosen": "Four.", "rejected": "Five, not four."}
    _assert_same(_ours(raw, tmp_path, CHAT_ROWS), _trl(raw, as_text))


def test_chat_template_true_renders_string_rows_as_one_user_and_one_assistant_turn(subword, tmp_path):
    as_chat = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in STRING_ROWS
    ]
    _assert_same(_ours(subword, tmp_path, STRING_ROWS, as_chat=True), _trl(subword, as_chat))


def test_a_character_tokenizer_gets_encode_sequences_rows():
    """The built-in tasks (character tokenizer, no template): BOS + prompt, response + EOS, exactly the
    rows DPO trained on before it followed TRL (and what SFT and the reward model use)."""
    tok = models.build_tokenizer("0123456789+= ")
    pairs = [("1+2=", "3", "4"), ("10+20=", "30", "3")]
    prompts = [p for p, _, _ in pairs]
    want = models.encode_sequences(
        tok, prompts + prompts, [c for _, c, _ in pairs] + [r for _, _, r in pairs]
    )
    _assert_same(models.encode_pairs(tok, pairs), want)


def test_a_chat_value_pickles_whole_and_reads_as_its_text():
    import pickle

    c = Chat("hi", [{"role": "user", "content": "hi"}])
    back = pickle.loads(pickle.dumps(c))
    assert back == "hi" and isinstance(back, Chat) and back.messages == [{"role": "user", "content": "hi"}]
    assert json.dumps(c) == '"hi"'


def _pairs(tmp_path, rows):
    path = tmp_path / "prefs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_preferences(path, "train")


def _saved(tok, tmp_path):
    where = tmp_path / "tok"
    tok.save_pretrained(where)
    return where


@pytest.mark.parametrize(("chat_template", "as_chat"), [(None, False), (False, False), (True, True)])
def test_the_offline_step_tokenises_its_pairs_this_way(monkeypatch, chat_template, as_chat):
    """pair_step hands the task's pairs (with their Chat values) and train.chat_template = True as
    `as_chat` to encode_pairs; stopped there by the spy (nothing else of the step is under test)."""
    from polgrad import offline

    seen = {}

    class Stop(Exception):
        pass

    def spy(tokenizer, pairs, as_chat=False):
        seen.update(tokenizer=tokenizer, pairs=pairs, as_chat=as_chat)
        raise Stop

    pairs = [(Chat("q", [{"role": "user", "content": "q"}]), "a", "b")]
    task = SimpleNamespace(preference_pairs=lambda n, seed: pairs)
    cfg = SimpleNamespace(prompts_per_step=1, chat_template=chat_template)
    m = SimpleNamespace(tokenizer=object())
    monkeypatch.setattr(offline, "encode_pairs", spy)
    with pytest.raises(Stop):
        offline.pair_step(cfg, None, m, task, seed=0, state=None)
    assert seen == {"tokenizer": m.tokenizer, "pairs": pairs, "as_chat": as_chat}


def test_string_pairs_trained_raw_beside_a_templated_evaluation_are_one_warning(monkeypatch, capsys):
    """Under train.chat_template = None a policy with a template is sampled and evaluated through it,
    while DPO trains string pairs raw (TRL's rule): one warning line per process saying how to align
    them; none for conversational pairs or an explicit True / False."""
    from polgrad import offline

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(offline, "encode_pairs", stop)
    monkeypatch.setattr(offline, "_WARNED", set())
    templated = SimpleNamespace(chat_template="{{ x }}")
    chat = [(Chat("q", [{"role": "user", "content": "q"}]), "a", "b")]

    def step(pairs, chat_template):
        task = SimpleNamespace(preference_pairs=lambda n, seed: pairs)
        cfg = SimpleNamespace(prompts_per_step=1, chat_template=chat_template)
        with pytest.raises(Stop):
            offline.pair_step(cfg, None, SimpleNamespace(tokenizer=templated), task, seed=0, state=None)
        return capsys.readouterr().err

    assert step(chat, None) == "" and step([("q", "a", "b")], True) == ""
    assert step([("q", "a", "b")], False) == ""
    err = step([("q", "a", "b")], None)
    assert (
        err.startswith("warning: DPO trains string preference pairs raw, as TRL does")
        and err.count("\n") == 1
    )
    assert step([("q", "a", "b")], None) == ""  # once
