"""A run's summary.json: means over its last steps, its first and last evaluation, its stability."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import Tensor

from polgrad import collective
from polgrad.collapse import RULE, collapse_reason
from polgrad.evaluation import read_evals
from polgrad.run_folder import RunFolder
from polgrad.tasks.base import is_correct

SUMMARY_LAST_K = 5  # final_train_reward: mean over the last k steps
# A reward-model run's gold beside its proxy (summarize); the sweep's CSV has a column for each.
REWARD_MODEL_KEYS = ("final_gold_reward", "eval_rm_score", "eval_rm_score_init", "rm_heldout_accuracy")
# The lengths of right and of wrong responses (generated tokens, EOS included), where a loss's length
# bias shows (Liu et al. 2025): means over the last LENGTH_WINDOW steps that had such responses, and
# the change of the wrong ones' mean from the first LENGTH_WINDOW such steps to the last.
LENGTH_KEYS = ("final_len_correct", "final_len_incorrect", "len_incorrect_change")
LENGTH_WINDOW = 10


def summarize(out_dir: str, wall_time_s: float, *, unstable_skip_frac: float) -> dict[str, Any]:
    """The run's summary: means over the last steps, the last and the starting eval accuracy.

    `status` is 'unstable' when more than `unstable_skip_frac` of the run's optimizer steps were
    skipped for a non-finite loss or gradient (`skipped_frac`; `unstable` says so in words), else 'ok'.
    A run whose held-out accuracy collapsed by the collapse rule (polgrad/collapse.py) also gets
    `collapsed`, which says so in words with the rule's numbers; its status stays what it was, since
    a sweep reruns what is not finished and ranks what is ok (its results name the collapse, from
    the same rule).
    `wall_time_s` is the RL run's (the trainer leaves the warm start out: its `warm_start_s`);
    `reward_errors` counts the faulty rewards of every step (train.reward_errors). A run trained on a
    reward model also gets the gold beside the proxy (`REWARD_MODEL_KEYS`): `final_gold_reward` (the
    task verifier's mean over the last steps' samples, as final_train_reward is the reward model's),
    `eval_rm_score` and `eval_rm_score_init` (the reward model's mean score of the last and the first
    evaluation's greedy responses, whose gold is eval_accuracy) and `rm_heldout_accuracy`."""
    metrics_path = RunFolder(out_dir).metrics
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    records = read_evals(out_dir)
    init = [e["accuracy"] for e in records if e["step"] == 0]
    last = rows[-SUMMARY_LAST_K:]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in last if key in r]
        return float(sum(vals) / len(vals)) if vals else None

    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    skipped = rows[-1].get("skipped_steps", 0) if rows else 0
    updates = sum(r.get("optimizer_steps", 1) for r in rows)  # rows of older runs: one per step
    stability = _stability(skipped, updates, unstable_skip_frac)
    proxy = [e for e in records if "rm_score" in e]
    gold = {
        "final_gold_reward": mean("gold_reward_mean"),
        "eval_rm_score": proxy[-1]["rm_score"] if proxy else None,
        "eval_rm_score_init": next((e["rm_score"] for e in proxy if e["step"] == 0), None),
        "rm_heldout_accuracy": next(
            (r["rm_heldout_accuracy"] for r in rows if "rm_heldout_accuracy" in r), None
        ),
    }
    collapse = collapse_reason(evals[-1] if evals else None, init[0] if init else None)
    return {
        **{k: v for k, v in gold.items() if v is not None},  # a reward-model run's only
        **{k: v for k, v in _lengths(rows).items() if v is not None},
        **stability,
        **({"collapsed": f"collapsed: {collapse} (the collapse rule: {RULE})"} if collapse else {}),
        "steps": len(rows),
        "final_train_reward": mean("reward_mean"),
        "eval_accuracy": evals[-1] if evals else None,
        "eval_accuracy_init": init[0] if init else None,
        "kl": mean("kl"),
        "kl_exact": mean("kl_exact"),
        "entropy": mean("entropy"),
        "tokens_per_s": mean("tokens_per_s"),
        "wall_time_s": wall_time_s,
        "peak_mem_mb": max((r.get("peak_mem_mb", 0.0) for r in rows), default=None),
        "skipped_steps": skipped,
        "reward_errors": sum(int(r.get("reward_errors", 0)) for r in rows),
    }


def response_lengths(lengths: Tensor, verdicts: Tensor) -> dict[str, float | None]:
    """A step's response_len_correct / response_len_incorrect: the mean generated length (EOS included)
    of its right and of its wrong responses over every rank (lengths, verdicts: [B]), None where
    there are none. Right = the task verifier's score is 1.0 (`verdicts`: the scorer's, the gold score
    in a reward-model run, whose proxy score is no verdict); NaN (a skipped faulty reward) is wrong.
    The two curves in which a loss's length bias shows (Liu et al. 2025)."""
    right = is_correct(verdicts.double()).double()
    lengths = lengths.double()
    sums = torch.stack(
        [right.new_tensor(float(len(right))), right.sum(), lengths.sum(), (lengths * right).sum()]
    )
    n, n_right, total, right_len = collective.all_sum(sums).tolist()
    n_wrong = n - n_right
    return {
        "response_len_correct": right_len / n_right if n_right else None,
        "response_len_incorrect": (total - right_len) / n_wrong if n_wrong else None,
    }


def _lengths(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """LENGTH_KEYS from the steps' response_len_correct / response_len_incorrect (None: no such step;
    the change needs at least 2 * LENGTH_WINDOW steps with wrong responses)."""

    def series(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) is not None]

    def avg(vals: list[float]) -> float | None:
        return sum(vals) / len(vals) if vals else None

    right, wrong = series("response_len_correct"), series("response_len_incorrect")
    w = LENGTH_WINDOW
    change = avg(wrong[-w:]) - avg(wrong[:w]) if len(wrong) >= 2 * w else None  # type: ignore[operator]
    return {
        "final_len_correct": avg(right[-w:]),
        "final_len_incorrect": avg(wrong[-w:]),
        "len_incorrect_change": change,
    }


def _stability(skipped: int, updates: int, threshold: float) -> dict[str, Any]:
    """status 'ok' or 'unstable' (skipped / optimizer steps above `threshold`), and the numbers."""
    frac = skipped / updates if updates else 0.0
    out: dict[str, Any] = {"status": "unstable" if frac > threshold else "ok", "skipped_frac": frac}
    if frac > threshold:
        out["unstable"] = (
            f"unstable: {skipped} of {updates} optimizer steps skipped for a non-finite loss or gradient "
            f"({frac:.0%} > train.unstable_skip_frac = {threshold:g}); try a lower train.lr"
        )
    return out
