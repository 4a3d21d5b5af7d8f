"""A run trained on a learned reward model logs the gold reward (the task's own verifier) beside the
proxy it trains on: per step on the same samples, per evaluation on the same greedy responses, and
in the summary and the sweep's CSV (issue: over-optimisation measured against the gold reward).
A run on the task's reward logs none of it (its reward is the gold one)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import gin
import pytest
import torch

from polgrad import hooks
from polgrad.batch import Batch
from polgrad.build import Models, RewardModelScorer, TaskScorer
from polgrad.evaluation import Evaluator, read_evals
from polgrad.loop_state import LoopState
from polgrad.results.record import REWARD_MODEL_COLUMNS
from polgrad.summary import REWARD_MODEL_KEYS, summarize
from polgrad.tasks.base import Example
from polgrad.tasks.rewards import RewardGuard
from polgrad.trainer import step_row

F64 = torch.float64


class _Add:
    """The gold: 1 for the right sum, else 0 (a verifier of our own, independent of polgrad's tasks)."""

    name = "gold_probe"

    def reward(self, example, response):
        return 1.0 if response.strip() == example.answer else 0.0


EXAMPLES = [Example("1+1=", "2"), Example("2+2=", "4"), Example("3+3=", "6"), Example("4+4=", "8")]
TEXTS = ["2", "5", "6", "9"]  # right, wrong, right, wrong: gold = 1, 0, 1, 0
ROLLOUT = SimpleNamespace(examples=EXAMPLES, texts=TEXTS)
RM_SCORES = torch.tensor([0.5, 2.0, -1.0, 3.5], dtype=F64)  # a proxy that disagrees with the gold


def _rm_scorer(monkeypatch) -> RewardModelScorer:
    from polgrad.rollout import hf as hf_rollout

    monkeypatch.setattr(hf_rollout, "rollout_scores", lambda model, rollout: RM_SCORES[: len(rollout.texts)])
    return RewardModelScorer(torch.nn.Identity(), RewardGuard())


def test_the_reward_model_scorer_trains_on_the_proxy_and_measures_the_gold(monkeypatch):
    scorer = _rm_scorer(monkeypatch)
    assert scorer(ROLLOUT, _Add()).tolist() == RM_SCORES.tolist()  # what the run trains on
    assert scorer.gold(ROLLOUT, _Add()).tolist() == [1.0, 0.0, 1.0, 0.0]  # the verifier, same samples
    assert scorer.proxy(ROLLOUT).tolist() == RM_SCORES.tolist()
    task = TaskScorer(RewardGuard())
    assert task(ROLLOUT, _Add()).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert task.gold(ROLLOUT, _Add()) is None and task.proxy is None  # its reward is the gold


def _sampled(gold):
    return Batch(
        mask=torch.ones(4, 2, dtype=F64),
        group_ids=torch.tensor([0, 0, 1, 1]),
        old_logp=torch.zeros(4, 2, dtype=F64),
        scores=RM_SCORES,
        gold_scores=gold,
        rollout=SimpleNamespace(mask=torch.ones(4, 2)),
    )


def test_a_step_row_holds_the_gold_beside_the_proxy_only_for_a_reward_model_run():
    m = Models(
        engine=None, tokenizer=None, sampler=None, score=RewardModelScorer(torch.nn.Identity(), RewardGuard())
    )
    gold = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)
    row = step_row(m, _sampled(gold), _sampled(gold), LoopState(step=1), {}, {})
    # reward_mean is what the run trains on (the proxy); the gold is the verifier's on the same samples
    assert row["reward_mean"] == pytest.approx(float(RM_SCORES.mean()), abs=1e-12)
    assert (row["gold_reward_mean"], row["gold_accuracy"]) == (0.5, 0.5)
    m = Models(engine=None, tokenizer=None, sampler=None)  # the task's verifier scores: it is the gold
    plain = step_row(m, _sampled(None), _sampled(None), LoopState(step=1), {}, {})
    assert not {"gold_reward_mean", "gold_accuracy"} & set(plain)


def test_the_evaluator_records_the_proxy_of_the_same_greedy_responses(tmp_path, monkeypatch):
    from polgrad import evaluation

    def fake_generate(model, tokenizer, examples, **kw):
        return SimpleNamespace(examples=list(examples), texts=TEXTS[: len(examples)])

    monkeypatch.setattr(evaluation.hf_rollout, "generate", fake_generate)
    model = torch.nn.Linear(1, 1)
    (tmp_path / "rm").mkdir()
    (tmp_path / "task").mkdir()
    proxy = Evaluator(_Add(), EXAMPLES, 4, str(tmp_path / "rm"), proxy=lambda r: RM_SCORES)
    proxy.start()
    assert proxy(model, None, 0) == 0.5  # the gold accuracy, as ever
    assert proxy.fields == {"eval_rm_score": pytest.approx(float(RM_SCORES.mean()))}
    (rec,) = read_evals(str(tmp_path / "rm"))
    assert rec["correct"] == [1, 0, 1, 0] and rec["rm_scores"] == RM_SCORES.tolist()
    assert rec["rm_score"] == pytest.approx(float(RM_SCORES.mean()))
    plain = Evaluator(_Add(), EXAMPLES, 4, str(tmp_path / "task"))
    plain.start()
    assert plain(model, None, 0) == 0.5 and plain.fields == {}
    (rec,) = read_evals(str(tmp_path / "task"))
    assert "rm_score" not in rec and "rm_scores" not in rec


def test_the_summary_gives_the_gold_and_the_proxy_of_a_reward_model_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [
        {"step": s, "reward_mean": 1.0 + s, "gold_reward_mean": 0.5 - 0.1 * s, "rm_heldout_accuracy": 0.9}
        for s in range(1, 4)
    ]
    rows[-1]["eval_accuracy"] = 0.3
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"step": 0, "accuracy": 0.4, "rm_score": 0.2}, {"step": 3, "accuracy": 0.3, "rm_score": 1.7}]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    s = summarize(str(run), 1.0, unstable_skip_frac=1.0)
    assert s["final_train_reward"] == pytest.approx(3.0)  # the proxy, mean of the last steps
    assert s["final_gold_reward"] == pytest.approx(0.3)  # the gold of the same steps
    assert (s["eval_rm_score"], s["eval_rm_score_init"], s["eval_accuracy"]) == (1.7, 0.2, 0.3)
    assert s["rm_heldout_accuracy"] == 0.9
    # a task-reward run: none of these keys
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 1.0}) + "\n")
    (run / "eval.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.4}) + "\n")
    assert not set(REWARD_MODEL_KEYS) & set(summarize(str(run), 1.0, unstable_skip_frac=1.0))
    assert REWARD_MODEL_COLUMNS == REWARD_MODEL_KEYS  # the CSV has a column for each


@pytest.mark.slow
def test_a_reward_model_run_logs_gold_and_proxy_end_to_end(tmp_path):
    """PPO on a learned reward model (cached), 2 steps: every row has the gold beside the proxy, every
    evaluation the proxy beside the gold, and the summary both; the gold accuracy of the samples is
    what the task's own verifier says of them."""
    from polgrad.config import parse_config
    from polgrad.train import run

    gin.clear_config()
    parse_config(
        ["registry/ppo.gin"],
        [
            # sort: the reward model the other reward-model runs of the suite train (cached once)
            "train.task = @task.sort",
            "train.reward_source = 'reward_model'",
            "train.steps = 2",
            "train.eval_every = 2",
            "train.eval_size = 32",
            "train.progress = False",
            "train.threads = 1",
        ],
    )
    phases: list[str] = []
    with hooks.listen(on_phase=lambda path, dt: phases.append(path)):
        summary = run(str(tmp_path / "rm"))
    gin.clear_config()
    rows = [json.loads(line) for line in open(tmp_path / "rm" / "metrics.jsonl")]
    assert all({"gold_reward_mean", "gold_accuracy", "rm_heldout_accuracy"} <= set(r) for r in rows)
    assert all(0.0 <= r["gold_accuracy"] <= 1.0 for r in rows)
    assert "eval_rm_score" in rows[-1]
    recs = read_evals(str(tmp_path / "rm"))
    assert [r["step"] for r in recs] == [0, 2] and all(len(r["rm_scores"]) == 32 for r in recs)
    assert {"final_gold_reward", "eval_rm_score", "eval_rm_score_init", "rm_heldout_accuracy"} <= set(summary)
    assert (
        summary["eval_rm_score"] == recs[-1]["rm_score"] and summary["eval_accuracy"] == recs[-1]["accuracy"]
    )
