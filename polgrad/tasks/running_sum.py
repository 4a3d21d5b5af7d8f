"""task.running_sum: the built-in task whose answers have a length.

    task.running_sum  "12+7+30+5=" -> "12+7=19\n19+30=49\n49+5=54\n#### 54"

running_sum is the task whose answers have a length: its demonstrations write one running sum per
line and end with GSM8K's '#### <sum>', so a correct response's length grows with the number of terms
(min_terms..max_terms, drawn uniformly) and a wrong one can be longer or shorter than it should be.
Its reward is GSM8K's rule (`polgrad.components.reward.gsm8k`): the number after the response's last
'####', else its last number, equals the sum; the steps themselves are not verified (outcome reward),
so wrong steps before a right '#### <sum>' score 1, and so does a response cut off by the generation
budget right after a running sum that happens to be the answer.

Its splits, drawing and seeds are those of every generated task (polgrad/tasks/synthetic.py).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from polgrad.checks import is_real
from polgrad.components.reward import gsm8k
from polgrad.errors import ConfigError
from polgrad.registry import register
from polgrad.tasks.base import Example
from polgrad.tasks.synthetic import DIGITS, _Generated, _sorted_alphabet


@dataclass(frozen=True)
class RunningSum(_Generated):
    """'12+7+30+5=' -> 54, demonstrated with worked steps: one line 'running+term=new running' per
    term after the first, then '#### <sum>' (GSM8K's final-answer line). Terms uniform in
    [0, 10**digits), their count uniform in [min_terms, max_terms].

    `checks` (default 0: never) is the probability that a demonstration follows a step 'a+b=c' with its
    check 'c-b=a' on a line of its own, drawn per step: the answers to one prompt then differ in
    length by the checks written (0 to terms - 1 of them), which the reward does not read (GSM8K's rule
    reads the final sum only). With checks = 0 the demonstrations are those of a task without them."""

    digits: int = 2
    min_terms: int = 2
    max_terms: int = 8
    worked: bool = True
    checks: float = 0.0
    name: str = field(default="running_sum", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.partial:
            raise ConfigError(
                "task.running_sum has no partial credit (its reward is GSM8K's rule); drop partial"
            )
        if not 1 <= self.digits <= 4:
            raise ConfigError(f"task.running_sum.digits = {self.digits} must be in 1..4")
        if not is_real(self.checks) or not 0 <= self.checks <= 1:
            raise ConfigError(f"task.running_sum.checks = {self.checks!r} must be a probability in [0, 1]")
        if self.checks and not self.worked:
            raise ConfigError(
                "task.running_sum.checks needs worked = True (a check is a line of a worked answer)"
            )
        if not 2 <= self.min_terms <= self.max_terms <= 16:
            raise ConfigError(
                f"task.running_sum needs 2 <= min_terms <= max_terms <= 16, got min_terms = "
                f"{self.min_terms}, max_terms = {self.max_terms}"
            )

    @property
    def alphabet(self) -> str:
        return _sorted_alphabet(DIGITS, "+=# \n" + ("-" if self.checks else ""))

    def _largest(self) -> list[int]:
        return [10**self.digits - 1] * self.max_terms  # every line as long as it can be

    @property
    def max_prompt_chars(self) -> int:
        return len(self._prompt(self._largest()))

    @property
    def max_response_chars(self) -> int:
        largest = self._largest()
        return len(self.response(largest, checked=[bool(self.checks)] * (len(largest) - 1)))

    @staticmethod
    def _prompt(terms: list[int]) -> str:
        return "+".join(map(str, terms)) + "="

    def response(
        self, terms: list[int], slip: tuple[int, int] | None = None, checked: Sequence[bool] = ()
    ) -> str:
        """The demonstration for `terms`; `slip` = (line, delta) adds delta to that line's result and
        carries the wrong running sum on (a plausible wrong worked answer); `checked[i]` writes step
        i's check 'new-term=difference' after it (the difference is computed, so after a slip it
        differs from the running sum the step started from)."""
        total, lines = terms[0], []
        for i, t in enumerate(terms[1:]):
            new = total + t + (slip[1] if slip is not None and slip[0] == i else 0)
            lines.append(f"{total}+{t}={new}")
            if i < len(checked) and checked[i]:
                lines.append(f"{new}-{t}={new - t}")
            total = new
        return "\n".join([*lines, f"#### {total}"]) if self.worked else str(total)

    def _terms(self, prompt: str) -> list[int]:
        return [int(t) for t in prompt.removesuffix("=").split("+")]

    def _sample(self, rng: random.Random) -> Example:
        n = rng.randint(self.min_terms, self.max_terms)
        terms = [rng.randrange(10**self.digits) for _ in range(n)]
        return Example(prompt=self._prompt(terms), answer=str(sum(terms)))

    def _count(self) -> int:
        return sum((10**self.digits) ** n for n in range(self.min_terms, self.max_terms + 1))

    def _all(self) -> Iterator[Example]:
        for n in range(self.min_terms, self.max_terms + 1):
            for terms in itertools.product(range(10**self.digits), repeat=n):
                yield Example(prompt=self._prompt(list(terms)), answer=str(sum(terms)))

    def reward(self, example: Example, response: str) -> float:
        return gsm8k(example.answer, response)

    def _checked(self, n_steps: int, rng: random.Random) -> list[bool]:
        """Which of `n_steps` steps a demonstration checks; no draw at all when checks = 0, so the
        demonstrations of a task without checks are unchanged by the setting."""
        return [rng.random() < self.checks for _ in range(n_steps)] if self.checks else []

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(f"{self.name}|demo|{seed}")
        out = []
        for ex in self._draw("train", n, rng):
            terms = self._terms(ex.prompt)
            out.append((ex.prompt, self.response(terms, checked=self._checked(len(terms) - 1, rng))))
        return out

    def preference_pairs(self, n: int, seed: int) -> list[tuple[str, str, str]]:
        """Chosen: the demonstration; rejected: one carried slip (`_corrupt`) with the same steps
        checked, so that the two differ in the slip alone."""
        rng = random.Random(f"{self.name}|pref|{seed}")
        out = []
        for ex in self._draw("train", n, rng):
            terms = self._terms(ex.prompt)
            checked = self._checked(len(terms) - 1, rng)
            out.append((ex.prompt, self.response(terms, checked=checked), self._corrupt(ex, rng, checked)))
        return out

    def _corrupt(self, ex: Example, rng: random.Random, checked: Sequence[bool] = ()) -> str:
        """One slip (off by 1 or 10) in one line, carried to the end: the final sum is wrong by it. No
        number written is negative: neither the slipped sum nor, when that step is checked, its check's
        difference (the step's starting sum plus the slip), so a rejected answer has no '-' a chosen one
        lacks. A +10 slip can lengthen a running sum by a digit (and, with checks, the check lines that
        repeat it), so a rejected answer may be a few characters longer than max_response_chars (which
        bounds right answers)."""
        terms = self._terms(ex.prompt)
        while True:
            line, delta = rng.randrange(len(terms) - 1), rng.choice((-10, -1, 1, 10))
            partial_sum = sum(terms[: line + 2])
            checked_here = line < len(checked) and checked[line]
            if partial_sum + delta >= 0 and (not checked_here or partial_sum - terms[line + 1] + delta >= 0):
                return self.response(terms, (line, delta), checked)


@register("task", "running_sum", key_neutral={"checks": 0.0})  # checks came after runs were cached
def running_sum(
    *,
    digits: int = 2,
    min_terms: int = 2,
    max_terms: int = 8,
    worked: bool = True,
    checks: float = 0.0,
    eval_fraction: float = 0.1,
) -> RunningSum:
    """Sum of min_terms..max_terms terms, '12+7+30+5=' -> '54', demonstrated with a running sum per
    line and '#### 54' (worked=False: '54' alone); GSM8K's reward rule. `checks`: the probability that
    a demonstrated step is followed by its check line ('19-7=12'), so that answers vary in length."""
    return RunningSum(
        digits=digits,
        min_terms=min_terms,
        max_terms=max_terms,
        worked=worked,
        checks=checks,
        eval_fraction=eval_fraction,
    )
