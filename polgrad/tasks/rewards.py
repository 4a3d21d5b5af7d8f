"""Reward faults: a reward that raises, or returns NaN, inf, None or a non-number, on one sample.

A task's `reward(example, response)` is user code, and a reward model can produce NaN. Every
reward polgrad computes (the loop's scores, the greedy baseline's, the held-out evaluation's) goes
through a `RewardGuard`, which checks each value and applies the run's policy,
`train.reward_errors`:

    'raise'       (default) stop with one line naming the task, the reward function, the sample
                  (prompt and response, truncated) and the problem:
                  "reward of task.add (polgrad.tasks.synthetic.Add.reward) failed on prompt '23+58=',
                  response '81': returned NaN; fix the reward, or set train.reward_errors = ..."
    'zero'        score the faulty sample 0 (warned once)
    'skip_group'  drop the prompt's whole group from the update (warned once): the score is NaN
                  here and `polgrad.trainer.collect` removes every row of its group, so no group
                  statistic sees it; in evaluation the sample counts as wrong

The guard counts faulty samples (`take()`: the count since the last take); the loop logs it per
step as `reward_errors` (summed over the ranks) and the summary its total.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from polgrad.errors import ConfigError, PolgradError

SHOW_CHARS = 60  # a prompt or response is shown up to this many characters in a message


@dataclass(frozen=True)
class RewardFault:
    """One faulty reward: which row, its text, and what went wrong ('raised ...', 'returned NaN')."""

    row: int
    prompt: str
    response: str
    problem: str


def check_value(value: Any) -> tuple[float, str | None]:
    """(the reward as a float, None) if it is a finite number, else (nan, what is wrong with it)."""
    if value is None:
        return math.nan, "returned None"
    try:  # a number: float, int, bool (0/1), numpy/torch scalars, Decimal; never a str
        if not isinstance(value, numbers.Real) and not hasattr(value, "__float__"):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        return math.nan, f"returned a non-number {repr(value)[:SHOW_CHARS]} ({type(value).__name__})"
    if math.isnan(number):
        return math.nan, "returned NaN"
    if math.isinf(number):
        return math.nan, f"returned {number}"
    return number, None


def call_reward(fn: Callable[[Any, str], Any], example: Any, response: str) -> tuple[float, str | None]:
    """`fn(example, response)` checked: (reward, None), or (nan, 'raised X: ...' / 'returned ...')."""
    try:
        value = fn(example, response)
    except Exception as e:  # noqa: BLE001 - user code: any exception is the sample's fault
        text = " ".join(str(e).split())
        return math.nan, f"raised {type(e).__name__}" + (f": {text[:120]}" if text else "")
    return check_value(value)


def qualified_name(fn: Any) -> str:
    """'module.Class.method' of a callable (what a message names as the reward function)."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{name}" if module else name


def _short(text: str) -> str:
    text = str(text)
    return repr(text if len(text) <= SHOW_CHARS else text[:SHOW_CHARS] + "...")


def _raise(guard: RewardGuard, scores: Tensor, faults: list[RewardFault], source: str) -> Tensor:
    f = faults[0]
    more = f" (and {len(faults) - 1} more in this batch)" if len(faults) > 1 else ""
    raise PolgradError(
        f"reward of {source} failed on prompt {_short(f.prompt)}, response {_short(f.response)}: "
        f"{f.problem}{more}; fix the reward, or set train.reward_errors = 'zero' (score it 0) or "
        "'skip_group' (drop the prompt's group from the update)"
    )


def _zero(guard: RewardGuard, scores: Tensor, faults: list[RewardFault], source: str) -> Tensor:
    guard.warn_once(source, faults[0], "scored 0")
    out = scores.clone()
    out[[f.row for f in faults]] = 0.0
    return out


def _skip_group(guard: RewardGuard, scores: Tensor, faults: list[RewardFault], source: str) -> Tensor:
    guard.warn_once(source, faults[0], "its group is dropped from the update")
    return scores  # NaN at the faulty rows: polgrad.trainer.collect drops their groups


# train.reward_errors -> what a batch's faulty rewards become (scores [B] with NaN at the faults).
POLICIES: dict[str, Callable[[RewardGuard, Tensor, list[RewardFault], str], Tensor]] = {
    "raise": _raise,
    "zero": _zero,
    "skip_group": _skip_group,
}
REWARD_ERRORS = tuple(POLICIES)


def check_policy(policy: Any, binding: str = "train.reward_errors") -> None:
    """A one-line ConfigError unless `policy` is one of REWARD_ERRORS."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ConfigError(f"{binding} must be one of {REWARD_ERRORS}, got {policy!r}")


@dataclass
class RewardGuard:
    """Checks every reward of a batch and applies `policy` (train.reward_errors) to the faulty ones.

    `task_name`: the registered name the messages give the task (default: the task's `name`);
    `reward_model`: how they name the reward model (e.g. its checkpoint path).
    """

    policy: str = "raise"
    task_name: str | None = None
    reward_model: str = "the reward model"
    faults: int = 0  # faulty samples since the last take()
    _warned: set = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        check_policy(self.policy)

    def task_scores(self, task, examples: Sequence[Any], texts: Sequence[str]) -> Tensor:
        """[B] float64: the task's reward of each (example, response), the policy applied."""
        values, faults = [], []
        for i, (ex, text) in enumerate(zip(examples, texts, strict=True)):
            value, problem = call_reward(task.reward, ex, text)
            values.append(value)
            if problem is not None:
                faults.append(RewardFault(i, getattr(ex, "prompt", str(ex)), text, problem))
        name = self.task_name or getattr(task, "name", None) or type(task).__name__
        source = f"task.{name} ({qualified_name(task.reward)})"
        return self._apply(torch.tensor(values, dtype=torch.float64), faults, source)

    def checked(self, scores: Tensor, examples: Sequence[Any], texts: Sequence[str]) -> Tensor:
        """Reward-model scores [B] with the policy applied to the non-finite ones."""
        scores = scores.double()
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        faults = [
            RewardFault(i, getattr(examples[i], "prompt", ""), texts[i], check_value(float(scores[i]))[1])
            for i in bad
        ]
        return self._apply(scores, faults, self.reward_model)

    def _apply(self, scores: Tensor, faults: list[RewardFault], source: str) -> Tensor:
        if not faults:
            return scores
        self.faults += len(faults)
        return POLICIES[self.policy](self, scores, faults, source)

    def take(self) -> int:
        """The number of faulty samples since the last call (and start counting again)."""
        n, self.faults = self.faults, 0
        return n

    def warn_once(self, source: str, fault: RewardFault, outcome: str) -> None:
        """One line on stderr, the first time `source` gives a faulty reward under this guard."""
        if source in self._warned:
            return
        self._warned.add(source)
        print(
            f"warning: reward of {source} failed on prompt {_short(fault.prompt)}, response "
            f"{_short(fault.response)}: {fault.problem}; {outcome} (train.reward_errors = "
            f"'{self.policy}'; this warning is shown once, the metrics' reward_errors counts them)",
            file=sys.stderr,
            flush=True,
        )
