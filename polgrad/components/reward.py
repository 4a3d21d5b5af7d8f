"""Built-in reward parts: answer verifiers, the score of a response against a reference's final answer.

Call signature: `polgrad.registry.kinds.RewardFn`.

    task.file.answer_format = 'math_verify'    # or 'gsm8k' (the default), 'exact', a user's part

`task.file` calls the one its `answer_format` names. `answer` is the reference's final answer: for a
GSM8K-style reference, what follows its last '####' (GSM8K's documented format); else the whole
reference, stripped.

  reward.exact        1 iff response.strip() == answer.strip()
  reward.gsm8k        1 iff norm(final(response)) == norm(answer): final = after the response's last
                      '####' (to the end of that line), else its last number, else all of it; norm drops
                      whitespace, commas, one leading '+', a trailing '.0…' (GSM8K's own answers)
  reward.math_verify  1 iff math_verify.verify(parse(answer), parse(response)): Hugging Face's
                      math-verify (the extra `tasks`), which reads LaTeX (\\frac, \\boxed{}, sets,
                      percentages, units) and plain numbers and compares them symbolically, the rule
                      TRL's accuracy reward uses. A bare LaTeX reference ('\\{-1, 1\\}') or a plain
                      expression it does not read alone ('x^2+1') is read as '$...$'; a reference it
                      cannot parse at all scores every response 0.
"""

from __future__ import annotations

import re
import threading

from polgrad.errors import ConfigError
from polgrad.registry import register

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_TRAILING_ZEROS = re.compile(r"(?<=\d)\.0+$")


def final_answer(reference: str) -> str:
    """What follows the last '####' of a reference (GSM8K's format), or all of it; stripped."""
    return reference.rsplit("####", 1)[-1].strip()


def normalize(text: str) -> str:
    """'+1,234.0 ' -> '1234': drop whitespace and commas, one leading '+', a trailing '.0…'."""
    s = "".join(text.split()).replace(",", "")
    if s.startswith("+"):
        s = s[1:]
    return _TRAILING_ZEROS.sub("", s)


def reference_answer(answer: str) -> str:
    """The final answer of a GSM8K reference: normalised text after the last '####' (or all of it)."""
    return normalize(answer.rsplit("####", 1)[-1])


def response_answer(response: str) -> str:
    """The final answer a response gives: after the last '####' (to end of line), else its last
    number, else the whole response; normalised. '' when it gives none."""
    if "####" in response:
        tail = response.rsplit("####", 1)[1].strip()
        return normalize(tail.splitlines()[0] if tail else "")
    numbers_ = _NUMBER.findall(response)
    return normalize(numbers_[-1] if numbers_ else response)


@register("reward", "exact", formula="1[response.strip() == answer.strip()]", reference=str.strip, demo="{}")
def exact(answer: str, response: str) -> float:
    """Exact match after stripping surrounding whitespace. answer, response: str -> float in {0, 1}."""
    if not isinstance(response, str):
        return 0.0
    return float(response.strip() == answer.strip())


@register(
    "reward",
    "gsm8k",
    formula="1[norm(final(response)) == norm(answer)], GSM8K's '####' rule",
    reference=reference_answer,
    demo="#### {}",
)
def gsm8k(answer: str, response: str) -> float:
    """GSM8K's exact-match rule (Cobbe et al. 2021, 'Training Verifiers to Solve Math Word Problems':
    a solution ends with '#### <number>'): the response's final answer (`response_answer`) equals the
    normalised reference (`reference_answer`). answer, response: str -> float in {0, 1}."""
    if not isinstance(response, str):
        return 0.0
    got = response_answer(response)
    return float(bool(got) and got == reference_answer(answer))


def _math_verify():
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ConfigError(
            "reward.math_verify needs the math-verify package: pip install 'polgrad[tasks]' "
            "(or pip install math-verify)"
        ) from None
    return parse, verify


@register("reward", "math_verify", formula="1[math_verify.verify(parse(answer), parse(response))]")
def math_verify(answer: str, response: str) -> float:
    """Hugging Face's math-verify (github.com/huggingface/Math-Verify): both texts are parsed (LaTeX
    in $...$ or \\boxed{}, or a plain expression; the last match wins) into sympy objects and compared
    (numbers to 6 decimals, fractions, sets, intervals, percentages as fractions, units dropped).
    answer, response: str -> float in {0, 1}. Off the main thread math-verify's signal-based time
    limit cannot work, so it runs without one there: train.reward_timeout_s (which runs every reward
    in a worker thread) then bounds a call by stopping the run, where math-verify's own limit would
    have scored the response 0."""
    if not isinstance(response, str) or not response.strip():
        return 0.0
    parse, verify = _math_verify()
    main = threading.current_thread() is threading.main_thread()
    limit = {} if main else {"parsing_timeout": None}
    if "\\" in answer and "$" not in answer:  # bare LaTeX ('\\frac{1}{2}'): read it as math
        answer = f"${answer}$"
    gold = parse(answer, **limit) or parse(f"${answer}$", **limit)  # 'x^2+1': plain math, no LaTeX
    got = parse(response, **limit)
    if not gold or not got:
        return 0.0
    return float(verify(gold, got, **({} if main else {"timeout_seconds": None})))
