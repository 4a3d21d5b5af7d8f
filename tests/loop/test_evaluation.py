"""Evaluation a comparison can rest on: distinct held-out prompts, per-prompt records, the exact KL."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from polgrad import registry
from polgrad.components.kl import full
from polgrad.errors import ConfigError, ShapeError
from polgrad.evaluation import Evaluator, exact_kl, read_evals
from polgrad.results.compare import Comparison
from polgrad.results.predictions import verdict
from polgrad.results.stats import Paired
from polgrad.tasks.synthetic import in_eval_split


@pytest.mark.parametrize("name", ["add", "sort", "reverse"])
def test_eval_examples_are_distinct_held_out_and_the_same_every_time(name):
    task = registry.get("task", name)(**({"length": 4, "symbols": 5} if name != "add" else {}))
    whole = task.eval_examples(None)
    prompts = [ex.prompt for ex in whole]
    assert len(prompts) == len(set(prompts)) > 0  # without replacement
    assert all(in_eval_split(p, task.eval_fraction) for p in prompts)  # held out only
    assert [ex.prompt for ex in task.eval_examples(None)] == prompts  # a fixed list
    some = task.eval_examples(50)
    assert len({ex.prompt for ex in some}) == 50
    assert [ex.prompt for ex in task.eval_examples(50)] == [ex.prompt for ex in some]


def test_the_whole_split_of_add_is_every_held_out_sum():
    task = registry.get("task", "add")(digits=1)  # 100 problems a+b, a, b in 0..9
    held = {
        f"{a}+{b}=" for a in range(10) for b in range(10) if in_eval_split(f"{a}+{b}=", task.eval_fraction)
    }
    assert {ex.prompt for ex in task.eval_examples(None)} == held
    with pytest.raises(ConfigError, match="eval_size = 500 is more than the 10 distinct held-out prompts"):
        task.eval_examples(500)


class _Task:
    def reward(self, example, response):
        return 1.0 if response == example.answer else 0.0


def test_evaluator_records_per_prompt_results_and_keeps_only_what_a_resume_covers(tmp_path, monkeypatch):
    from polgrad import evaluation
    from polgrad.tasks.base import Example

    examples = [Example("1+1=", "2"), Example("2+2=", "4"), Example("3+3=", "6")]
    answers = iter([[1, 0, 1], [1, 1, 1], [0, 0, 1]])
    monkeypatch.setattr(evaluation, "greedy_results", lambda *a, **k: (next(answers), None))
    ev = Evaluator(_Task(), examples, 4, str(tmp_path))
    ev.start()
    assert ev(None, None, 0) == pytest.approx(2 / 3)
    ev(None, None, 10)
    ev(None, None, 20)
    recs = read_evals(str(tmp_path))
    assert [r["step"] for r in recs] == [0, 10, 20]
    assert recs[0]["prompts"] == ["1+1=", "2+2=", "3+3="] and recs[0]["correct"] == [1, 0, 1]
    ev.keep_until(10)  # a resume from the step-10 checkpoint evaluates step 20 again
    assert [r["step"] for r in read_evals(str(tmp_path))] == [0, 10]
    ev.start()  # a fresh run in the same folder
    assert read_evals(str(tmp_path)) == []
    assert json.loads(json.dumps(recs[1]))["accuracy"] == 1.0


def test_exact_kl_equals_the_full_vocabulary_kl_and_does_not_depend_on_the_chunking():
    from polgrad.models import build_tiny
    from polgrad.rollout import hf
    from polgrad.tasks.base import Example

    task = registry.get("task", "add")()
    policy, tok = build_tiny(task, seed=0)
    reference, _ = build_tiny(task, seed=1)  # another random init: a KL well above zero
    examples = [Example("1+2=", "3"), Example("12+3=", "15")]
    rollout = hf.generate(policy, tok, examples, group_size=3, max_new_tokens=4, generator_seed=1)
    got, ref_logp = exact_kl(policy, reference, rollout, temperature=1.0)
    one_row, ref_logp_rows = exact_kl(
        policy, reference, rollout, temperature=1.0, max_elements=1
    )  # row by row
    torch.testing.assert_close(got, one_row, rtol=0, atol=1e-6)
    # the reference log-probs it returns are the reference forward's (the loop's ref_logp)
    torch.testing.assert_close(ref_logp, hf.response_logprobs(reference, rollout), rtol=0, atol=0)
    torch.testing.assert_close(ref_logp_rows, ref_logp, rtol=0, atol=1e-6)
    # the definition, by hand: sum_v p(v) (log p(v) - log q(v)) at every valid position
    p = hf.response_logprobs(policy, rollout, return_logits=True)
    q = hf.response_logprobs(reference, rollout, return_logits=True)
    lp, lq = torch.log_softmax(p.logits.double(), -1), torch.log_softmax(q.logits.double(), -1)
    by_hand = (lp.exp() * (lp - lq)).sum(-1) * rollout.mask.double()
    torch.testing.assert_close(got, by_hand, rtol=0, atol=1e-5)  # fp32 logits: ~1e-6 relative
    assert (got * rollout.mask).sum() > 0 and torch.all(got[rollout.mask == 0] == 0)
    assert full is not None


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_exact_kl_from_the_sampling_distributions_equals_the_policy_forward_one(temperature, top_p):
    """The loop's exact KL reads π_θ from the distributions the HF sampler drew from (no second policy
    forward): the same KL as with the policy's own forward, at any temperature / top-p, and keeping
    them does not change the rollout."""
    from polgrad.models import build_tiny
    from polgrad.rollout import hf
    from polgrad.tasks.base import Example

    task = registry.get("task", "add")()
    policy, tok = build_tiny(task, seed=0)
    reference, _ = build_tiny(task, seed=1)
    examples = [Example("1+2=", "3"), Example("12+3=", "15"), Example("7+70=", "77")]
    kw = dict(group_size=4, max_new_tokens=6, generator_seed=3, temperature=temperature, top_p=top_p)
    plain = hf.generate(policy, tok, examples, **kw)
    kept = hf.generate(policy, tok, examples, keep_distribution=True, **kw)
    assert plain.policy_logp_all is None
    assert torch.equal(kept.response_ids, plain.response_ids)
    assert torch.equal(kept.rollout_logp, plain.rollout_logp)
    dist = kept.policy_logp_all
    assert dist.shape == (*kept.response_ids.shape, policy.config.vocab_size)
    # the sampled tokens' log-probs are read off the kept distributions
    picked = dist.gather(-1, kept.response_ids[..., None]).squeeze(-1) * kept.mask
    torch.testing.assert_close(picked, kept.rollout_logp, rtol=0, atol=0)
    t = kept.temperature or 1.0  # temperature 0: log-probs at temperature 1 (the module docstring)
    without = dataclasses.replace(kept, policy_logp_all=None)
    two_forwards, ref_logp = exact_kl(policy, reference, without, temperature=t)
    one_forward, ref_logp_1 = exact_kl(policy, reference, kept, temperature=t)
    assert torch.equal(ref_logp_1, ref_logp)  # the same reference forward
    # fp32: a KV-cached decode and one full forward round differently; the per-token KL (up to ~0.1
    # nat here) differs by ~2e-7 on this CPU, so 1e-5 absolute leaves 40x room for other CPUs.
    torch.testing.assert_close(one_forward, two_forwards, rtol=0, atol=1e-5)
    assert float((two_forwards * kept.mask).sum()) > 0.5  # a real KL, not 0 = 0
    with pytest.raises(ShapeError, match=r"policy_logp_all must be \[B,T,V\] with \[B,T\]=\[12,"):
        exact_kl(policy, reference, dataclasses.replace(kept, policy_logp_all=dist[:, :2]), temperature=t)


def _cmp(mean: float, p_holm: float, n: int = 5) -> Comparison:
    return Comparison(
        ("b",), ("x",), "kl_exact", Paired(n, mean, mean - 0.1, mean + 0.1, p_holm, 0.1), p_holm, 4
    )


@pytest.mark.parametrize(
    "expected, mean, p, word",
    [
        ("lower", -0.05, 0.001, "confirmed"),
        ("lower", 0.05, 0.001, "refuted"),
        ("lower", -0.05, 0.2, "not confirmed"),
        ("no difference", 0.01, 0.3, "undecided"),
        ("no difference", 0.05, 0.01, "refuted"),
        ("higher", 0.05, 0.01, "confirmed"),
    ],
)
def test_prediction_verdicts_follow_the_corrected_test(expected, mean, p, word):
    assert verdict(expected, _cmp(mean, p)).startswith(word)
    assert verdict(expected, None).startswith("untested")


def test_no_difference_is_confirmed_only_by_an_equivalence_test_within_the_declared_margin():
    c = _cmp(0.01, 0.3)  # not significantly different
    assert verdict("no difference", c, p_equivalence=0.01, margin=0.03).startswith("confirmed (equivalent")
    assert verdict("no difference", c, p_equivalence=0.2, margin=0.03).startswith("undecided")
    assert verdict("no difference", c).startswith("undecided")  # no margin declared
    # a significant difference inside the margin is both, not a refutation; beyond it, refuted
    assert verdict("no difference", _cmp(0.02, 0.01), 0.01, 0.03).startswith("confirmed and different")
    assert verdict("no difference", _cmp(0.05, 0.01), 0.9, 0.03, p_outside=0.01).startswith("refuted")


def test_equivalence_p_known_value():
    # n = 3 differences with mean 0.01, sd 0.01 -> se = 0.01/sqrt(3); margin 0.05:
    # t_low = (0.01 + 0.05)/se = 6 sqrt(3), t_high = (0.01 - 0.05)/se = -4 sqrt(3); the larger one-sided p
    # is P(T_2 > 4 sqrt(3)) = 1/2 - t/(2 sqrt(2 + t^2)) with t = 4 sqrt(3) (Student t, 2 df, closed form).
    t = 4 * math.sqrt(3)
    p = Paired(3, 0.01, 0.0, 0.02, 0.3, 0.01).equivalence_p(0.05)
    assert p == pytest.approx(0.5 - t / (2 * math.sqrt(2 + t * t)), abs=1e-12)
    assert math.isnan(Paired(1, 0.0, 0.0, 0.0, math.nan, math.nan).equivalence_p(0.05))
