"""Tasks: the contract of every registered task, the built-ins' knobs, and the file loader."""

from __future__ import annotations

import json
import os

import gin
import pandas as pd
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import polgrad  # noqa: F401  (registers the built-in tasks)
from polgrad.config_parts import part
from polgrad.errors import ConfigError, DataError
from polgrad.registry import get, names
from polgrad.tasks.base import Example
from polgrad.tasks.files import EXAMPLE_GSM8K, normalize, reference_answer, response_answer
from polgrad.tasks.synthetic import in_eval_split

EXAMPLE_ROWS = [json.loads(line) for line in EXAMPLE_GSM8K.read_text().splitlines() if line.strip()]


# --- every registered task, with independent oracles ----------------------------------------------
def _file_default():
    return get("task", "file")(path=str(EXAMPLE_GSM8K), prompt_column="question")


def _file_worked():
    return get("task", "file")(path=str(EXAMPLE_GSM8K), prompt_column="question", response_column="answer")


# name -> (factory, oracle(task, prompt) -> answer); variants exercise each knob through the contract.
def _add_oracle(task, prompt):
    a, b = prompt.removesuffix("=").split("+")
    s = str(int(a) + int(b))
    return s[::-1] if task.reverse else s


def _sort_oracle(task, prompt):
    assert prompt.startswith("sort ") and prompt.endswith("=")
    return "".join(sorted(prompt[5:-1]))


def _reverse_oracle(task, prompt):
    assert prompt.startswith("rev ") and prompt.endswith("=")
    return prompt[4:-1][::-1]


def _running_sum_oracle(task, prompt):
    assert prompt.endswith("=")
    return str(sum(int(t) for t in prompt[:-1].split("+")))


def _file_oracle(task, prompt):
    answers = {r["question"]: r["answer"].split("####")[-1].strip().replace(",", "") for r in EXAMPLE_ROWS}
    return answers[prompt]


VARIANTS = {
    "add": (lambda: get("task", "add")(), _add_oracle),
    "add_d1": (lambda: get("task", "add")(digits=1), _add_oracle),
    "add_d3_reverse_pad": (lambda: get("task", "add")(digits=3, reverse=True, pad=True), _add_oracle),
    "sort": (lambda: get("task", "sort")(), _sort_oracle),
    "sort_short_3sym": (lambda: get("task", "sort")(length=3, symbols=3), _sort_oracle),
    "reverse": (lambda: get("task", "reverse")(), _reverse_oracle),
    "reverse_long": (lambda: get("task", "reverse")(length=8), _reverse_oracle),
    "running_sum": (lambda: get("task", "running_sum")(), _running_sum_oracle),
    "running_sum_checks": (
        lambda: get("task", "running_sum")(min_terms=5, max_terms=5, checks=0.5),
        _running_sum_oracle,
    ),
    "running_sum_d1_answer_only": (
        lambda: get("task", "running_sum")(digits=1, max_terms=3, worked=False),
        _running_sum_oracle,
    ),
    "file": (_file_default, _file_oracle),
    "file_worked": (_file_worked, _file_oracle),
}
BUILTINS = ("add", "sort", "reverse")


@pytest.fixture(params=sorted(VARIANTS))
def variant(request):
    make, oracle = VARIANTS[request.param]
    return make(), oracle


def _eval_prompts(task):
    if hasattr(task, "eval") and isinstance(task.eval, tuple):  # file task: the held-out rows
        return {r.prompt for r in task.eval}
    return None


def _is_eval(task, prompt):
    held = _eval_prompts(task)
    return prompt in held if held is not None else in_eval_split(prompt, task.eval_fraction)


def test_every_registered_task_is_covered():
    registered = {n for n in names("task") if not n.startswith("test_")}  # test files' own tasks
    assert {"add", "sort", "reverse", "file"} <= registered
    # a variant is named after its task, or its task and a suffix ('add_d1'); reasoning_gym is covered
    # in tests/tasks/test_gym_task.py
    covered = {n for n in registered if any(k == n or k.startswith(n + "_") for k in VARIANTS)}
    assert registered - covered == {"reasoning_gym"}, f"add a VARIANTS entry for {registered - covered}"


def test_task_attributes(variant):
    task, _ = variant
    assert isinstance(task.name, str) and task.name in names("task")
    assert isinstance(task.alphabet, str) and len(set(task.alphabet)) == len(task.alphabet)
    assert task.max_prompt_chars > 0 and task.max_response_chars > 0


@pytest.mark.parametrize("split", ["train", "eval"])
def test_examples_deterministic_per_seed(variant, split):
    task, _ = variant
    a = task.examples(split, 30, seed=3)
    assert a == task.examples(split, 30, seed=3)
    assert len(a) == 30 and all(isinstance(e, Example) for e in a)
    if split == "train":
        assert a != task.examples(split, 30, seed=4)
    assert task.demonstrations(20, seed=1) == task.demonstrations(20, seed=1)
    assert task.preference_pairs(20, seed=1) == task.preference_pairs(20, seed=1)


def test_examples_deterministic_across_processes():
    import subprocess
    import sys

    code = "import polgrad; t = polgrad.registry.get('task', 'add')(); print(t.examples('train', 5, 7))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": h},
        ).stdout
        for h in ("1", "2")
    }
    assert len(outs) == 1
    assert repr(get("task", "add")().examples("train", 5, 7)) == outs.pop().strip()


def test_eval_and_train_disjoint(variant):
    task, oracle = variant
    train = task.examples("train", 400, seed=0)
    ev = task.examples("eval", 100, seed=0)
    demos = task.demonstrations(200, seed=0)
    pairs = task.preference_pairs(200, seed=0)
    train_prompts = {e.prompt for e in train} | {p for p, _ in demos} | {p for p, _, _ in pairs}
    eval_prompts = {e.prompt for e in ev}
    assert train_prompts and eval_prompts
    assert not train_prompts & eval_prompts
    assert all(_is_eval(task, p) for p in eval_prompts)
    assert not any(_is_eval(task, p) for p in train_prompts)


def test_answers_match_oracle_and_score_one(variant):
    task, oracle = variant
    for split in ("train", "eval"):
        for ex in task.examples(split, 100, seed=1):
            assert ex.answer == oracle(task, ex.prompt)
            assert task.reward(ex, ex.answer) == 1.0
            assert task.reward(ex, f" {ex.answer}\n") == 1.0  # surrounding whitespace is ignored
            assert task.reward(ex, ex.answer + "1") < 1.0
            assert task.reward(ex, "") == 0.0


def test_demonstrations_score_one(variant):
    task, oracle = variant
    demos = task.demonstrations(100, seed=2)
    assert len(demos) == 100
    for prompt, response in demos:
        assert task.reward(Example(prompt, oracle(task, prompt)), response) == 1.0


def test_preference_pairs_chosen_beats_rejected(variant):
    task, oracle = variant
    pairs = task.preference_pairs(200, seed=5)
    assert len(pairs) == 200
    for prompt, chosen, rejected in pairs:
        ex = Example(prompt, oracle(task, prompt))
        assert task.reward(ex, chosen) == 1.0
        assert task.reward(ex, rejected) == 0.0
        assert rejected != chosen
        assert set(rejected) <= set(task.alphabet)
    if task.name in BUILTINS:  # plausible: same length up to a carry, mostly the same characters
        assert all(abs(len(r) - len(c)) <= 1 for _, c, r in pairs)
        assert len({r for _, _, r in pairs}) > 5


def test_alphabet_and_lengths(variant):
    task, _ = variant
    alphabet = set(task.alphabet)
    texts = [(e.prompt, e.answer) for s in ("train", "eval") for e in task.examples(s, 300, seed=0)]
    texts += task.demonstrations(300, seed=0)
    for prompt, response in texts:
        assert set(prompt) <= alphabet and set(response) <= alphabet
        assert len(prompt) <= task.max_prompt_chars
        assert len(response) <= task.max_response_chars
    if task.name in BUILTINS:
        assert task.max_prompt_chars <= 16 and task.max_response_chars <= 8
        assert max(len(p) for p, _ in texts) == task.max_prompt_chars  # the bound is tight
        assert len(task.alphabet) <= 20


JUNK = [
    "",
    " ",
    "\n",
    "####",
    "#### ",
    "-",
    "+",
    ".",
    ",",
    "\x00",
    "\ud7ff" * 3,
    "😀" * 50,
    "9" * 5000,
    "#### \n 1",
    "1e9",
    "nan",
    "∞",
    "٣",
]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_reward_of_arbitrary_text_is_zero_and_never_raises(name):
    make, oracle = VARIANTS[name]
    task = make()
    exs = task.examples("train", 5, seed=0)

    @given(text=st.text(max_size=60), i=st.integers(0, len(exs) - 1))
    @example(text="", i=0)
    def check(text, i):
        ex = exs[i]
        r = task.reward(ex, text)
        assert isinstance(r, float) and r in (0.0, 1.0)
        if task.name in BUILTINS:
            assert r == float(text.strip() == ex.answer)
        elif r == 1.0:  # a GSM8K match needs the answer's digits in the (comma/space-free) text
            assert ex.answer in "".join(text.split()).replace(",", "")

    check()
    for text in JUNK:
        assert task.reward(exs[0], text) == 0.0


@pytest.mark.parametrize("name", BUILTINS)
@given(text=st.text(alphabet="0123456789 +=#x", max_size=12))
def test_partial_credit_in_unit_interval(name, text):
    task = get("task", name)(partial=True)
    ex = task.examples("train", 1, seed=0)[0]
    r = task.reward(ex, text)
    assert 0.0 <= r <= 1.0
    assert (r == 1.0) == (text.strip() == ex.answer)


# --- built-in knobs -------------------------------------------------------------------------------
def test_add_known_values_and_knobs():
    ex = Example("23+58=", "81")
    add = part("task", "add")()
    assert add.reward(ex, "81") == 1.0 and add.reward(ex, "80") == 0.0 and add.reward(ex, "081") == 0.0
    partial = get("task", "add")(partial=True)
    assert partial.reward(ex, "80") == pytest.approx(0.5)
    assert partial.reward(ex, "81x") == pytest.approx(2 / 3)
    assert partial.reward(ex, "") == 0.0 and partial.reward(ex, "99") == 0.0
    rev = get("task", "add")(reverse=True, pad=True, digits=3)
    for e in rev.examples("train", 50, seed=0):
        a, b = e.prompt[:-1].split("+")
        assert len(a) == len(b) == 3
        assert e.answer == str(int(a) + int(b))[::-1]
    assert rev.max_prompt_chars == 8 and rev.max_response_chars == 4
    assert {len(e.prompt) for e in add.examples("train", 500, seed=0)} == {4, 5, 6}  # unpadded operands


def test_sort_and_reverse_knobs():
    s = get("task", "sort")(length=4, symbols=3)
    for e in s.examples("train", 50, seed=0):
        assert set(e.prompt[5:-1]) <= set("012") and len(e.answer) == 4
    r = get("task", "reverse")(length=3)
    assert r.reward(Example("rev 123=", "321"), "321") == 1.0
    assert r.reward(Example("rev 123=", "321"), "123") == 0.0


def test_running_sum_known_values():
    task = get("task", "running_sum")()
    ex = Example("12+7+30+5=", "54")
    worked = "12+7=19\n19+30=49\n49+5=54\n#### 54"
    assert task.response([12, 7, 30, 5]) == worked
    for right in (worked, "#### 54", "54", " 54\n", "12+7=19\n19+30=49\n49+5=54"):  # GSM8K's rule
        assert task.reward(ex, right) == 1.0, right
    for wrong in ("12+7=19\n19+30=49\n49+5=54\n#### 55", "#### 54 55x", "54 55", "#### ", ""):
        assert task.reward(ex, wrong) == 0.0, wrong
    # the bounds are those of the longest problem: max_terms terms of 10**digits - 1
    small = get("task", "running_sum")(digits=1, max_terms=3)
    assert small.max_prompt_chars == len("9+9+9=")
    assert small.max_response_chars == len("9+9=18\n18+9=27\n#### 27")
    assert get("task", "running_sum")(digits=1, max_terms=3, worked=False).max_response_chars == 2
    # the number of terms is uniform in min_terms..max_terms, and the worked answer grows with it; the
    # terms cover 0..99
    by_terms: dict[int, list[int]] = {}
    drawn: set[int] = set()
    for prompt, response in task.demonstrations(2000, seed=0):
        by_terms.setdefault(prompt.count("+") + 1, []).append(len(response))
        drawn.update(int(t) for t in prompt[:-1].split("+"))
    assert drawn == set(range(100))
    assert sorted(by_terms) == list(range(2, 9))
    assert all(150 < len(v) < 350 for v in by_terms.values())  # 2000 / 7 = 286 each
    means = [sum(v) / len(v) for _, v in sorted(by_terms.items())]
    assert all(a + 5 < b for a, b in zip(means[:-1], means[1:], strict=True))  # each term: a line of >= 6


def test_running_sum_rejected_answers_are_one_carried_slip():
    """A rejected worked answer follows the chosen one up to one line whose result is off by 1 or
    10, and carries that wrong running sum on: every other line adds right, and each line starts from
    the previous line's result."""
    task = get("task", "running_sum")()
    slips = set()
    for prompt, chosen, rejected in task.preference_pairs(300, seed=1):
        terms = [int(t) for t in prompt[:-1].split("+")]
        *lines, last = rejected.split("\n")
        running, off = terms[0], []
        for i, line in enumerate(lines):
            a, rest = line.split("+")
            b, c = rest.split("=")
            assert (int(a), int(b)) == (running, terms[i + 1]), (prompt, rejected)
            if int(c) != int(a) + int(b):
                off.append(int(c) - int(a) - int(b))
            running = int(c)
        assert len(off) == 1 and off[0] in (-10, -1, 1, 10), (prompt, rejected)
        assert last == f"#### {running}" and running == sum(terms) + off[0]
        assert chosen == task.response(terms)
        slips.add(off[0])
    assert slips == {-10, -1, 1, 10}


def test_running_sum_checks_known_values_and_lengths():
    """A check 'c-b=a' after a step 'a+b=c', drawn per step with probability `checks`: the answers to
    one problem then vary in length by the checks written; checks = 0 draws nothing, so the
    demonstrations and preference pairs are byte for byte those of the task without the setting."""
    task = get("task", "running_sum")(checks=0.5)
    ex = Example("12+7+30+5=", "54")
    checked = "12+7=19\n19-7=12\n19+30=49\n49+5=54\n54-5=49\n#### 54"
    assert task.response([12, 7, 30, 5], checked=[True, False, True]) == checked
    assert task.reward(ex, checked) == 1.0  # GSM8K's rule reads the final sum, not the checks
    # after a slip the check's difference is computed, not copied: it shows the slip
    assert task.response([12, 7, 30], (0, 1), [True, True]) == "12+7=20\n20-7=13\n20+30=50\n50-30=20\n#### 50"
    assert "-" in task.alphabet and "-" not in get("task", "running_sum")().alphabet
    # the longest answer checks every step: 9+9=18 / 18-9=9 / 18+9=27 / 27-9=18 / #### 27
    assert get("task", "running_sum")(digits=1, max_terms=3, checks=0.1).max_response_chars == len(
        "9+9=18\n18-9=9\n18+9=27\n27-9=18\n#### 27"
    )
    plain = get("task", "running_sum")(min_terms=5, max_terms=5)
    no_checks = get("task", "running_sum")(min_terms=5, max_terms=5, checks=0)
    assert no_checks.demonstrations(50, 3) == plain.demonstrations(50, 3)
    assert no_checks.preference_pairs(50, 3) == plain.preference_pairs(50, 3)  # the same slips drawn
    # 5 terms, checks 0.5: each of the 4 steps checked with probability 1/2, and the answer without
    # its checks is the plain one
    with_checks = get("task", "running_sum")(min_terms=5, max_terms=5, checks=0.5)
    counts = []
    for (prompt, response), (prompt0, response0) in zip(
        with_checks.demonstrations(2000, 0), plain.demonstrations(2000, 0), strict=True
    ):
        lines = response.split("\n")
        counts.append(sum("-" in line for line in lines))
        assert prompt == prompt0  # the problems are drawn before any check
        assert "\n".join(line for line in lines if "-" not in line) == response0
    # Binomial(4, 1/2): mean 2, sd 1; over 2000 answers the mean's sd is 0.022, 0.1 is 4.5 of them
    assert abs(sum(counts) / len(counts) - 2) < 0.1
    assert set(counts) == {0, 1, 2, 3, 4}


def test_running_sum_checks_at_their_default_leave_the_warm_start_key_alone():
    """`checks` came after running_sum's warm starts were cached (the length_bias pilot's): at its
    default it is not in the task's configuration, which keys the warm start; set, it is."""
    from polgrad.registry import task_configuration

    assert task_configuration("running_sum", {}) == {
        "digits": 2,
        "min_terms": 2,
        "max_terms": 8,
        "worked": True,
        "eval_fraction": 0.1,
    }
    assert task_configuration("running_sum", {"checks": 0.0}) == task_configuration("running_sum", {})
    assert task_configuration("running_sum", {"checks": 0.5})["checks"] == 0.5


def test_running_sum_rejected_answers_with_checks_keep_the_chosen_ones_checks():
    # at 1 digit and every step checked a -10 slip on a small starting sum is common: its check's
    # difference would be negative (9+5=4 / 4-5=-1) without the guard
    for task in (
        get("task", "running_sum")(min_terms=4, max_terms=4, checks=0.5),
        get("task", "running_sum")(digits=1, min_terms=3, max_terms=3, checks=1.0),
    ):
        pairs = task.preference_pairs(300, seed=2)
        assert all(_checks_kept_and_positive(chosen, rejected) for _, chosen, rejected in pairs)


def _checks_kept_and_positive(chosen: str, rejected: str) -> bool:
    """The rejected answer checks the chosen one's steps, differs from it, and writes no negative
    number (one would betray the slip)."""
    a, b = chosen.split("\n"), rejected.split("\n")
    same_checks = len(a) == len(b) and [("-" in x) for x in a] == [("-" in x) for x in b]
    return same_checks and chosen != rejected and "=-" not in rejected


def test_running_sum_has_too_many_problems_to_evaluate_on_all():
    with pytest.raises(ConfigError, match="set train.eval_size to a number"):
        get("task", "running_sum")().eval_examples(None)
    small = get("task", "running_sum")(digits=1, max_terms=3)  # 10**2 + 10**3 problems: counted
    assert small.eval_split_size() == len(small.eval_examples(None)) > 50


def test_split_rule_is_stable_and_has_the_right_size():
    # Changing the hash rule would silently move eval prompts into training: pin it.
    held_out = ["0+3=", "0+5=", "sort 00002=", "sort 00008=", "rev 00007=", "rev 00009="]
    trained = ["23+58=", "0+0=", "sort 31524=", "rev 31524=", "sort 00000=", "rev 00000="]
    assert all(in_eval_split(p, 0.1) for p in held_out)
    assert not any(in_eval_split(p, 0.1) for p in trained)
    every = [f"{a}+{b}=" for a in range(100) for b in range(100)]
    held = [p for p in every if in_eval_split(p, 0.1)]
    assert 0.09 < len(held) / len(every) < 0.11
    assert sum(in_eval_split(p, 0.3) for p in every) / len(every) == pytest.approx(0.3, abs=0.015)
    assert set(held) <= {p for p in every if in_eval_split(p, 0.3)}  # a larger fraction only adds prompts


def test_gin_binding_changes_the_task():
    gin.parse_config("task.add.digits = 3\ntask.add.reverse = True\ntask.sort.length = 7")
    add = part("task", "add")()
    assert add.digits == 3 and add.reverse and add.max_response_chars == 4
    assert any(len(e.prompt) == 8 for e in add.examples("train", 50, seed=0))
    assert len(part("task", "sort")().examples("train", 1, seed=0)[0].answer) == 7


def test_gin_reference_builds_a_task():
    @gin.configurable("uses_task", module="test_tasks")
    def uses_task(task=None):
        return task

    gin.parse_config("test_tasks.uses_task.task = @task.reverse()\ntask.reverse.length = 3")
    assert uses_task().examples("eval", 1, seed=0)[0].answer.__len__() == 3


@pytest.mark.parametrize(
    "name, kwargs, fragment",
    [
        ("add", {"digits": 0}, "task.add.digits = 0"),
        ("add", {"digits": 7}, "1..6"),
        ("sort", {"length": 1}, "task.sort.length"),
        ("sort", {"symbols": 11}, "task.sort.symbols"),
        ("reverse", {"length": 11}, "task.reverse.length"),
        ("running_sum", {"digits": 5}, "task.running_sum.digits = 5"),
        ("running_sum", {"min_terms": 1}, "min_terms = 1"),
        ("running_sum", {"min_terms": 5, "max_terms": 3}, "2 <= min_terms <= max_terms <= 16"),
        ("running_sum", {"max_terms": 17}, "max_terms = 17"),
        ("running_sum", {"checks": 1.5}, "task.running_sum.checks = 1.5 must be a probability"),
        ("running_sum", {"checks": True}, "task.running_sum.checks = True must be a probability"),
        ("running_sum", {"checks": 0.5, "worked": False}, "checks needs worked = True"),
        ("add", {"eval_fraction": 1.0}, "must be in [0, 1)"),
        ("add", {"eval_fraction": -0.1}, "task.add.eval_fraction"),
    ],
)
def test_bad_knobs_raise_config_error(name, kwargs, fragment):
    with pytest.raises(ConfigError) as err:
        get("task", name)(**kwargs)
    assert fragment in _message(err.value)


def test_bad_split_and_empty_eval_raise():
    add = part("task", "add")()
    with pytest.raises(ConfigError, match="unknown split 'test'; valid splits: train, eval"):
        add.examples("test", 1, seed=0)
    with pytest.raises(ConfigError, match="eval split is empty"):
        get("task", "add")(eval_fraction=0.0).examples("eval", 1, seed=0)
    assert get("task", "add")(eval_fraction=0.0).examples("train", 3, seed=0)  # all of it is train
    with pytest.raises(ConfigError, match="nearly"):  # 1-digit add has ~10 eval prompts out of 100
        get("task", "add")(digits=1, eval_fraction=0.001).examples("eval", 1, seed=0)


# --- the file loader: GSM8K matching --------------------------------------------------------------
@pytest.mark.parametrize(
    "reference, expected",
    [
        ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### +7", "7"),
        ("#### 42.0", "42"),
        ("#### 42.00", "42"),
        ("#### 3.50", "3.50"),
        ("#### -5", "-5"),
        ("a #### 1 #### 2", "2"),
        ("18", "18"),
        (" Paris ", "Paris"),
    ],
)
def test_reference_answer_known_values(reference, expected):
    assert reference_answer(reference) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is 42.", "42"),
        ("I think 12, no wait, 17", "17"),
        ("#### 18\nQuestion: 99 apples", "18"),
        ("so 3 + 4 = 7 #### 7", "7"),
        ("#### 1,000,000", "1000000"),
        ("+15 dollars", "15"),
        ("cost is $2.50 total", "2.50"),
        ("is 6.0", "6"),
        ("-3 degrees", "-3"),
        ("####", ""),
        ("#### \n", ""),
        ("", ""),
        ("no number here", "nonumberhere"),
    ],
)
def test_response_answer_known_values(response, expected):
    assert response_answer(response) == expected


@given(n=st.integers(-(10**12), 10**12), noise=st.sampled_from(["", " ", "  ", "\t"]))
def test_gsm8k_number_round_trip(n, noise):
    assert response_answer(f"work 1 2 3 ####{noise}{n:,}") == str(n)
    assert response_answer(f"so it is {n:,}.") == str(n)
    assert reference_answer(f"...\n#### {n}") == str(n)
    assert normalize(normalize(f"{n:,}")) == normalize(f"{n:,}")


def test_file_reward_known_values():
    task = _file_default()
    ex = Example("q", "1234")
    for good in ("#### 1234", "#### 1,234", "it is 1,234.", "####1234.0", "#### +1234\nmore text 5"):
        assert task.reward(ex, good) == 1.0, good
    for bad in ("#### 1235", "1234 then 5", "#### 12345", "####", "", "#### 1234 apples", "x" * 9999):
        assert task.reward(ex, bad) == 0.0, bad


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [
    {"prompt": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b:,}"}
    for a, b in [(1, 2), (30, 40), (500, 700), (12, 9), (8, 8), (1000, 2345), (3, 3), (77, 1)]
]


def test_file_round_trip_jsonl_and_parquet(tmp_path):
    jl = _write_jsonl(tmp_path / "d.jsonl", ROWS)
    pq = tmp_path / "d.parquet"
    pd.DataFrame(ROWS).to_parquet(pq)
    a = get("task", "file")(path=str(jl))
    b = get("task", "file")(path=str(pq))
    assert (a.train, a.eval, a.alphabet) == (b.train, b.eval, b.alphabet)
    assert len(a.train) + len(a.eval) == len(ROWS) and a.eval and a.train
    expected = {r["prompt"]: r["answer"].split("#### ")[1].replace(",", "") for r in ROWS}
    for ex in a.examples("train", 30, seed=0) + a.examples("eval", 5, seed=0):
        assert ex.answer == expected[ex.prompt]
    train = a.examples("train", len(a.train), seed=0)  # one pass covers every row before repeating
    assert sorted(e.prompt for e in train) == sorted(r.prompt for r in a.train)
    assert a.max_prompt_chars == max(len(r["prompt"]) for r in ROWS)
    assert a.max_response_chars == len("#### 3345")
    assert dict(a.demonstrations(3, seed=0)).keys() <= {r.prompt for r in a.train}


def test_a_json_file_of_json_lines_or_of_one_array_reads_as_the_jsonl(tmp_path):
    """`Dataset.to_json`'s default output (JSON lines in a file named .json) and pandas'
    `orient='records'` array both read as the same rows in a .jsonl would (refused before: "unsupported
    extension '.json'")."""
    from datasets import Dataset

    reference = get("task", "file")(path=str(_write_jsonl(tmp_path / "d.jsonl", ROWS)))
    Dataset.from_list(ROWS).to_json(tmp_path / "lines.json")
    pd.DataFrame(ROWS).to_json(tmp_path / "array.json", orient="records", indent=2)
    assert (tmp_path / "lines.json").read_text().startswith("{")  # JSON lines, as datasets writes it
    for name in ("lines.json", "array.json"):
        t = get("task", "file")(path=str(tmp_path / name))
        assert (t.train, t.eval, t.alphabet) == (reference.train, reference.eval, reference.alphabet), name
    (tmp_path / "bad.json").write_text('[{"prompt": "1+1=", "answer": "2"}, 3]')
    _raises(tmp_path / "bad.json", "bad.json", "item 1 (0-based) of its array is a JSON int", "an object")
    (tmp_path / "torn.json").write_text('[{"prompt": "1+1=",\n "answer": ')
    _raises(tmp_path / "torn.json", "torn.json", "not valid JSON", "line 2")


def test_file_numeric_answers_exact_format_and_response_column(tmp_path):
    rows = [{"q": f"{i}*2=", "a": i * 2, "sol": f"{i}*2={i * 2}"} for i in range(1, 9)]
    jl = _write_jsonl(tmp_path / "n.jsonl", rows)
    t = get("task", "file")(path=str(jl), prompt_column="q", answer_column="a", response_column="sol")
    assert {e.answer for e in t.examples("train", 20, seed=0)} <= {str(i * 2) for i in range(1, 9)}
    for prompt, demo in t.demonstrations(10, seed=0):
        assert demo == f"{prompt}{int(prompt[:-3]) * 2}"
    for _, chosen, rejected in t.preference_pairs(10, seed=0):
        assert rejected.rsplit("=", 1)[0] == chosen.rsplit("=", 1)[0]  # only the final number changes
    pq = tmp_path / "n.parquet"
    pd.DataFrame(rows).to_parquet(pq)  # an int64 column
    tp = get("task", "file")(path=str(pq), prompt_column="q", answer_column="a", response_column="sol")
    assert (tp.train, tp.eval) == (t.train, t.eval)

    capitals = [("FR", "Paris"), ("IT", "Rome"), ("DE", "Berlin"), ("ES", "Madrid")]
    words = [{"prompt": f"capital of {c}?", "answer": f" {a} "} for c, a in capitals]
    ex = get("task", "file")(path=str(_write_jsonl(tmp_path / "w.jsonl", words)), answer_format="exact")
    e = Example("capital of FR?", "Paris")
    assert ex.reward(e, "Paris") == 1.0 and ex.reward(e, " Paris\n") == 1.0 and ex.reward(e, "paris") == 0.0
    assert all(ex.reward(Example(p, c.strip()), r) == 0.0 for p, c, r in ex.preference_pairs(8, seed=0))


def test_file_path_bound_by_gin(tmp_path):
    jl = _write_jsonl(tmp_path / "g.jsonl", ROWS)
    gin.parse_config(f"task.file.path = '{jl}'\ntask.file.eval_fraction = 0.3")
    t = part("task", "file")()
    assert t.path == str(jl) and len(t.eval) >= 1


# --- the file loader: every error is a one-line DataError naming the file and the fix -------------
def _message(err: BaseException) -> str:
    """polgrad's message: gin appends '\n  In call to configurable ...' to errors raised inside a
    configurable, so the message is the text before that (and must itself be one line)."""
    msg = str(err).split("\n  In call to configurable")[0]
    assert "\n" not in msg, msg
    return msg


def _raises(path_or_kwargs, *fragments, exc=DataError):
    kwargs = path_or_kwargs if isinstance(path_or_kwargs, dict) else {"path": str(path_or_kwargs)}
    with pytest.raises(exc) as err:
        get("task", "file")(**kwargs)
    msg = _message(err.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def test_error_missing_file(tmp_path):
    _raises(tmp_path / "nope.jsonl", "nope.jsonl", "no such file or folder", "task.file.path")


def test_error_folder_that_is_no_dataset(tmp_path):
    (tmp_path / "dir.jsonl").mkdir()
    _raises(tmp_path / "dir.jsonl", "dir.jsonl: datasets could not read it", "written by save_to_disk")


def test_error_unsupported_extension(tmp_path):
    p = tmp_path / "d.txt"
    p.write_text("prompt,answer\n1,2\n")
    _raises(p, "d.txt", "unsupported extension '.txt'", "supported: .jsonl, .json, .parquet, .csv")


def test_error_malformed_json_names_the_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "x", "answer": \n')
    _raises(p, "bad.jsonl", "line 3 is not valid JSON", "one JSON object")


def test_error_line_not_an_object(tmp_path):
    p = tmp_path / "list.jsonl"
    p.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(["a", "b"]) + "\n")
    _raises(p, "list.jsonl", "line 2 is a JSON list, not an object")


def test_error_not_utf8_names_the_line_the_byte_and_the_fix(tmp_path):
    """A Latin-1 'é' (0xe9, 13 bytes into its line) on line 3, after two UTF-8 lines that a
    buffered text reader decodes in the same chunk: the line is named, not an offset into a buffer."""
    p = tmp_path / "latin.jsonl"
    good = "".join(json.dumps(r) + "\n" for r in ROWS[:2])
    p.write_bytes(good.encode() + '{"prompt": "caf\xe9", "answer": "1"}\n'.encode("latin-1"))
    _raises(
        p,
        f"{p}: line 3 is not UTF-8 text (byte 0xe9 at byte 16 of the line: invalid continuation byte); "
        "re-encode the file as UTF-8, e.g. iconv -f <its encoding> -t UTF-8 latin.jsonl > latin.utf8.jsonl",
    )


def test_error_missing_column_lists_present(tmp_path):
    p = _write_jsonl(tmp_path / "gsm.jsonl", [{"question": "q", "answer": "#### 1"}])
    present = "columns present: question, answer"
    _raises(p, "gsm.jsonl", "no column 'prompt' (task.file.prompt_column)", present)
    _raises(
        {"path": str(p), "prompt_column": "question", "response_column": "solution"},
        "no column 'solution' (task.file.response_column)",
        "columns present: question, answer",
    )
    pq = tmp_path / "gsm.parquet"
    pd.DataFrame([{"question": "q", "answer": "#### 1"}]).to_parquet(pq)
    _raises(
        {"path": str(pq), "answer_column": "label", "prompt_column": "question"},
        "gsm.parquet",
        "no column 'label' (task.file.answer_column)",
        "columns present: question, answer",
    )


def test_error_row_missing_key(tmp_path):
    p = _write_jsonl(tmp_path / "holes.jsonl", [ROWS[0], {"prompt": "only a prompt"}])
    _raises(p, "holes.jsonl", "line 2 has no 'answer'")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_error_empty_jsonl(tmp_path, content):
    p = tmp_path / "empty.jsonl"
    p.write_text(content)
    _raises(p, "empty.jsonl has no rows")


def test_error_empty_parquet(tmp_path):
    p = tmp_path / "empty.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str), "answer": pd.Series([], dtype=str)}).to_parquet(p)
    _raises(p, "empty.parquet has no rows")


def test_error_unreadable_parquet(tmp_path):
    p = tmp_path / "junk.parquet"
    p.write_bytes(b"this is not parquet")
    _raises(p, "junk.parquet", "could not read parquet")


@pytest.mark.parametrize(
    "row, fragments",
    [
        ({"prompt": 5, "answer": "1"}, ["line 2 has the value 5 (int) in column 'prompt'", "be a string"]),
        ({"prompt": None, "answer": "1"}, ["line 2 has a missing value in column 'prompt'"]),
        (
            {"prompt": "p", "answer": ["1"]},
            ["line 2 has the value ['1'] (list) in column 'answer'", "or a number"],
        ),
        ({"prompt": "p", "answer": None}, ["line 2 has a missing value in column 'answer'"]),
        ({"prompt": "p", "answer": True}, ["line 2 has the value True (bool)", "a string or a number"]),
        ({"prompt": "p", "answer": "#### "}, ["line 2 has an empty answer in column 'answer'"]),
    ],
)
def test_error_bad_values(tmp_path, row, fragments):
    p = _write_jsonl(tmp_path / "vals.jsonl", [ROWS[0], row])
    _raises(p, "vals.jsonl", *fragments)


def test_error_bad_values_parquet(tmp_path):
    p = tmp_path / "nan.parquet"
    pd.DataFrame({"prompt": ["a", None], "answer": ["1", "2"]}).to_parquet(p)
    _raises(p, "nan.parquet", "row 1 (0-based) has a missing value in column 'prompt'")
    p2 = tmp_path / "floatnan.parquet"
    pd.DataFrame({"prompt": ["a", "b"], "answer": [1.0, float("nan")]}).to_parquet(p2)
    _raises(p2, "floatnan.parquet", "row 1 (0-based) has a missing value in column 'answer'")


def test_error_response_disagrees_with_answer(tmp_path):
    p = _write_jsonl(tmp_path / "r.jsonl", [{"prompt": "1+1?", "answer": "#### 2", "sol": "1+1 = 3 #### 3"}])
    kwargs = {"path": str(p), "response_column": "sol"}
    _raises(kwargs, "r.jsonl", "line 1", "gives '3' but the answer is '2'")


def test_error_splits_empty(tmp_path):
    prompt = next(f"p{i}" for i in range(1000) if not in_eval_split(f"p{i}", 0.1))
    p = _write_jsonl(tmp_path / "one.jsonl", [{"prompt": prompt, "answer": "1"}])
    t = get("task", "file")(path=str(p))  # one row: all train, no eval
    assert len(t.train) == 1
    with pytest.raises(DataError, match="one.jsonl: the eval split is empty"):
        t.examples("eval", 1, seed=0)
    held = next(f"p{i}" for i in range(1000) if in_eval_split(f"p{i}", 0.5))
    p2 = _write_jsonl(tmp_path / "alleval.jsonl", [{"prompt": held, "answer": "1"}])
    _raises({"path": str(p2), "eval_fraction": 0.5}, "alleval.jsonl", "every prompt fell in the eval split")


def test_bad_file_knobs_raise_config_error(tmp_path):
    p = _write_jsonl(tmp_path / "ok.jsonl", ROWS)
    _raises(
        {"path": str(p), "answer_format": "xml"},
        "task.file.answer_format = 'xml'",
        "exact, gsm8k, math_verify",
        exc=ConfigError,
    )
    _raises({"path": str(p), "eval_fraction": 1.5}, "task.file.eval_fraction", exc=ConfigError)


def test_example_file_is_valid_gsm8k():
    assert len(EXAMPLE_ROWS) >= 12
    for row in EXAMPLE_ROWS:
        assert set(row) == {"question", "answer"} and "\n#### " in row["answer"]
        for calc in row["answer"].split("<<")[1:]:  # every calculator annotation is right
            expr, value = calc.split(">>")[0].split("=")
            assert eval(expr) == float(value), calc  # noqa: S307  (our own arithmetic)
    assert _file_worked().max_response_chars == max(len(r["answer"]) for r in EXAMPLE_ROWS)


def test_a_response_is_correct_at_the_full_score_only():
    """The one definition of 'correct' (polgrad.tasks.base.is_correct): a task scores in [0, 1]; only
    the full score counts (partial credit does not), and NaN (a skipped faulty reward) never does."""
    import torch

    from polgrad.tasks.base import is_correct

    scores = torch.tensor([1.0, 0.999, 0.0, float("nan"), 1.5])
    assert is_correct(scores).tolist() == [True, False, False, False, True]
    assert is_correct(1.0) and not is_correct(0.2) and not is_correct(float("nan"))
