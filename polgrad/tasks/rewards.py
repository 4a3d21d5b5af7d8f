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

A reward that hangs: with `train.reward_timeout_s = N` every call of the task's reward runs in
the guard's worker thread and the caller waits at most N s for it; a call over the limit stops
the run with one line naming the task, the reward function, the sample and the limit, whatever
`train.reward_errors` says (a hung call cannot be scored: Python cannot stop a thread, so the
daemon worker is abandoned and dies with the process). The thread works from the trainer's main
thread and from any other; a reward that installs signal handlers itself (signal.alarm, as some
math verifiers do) must run in the main thread: keep the default None (no limit) for it.
"""

from __future__ import annotations

import math
import numbers
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from polgrad.checks import is_real
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


class _Worker:
    """One daemon thread that runs reward calls, so that the caller can stop waiting for one."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="polgrad-reward", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, example, response = self.jobs.get()
            try:
                self.results.put(call_reward(fn, example, response))
            except BaseException as e:  # noqa: BLE001 - SystemExit & co. would end this thread silently
                self.results.put((math.nan, f"raised {type(e).__name__}"))

    def call(self, fn: Callable[[Any, str], Any], example: Any, response: str, timeout_s: float):
        """call_reward's answer, or None when the call did not return within `timeout_s`."""
        self.jobs.put((fn, example, response))
        try:
            return self.results.get(timeout=timeout_s)
        except queue.Empty:
            return None


def check_timeout(value: Any, binding: str = "train.reward_timeout_s") -> None:
    """A one-line ConfigError unless `value` is None (no limit) or a finite number of seconds > 0."""
    ok = value is None or (is_real(value, abc=True) and 0 < value < math.inf)
    if not ok:
        raise ConfigError(f"{binding} must be a number of seconds > 0 or None (no limit), got {value!r}")


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
    `reward_model`: how they name the reward model (e.g. its checkpoint path); `timeout_s`: the
    limit of one call of the task's reward (train.reward_timeout_s; None: no limit).
    """

    policy: str = "raise"
    task_name: str | None = None
    reward_model: str = "the reward model"
    faults: int = 0  # faulty samples since the last take()
    timeout_s: float | None = None
    _warned: set = field(default_factory=set, repr=False)
    _worker: _Worker | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        check_policy(self.policy)
        check_timeout(self.timeout_s)

    def task_scores(self, task, examples: Sequence[Any], texts: Sequence[str]) -> Tensor:
        """[B] float64: the task's reward of each (example, response), the policy applied."""
        values, faults = [], []
        name = self.task_name or getattr(task, "name", None) or type(task).__name__
        source = f"task.{name} ({qualified_name(task.reward)})"
        for i, (ex, text) in enumerate(zip(examples, texts, strict=True)):
            value, problem = self._call(task.reward, ex, text, source)
            values.append(value)
            if problem is not None:
                faults.append(RewardFault(i, getattr(ex, "prompt", str(ex)), text, problem))
        return self._apply(torch.tensor(values, dtype=torch.float64), faults, source)

    def _call(self, fn: Callable[[Any, str], Any], example: Any, text: str, source: str):
        """call_reward, within timeout_s when one is set; a call over it stops the run in one line."""
        if self.timeout_s is None:
            return call_reward(fn, example, text)
        if self._worker is None:
            self._worker = _Worker()
        got = self._worker.call(fn, example, text, self.timeout_s)
        if got is not None:
            return got
        self._worker = None  # stuck in the hung call: a later call gets a fresh thread
        prompt = getattr(example, "prompt", str(example))
        raise PolgradError(
            f"reward of {source} did not return within train.reward_timeout_s = {self.timeout_s:g} s on "
            f"prompt {_short(prompt)}, response {_short(text)}; fix the reward (does it hang on this "
            "sample?) or raise train.reward_timeout_s"
        )

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
