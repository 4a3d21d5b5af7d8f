"""Answer verifiers (kind `reward`): known values, arbitrary text never raises, and task.file using them.

math-verify's expected values are its documented behaviour (its README: LaTeX and plain answers,
\\boxed{}, fractions equal to decimals, sets unordered, percentages, units dropped), checked here on
cases worked by hand, not copied from polgrad's output."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polgrad  # noqa: F401  (registers the parts)
from polgrad.registry import get

math_verify = get("reward", "math_verify")
gsm8k = get("reward", "gsm8k")
exact = get("reward", "exact")


@pytest.mark.parametrize(
    "answer, response, want",
    [
        ("0.5", "\\frac{1}{2}", 1.0),  # a fraction equals its decimal
        ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$.", 1.0),  # \boxed{} is read
        ("\\frac{1}{2}", "$\\frac{2}{4}$", 1.0),  # equal values, different forms
        ("\\frac{1}{2}", "$\\frac{1}{3}$", 0.0),
        ("72", "so she sold 72 clips", 1.0),  # a plain number in text
        ("72", "#### 72", 1.0),
        ("72", "73", 0.0),  # a wrong answer
        ("72", "no answer here", 0.0),
        ("72", "", 0.0),
        ("$\\{1, 2\\}$", "$\\{2, 1\\}$", 1.0),  # sets are unordered
        ("$10\\%$", "$0.1$", 1.0),  # a percentage is a fraction
        ("10", "$10\\text{ cm}$", 1.0),  # units are dropped
        ("1,234", "1234", 1.0),  # thousands separators
        ("x^2+7x+10", "$\\boxed{x^2 + 7x + 10}$", 1.0),  # a plain symbolic reference (MATH style)
        ("x^2+7x+10", "$x^2 + 7x + 11$", 0.0),
    ],
)
def test_math_verify_known_values(answer, response, want):
    assert math_verify(answer, response) == want


def test_math_verify_off_the_main_thread():
    """math-verify's time limit uses signal.alarm, main thread only: elsewhere it runs without one."""
    out = []
    t = threading.Thread(
        target=lambda: out.append((math_verify("0.5", "$\\frac{1}{2}$"), math_verify("2", "3")))
    )
    t.start()
    t.join()
    assert out == [(1.0, 0.0)]


@pytest.mark.parametrize(
    "fn, answer, response, want",
    [
        (gsm8k, "Natalia sold 48/2 = 24 clips ... #### 72", "#### 72", 1.0),
        (gsm8k, "#### 1,234", "she has +1,234.00 left", 1.0),  # normalised: commas, '+', '.00'
        (gsm8k, "72", "#### 72\nthen 5", 1.0),  # the '####' line wins over a later number
        (gsm8k, "72", "72 or 73", 0.0),  # the last number is read
        (exact, "abc", "  abc\n", 1.0),
        (exact, "abc", "abcd", 0.0),
    ],
)
def test_gsm8k_and_exact_known_values(fn, answer, response, want):
    assert fn(answer, response) == want


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_every_verifier_scores_arbitrary_text_in_0_1_without_raising(text):
    for fn in (math_verify, gsm8k, exact):
        assert fn("\\frac{1}{2}", text) in (0.0, 1.0)
        assert fn("12", text) in (0.0, 1.0)


def test_file_task_scores_with_math_verify(tmp_path):
    """task.file.answer_format = 'math_verify': LaTeX references (after '####' where present) are
    compared by math-verify; the demonstrations score 1 and the preference pairs' rejected 0."""
    rows = [
        {"prompt": "half of one?", "answer": "\\frac{1}{2}"},
        {"prompt": "a quarter plus a quarter?", "answer": "so #### \\frac{1}{2}"},
        {"prompt": "two times three?", "answer": "6"},
        {"prompt": "the set of roots of x^2 = 1?", "answer": "\\{-1, 1\\}"},
    ] + [{"prompt": f"{i} + {i}?", "answer": str(2 * i)} for i in range(40)]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = get("task", "file")(path=str(path), answer_format="math_verify", eval_fraction=0.2)
    examples = {ex.prompt: ex for s in ("train", "eval") for ex in task.examples(s, 400, seed=0)}
    by_prompt = {r["prompt"]: r for r in rows}
    assert set(examples) == set(by_prompt)
    half = examples["a quarter plus a quarter?"]
    assert half.answer == "\\frac{1}{2}"  # what follows the '####'
    assert task.reward(half, "It is $0.5$") == 1.0 and task.reward(half, "$\\boxed{1/3}$") == 0.0
    assert task.reward(examples["the set of roots of x^2 = 1?"], "$\\{1, -1\\}$") == 1.0
    for prompt, chosen, rejected in task.preference_pairs(50, seed=1):
        ex = examples[prompt]
        assert task.reward(ex, chosen) == 1.0 and task.reward(ex, rejected) == 0.0
