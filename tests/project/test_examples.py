"""examples/minimal_grpo.py: the hand-composed GRPO loss is the trainer's, and the script runs.

The trainer builds GRPO from registry/grpo.gin through gin, the Algorithm and its strategies; the
example calls four registered parts by hand. On a batch the trainer actually trained on (its loss
call captured), the example's `grpo_loss` of the same tensors must give the trainer's policy loss.
The batch is taken where every term acts: after two steps at a learning rate of 3e-4 (the policy is
away from the reference, so k3 > 0) and in the second of two epochs (the ratio is away from 1 and
the clip binds on some tokens); the test checks both, so that a missing KL term, a missing clip or
another aggregator cannot agree by accident.

Tolerance: the two compute the same float64 ops on the same rows, except that the trainer's update
shuffles the rows (torch.randperm) before its one micro-batch, so each group's float32 reward sums
may be added in another order: each advantage moves by at most ~G u |r| (G = 8, u = 2^-24, rewards
in [0, 1]), ~5e-7 relative, and the loss, a mean of advantage-weighted terms plus the unchanged KL
term, by no more than that. Hence rel 1e-6 (plus 1e-12 absolute for a loss near 0); a wrong part or
a missing term moves the loss by far more (checked below: the KL term alone is > 1e-4 of it).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polgrad import config
from polgrad.algorithm import Algorithm
from polgrad.train import run as train

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "minimal_grpo.py"


def load_example():
    spec = importlib.util.spec_from_file_location("minimal_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_is_at_most_150_lines_and_uses_no_gin_deepspeed_or_strategies():
    text = EXAMPLE.read_text()
    assert len(text.splitlines()) <= 150
    for banned in ("import gin", "deepspeed", "polgrad.sampling", "polgrad.reference", "polgrad.critic",
                   "polgrad.build", "polgrad.trainer", "polgrad.algorithm", "polgrad.config"):  # fmt: skip
        assert banned not in text, banned


def test_the_examples_loss_is_the_trainers_on_a_batch_it_trained_on(tmp_path, monkeypatch):
    example = load_example()
    seen = []
    loss = Algorithm.loss

    def capture(self, mb, counts, *, kl_coef):
        policy_loss, value_loss, metrics = loss(self, mb, counts, kl_coef=kl_coef)
        seen.append((mb, policy_loss.item(), {k: float(v) for k, v in metrics.items()}, kl_coef))
        return policy_loss, value_loss, metrics

    monkeypatch.setattr(Algorithm, "loss", capture)
    bindings = [
        "train.steps = 3",
        "train.lr = 3e-4",  # moves the policy enough in one step that the second epoch clips (6-7% of tokens)
        "Algorithm.ppo_epochs = 2",
        "train.micro_batch_size = 64",  # 8 prompts x 8: one micro-batch, the whole step
        "train.eval_every = 100",
        "train.eval_size = 8",
    ]
    config.parse_config([str(REPO / "registry" / "grpo.gin")], bindings)
    train(str(tmp_path / "run"), progress=False)
    assert len(seen) == 6  # 3 steps x 2 epochs x 1 micro-batch
    mb, trainer_loss, metrics, kl_coef = seen[-1]  # step 3, epoch 2
    assert kl_coef == 0.04 and mb.mask.shape[0] == 64
    # every term acts on this batch: the ratio left the clip range on some tokens, and k3 > 0
    assert metrics["clip/clip_low"] + metrics["clip/clip_high"] > 0, metrics
    assert metrics["kl_loss"] * kl_coef > 1e-4 * abs(trainer_loss), (metrics, trainer_loss)
    assert metrics["pg_loss"] != 0, metrics  # some group's rewards differ: advantages are not all 0

    mine = example.grpo_loss(
        mb.logp.detach(), mb.old_logp, mb.ref_logp, mb.rewards, mb.mask, mb.group_ids, kl_coef=kl_coef
    )
    assert mine.item() == pytest.approx(trainer_loss, rel=1e-6, abs=1e-12)
    # and the trainer's prepared advantages are the example's part on the same rewards
    adv, _ = example.get("advantage", "grpo")(mb.rewards, mb.mask, group_ids=mb.group_ids)
    torch.testing.assert_close(adv.to(mb.adv.dtype), mb.adv, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_the_example_runs_two_steps():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "2"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("reward" in line and "loss" in line for line in steps), proc.stdout
