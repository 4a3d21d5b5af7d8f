"""Built-in verifiable tasks that a ~1M-parameter character model learns on a CPU in minutes.

    task.add      "23+58="      -> "81"       (digits=2; reverse=True writes the sum units-first: "18")
    task.sort     "sort 31524=" -> "12345"    (length=5; symbols=10 draws digits from 0..symbols-1)
    task.reverse  "rev 31524="  -> "42513"    (length=5; the easiest of the three)
    task.running_sum  "12+7+30+5=" -> "12+7=19\n19+30=49\n49+5=54\n#### 54"  (worked steps; 2-8 terms
                  of digits=2; worked=False demonstrates the final answer alone; checks=p follows each
                  step with its check line, "19-7=12", with probability p)

Every task draws its problems from a seeded `random.Random`, so `examples(split, n, seed)` is the
same list on every machine and in every process (string seeds do not depend on PYTHONHASHSEED).

Train/eval split: a prompt belongs to the eval split iff the first 8 bytes of blake2b(prompt),
read as an integer in [0, 2**64), fall below `eval_fraction * 2**64` (default 0.1). The split is a
property of the prompt alone, so no eval prompt is ever trained on (not by RL, SFT demos or
preference pairs), whatever the seed or n. Examples are sampled with replacement within a split.

Reward: the response is compared with the answer after stripping surrounding whitespace; 1.0 iff
equal, else 0.0. With `partial=True` a wrong response earns the fraction of answer positions it
gets right, matched left to right: matches / max(len(answer), len(response)), which is < 1 unless
the response is exactly right (so arbitrary junk may then earn a little credit).

running_sum (the task whose answers have a length) lives in polgrad/tasks/running_sum.py.

Difficulty knobs (a briefly SFT-ed tiny model should be right 20-60% of the time):
`add.digits` (1 is easy: 100 problems; 2 is the default; 3 is hard), `add.reverse` (units-first
sums are much easier: each digit depends only on digits already seen), `add.pad` (fixed-width
operands are a little easier); `sort.length` / `reverse.length` and `sort.symbols` (fewer distinct
symbols is easier); `running_sum.digits`, `.min_terms` / `.max_terms` (more terms: longer answers,
more sums to get right), `.worked` (False: the final answer alone) and `.checks` (check lines: answers
to one prompt of several lengths).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import ClassVar

from polgrad.errors import ConfigError
from polgrad.registry import register
from polgrad.tasks.base import Example, check_eval_size

DIGITS = "0123456789"
SPLITS = ("train", "eval")
MAX_ENUMERATED = 200_000  # a task with more problems evaluates on a drawn subset (train.eval_size)


def prompt_hash(prompt: str) -> int:
    """A stable 64-bit hash of the prompt: blake2b(prompt)[:8] as a big-endian integer."""
    return int.from_bytes(hashlib.blake2b(prompt.encode("utf-8"), digest_size=8).digest(), "big")


def in_eval_split(prompt: str, eval_fraction: float) -> bool:
    """True iff `prompt` is held out: prompt_hash(prompt) < eval_fraction * 2**64."""
    return prompt_hash(prompt) < eval_fraction * 2.0**64


@functools.lru_cache(maxsize=64)
def _held_out_count(task) -> int:
    """How many of a (frozen, hashable) task's enumerated prompts are held out."""
    return sum(in_eval_split(ex.prompt, task.eval_fraction) for ex in task._all())


def exact_or_partial(answer: str, response: str, partial: bool) -> float:
    """1.0 iff the stripped response equals the answer; else 0.0, or positional credit if `partial`."""
    if not isinstance(response, str):
        return 0.0
    response = response.strip()
    if response == answer:
        return 1.0
    if not partial or not response:
        return 0.0
    matches = sum(a == r for a, r in zip(answer, response, strict=False))
    return min(matches / max(len(answer), len(response)), 1.0 - 1e-6)


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ConfigError(f"unknown split '{split}'; valid splits: {', '.join(SPLITS)}")


def check_fraction(name: str, eval_fraction: float) -> None:
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"task.{name}.eval_fraction = {eval_fraction} must be in [0, 1)")


def _sorted_alphabet(*parts: str) -> str:
    return "".join(sorted(set("".join(parts))))


@dataclass(frozen=True)
class _Generated:
    """A task whose problems are generated: subclasses define `_sample` and `_corrupt`."""

    eval_fraction: float = 0.1
    partial: bool = False
    name: str = field(default="", init=False)

    def __post_init__(self) -> None:
        check_fraction(self.name, self.eval_fraction)

    # --- what a subclass provides -------------------------------------------------------------
    def _sample(self, rng: random.Random) -> Example:  # pragma: no cover - abstract
        raise NotImplementedError

    def _count(self) -> int:  # pragma: no cover - abstract
        """How many distinct problems the task has."""
        raise NotImplementedError

    def _all(self) -> Iterator[Example]:  # pragma: no cover - abstract
        """Every distinct problem once."""
        raise NotImplementedError

    def _corrupt(self, ex: Example, rng: random.Random) -> str:  # pragma: no cover - abstract
        """A plausible wrong answer (never equal to `ex.answer`)."""
        raise NotImplementedError

    # --- the Task contract ----------------------------------------------------------------------
    def _draw(self, split: str, n: int, rng: random.Random) -> list[Example]:
        check_split(split)
        want_eval = split == "eval"
        if want_eval and self.eval_fraction == 0.0:
            raise ConfigError(f"task.{self.name}.eval_fraction is 0, so the eval split is empty; set it > 0")
        out: list[Example] = []
        budget = 200 * (n + 10)  # expected draws per eval example is 1/eval_fraction
        while len(out) < n:
            ex = self._sample(rng)
            if in_eval_split(ex.prompt, self.eval_fraction) == want_eval:
                out.append(ex)
            budget -= 1
            if budget < 0:
                raise ConfigError(
                    f"task.{self.name}: the {split} split is (nearly) empty for these settings; "
                    f"change eval_fraction ({self.eval_fraction}) or make the problems larger"
                )
        return out

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return self._draw(split, n, random.Random(f"{self.name}|{split}|{seed}"))

    def eval_split_size(self) -> int | None:
        """The distinct held-out prompts: counted (hashed, not drawn) when the task has at most
        MAX_ENUMERATED problems, else None. Counted once per process for equal settings (a sweep
        builds every cell's task, and hashing 100,000 prompts takes about a second)."""
        if self._count() > MAX_ENUMERATED:
            return None
        return _held_out_count(self)  # the tasks are frozen dataclasses of scalars: hashable

    def eval_examples(self, n: int | None) -> list[Example]:
        if self.eval_fraction == 0.0:
            raise ConfigError(f"task.{self.name}.eval_fraction is 0, so the eval split is empty; set it > 0")
        check_eval_size(self, n)  # before drawing 50 n + 100 examples towards a count out of reach
        if n is None:  # the whole split: every problem, held-out ones kept, ordered by prompt hash
            if self._count() > MAX_ENUMERATED:
                raise ConfigError(
                    f"task.{self.name} has {self._count():,} problems, too many to evaluate on all of its "
                    f"held-out ones: set train.eval_size to a number"
                )
            held = [ex for ex in self._all() if in_eval_split(ex.prompt, self.eval_fraction)]
            return sorted(held, key=lambda ex: prompt_hash(ex.prompt))
        out: dict[str, Example] = {}  # distinct prompts, drawn in a fixed order
        for ex in self._draw("eval", 50 * n + 100, random.Random(f"{self.name}|eval_set")):
            out.setdefault(ex.prompt, ex)
            if len(out) == n:
                return list(out.values())
        raise ConfigError(
            f"task.{self.name}: its eval split has fewer than {n} distinct prompts; lower train.eval_size"
        )

    def reward(self, example: Example, response: str) -> float:
        return exact_or_partial(example.answer, response, self.partial)

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        rng = random.Random(f"{self.name}|demo|{seed}")
        return [(ex.prompt, ex.answer) for ex in self._draw("train", n, rng)]

    def preference_pairs(self, n: int, seed: int) -> list[tuple[str, str, str]]:
        rng = random.Random(f"{self.name}|pref|{seed}")
        return [(ex.prompt, ex.answer, self._corrupt(ex, rng)) for ex in self._draw("train", n, rng)]


def change_one(s: str, rng: random.Random, symbols: str = DIGITS) -> str:
    """`s` with one character replaced by a different symbol."""
    i = rng.randrange(len(s))
    c = rng.choice([d for d in symbols if d != s[i]])
    return s[:i] + c + s[i + 1 :]


def _swap_adjacent(s: str, rng: random.Random) -> str | None:
    """`s` with one pair of unequal neighbours swapped, or None if all characters are equal."""
    spots = [i for i in range(len(s) - 1) if s[i] != s[i + 1]]
    if not spots:
        return None
    i = rng.choice(spots)
    return s[:i] + s[i + 1] + s[i] + s[i + 2 :]


@dataclass(frozen=True)
class Add(_Generated):
    """'a+b=' -> the decimal sum; operands uniform in [0, 10**digits)."""

    digits: int = 2
    reverse: bool = False
    pad: bool = False
    name: str = field(default="add", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.digits <= 6:
            raise ConfigError(f"task.add.digits = {self.digits} must be in 1..6 (prompts stay short)")

    @property
    def alphabet(self) -> str:
        return _sorted_alphabet(DIGITS, "+=")

    @property
    def max_prompt_chars(self) -> int:
        return 2 * self.digits + 2

    @property
    def max_response_chars(self) -> int:
        return self.digits + 1

    def _write(self, total: int) -> str:
        return str(total)[::-1] if self.reverse else str(total)

    def _sample(self, rng: random.Random) -> Example:
        return self._problem(rng.randrange(10**self.digits), rng.randrange(10**self.digits))

    def _problem(self, a: int, b: int) -> Example:
        fa, fb = (str(a).zfill(self.digits), str(b).zfill(self.digits)) if self.pad else (str(a), str(b))
        return Example(prompt=f"{fa}+{fb}=", answer=self._write(a + b))

    def _count(self) -> int:
        return 10 ** (2 * self.digits)

    def _all(self) -> Iterator[Example]:
        n = 10**self.digits
        return (self._problem(a, b) for a in range(n) for b in range(n))

    def _corrupt(self, ex: Example, rng: random.Random) -> str:
        total = int(ex.answer[::-1] if self.reverse else ex.answer)
        while True:
            kind = rng.randrange(3)
            if kind == 0:  # off by one
                wrong = total + rng.choice((-1, 1))
            elif kind == 1:  # a dropped or spurious carry
                wrong = total + rng.choice((-10, 10))
            else:  # one digit wrong
                wrong = int(change_one(str(total), rng))
            plausible = abs(len(str(wrong)) - len(str(total))) <= 1  # no '107' -> '7'
            if wrong >= 0 and wrong != total and plausible and len(str(wrong)) <= self.max_response_chars:
                return self._write(wrong)


@dataclass(frozen=True)
class _DigitString(_Generated):
    """'<prefix> 31524=' -> `_transform('31524')`: `length` digits drawn from the first `symbols` digits."""

    length: int = 5
    symbols: int = 10
    prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.length <= 10:
            raise ConfigError(
                f"task.{self.name}.length = {self.length} must be in 2..10 (prompts stay short)"
            )
        if not 2 <= self.symbols <= 10:
            raise ConfigError(f"task.{self.name}.symbols = {self.symbols} must be in 2..10")

    @property
    def alphabet(self) -> str:
        return _sorted_alphabet(DIGITS, self.prefix + " =")

    @property
    def max_prompt_chars(self) -> int:
        return self.length + len(self.prefix) + 2  # '<prefix> ' + digits + '='

    @property
    def max_response_chars(self) -> int:
        return self.length

    @staticmethod
    def _transform(s: str) -> str:
        raise NotImplementedError

    def _sample(self, rng: random.Random) -> Example:
        s = "".join(rng.choice(DIGITS[: self.symbols]) for _ in range(self.length))
        return Example(prompt=f"{self.prefix} {s}=", answer=self._transform(s))

    def _count(self) -> int:
        return self.symbols**self.length

    def _all(self) -> Iterator[Example]:
        for digits in itertools.product(DIGITS[: self.symbols], repeat=self.length):
            s = "".join(digits)
            yield Example(prompt=f"{self.prefix} {s}=", answer=self._transform(s))


@dataclass(frozen=True)
class Sort(_DigitString):
    """'sort 31524=' -> '12345': the digits in ascending order (repeats allowed)."""

    name: str = field(default="sort", init=False)
    prefix: ClassVar[str] = "sort"

    @staticmethod
    def _transform(s: str) -> str:
        return "".join(sorted(s))

    def _corrupt(self, ex: Example, rng: random.Random) -> str:
        if rng.random() < 0.5:  # right multiset, wrong order
            swapped = _swap_adjacent(ex.answer, rng)
            if swapped is not None:
                return swapped
        return "".join(sorted(change_one(ex.answer, rng, DIGITS[: self.symbols])))  # sorted, wrong digit


@dataclass(frozen=True)
class Reverse(_DigitString):
    """'rev 31524=' -> '42513': the digits in reverse order."""

    name: str = field(default="reverse", init=False)
    prefix: ClassVar[str] = "rev"

    @staticmethod
    def _transform(s: str) -> str:
        return s[::-1]

    def _corrupt(self, ex: Example, rng: random.Random) -> str:
        if rng.random() < 0.5:
            swapped = _swap_adjacent(ex.answer, rng)  # also covers "copied instead of reversed"
            if swapped is not None:
                return swapped
        return change_one(ex.answer, rng, DIGITS[: self.symbols])


@register("task", "add")
def add(
    *,
    digits: int = 2,
    reverse: bool = False,
    pad: bool = False,
    partial: bool = False,
    eval_fraction: float = 0.1,
) -> Add:
    """Two-operand addition, '23+58=' -> '81'; reverse=True writes sums units-first (easier)."""
    return Add(digits=digits, reverse=reverse, pad=pad, partial=partial, eval_fraction=eval_fraction)


@register("task", "sort")
def sort(*, length: int = 5, symbols: int = 10, partial: bool = False, eval_fraction: float = 0.1) -> Sort:
    """Sort a digit string, 'sort 31524=' -> '12345'."""
    return Sort(length=length, symbols=symbols, partial=partial, eval_fraction=eval_fraction)


@register("task", "reverse")
def reverse(
    *, length: int = 5, symbols: int = 10, partial: bool = False, eval_fraction: float = 0.1
) -> Reverse:
    """Reverse a digit string, 'rev 31524=' -> '42513' (the easiest built-in)."""
    return Reverse(length=length, symbols=symbols, partial=partial, eval_fraction=eval_fraction)
