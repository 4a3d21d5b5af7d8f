"""The task contract: prompts, a verifiable reward, a held-out split, SFT demos, preference pairs.

A task is registered under kind `task` as a factory (`@register("task", "add")`) whose keyword
arguments are gin-bindable (`task.add.digits = 2`) and which returns a `Task`. Text is plain
`str`; the response never contains the EOS token (the tokenizer adds it). Everything is
deterministic given the seed, so a run is reproducible from its config alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from polgrad.errors import ConfigError

# A response is correct when its task's verifier gives it the full score: a task scores in [0, 1],
# and partial credit (a close answer, a format bonus) is below 1.
CORRECT_SCORE = 1.0


def is_correct(score: Any) -> Any:
    """Whether a task score (a float, or a tensor of them: elementwise) means a correct response:
    score >= CORRECT_SCORE. NaN (a faulty reward the run skipped) is not correct. The one definition
    behind held-out accuracy, a step's `correct_frac`, the length of right and wrong responses, and
    which reasoning-gym items a warm start may learn from."""
    return score >= CORRECT_SCORE


class Chat(str):
    """A conversational value of a preference file (TRL's list of {'role', 'content'} messages) that
    reads as its flattened text everywhere a string is expected (the reward model's pairs, logs), and
    keeps its `messages` for DPO's tokenisation (`polgrad.models.encode_pairs`), which renders them
    through the policy's chat template as TRL's DPOTrainer does."""

    messages: list[dict[str, str]]

    def __new__(cls, text: str, messages: list[dict[str, str]]) -> Chat:
        obj = super().__new__(cls, text)
        obj.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        return obj

    def __getnewargs__(self) -> tuple[str, list[dict[str, str]]]:  # pickles (Ray, subprocesses) whole
        return str(self), self.messages


@dataclass(frozen=True)
class Example:
    """One prompt and the reference answer its reward is checked against."""

    prompt: str
    answer: str


class Task(Protocol):
    name: str
    alphabet: str  # every character a prompt or response may contain (for the char tokenizer)
    max_prompt_chars: int  # longest prompt, in characters
    max_response_chars: int  # longest correct response, in characters (max_new_tokens = this + 1 for EOS)

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """`n` examples of `split` ('train' or 'eval'); the eval split never overlaps train."""
        ...

    def eval_examples(self, n: int | None) -> list[Example]:
        """Distinct held-out examples in a fixed order (no prompt twice): the whole eval split when
        `n` is None, else its first `n`. Every run of the task evaluates on the same list."""
        ...

    def reward(self, example: Example, response: str) -> float:
        """Score in [0, 1] of a decoded response (EOS stripped): 1.0 = exactly right."""
        ...

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        """(prompt, correct response) pairs for the SFT warm start, from the train split."""
        ...

    def preference_pairs(self, n: int, seed: int) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected) with chosen scoring higher than rejected, for the reward model."""
        ...

    # Optional: eval_split_size() -> int | None, how many distinct held-out prompts the task can make
    # (None: not counted), so that a train.eval_size above it is refused before any is drawn
    # (`check_eval_size`).
    # Optional: heldout_preference_pairs(n) -> list of (prompt, chosen, rejected) | None, the task's own
    # held-out pairs (prompts never trained on) for the reward model's held-out accuracy; without it
    # (or when it returns None) the reward model draws fresh pairs with another seed (task.file with
    # a preference file has it).


def check_eval_size(task: Any, n: int | None) -> None:
    """A one-line ConfigError when `n` (train.eval_size) is more than the distinct held-out prompts the
    task can make (its optional `eval_split_size()`), before any example is drawn: drawing towards a
    count the split cannot reach would run until the draw's budget gives up (minutes, gigabytes)."""
    count = getattr(task, "eval_split_size", None)
    limit = count() if n is not None and callable(count) else None
    # An empty held-out split (limit 0) is the task's own error to give (e.g. its eval_fraction is 0):
    # "at most 0" would be no fix.
    if limit and n > limit:
        where = f" ({task.path})" if getattr(task, "path", None) else ""
        raise ConfigError(
            f"train.eval_size = {n} is more than the {limit:,} distinct held-out prompts task."
            f"{getattr(task, 'name', type(task).__name__)}{where} can make; bind train.eval_size to at most "
            f"{limit}, or to None to evaluate on all of them"
        )
