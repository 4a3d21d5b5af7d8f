"""task.reasoning_gym: reasoning-gym's datasets behind the Task contract, scored by their own rule.

The oracles here are independent of polgrad's code: a chain sum's answer is the value of its
expression read back from the prompt, and every score is compared with the score reasoning-gym's
own dataset object gives (built here with reasoning_gym.create_dataset)."""

from __future__ import annotations

import pickle
import re
import subprocess
import sys

import gin
import pytest
import reasoning_gym

import polgrad  # noqa: F401  (registers the tasks)
from polgrad.config_parts import part
from polgrad.errors import ConfigError, DataError
from polgrad.registry import get
from polgrad.tasks.base import Example
from polgrad.tasks.gym import EVAL_SIZE, GymExample
from polgrad.tasks.synthetic import in_eval_split

CHAIN = {"min_terms": 2, "max_terms": 3, "max_digits": 2}
ARITH = {
    "min_terms": 2,
    "max_terms": 3,
    "max_digits": 2,
    "operators": ("+", "-"),
    "allow_parentheses": False,
    "allow_negation": False,
}


def make(name="chain_sum", config=CHAIN, **kw):
    return get("task", "reasoning_gym")(name=name, config=config, **kw)


@pytest.fixture(scope="module")
def chain():
    return make()


def _value_of_chain(prompt: str) -> str:
    """The chain sum's value, computed from the prompt's expression (independent of reasoning-gym)."""
    expr = re.fullmatch(r"State the final answer to the following arithmetic problem: (.*) =", prompt)
    assert expr, prompt
    tokens = expr.group(1).split()
    total = int(tokens[0])
    for op, term in zip(tokens[1::2], tokens[2::2], strict=True):
        total = total + int(term) if op == "+" else total - int(term)
    return str(total)


def test_answers_are_the_expressions_values_and_score_one(chain):
    for split in ("train", "eval"):
        for ex in chain.examples(split, 200, seed=3):
            assert ex.answer == _value_of_chain(ex.prompt)
            assert chain.reward(ex, ex.answer) == 1.0
            assert chain.reward(ex, f" {ex.answer}\n") == 1.0


def test_reward_is_reasoning_gyms_own_score_on_fixed_samples():
    """The task's reward equals score_answer of a dataset reasoning-gym builds itself, on responses
    that are right, right in another spelling (sign, zeros, decimals), partly right and wrong; for
    chain_sum (decimal comparison) and spell_backward (positional partial credit)."""
    for name, config, variants in (
        ("chain_sum", CHAIN, lambda a: [a, "+0" + a, a + ".00", a + "1", "x" + a, "", "7 7", "-" + a]),
        ("spell_backward", {"min_word_len": 3, "max_word_len": 6},
         lambda a: [a, a.upper(), a[:-1], a[:-1] + "q", a[::-1], a + "s", ""]),
    ):  # fmt: skip
        task = make(name, config)
        theirs = reasoning_gym.create_dataset(name, **config, seed=1, size=10)
        scores = set()
        for ex in task.examples("train", 30, seed=0):
            assert ex.entry["metadata"]["source_dataset"] == name
            for response in variants(ex.answer):
                want = theirs.score_answer(answer=response.strip(), entry=ex.entry)
                assert task.reward(ex, response) == want
                scores.add(want)
        assert 1.0 in scores and 0.0 in scores and any(0 < s < 1 for s in scores)  # partial credit seen


def test_known_partial_credit_values():
    """spell_backward scores the fraction of positions right; chain_sum gives len(oracle)/len(text)
    when the oracle is a substring of a wrong text (reasoning-gym's rules, worked by hand)."""
    task = make("spell_backward", {"min_word_len": 3, "max_word_len": 6})
    ex = GymExample(
        "Spell this word backward (example: sun -> nus): splat", "talps", entry={"answer": "talps"}
    )
    assert task.reward(ex, "talps") == 1.0
    assert task.reward(ex, "talpx") == pytest.approx(4 / 5, abs=1e-12)  # 4 of 5 positions
    # a plain answer is stripped before reasoning-gym scores it: unstripped, ' talps\n' is shifted by
    # one and matches none of the 5 positions (0.0); a chain sum's number parses either way, so only a
    # positional score like this one tells
    assert task.reward(ex, " talps\n") == 1.0
    chain = make()
    ex = chain.examples("train", 1, seed=0)[0]
    assert chain.reward(ex, ex.answer + "9") == pytest.approx(
        len(ex.answer) / (len(ex.answer) + 1), abs=1e-12
    )


def test_tagged_answers_are_extracted():
    task = make(answer_format="tagged")
    ex = task.examples("train", 1, seed=0)[0]
    assert task.demonstrations(1, seed=0)[0][1].startswith("<answer>")
    assert task.reward(ex, f"I think <answer>0</answer> no, <answer>{ex.answer}</answer>") == 1.0
    assert task.reward(ex, ex.answer) == 0.0  # no tags: nothing to score
    assert task.max_response_chars >= len("<answer></answer>") + 1


def test_splits_disjoint_deterministic_and_distinct(chain):
    train = {e.prompt for s in range(3) for e in chain.examples("train", 300, seed=s)}
    train |= {p for p, _ in chain.demonstrations(300, seed=0)} | {
        p for p, _, _ in chain.preference_pairs(100, 0)
    }
    held = chain.eval_examples(64)
    assert len(held) == 64 and len({e.prompt for e in held}) == 64
    assert not train & {e.prompt for e in held}
    assert all(in_eval_split(e.prompt, 0.1) for e in held)
    assert not any(in_eval_split(p, 0.1) for p in train)
    assert chain.examples("train", 50, seed=7) == chain.examples("train", 50, seed=7)
    assert chain.examples("train", 50, seed=7) != chain.examples("train", 50, seed=8)
    assert chain.eval_examples(64) == held == chain.eval_examples(128)[:64]
    assert len(chain.eval_examples(None)) == EVAL_SIZE


def test_examples_same_in_another_process(chain):
    code = (
        "import polgrad, json; from polgrad.registry import get; "
        f"t = get('task', 'reasoning_gym')(name='chain_sum', config={CHAIN!r}); "
        "print(json.dumps([e.prompt for e in t.examples('train', 20, 4)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == str(
        [e.prompt for e in chain.examples("train", 20, 4)]
    ).replace("'", '"')


def test_alphabet_and_bounds_cover_every_text(chain):
    texts = [(e.prompt, e.answer) for s in ("train", "eval") for e in chain.examples(s, 300, seed=0)]
    texts += chain.demonstrations(300, seed=0)
    for prompt, response in texts:
        assert set(prompt + response) <= set(chain.alphabet)
        assert len(prompt) <= chain.max_prompt_chars and len(response) <= chain.max_response_chars
    assert len(set(chain.alphabet)) == len(chain.alphabet)
    assert chain.skipped_fraction == 0.0


def test_limits_skip_what_does_not_fit():
    task = make("basic_arithmetic", ARITH, max_prompt_chars=18)
    exs = task.examples("train", 200, seed=0)
    assert max(len(e.prompt) for e in exs) <= 18 < make("basic_arithmetic", ARITH).max_prompt_chars
    assert 0 < task.skipped_fraction <= 0.5
    with pytest.raises(DataError, match="max_prompt_chars = 5"):
        make("basic_arithmetic", ARITH, max_prompt_chars=5)


def test_preference_pairs_chosen_scores_one_rejected_lower(chain):
    for prompt, chosen, rejected in chain.preference_pairs(200, seed=5):
        answer = _value_of_chain(prompt)
        ex = GymExample(prompt, answer, entry={"question": prompt, "answer": answer, "metadata": {}})
        assert chain.reward(ex, chosen) == 1.0
        assert chain.reward(ex, rejected) < 1.0
        assert set(rejected) <= set(chain.alphabet) and len(rejected) <= chain.max_response_chars


def test_a_plain_example_is_refused_in_one_line(chain):
    """Some datasets score by the item's metadata (countdown, number_sorting): a plain Example,
    which has none, would score a right answer wrong, so it is refused."""
    with pytest.raises(DataError) as e:
        chain.reward(Example("State the final answer to the following arithmetic problem: 1 + 2 =", "3"), "3")
    assert "got a plain Example" in str(e.value) and "\n" not in str(e.value)


def test_eval_examples_read_only_what_they_need(chain, monkeypatch):
    """The held-out list stops at n distinct prompts: it reads about n / eval_fraction items, not 50 n."""
    from polgrad.tasks import gym

    built = []
    real = gym.ReasoningGymTask._build
    monkeypatch.setattr(
        gym.ReasoningGymTask, "_build", lambda self, seed: built.append(seed) or real(self, seed)
    )
    count = {"n": 0}
    real_items = gym.ReasoningGymTask._items

    def counting(self, label):
        for item in real_items(self, label):
            count["n"] += 1
            yield item

    monkeypatch.setattr(gym.ReasoningGymTask, "_items", counting)
    assert len(chain.eval_examples(100)) == 100
    assert count["n"] < 100 / 0.1 * 3  # ~1,000 expected at eval_fraction 0.1 (plus repeats)


def test_examples_pickle_with_their_entries(chain):
    ex = chain.examples("train", 3, seed=0)
    back = pickle.loads(pickle.dumps(ex))
    assert back == ex and [b.entry for b in back] == [e.entry for e in ex]
    assert [chain.reward(b, b.answer) for b in back] == [1.0] * 3


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"name": "chainsum"}, "did you mean chain_sum"),
        ({"name": "chain_sum", "config": {"foo": 1}}, "its settings: min_terms, max_terms"),
        ({"name": "chain_sum", "config": {"min_terms": 0}}, "min_terms must be positive"),
        ({"name": "chain_sum", "config": {"seed": 3}}, "polgrad sets the seed and size itself"),
        ({"name": "chain_sum", "answer_format": "xml"}, "valid: plain, tagged"),
        ({"name": "chain_sum", "eval_fraction": 1.0}, "eval_fraction = 1.0 must be in [0, 1)"),
        ({"name": "chain_sum", "max_response_chars": 0}, "max_response_chars = 0 must be >= 1"),
    ],
)
def test_bad_settings_raise_one_line(kwargs, fragment):
    with pytest.raises(ConfigError) as e:
        get("task", "reasoning_gym")(**kwargs)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_gin_binding_builds_the_task():
    gin.clear_config()
    try:
        gin.parse_config(
            "task.reasoning_gym.name = 'basic_arithmetic'\n"
            "task.reasoning_gym.config = {'min_terms': 2, 'max_terms': 2, 'operators': ('+', '-')}"
        )
        task = part("task", "reasoning_gym")()
        assert task.dataset == "basic_arithmetic"
        assert all(e.prompt.startswith("Calculate ") for e in task.examples("train", 20, 0))
    finally:
        gin.clear_config()


@pytest.mark.slow
def test_a_run_trains_on_a_reasoning_gym_task_and_evaluates_by_its_score(tmp_path, monkeypatch):
    """GRPO on task.reasoning_gym through the trainer (a short SFT, 2 steps): the held-out record holds
    the task's distinct held-out prompts, and each prompt's 'correct' is reasoning-gym's own
    score_answer of the greedy response being 1.0 (the responses recorded by a spy on the reward)."""
    from polgrad.config import parse_config
    from polgrad.tasks import gym
    from polgrad.train import run

    scored: dict[str, list[tuple[str, float]]] = {}
    real = gym.ReasoningGymTask.reward

    def spy(self, example, response):
        value = real(self, example, response)
        scored.setdefault(example.prompt, []).append((response, value))
        return value

    gin.clear_config()
    try:
        parse_config(
            ["registry/grpo.gin"],
            [
                "train.task = @task.reasoning_gym",
                "task.reasoning_gym.name = 'chain_sum'",
                f"task.reasoning_gym.config = {CHAIN!r}",
                "train.sft_steps = 20",
                "train.steps = 2",
                "train.eval_every = 2",
                "train.eval_size = 16",
                "train.progress = False",
            ],
        )
        from polgrad import build as builder
        from polgrad.config import build

        builder.warm_start(build()[0])  # the SFT first (its own scoring is not the evaluation's)
        monkeypatch.setattr(gym.ReasoningGymTask, "reward", spy)
        summary = run(str(tmp_path / "run"))
    finally:
        gin.clear_config()
    assert summary["status"] == "ok" and summary["steps"] == 2
    held_prompts = {e.prompt for e in make().eval_examples(16)}
    assert all(len(scored[p]) == 2 for p in held_prompts)  # scored once per evaluation, never trained on
    from polgrad.evaluation import read_evals

    theirs = reasoning_gym.create_dataset("chain_sum", **CHAIN, seed=1, size=10)
    held = {e.prompt: e for e in make().eval_examples(16)}
    for record in read_evals(str(tmp_path / "run")):
        assert record["prompts"] == list(held)
        for prompt, correct in zip(record["prompts"], record["correct"], strict=True):
            response, value = scored[prompt][0 if record["step"] == 0 else 1]  # steps 0 and 2
            assert value == theirs.score_answer(answer=response.strip(), entry=held[prompt].entry)
            assert correct == int(value >= 1.0)


def test_a_task_is_probed_once_per_process_for_the_same_arguments(monkeypatch):
    """A sweep builds every cell's task; the probe (1,000 items; seconds for spell_backward) runs once
    per set of arguments, and other arguments give another task."""
    from polgrad.tasks import gym

    calls = []
    real = gym._probed
    monkeypatch.setattr(gym, "_probed", lambda *a: (calls.append(a[2:]), real(*a))[1])
    monkeypatch.setattr(gym, "_BUILT", {})
    first = make(config={**CHAIN, "max_terms": 2})
    assert make(config={"max_digits": 2, "max_terms": 2, "min_terms": 2}) is first  # key order aside
    assert len(calls) == 1
    other = make(config={**CHAIN, "max_terms": 2}, eval_fraction=0.2)
    assert other is not first and other.eval_fraction == 0.2 and len(calls) == 2
    with pytest.raises(ConfigError, match="max_prompt_chars = 0 must be >= 1"):
        make(config={**CHAIN, "max_terms": 2}, max_prompt_chars=0)  # an error is never cached
    with pytest.raises(ConfigError, match="max_prompt_chars = 0 must be >= 1"):
        make(config={**CHAIN, "max_terms": 2}, max_prompt_chars=0)
