"""task.reasoning_gym: any reasoning-gym dataset as a polgrad task, scored by its own `score_answer`.

    train.task = @task.reasoning_gym
    task.reasoning_gym.name = 'chain_sum'
    task.reasoning_gym.config = {'min_terms': 2, 'max_terms': 3, 'max_digits': 2}

reasoning-gym (`pip install 'polgrad[tasks]'`) generates its problems procedurally and offline: item
`idx` of a dataset built with integer seed `s` is a pure function of (name, config, s, idx). polgrad
reads items as they come and never stores the dataset.

Streams. `examples(split, n, seed)` reads the dataset built with seed blake2b('<name>|<split>|<seed>')
(an integer below 2**31) from item 0 on, keeping the items of `split`; every machine and process
draws the same list. The held-out list (`eval_examples`) reads the seed of '<name>|eval_set' and keeps
distinct prompts in the order met: the first `train.eval_size`, or EVAL_SIZE (256) when it is None
(a procedural dataset has no whole held-out split to enumerate).

Split: an item is held out iff its prompt hashes below `eval_fraction` (blake2b(prompt)[:8] / 2**64,
the rule of every polgrad task), so no held-out prompt is ever trained on, whatever the seed.

Reward: the dataset's own `score_answer(answer, entry)` (in [0, 1]; 1.0 = right; some datasets give
partial credit), `entry` being the item the example carries (a plain Example, not drawn by this
task, is refused in one line: some datasets score by the item's metadata); `answer` is the stripped
response or, with `answer_format = 'tagged'`, the text inside its last <answer>...</answer>
(reasoning-gym's `extract_answer`; no tags scores 0). Held-out accuracy is the fraction of prompts
whose greedy response scores 1.0 by reasoning-gym's rule.

Fitting the tiny default. The character tokenizer needs every character up front: the task's
alphabet is printable ASCII plus the characters of a probe of `PROBE_ITEMS` train and eval items,
and its length bounds (`max_prompt_chars`, `max_response_chars`) are the probe's longest, or the
limits you set where they are smaller. Every stream then skips an item that does not fit: a
character outside the alphabet, a prompt or demonstration longer than the bounds, or an answer that
does not itself score 1.0 (a dataset whose oracle answer is None or not the only right one). The
probe's share of skipped items is `skipped_fraction`; a dataset with more than `MAX_SKIPPED` skipped
is refused in one line naming the limit to raise. For the tiny model choose configs with short
prompts and answers (chain_sum with 2-3 terms of 1-2 digits; spell_backward with words of 3-6
letters) and set `train.max_new_tokens` to at least `max_response_chars + 1`; a real model with a
subword tokenizer and a chat template would use the datasets' defaults, `answer_format = 'tagged'`
and a system prompt asking for <answer> tags, as reasoning-gym's own examples do.

SFT demonstrations are the oracle answers ('<answer>X</answer>' when tagged); preference pairs put
the oracle answer against a corrupted one that scores lower by the dataset's own rule.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
import re
import string
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from polgrad.errors import ConfigError, DataError
from polgrad.registry import register
from polgrad.tasks.base import Example, is_correct
from polgrad.tasks.synthetic import check_fraction, check_split, in_eval_split

ANSWER_FORMATS = ("plain", "tagged")
PROBE_ITEMS = 1000  # items (train and eval streams together) read to fix the alphabet and the bounds
MAX_SKIPPED = 0.5  # a dataset whose probe skips more than this share of items is refused
CHUNK = 1_000_000  # items per dataset seed; a stream moves to the next seed after this many
BUDGET_PER_ITEM = 200  # items a stream may read per example it returns before it gives up
EVAL_SIZE = 256  # held-out prompts when train.eval_size is None (the dataset has no finite split)
BASE_ALPHABET = string.printable.replace("\x0b", "").replace("\x0c", "")  # no vertical tab / form feed


def _import():
    try:
        import reasoning_gym  # noqa: F401
        from reasoning_gym.factory import DATASETS
        from reasoning_gym.utils import extract_answer
    except ImportError:
        raise ConfigError(
            "task.reasoning_gym needs the reasoning-gym package: pip install 'polgrad[tasks]' "
            "(or pip install reasoning-gym)"
        ) from None
    return DATASETS, extract_answer


def int_seed(label: str) -> int:
    """A stable seed below 2**31 for `label`: blake2b(label)[:4] as an integer, top bit cleared."""
    return int.from_bytes(hashlib.blake2b(label.encode("utf-8"), digest_size=4).digest(), "big") >> 1


@dataclass(frozen=True)
class GymExample(Example):
    """An Example that carries its reasoning-gym entry (question, answer, metadata) for scoring."""

    entry: Mapping[str, Any] = field(compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class ReasoningGymTask:
    """A reasoning-gym dataset behind polgrad's Task contract: see the module docstring."""

    dataset: str
    config: Mapping[str, Any]
    eval_fraction: float
    answer_format: str
    alphabet: str = field(repr=False)
    max_prompt_chars: int
    max_response_chars: int
    skipped_fraction: float
    scorer: Any = field(repr=False, compare=False)  # one dataset instance: its score_answer
    extract: Any = field(repr=False, compare=False)
    name: str = "reasoning_gym"

    # --- items ----------------------------------------------------------------------------------
    def _build(self, seed: int):
        from reasoning_gym.factory import DATASETS

        dataset_cls, config_cls = DATASETS[self.dataset]
        return dataset_cls(config=config_cls(**{**self.config, "seed": seed, "size": CHUNK}))

    def _items(self, label: str) -> Iterator[dict[str, Any]]:
        """The dataset's items for `label`, in order, moving to a new seed every CHUNK items."""
        for chunk in range(1 << 20):
            ds = self._build(int_seed(f"{label}|{chunk}" if chunk else label))
            for idx in range(CHUNK):
                yield ds[idx]

    def demo_of(self, entry: Mapping[str, Any]) -> str:
        answer = str(entry["answer"])
        return f"<answer>{answer}</answer>" if self.answer_format == "tagged" else answer

    def score(self, entry: Mapping[str, Any], response: str) -> float:
        """reasoning-gym's score of `response` for `entry` (the tagged answer extracted first)."""
        if not isinstance(response, str):
            return 0.0
        answer = self.extract(response) if self.answer_format == "tagged" else response.strip()
        if answer is None:
            return 0.0
        return float(self.scorer.score_answer(answer=answer, entry=dict(entry)))

    def fits(self, entry: Mapping[str, Any]) -> bool:
        """Whether an item can be used: see 'Fitting the tiny default' in the module docstring."""
        prompt, answer = entry.get("question"), entry.get("answer")
        if not isinstance(prompt, str) or not prompt or answer is None or str(answer) == "":
            return False
        demo = self.demo_of(entry)
        if len(prompt) > self.max_prompt_chars or len(demo) > self.max_response_chars:
            return False
        allowed = set(self.alphabet)
        if not set(prompt) <= allowed or not set(demo) <= allowed:
            return False
        return is_correct(self.score(entry, demo))

    def _draw(self, split: str, n: int, label: str, distinct: bool = False) -> list[GymExample]:
        """The first `n` fitting items of `split` in the stream `label` (with `distinct`, the first `n`
        distinct prompts)."""
        check_split(split)
        want_eval = split == "eval"
        if want_eval and self.eval_fraction == 0.0:
            raise ConfigError("task.reasoning_gym.eval_fraction is 0, so the eval split is empty; set it > 0")
        out: list[GymExample] = []
        seen: set[str] = set()
        budget = BUDGET_PER_ITEM * (n + 10)
        for entry in self._items(label):
            if len(out) == n:
                break
            budget -= 1
            if budget < 0:
                raise ConfigError(
                    f"task.reasoning_gym '{self.dataset}': its {split} split is (nearly) empty for this "
                    f"config; change eval_fraction ({self.eval_fraction}) or the config's ranges"
                )
            prompt = entry.get("question")
            if isinstance(prompt, str) and in_eval_split(prompt, self.eval_fraction) == want_eval:
                if distinct and prompt in seen:
                    continue
                if self.fits(entry):
                    seen.add(prompt)
                    out.append(GymExample(prompt=prompt, answer=str(entry["answer"]), entry=entry))
        return out

    # --- the Task contract ------------------------------------------------------------------------
    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        return list(self._draw(split, n, f"{self.dataset}|{split}|{seed}"))

    def eval_examples(self, n: int | None) -> list[Example]:
        n = EVAL_SIZE if n is None else n  # no whole split: problems come without end
        try:
            return list(self._draw("eval", n, f"{self.dataset}|eval_set", distinct=True))
        except ConfigError:
            raise ConfigError(
                f"task.reasoning_gym '{self.dataset}': its eval split gave fewer than {n} distinct prompts "
                f"in {BUDGET_PER_ITEM * (n + 10):,} items; lower train.eval_size or widen the config's ranges"
            ) from None

    def reward(self, example: Example, response: str) -> float:
        entry = getattr(example, "entry", None)
        if entry is None:
            raise DataError(
                f"task.reasoning_gym '{self.dataset}' scores an example with its reasoning-gym item (some "
                f"datasets score by its metadata); got a plain Example (prompt {example.prompt[:40]!r}): "
                "score the task's own examples (GymExample)"
            )
        return self.score(entry, response)

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        return [
            (ex.prompt, self.demo_of(ex.entry))
            for ex in self._draw("train", n, f"{self.dataset}|demo|{seed}")
        ]

    def _rejected(self, ex: GymExample, rng: random.Random) -> str:
        """A corrupted answer that scores below 1.0 by the dataset's rule (and fits the bounds)."""
        answer = ex.answer
        for _ in range(50):
            if re.fullmatch(r"-?\d+", answer) and rng.random() < 0.5:
                wrong = str(int(answer) + rng.choice((-10, -1, 1, 10)))
            else:
                i = rng.randrange(len(answer))
                pool = [
                    c
                    for c in (string.digits if answer[i].isdigit() else string.ascii_lowercase)
                    if c != answer[i]
                ]
                wrong = answer[:i] + rng.choice(pool) + answer[i + 1 :]
            text = self.demo_of({**ex.entry, "answer": wrong})
            if len(text) <= self.max_response_chars and self.score(ex.entry, text) < 1.0:
                return text
        raise DataError(
            f"task.reasoning_gym '{self.dataset}': found no wrong answer for {ex.prompt[:40]!r} that scores "
            "below 1.0; this dataset cannot make preference pairs, train the reward model on a file"
        )

    def preference_pairs(self, n: int, seed: int) -> list[tuple[str, str, str]]:
        rng = random.Random(f"{self.dataset}|pref|{seed}")
        pairs = self._draw("train", n, f"{self.dataset}|pref|{seed}")
        return [(ex.prompt, self.demo_of(ex.entry), self._rejected(ex, rng)) for ex in pairs]


@register("task", "reasoning_gym")
def reasoning_gym_task(
    *,
    name: str,
    config: Mapping[str, Any] | None = None,
    eval_fraction: float = 0.1,
    answer_format: str = "plain",
    max_prompt_chars: int | None = None,
    max_response_chars: int | None = None,
) -> ReasoningGymTask:
    """A reasoning-gym dataset by `name` with its `config`, scored by its own score_answer."""
    datasets, extract = _import()
    check_fraction("reasoning_gym", eval_fraction)
    if name not in datasets:
        close = difflib.get_close_matches(name, list(datasets), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ConfigError(
            f"task.reasoning_gym.name = '{name}' is not a reasoning-gym dataset; {hint}"
            f"valid names: {', '.join(sorted(datasets))}"
        )
    if answer_format not in ANSWER_FORMATS:
        raise ConfigError(
            f"task.reasoning_gym.answer_format = '{answer_format}' is unknown; "
            f"valid: {', '.join(ANSWER_FORMATS)}"
        )
    config = dict(config or {})
    reserved = sorted({"seed", "size"} & set(config))
    if reserved:
        raise ConfigError(
            f"task.reasoning_gym.config sets {reserved}; polgrad sets the seed and size itself: remove them"
        )
    # the dataset's classes and the extractor themselves (a test's stand-in dataset is another task)
    key = (tuple(datasets[name]), extract, json.dumps(
        [name, config, eval_fraction, answer_format, max_prompt_chars, max_response_chars],
        sort_keys=True, default=repr))  # fmt: skip
    if key not in _BUILT:  # the probe reads 1,000 items: a sweep builds every cell's task (seconds each)
        _BUILT[key] = _probed(datasets, extract, name, config, eval_fraction, answer_format,
                              max_prompt_chars, max_response_chars)  # fmt: skip
    return _BUILT[key]


_BUILT: dict[tuple, ReasoningGymTask] = {}  # built tasks (frozen, their scorer read-only) by their arguments


def _probed(
    datasets, extract, name, config, eval_fraction, answer_format, max_prompt_chars, max_response_chars
):
    """`reasoning_gym_task`'s task once its arguments are checked: the dataset's config checked and the
    alphabet and bounds fixed from a probe of its items."""
    dataset_cls, config_cls = datasets[name]
    try:
        scorer = dataset_cls(config=config_cls(**config, seed=0, size=CHUNK))
    except (TypeError, AssertionError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        fields = [f for f in getattr(config_cls, "__dataclass_fields__", {}) if f not in ("seed", "size")]
        raise ConfigError(
            f"task.reasoning_gym.config {config} is not valid for '{name}' ({why}); "
            f"its settings: {', '.join(fields)}"
        ) from None
    for limit, value in (("max_prompt_chars", max_prompt_chars), ("max_response_chars", max_response_chars)):
        if value is not None and value < 1:
            raise ConfigError(
                f"task.reasoning_gym.{limit} = {value} must be >= 1 (or None: the probe's longest)"
            )

    # The probe: fix the alphabet and the bounds from items of both splits, then count what fits.
    loose = ReasoningGymTask(
        dataset=name, config=config, eval_fraction=eval_fraction, answer_format=answer_format,
        alphabet="", max_prompt_chars=1 << 30, max_response_chars=1 << 30, skipped_fraction=0.0,
        scorer=scorer, extract=extract,
    )  # fmt: skip
    probe: list[dict[str, Any]] = []
    for label in (f"{name}|probe|train", f"{name}|probe|eval"):
        items = loose._items(label)
        probe += [next(items) for _ in range(PROBE_ITEMS // 2)]
    usable = [
        e for e in probe
        if isinstance(e.get("question"), str) and e.get("answer") is not None and str(e["answer"]) != ""
    ]  # fmt: skip
    if not usable:
        raise DataError(f"task.reasoning_gym '{name}': its items have no question/answer strings to train on")
    chars = set(BASE_ALPHABET)
    for e in usable:
        chars.update(e["question"], loose.demo_of(e))
    alphabet = "".join(sorted(chars))
    longest_prompt = max(len(e["question"]) for e in usable)
    longest_demo = max(len(loose.demo_of(e)) for e in usable)
    task = ReasoningGymTask(
        dataset=name, config=config, eval_fraction=eval_fraction, answer_format=answer_format,
        alphabet=alphabet,
        max_prompt_chars=min(longest_prompt, max_prompt_chars or longest_prompt),
        max_response_chars=min(longest_demo, max_response_chars or longest_demo),
        skipped_fraction=0.0, scorer=scorer, extract=extract,
    )  # fmt: skip
    skipped = sum(not task.fits(e) for e in probe) / len(probe)
    if skipped > MAX_SKIPPED:
        raise DataError(
            f"task.reasoning_gym '{name}': {skipped:.0%} of {len(probe)} probe items do not fit (a prompt "
            f"over max_prompt_chars = {task.max_prompt_chars} or a response over max_response_chars = "
            f"{task.max_response_chars}, or an answer that does not score 1.0); raise those limits or "
            "narrow the config"
        )
    return ReasoningGymTask(**{**task.__dict__, "skipped_fraction": skipped})
