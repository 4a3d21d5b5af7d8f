"""task.file: prompts and reference answers from a user's .jsonl/.json/.parquet/.csv file or dataset folder.

    task.file.path = 'data/gsm8k_train.jsonl'
    task.file.prompt_column = 'question'      # default 'prompt'
    task.file.answer_column = 'answer'        # default 'answer'
    task.file.response_column = 'answer'      # optional: full worked solutions for SFT demos
    task.file.answer_format = 'gsm8k'         # or 'exact', 'math_verify': a registered reward

A .jsonl file holds one JSON object per line (blank lines are skipped); a .json file the same (what
`Dataset.to_json` writes) or one JSON array of objects; a .parquet file is read with pandas. A .csv
file, a folder written by `save_to_disk` or a folder of data files is read with Hugging Face
`datasets` (the extra `tasks`; task.file.split picks the split of a DatasetDict or a folder, default
'train'; polgrad/tasks/datasets_io.py). Prompts (and responses) must be strings; an answer may be a
string or a number.

Scoring, answer_format='gsm8k' (exact match, GSM8K style):
  reference  what follows the last '####' in the answer, or the whole answer if it has none;
  response   what follows the last '####' (up to the end of that line) if the response has one,
             else the last number in it, else the whole response;
  both are normalised (whitespace and commas removed, one leading '+' dropped, a trailing '.0'
  (or '.00', ...) after a digit dropped) and must be equal: reward 1.0, else 0.0.
answer_format='exact': the stripped response must equal the stripped answer.
answer_format='math_verify' (extra `tasks`): Hugging Face's math-verify compares the response with the
reference's final answer (after its last '####', else all of it) as LaTeX or plain math. Any other
name is a part registered under kind `reward` (polgrad/components/reward.py), which reads the same final
answer. Without a response column, demonstrations are '#### <answer>' (the answer alone for 'exact',
'\\boxed{<answer>}' for any other verifier).

Split: a row is held out iff blake2b(prompt)[:8] / 2**64 < eval_fraction (the rule of the built-in
tasks, see polgrad.tasks.synthetic), so equal prompts always land together and eval never
overlaps train. A small file where no prompt hashes below the threshold still gets an eval split:
the prompt with the smallest hash is held out (if there are at least two distinct prompts).

Preference pairs for the reward model and DPO: with task.file.preferences = <a .jsonl/.parquet/.csv
file or dataset folder in TRL's preference format> (columns prompt / chosen / rejected, each a string
or a list of {'role', 'content'} messages; task.file.preference_split picks a split), the file's
pairs: those whose prompt is held out (the same prompt-hash rule, or a prompt of the eval split) are
the reward model's held-out pairs, never trained on; the rest are drawn in shuffled passes. Without
it, synthetic pairs as below.

SFT demonstrations are the response column if given (each must score 1.0 against its own
answer, else a DataError names the row), else '#### <answer>'. Preference pairs: chosen = the
demonstration, rejected = the same text with the final answer replaced by a plausible wrong one
(off by one or ten, or one digit changed).

Every problem with the file raises a one-line `DataError` naming the file and what to do.
"""

from __future__ import annotations

import math
import numbers
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polgrad.components.reward import final_answer, normalize, reference_answer, response_answer  # noqa: F401
from polgrad.errors import ConfigError, DataError
from polgrad.registry import get, lookup, names, register
from polgrad.tasks.base import Chat, Example, check_eval_size
from polgrad.tasks.synthetic import (
    DIGITS,
    change_one,
    check_fraction,
    check_split,
    in_eval_split,
    prompt_hash,
)
from polgrad.tasks.tables import read_table

# How a reference's final answer is read and a demonstration written (no response column) come from
# the reward part's metadata `reference` / `demo`; a part without them reads what follows the last
# '####' (GSM8K's format), or the whole reference, stripped, and writes '\boxed{<answer>}' (how math
# answers are written for math-verify).
DEFAULT_DEMO = "\\boxed{{{}}}"
EXAMPLE_GSM8K = Path(__file__).parent / "data" / "example_gsm8k.jsonl"  # prompt_column='question'

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def _wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong final answer: off by one or ten, or one digit changed; never `answer`."""
    if re.fullmatch(r"-?\d+", answer):
        n = int(answer)
        for _ in range(100):
            kind = rng.randrange(3)
            if kind < 2:
                wrong = n + rng.choice((-1, 1) if kind == 0 else (-10, 10))
            else:
                wrong = int(change_one(str(abs(n)), rng)) * (-1 if n < 0 else 1)
            plausible = abs(len(str(wrong)) - len(answer)) <= 1 and (wrong >= 0) == (n >= 0)
            if str(wrong) != answer and plausible:
                return str(wrong)
    spots = [i for i, c in enumerate(answer) if c.isdigit() and c in DIGITS]
    if spots:
        i = rng.choice(spots)
        return answer[:i] + rng.choice([d for d in DIGITS if d != answer[i]]) + answer[i + 1 :]
    return "0"  # a non-numeric answer (no digits, so '0' differs from it)


PREFERENCE_COLUMNS = ("prompt", "chosen", "rejected")  # TRL's preference format


def _messages_text(p: Path, where: str, column: str, value: list, prompt: bool) -> Chat:
    """A conversational column as a `Chat`: the messages themselves (DPO renders them through the
    policy's chat template, as TRL does), read as text where a string is needed (the reward model,
    a policy without a template): a prompt's single user message is its content, several messages
    are 'role: content' lines; a response (assistant messages only) is their contents, one per line."""
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(
                f"{p}: {where} has a message without string 'role' and 'content' in column '{column}' "
                f"({repr(m)[:60]}); conversational columns are lists of {{'role': ..., 'content': ...}}"
            )
    if not value:
        raise DataError(f"{p}: {where} has an empty message list in column '{column}'")
    if prompt and len(value) == 1 and value[0]["role"] == "user":
        return Chat(value[0]["content"], value)
    if prompt:
        return Chat("\n".join(f"{m['role']}: {m['content']}" for m in value), value)
    others = sorted({m["role"] for m in value} - {"assistant"})
    if others:
        raise DataError(
            f"{p}: {where} has a '{others[0]}' message in column '{column}'; a response holds only the "
            "assistant's messages (the conversation before it belongs in 'prompt')"
        )
    return Chat("\n".join(m["content"] for m in value), value)


def read_preferences(p: Path, split: str) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) rows of a preference file or dataset in TRL's format: columns
    'prompt', 'chosen', 'rejected', each a string (standard) or a list of messages (conversational,
    kept as a `Chat`: DPO renders its turns through the chat template as TRL's DPOTrainer does; where
    text is needed a prompt's lone user message is its text, several become 'role: content' lines,
    and a response is its assistant messages' contents, one per line). A row whose prompt is
    conversational and a response a string reads the response as one assistant message, and the
    other way round the prompt as one user message. A one-line DataError names the file, the row and
    the column."""
    records, present = read_table(p, split, "task.file.preferences", "task.file.preference_split")
    missing = [c for c in PREFERENCE_COLUMNS if c not in present]
    if missing:
        raise DataError(
            f"{p}: no column '{missing[0]}' (task.file.preferences in TRL's format needs "
            f"{', '.join(PREFERENCE_COLUMNS)}); columns present: {', '.join(present) or '(none)'}"
        )
    out = []
    for where, rec in records:
        texts = []
        for column in PREFERENCE_COLUMNS:
            value = rec.get(column)
            if hasattr(value, "tolist") and not isinstance(value, str):  # parquet: numpy arrays
                value = value.tolist()
            if isinstance(value, tuple):
                value = list(value)
            if isinstance(value, list):
                texts.append(_messages_text(p, where, column, value, prompt=column == "prompt"))
            else:
                texts.append(_text(p, where, column, "task.file.preferences", value))
        for column, text in zip(PREFERENCE_COLUMNS[1:], texts[1:], strict=True):
            if not text.strip():  # a reward model or DPO would learn a preference for (or against) nothing
                raise DataError(
                    f"{p}: {where} has an empty '{column}' response (task.file.preferences); every pair "
                    "needs a non-empty chosen and rejected response: fill it in or drop the row"
                )
        if any(isinstance(t, Chat) for t in texts):  # one form for the row: TRL's is per row too
            roles = ("user", "assistant", "assistant")
            texts = [
                t if isinstance(t, Chat) else Chat(t, [{"role": r, "content": t}])
                for t, r in zip(texts, roles, strict=True)
            ]
        if texts[1] == texts[2]:
            raise DataError(f"{p}: {where} has the same chosen and rejected response; drop the row")
        out.append((texts[0], texts[1], texts[2]))
    if not out:
        raise DataError(f"{p} has no rows; task.file.preferences needs preference pairs")
    return out


def _is_missing(value: Any) -> bool:
    """None, NaN, or pandas' NA / NaT (what a parquet file holds in an empty cell)."""
    if value is None or type(value).__name__ in ("NAType", "NaTType"):
        return True
    return isinstance(value, float) and math.isnan(value)


def _text(path: Path, where: str, column: str, param: str, value: Any, numbers_ok: bool = False) -> str:
    """`value` as a string, or a DataError naming the row and the column."""
    if isinstance(value, str):
        return value
    is_number = isinstance(value, numbers.Number) and not isinstance(value, bool)
    if numbers_ok and is_number and not _is_missing(value):
        return str(value)
    shown = f"the value {repr(value)[:40]} ({type(value).__name__})"
    what = "a missing value" if _is_missing(value) else shown
    need = "a string or a number" if numbers_ok else "a string"
    raise DataError(f"{path}: {where} has {what} in column '{column}' ({param}); it must be {need}")


@dataclass(frozen=True)
class _Row:
    prompt: str
    answer: str  # the normalised final answer the reward compares against
    demo: str  # a correct response: the response column or '#### <answer>'


@dataclass(frozen=True)
class FileTask:
    """A task read from a user's file: see the module docstring for format, scoring and split."""

    path: str
    answer_format: str
    train: tuple[_Row, ...] = field(repr=False)
    eval: tuple[_Row, ...] = field(repr=False)
    alphabet: str = field(repr=False)
    max_prompt_chars: int
    max_response_chars: int
    preferences: tuple[tuple[str, str, str], ...] = field(default=(), repr=False)  # train-split pairs
    preference_eval: tuple[tuple[str, str, str], ...] = field(default=(), repr=False)  # held-out pairs
    name: str = "file"

    def _score(self, answer: str, response: str) -> float:
        if not isinstance(response, str):
            return 0.0
        return float(get("reward", self.answer_format)(answer, response))

    def reward(self, example: Example, response: str) -> float:
        return self._score(example.answer, response)

    def _rows(self, split: str) -> tuple[_Row, ...]:
        check_split(split)
        rows = self.train if split == "train" else self.eval
        if not rows:
            raise DataError(
                f"{self.path}: the {split} split is empty ({len(self.train)} train, {len(self.eval)} eval "
                "rows); add rows with more distinct prompts or change task.file.eval_fraction"
            )
        return rows

    def _draw(self, split: str, n: int, rng: random.Random) -> list[_Row]:
        """`n` rows of `split`: shuffled passes over the split, so every row appears before any repeats."""
        rows = self._rows(split)
        out: list[_Row] = []
        while len(out) < n:
            perm = list(rows)
            rng.shuffle(perm)
            out.extend(perm)
        return out[:n]

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        rows = self._draw(split, n, random.Random(f"file|{split}|{seed}"))
        return [Example(prompt=r.prompt, answer=r.answer) for r in rows]

    def eval_split_size(self) -> int:
        """The distinct prompts of the eval split."""
        return len({r.prompt for r in self._rows("eval")})

    def eval_examples(self, n: int | None) -> list[Example]:
        rows: dict[str, _Row] = {}
        for r in sorted(self._rows("eval"), key=lambda r: prompt_hash(r.prompt)):  # distinct prompts
            rows.setdefault(r.prompt, r)
        check_eval_size(self, n)
        return [Example(prompt=r.prompt, answer=r.answer) for r in list(rows.values())[:n]]

    def demonstrations(self, n: int, seed: int) -> list[tuple[str, str]]:
        return [(r.prompt, r.demo) for r in self._draw("train", n, random.Random(f"file|demo|{seed}"))]

    def _rejected(self, row: _Row, rng: random.Random) -> str:
        wrong = _wrong_answer(row.answer, rng)
        if self.answer_format == "exact":
            return wrong
        if "####" in row.demo:
            candidate = row.demo.rsplit("####", 1)[0] + "#### " + wrong
        else:
            spans = list(_NUMBER.finditer(row.demo))
            candidate = row.demo[: spans[-1].start()] + wrong + row.demo[spans[-1].end() :] if spans else ""
        return candidate if self._score(row.answer, candidate) < 1.0 else f"#### {wrong}"

    def heldout_preference_pairs(self, n: int) -> list[tuple[str, str, str]] | None:
        """The first `n` pairs of the preference file whose prompts are held out (in prompt-hash order),
        for the reward model's held-out accuracy; None without a preference file (the reward model
        then draws fresh synthetic pairs)."""
        if not self.preferences:
            return None
        if not self.preference_eval:
            raise DataError(
                f"{self.path}: no preference pair's prompt is in the eval split, so the reward model has "
                "no held-out pairs; add pairs or raise task.file.eval_fraction"
            )
        return sorted(self.preference_eval, key=lambda t: prompt_hash(t[0]))[:n]

    def preference_pairs(self, n: int, seed: int) -> list[tuple[str, str, str]]:
        rng = random.Random(f"file|pref|{seed}")
        if self.preferences:  # the user's pairs: shuffled passes, every pair before any repeats
            out: list[tuple[str, str, str]] = []
            while len(out) < n:
                perm = list(self.preferences)
                rng.shuffle(perm)
                out.extend(perm)
            return out[:n]
        return [(r.prompt, r.demo, self._rejected(r, rng)) for r in self._draw("train", n, rng)]


# Parameters task.file gained after runs were cached: at these defaults they leave its cache keys as
# they were (train_config.TrainConfig.task_kwargs).
KEY_NEUTRAL = {"split": "train", "preferences": None, "preference_split": "train"}


@register("task", "file", key_neutral=KEY_NEUTRAL)
def file_task(
    *,
    path: str,
    prompt_column: str = "prompt",
    answer_column: str = "answer",
    response_column: str | None = None,
    eval_fraction: float = 0.1,
    answer_format: str = "gsm8k",
    split: str = "train",
    preferences: str | None = None,
    preference_split: str = "train",
) -> FileTask:
    """Prompts and answers from a .jsonl/.json/.parquet/.csv file or a Hugging Face dataset folder, scored by
    the reward part `answer_format` names (default: GSM8K's '####' exact match)."""
    check_fraction("file", eval_fraction)
    if answer_format not in names("reward"):
        raise ConfigError(
            f"task.file.answer_format = '{answer_format}' is unknown; "
            f"valid formats (registered rewards): {', '.join(names('reward'))}"
        )
    p = Path(path).expanduser()
    records, present = read_table(p, split, "task.file.path", "task.file.split")
    if not records:
        raise DataError(f"{p} has no rows; it needs at least two examples (one train, one eval)")
    wanted = [(prompt_column, "task.file.prompt_column"), (answer_column, "task.file.answer_column")]
    if response_column is not None:
        wanted.append((response_column, "task.file.response_column"))
    for column, param in wanted:
        if column not in present:
            raise DataError(
                f"{p}: no column '{column}' ({param}); columns present: {', '.join(present) or '(none)'}"
            )

    verifier = lookup("reward", answer_format).meta
    fmt = verifier.get("reference", final_answer)
    rows: list[_Row] = []
    chars: set[str] = set(DIGITS + "# ")
    for where, rec in records:
        for column, param in wanted:
            if column not in rec:
                raise DataError(f"{p}: {where} has no '{column}' ({param}); every row needs one")
        prompt = _text(p, where, prompt_column, "task.file.prompt_column", rec[prompt_column])
        raw_answer = _text(
            p, where, answer_column, "task.file.answer_column", rec[answer_column], numbers_ok=True
        )
        answer = fmt(raw_answer)
        if not answer:
            raise DataError(
                f"{p}: {where} has an empty answer in column '{answer_column}'; every row needs one"
            )
        if response_column is None:
            demo = verifier.get("demo", DEFAULT_DEMO).format(answer)
        else:
            demo = _text(p, where, response_column, "task.file.response_column", rec[response_column])
        row = _Row(prompt=prompt, answer=answer, demo=demo)
        rows.append(row)
        chars.update(prompt, raw_answer, demo)

    held_out = {r.prompt for r in rows if in_eval_split(r.prompt, eval_fraction)}
    distinct = {r.prompt for r in rows}
    if not held_out and eval_fraction > 0 and len(distinct) >= 2:
        held_out = {min(distinct, key=prompt_hash)}  # a small file still gets an eval split
    train = tuple(r for r in rows if r.prompt not in held_out)
    eval_ = tuple(r for r in rows if r.prompt in held_out)
    if not train:
        raise DataError(
            f"{p}: every prompt fell in the eval split ({len(rows)} rows); "
            "add rows or lower task.file.eval_fraction"
        )
    pairs: tuple[tuple[str, str, str], ...] = ()
    pairs_eval: tuple[tuple[str, str, str], ...] = ()
    if preferences is not None:  # the user's pairs, held-out prompts dropped (never trained on)
        every = read_preferences(Path(preferences).expanduser(), preference_split)
        out = {t[0] for t in every if t[0] in held_out or in_eval_split(t[0], eval_fraction)}
        pairs = tuple(t for t in every if t[0] not in out)
        pairs_eval = tuple(t for t in every if t[0] in out)
        if not pairs:
            raise DataError(
                f"{preferences}: every preference pair's prompt is in the eval split ({len(every)} pairs); "
                "add pairs or lower task.file.eval_fraction"
            )
        for prompt, chosen, rejected in every:
            chars.update(prompt, chosen, rejected)
    task = FileTask(
        path=str(p),
        preferences=pairs,
        preference_eval=pairs_eval,
        answer_format=answer_format,
        train=train,
        eval=eval_,
        alphabet="".join(sorted(chars)),
        max_prompt_chars=max(len(t) for t in [r.prompt for r in rows] + [t[0] for t in pairs + pairs_eval]),
        max_response_chars=max(
            len(t) for t in [r.demo for r in rows] + [x for t in pairs + pairs_eval for x in t[1:]]
        ),
    )
    for (where, _), row in zip(records, rows, strict=True):
        if task._score(row.answer, row.demo) < 1.0:
            gives = response_answer(row.demo) if answer_format == "gsm8k" else row.demo.strip()
            if response_column is None:
                raise DataError(
                    f"{p}: {where}: reward.{answer_format} does not accept its own answer "
                    f"'{row.answer[:40]}' written as '{gives[:40]}'; fix the answer or choose another "
                    "task.file.answer_format"
                )
            raise DataError(
                f"{p}: {where}: the response in column '{response_column}' gives '{gives[:40]}' but the "
                f"answer is '{row.answer[:40]}'; fix the row or unset task.file.response_column"
            )
    return task
