"""Inputs a model cannot represent, found before anything trains (`check_inputs`).

Two things go wrong silently otherwise:

* a prompt plus `train.max_new_tokens` longer than the model's positions
  (`config.max_position_embeddings`): positions past the end are garbage (RoPE) or an index error
  (learned positions), and the run trains to accuracy 0;
* characters the tokenizer cannot encode: a character tokenizer maps them to UNK, which decoding
  drops ('sort 31524=' read by the tokenizer of a task.add warm start is '31524='), so the model
  never sees them and can never write them.

`check_inputs` encodes a sample of the task's prompts (train and held-out split), answers and
demonstrations with the policy's tokenizer and raises a one-line ConfigError naming the example,
the binding and the fix.
"""

from __future__ import annotations

import sys
from typing import Any

from polgrad.errors import ConfigError, PolgradError
from polgrad.models.cache import read_info
from polgrad.models.tokenizer import prompt_ids

SAMPLE_TRAIN, SAMPLE_EVAL, SAMPLE_DEMOS = 1024, 256, 64  # examples drawn (seed 0) for the checks
SHOW_CHARS = 60


def _short(text: str) -> str:
    return repr(text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS] + "...")


def check_response_room(demos: list[str], tokenizer, max_new_tokens: int, *, name) -> bool:
    """One warning line on stderr (and False) when the longest correct response of the sample, in
    tokens plus EOS, does not fit in `max_new_tokens`: such answers are cut off and score 0, so the
    run learns less and says nothing. True when they fit (or there is nothing to check)."""
    if not demos:
        return True
    lengths = [len(ids) + 1 for ids in tokenizer(demos, add_special_tokens=False)["input_ids"]]
    longest = max(range(len(demos)), key=lengths.__getitem__)
    if lengths[longest] <= max_new_tokens:
        return True
    print(
        f"warning: task.{name}: the correct response {_short(demos[longest])} needs {lengths[longest]} "
        f"tokens with EOS but train.max_new_tokens = {max_new_tokens}, so such answers are cut off and "
        f"score 0; raise train.max_new_tokens to at least {lengths[longest]}",
        file=sys.stderr,
        flush=True,
    )
    return False


def sample_texts(task) -> tuple[list[str], list[str]]:
    """(prompts, every text: prompts, answers and demonstrations) of a sample of the task's data."""
    examples = list(task.examples("train", SAMPLE_TRAIN, 0))
    try:
        examples += task.examples("eval", SAMPLE_EVAL, 0)
    except PolgradError:  # no held-out split: the evaluator says so in its own words
        pass
    prompts = list(dict.fromkeys(ex.prompt for ex in examples))
    texts = [*prompts, *dict.fromkeys(str(ex.answer) for ex in examples)]
    if hasattr(task, "demonstrations"):
        texts += [response for _, response in task.demonstrations(SAMPLE_DEMOS, 0)]
    return prompts, list(dict.fromkeys(texts))


def lost_characters(tokenizer, text: str) -> list[str]:
    """The characters of `text` that do not survive encode + decode (mapped to UNK, or dropped)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    back = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return [c for c in dict.fromkeys(text) if c not in back]


def check_positions(prompts: list[str], tokenizer, model_config, max_new_tokens: int, *, path, name) -> None:
    """ConfigError if the longest prompt (in tokens as fed: BOS or the chat template included) plus
    max_new_tokens exceeds the model's `max_position_embeddings` (nothing is checked for a model that
    does not declare it)."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions <= 0 or not prompts:
        return
    lengths = [len(prompt_ids(tokenizer, p)) for p in prompts]  # as the sampler feeds them
    longest = max(range(len(prompts)), key=lengths.__getitem__)
    need = lengths[longest] + max_new_tokens
    if need <= positions:
        return
    room = positions - lengths[longest]
    fix = (
        f"lower train.max_new_tokens to at most {room}"
        if room >= 1
        else "shorten the task's prompts (or drop the longest)"
    )
    raise ConfigError(
        f"task.{name}: the prompt {_short(prompts[longest])} is {lengths[longest]} tokens, so with "
        f"train.max_new_tokens = {max_new_tokens} a sequence needs {need} positions, but "
        f"{_model(path)} has {positions} (max_position_embeddings); {fix}, or use a model with more positions"
    )


def _model(path) -> str:
    """The model a message names: the checkpoint at `path`, or the tiny default before its warm start."""
    return f"the model at {path}" if path is not None else "the tiny default model (train.policy_path = None)"


def check_alphabet(texts: list[str], tokenizer, *, path, name) -> None:
    """ConfigError naming the first text whose characters the tokenizer loses."""
    for text in texts:
        lost = lost_characters(tokenizer, text)
        if not lost:
            continue
        made_for = read_info(path).get("task") if path is not None else None
        origin = f" (a warm start of task.{made_for})" if made_for and made_for != name else ""
        raise ConfigError(
            f"task.{name}: {_short(text)} loses {', '.join(map(repr, lost))} in the tokenizer of "
            f"{path}{origin}, so the model can neither read nor write them; clear train.policy_path "
            "(polgrad then warm-starts a model for this task) or use a tokenizer whose alphabet "
            "covers the task"
        )


def check_inputs(task, tokenizer, model_config: Any, max_new_tokens: int, *, path=None, name=None) -> None:
    """Check a sample of `task`'s data against the policy: its characters survive the tokenizer
    (encode + decode) and its prompts + `max_new_tokens` fit the model's positions (ConfigError
    otherwise), and its correct responses fit in `max_new_tokens` (a warning otherwise).

    `path` (the checkpoint) and `name` (the registered task name) are for the message."""
    name = name or getattr(task, "name", type(task).__name__)
    prompts, texts = sample_texts(task)
    check_alphabet(texts, tokenizer, path=path, name=name)
    check_positions(prompts, tokenizer, model_config, max_new_tokens, path=path, name=name)
    if hasattr(task, "demonstrations"):
        demos = [response for _, response in task.demonstrations(SAMPLE_DEMOS, 0)]
        check_response_room(demos, tokenizer, max_new_tokens, name=name)
