"""Inputs a model cannot represent, and a user's own model (issue 14).

* prompts + train.max_new_tokens longer than the model's positions, and characters its tokenizer
  loses, stop the run before anything trains (`models.check_inputs`, called by build_models);
* a GPT-2 style tokenizer without a pad token pads with EOS (with a warning), and a model's
  dropout is switched off on load, so on-policy log-probs agree between two forwards;
* the SFT warm start reports its progress on stdout when there is no progress bar.

The own model is a tiny GPT-2 built from a config with a byte-level BPE tokenizer trained here
(no hub access), saved with save_pretrained.
"""

from __future__ import annotations

import json
import os
import re

import gin
import pytest
import torch

from polgrad import build, config, models, pretrain
from polgrad.errors import ConfigError, PolgradError
from polgrad.rollout import hf as hf_rollout
from polgrad.tasks.base import Example
from polgrad.tasks.synthetic import Add, Sort
from polgrad.train import run as train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRPO = os.path.join(REPO, "registry", "grpo.gin")
FAST = [
    "train.steps = 2",
    "train.prompts_per_step = 4",
    "train.eval_every = 2",
    "train.eval_size = 16",
    "train.checkpoint_every = 100",
    "train.progress = False",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def gpt2_dir(path, *, dropout: float = 0.1, positions: int = 64) -> str:
    """A tiny GPT-2 (2 layers, n_embd 32) and a GPT-2 style tokenizer (byte-level BPE, one special
    token <|endoftext|> as BOS/EOS, no pad token), saved at `path`."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["12+34=46", "sort 31524=12345", "rev 123=321"] * 10, trainer)
    eot = "<|endoftext|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eot, eos_token=eot, unk_token=eot)
    assert fast.pad_token is None
    cfg = GPT2Config(
        vocab_size=len(fast),
        n_positions=positions,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        summary_first_dropout=dropout,
        bos_token_id=fast.eos_token_id,
        eos_token_id=fast.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(str(path))
    fast.save_pretrained(str(path))
    return str(path)


def tiny_dir(path, task, *, made_for: str | None = None) -> str:
    """The (untrained) tiny default model and character tokenizer of `task`, saved at `path`;
    with `made_for`, a polgrad.json that says it is a warm start of that task."""
    model, tok = models.build_tiny(task)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    if made_for:
        models.write_info(path, {"task": made_for})
    return str(path)


def build_models_for(bindings):
    gin.clear_config()
    config.parse_config([GRPO], [*FAST, *bindings])
    cfg, algo, task = config.build()
    return build.build_models(cfg, algo, task, out_dir=".", seed_of=lambda s: s)


# ----------------------------------------------------------------------------- positions
def test_a_prompt_and_max_new_tokens_beyond_the_models_positions_stop_the_run(tmp_path):
    path = tiny_dir(tmp_path / "tiny", Add())  # 128 positions; the longest prompt '99+99=' is 7 tokens
    with pytest.raises(ConfigError) as err:
        build_models_for([f"train.policy_path = '{path}'", "train.max_new_tokens = 122"])
    msg = str(err.value)
    assert "\n" not in msg
    assert re.fullmatch(
        r"task.add: the prompt '\d{1,2}\+\d{1,2}=' is 7 tokens, so with train.max_new_tokens = 122 a "
        rf"sequence needs 129 positions, but the model at {re.escape(path)} has 128 "
        r"\(max_position_embeddings\); lower train.max_new_tokens to at most 121, or use a model with "
        r"more positions",
        msg,
    ), msg
    build_models_for([f"train.policy_path = '{path}'", "train.max_new_tokens = 121"])  # fits exactly


# ----------------------------------------------------------------------------- the tokenizer's alphabet
def test_a_warm_start_of_another_task_loses_characters_and_stops_the_run(tmp_path):
    path = tiny_dir(tmp_path / "add", Add(), made_for="add")  # digits, '+' and '=' only
    with pytest.raises(ConfigError) as err:
        build_models_for([f"train.policy_path = '{path}'", "train.task = @task.sort"])
    msg = str(err.value)
    assert "\n" not in msg
    assert re.fullmatch(
        rf"task.sort: 'sort \d{{5}}=' loses 's', 'o', 'r', 't', ' ' in the tokenizer of {re.escape(path)} "
        r"\(a warm start of task.add\), so the model can neither read nor write them; clear "
        r"train.policy_path \(polgrad then warm-starts a model for this task\) or use a tokenizer "
        r"whose alphabet covers the task",
        msg,
    ), msg


def test_what_the_tokenizer_loses_is_found_by_encoding_and_decoding():
    tok = models.build_tokenizer(Add().alphabet)
    # what the user saw: 'sort 31524=' decodes to '31524=' (UNK is dropped)
    ids = tok("sort 31524=", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "31524="
    assert models.inputs.lost_characters(tok, "sort 31524=") == ["s", "o", "r", "t", " "]
    assert models.inputs.lost_characters(tok, "12+34=") == []


def test_a_saved_character_tokenizer_reloads_as_it_was_trained(tmp_path):
    """What SFT trains with (the tokenizer build_tiny makes) is what RL reads after reloading it:
    transformers 5's AutoTokenizer took the model type's Qwen2Tokenizer and dropped the space."""
    path = tiny_dir(tmp_path / "sort", Sort())
    built = models.build_tokenizer(Sort().alphabet)
    loaded = models.load_tokenizer(path)
    for text in ["sort 31524=", "sort 00000=", "12345"]:
        assert loaded(text)["input_ids"] == built(text)["input_ids"]
    assert models.inputs.lost_characters(loaded, "sort 31524=") == []


def test_a_tokenizer_that_covers_the_task_passes(tmp_path):
    tok = models.build_tokenizer(Sort().alphabet)
    models.check_inputs(Sort(), tok, models.build_tiny(Sort())[0].config, 6, path="x", name="sort")
    gpt2 = gpt2_dir(tmp_path / "gpt2")  # byte-level: every character survives
    models.check_inputs(Sort(), models.load_tokenizer(gpt2), None, 6, path=gpt2, name="sort")


# ----------------------------------------------------------------------------- own models
def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_says_so(tmp_path, capsys):
    path = gpt2_dir(tmp_path / "gpt2")
    capsys.readouterr()
    tok = models.load_tokenizer(path)
    assert tok.pad_token == tok.eos_token == "<|endoftext|>"
    assert capsys.readouterr().err.splitlines() == [
        f"warning: the tokenizer of {path} has no pad token; padding with its EOS token "
        "'<|endoftext|>' (id 0)"
    ]
    ids, mask = models.encode_prompts(tok, ["1+2=", "10+20="])  # was: TypeError (pad id None)
    assert ids[0, 0] == tok.eos_token_id and mask[0].tolist() == [0, 0, 1, 1, 1, 1]


def test_a_tokenizer_without_pad_or_eos_is_one_line(tmp_path):
    from transformers import AutoTokenizer

    path = gpt2_dir(tmp_path / "gpt2")
    tok = AutoTokenizer.from_pretrained(path)
    tok.eos_token = None
    tok.bos_token = None
    tok.save_pretrained(path)
    with pytest.raises(PolgradError, match=r"has neither a pad nor an EOS token; add them"):
        models.load_tokenizer(path)


def _approx_kl_of_two_train_mode_forwards(path) -> float:
    """k3 estimate of KL between the sampler's log-probs (eval mode) and a train-mode forward, as the
    clip parts' approx_kl on the first (on-policy) minibatch: mean over tokens of (r - 1) - log r."""
    policy, tok = models.load_policy(path), models.load_tokenizer(path)
    examples = [Example(f"{a}+{b}=", str(a + b)) for a, b in [(1, 2), (12, 34), (5, 67), (89, 10)]]
    rollout = hf_rollout.generate(policy, tok, examples, group_size=4, max_new_tokens=6, generator_seed=0)
    assert policy.training  # generate restores train mode
    with torch.no_grad():
        logp = hf_rollout.response_logprobs(policy, rollout)
    log_ratio = (logp - rollout.rollout_logp).double() * rollout.mask
    k3 = (log_ratio.exp() - 1) - log_ratio
    return float((k3 * rollout.mask).sum() / rollout.mask.sum())


def test_dropout_is_off_so_on_policy_log_probs_agree(tmp_path):
    path = gpt2_dir(tmp_path / "gpt2", dropout=0.1)
    policy = models.load_policy(path)
    assert policy.config.resid_pdrop == policy.config.attn_pdrop == policy.config.embd_pdrop == 0.0
    assert policy.config.summary_first_dropout == 0.0
    assert all(m.p == 0.0 for m in policy.modules() if isinstance(m, torch.nn.Dropout))
    assert _approx_kl_of_two_train_mode_forwards(path) < 1e-10
    # the same model built with dropout 0 from the start: identical log-probs (nothing else changed)
    assert _approx_kl_of_two_train_mode_forwards(gpt2_dir(tmp_path / "nodrop", dropout=0.0)) < 1e-10


def test_the_no_dropout_helper_names_what_it_changed():
    from transformers import GPT2Config

    cfg = GPT2Config(resid_pdrop=0.1, embd_pdrop=0.2, attn_pdrop=0.0, summary_first_dropout=0.1)
    changed = models.loading.no_dropout(cfg)
    assert sorted(changed) == ["embd_pdrop", "resid_pdrop", "summary_first_dropout"]
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.summary_first_dropout == 0.0


@pytest.mark.slow
def test_a_gpt2_with_dropout_and_no_pad_token_trains_on_policy(tmp_path):
    """End to end with train.policy_path = a GPT-2 style checkpoint: no crash, and the first
    minibatch's approx_kl (on-policy, one epoch of one minibatch) is float noise, not dropout."""
    path = gpt2_dir(tmp_path / "gpt2", dropout=0.1)
    gin.clear_config()
    config.parse_config([GRPO], [*FAST, f"train.policy_path = '{path}'"])
    summary = train(str(tmp_path / "run"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert summary["steps"] == 2 and summary["warm_start_s"] == pytest.approx(0.0, abs=0.05)
    assert all(abs(r["clip/approx_kl"]) < 1e-10 for r in rows), [r["clip/approx_kl"] for r in rows]


# ----------------------------------------------------------------------------- the warm start's progress
def test_the_warm_start_prints_progress_lines_without_a_bar(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pretrain.sft, "SFT_LOG_EVERY", 2)
    pretrain.warm_start(
        "add", {"digits": 1}, None, sft_steps=4, batch_size=8, target_accuracy=None, seed=0,
        cache_dir=tmp_path, progress=False,
    )  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "warm start: SFT of task.add, up to 4 steps (cached once done)"
    assert [line.split(",")[0] for line in out[1:3]] == ["warm start: step 2/4", "warm start: step 4/4"]
    assert re.fullmatch(r"warm start: done, 4 steps in \d+ s, held-out greedy accuracy \d\.\d\d", out[3])
    # a cache hit trains nothing and prints nothing
    pretrain.warm_start(
        "add", {"digits": 1}, None, sft_steps=4, batch_size=8, target_accuracy=None, seed=0,
        cache_dir=tmp_path, progress=False,
    )  # fmt: skip
    assert capsys.readouterr().out == ""


def test_a_budget_too_short_for_the_answers_warns_in_one_line(capsys):
    """task.add (2 digits) has answers of up to 3 characters: with EOS 4 tokens, so max_new_tokens = 3
    cuts every 3-digit sum off (it could only score 0): one warning line naming the fix; 4 is quiet."""
    from polgrad.tasks.synthetic import Add

    task = Add()
    tok = models.build_tokenizer(task.alphabet)
    config = models.build_tiny(task)[0].config
    models.check_inputs(task, tok, config, 4, path="x", name="add")
    assert capsys.readouterr().err == ""
    models.check_inputs(task, tok, config, 3, path="x", name="add")
    err = capsys.readouterr().err.strip()
    assert err.startswith("warning: task.add: the correct response") and "\n" not in err
    assert "needs 4 tokens with EOS but train.max_new_tokens = 3" in err and "at least 4" in err
