"""Critic warm-up (train.critic_warmup_steps): the first N steps train the critic alone, the policy
does not move (verl's critic_warmup, OpenRLHF's freezing_actor_steps)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import gin
import pytest
import torch

from polgrad import config
from polgrad.config import parse_config
from polgrad.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PPO, PPO_LORA, GRPO = (str(REPO / "registry" / f"{s}.gin") for s in ("ppo", "ppo_lora", "grpo"))


@pytest.mark.parametrize(
    "spec, binding, message",
    [
        (
            GRPO,
            "train.critic_warmup_steps = 2",
            "train.critic_warmup_steps = 2: grpo has no critic; a warm-up needs",
        ),
        (
            PPO_LORA,
            "train.critic_warmup_steps = 2",
            "train.critic_warmup_steps = 2: ppo_lora trains its critic (@value_init.shared_lora) in the "
            "policy's engine",
        ),
        (
            PPO,
            "train.critic_warmup_steps = -1",
            "train.critic_warmup_steps must be an integer >= 0 (0: none), got -1",
        ),
    ],
)
def test_a_warm_up_without_a_critic_of_its_own_is_one_line(spec, binding, message):
    gin.clear_config()
    parse_config([spec], [binding])
    with pytest.raises(ConfigError) as info:
        config.build()
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.parametrize("warmup, steps", [(0, [False] * 4), (2, [True, True, False, False])])
def test_the_first_n_steps_and_only_those_are_warm_up_steps(monkeypatch, warmup, steps):
    """train.critic_warmup_steps = N: the critic (OwnEngineCritic, chosen at build with N) backs up and
    steps the policy in loop steps N, N+1, ... and not in steps 0 .. N-1, where its own backward and
    step alone run; rl_step hands each update the loop state's step (the steps done). The engines
    are stand-ins recorded by name: only which steps warm up is under test (what a warm-up step does
    to the real engines: the slow test below)."""
    from types import SimpleNamespace

    from polgrad import critic as critic_lib
    from polgrad import trainer
    from polgrad.loop_state import LoopState
    from polgrad.reference import NoReference

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(
        critic_lib.dist_lib, "backward", lambda engine, loss, boundary: calls.append(("bwd", engine))
    )
    monkeypatch.setattr(critic_lib.dist_lib, "step", lambda engine: calls.append(("step", engine)) or True)
    critic = critic_lib.OwnEngineCritic("critic", warmup_steps=warmup)

    def update(cfg, algo, m, batch, kl_coef, seed, *, step):  # one micro-batch, one optimizer step
        m.critic.backward("policy", None, None, last=True, step=step)
        return {}, 1, int(m.critic.optimizer_step("policy", step) is False)

    got = SimpleNamespace(batch="batch", sampled="sampled", info={}, counts=(4.0, 40.0))
    monkeypatch.setattr(trainer, "update", update)
    monkeypatch.setattr(trainer, "step_row", lambda *a: {"update_seqs": 4})
    sampler = SimpleNamespace(begin=lambda *a: None, sync=lambda *a: None, metrics=lambda batch: {})
    m = SimpleNamespace(
        sampler=sampler, engine=SimpleNamespace(module=None), critic=critic, reference=NoReference()
    )
    algo = SimpleNamespace(prepare=lambda batch, kl_coef: (batch, {}))
    state, seen = LoopState(), []
    for _ in range(4):
        calls.clear()
        _, _, state = trainer.rl_step(None, algo, m, task=None, seed=0, state=state, collector=lambda *a: got)
        policy_backward, policy_step = ("bwd", "policy") in calls, ("step", "policy") in calls
        assert ("bwd", "critic") in calls and ("step", "critic") in calls  # the critic trains every step
        # backward and step of the policy go together (a backward alone would reach the next step)
        assert policy_backward == policy_step, calls
        seen.append(not policy_step)
    assert seen == steps and state.step == 4


def _weights(path: str) -> dict[str, torch.Tensor]:
    from polgrad.models import load_policy

    return load_policy(path).state_dict()


def _run(tmp_path, name: str, warmup: int, calls: list | None = None) -> tuple[dict, dict, dict]:
    """(warm start's policy weights, the run's final policy weights, its final critic's weights);
    `calls` gets (backward|step, the engine module's class) of every backward and optimizer step."""
    from polgrad import distributed
    from polgrad.build import warm_start
    from polgrad.models import ScalarHeadModel
    from polgrad.trainer import train

    backward, step = distributed.backward, distributed.step
    if calls is not None:

        def spy_backward(engine, loss, **kw):
            calls.append(("backward", type(engine.module).__name__))
            return backward(engine, loss, **kw)

        def spy_step(engine):
            calls.append(("step", type(engine.module).__name__))
            return step(engine)

        distributed.backward, distributed.step = spy_backward, spy_step

    gin.clear_config()
    parse_config(
        [PPO],
        [
            "train.steps = 2",
            "train.eval_every = 2",
            "train.eval_size = 16",
            "train.progress = False",
            "train.threads = 1",
        ],
    )
    cfg, algo, task = config.build()
    # config.build() refuses a warm-up as long as the run (the policy would never move); to watch the
    # warm-up steps alone the trainer is handed the config with it set, as run() hands its overrides.
    cfg = dataclasses.replace(cfg, critic_warmup_steps=warmup)
    out = tmp_path / name
    try:
        train(cfg, algo, task, str(out), record=config.record(cfg, algo))
    finally:
        distributed.backward, distributed.step = backward, step
        gin.clear_config()
    critic = ScalarHeadModel.from_pretrained(str(out / "final" / "critic")).state_dict()
    return _weights(warm_start(cfg)), _weights(str(out / "final")), critic


@pytest.mark.slow
def test_the_policy_does_not_move_while_the_critic_warms_up_and_does_after(tmp_path):
    calls: list = []
    start, warmed, critic_warmed = _run(tmp_path, "warm2", warmup=2, calls=calls)
    # the policy's engine gets neither a backward (no gradient accumulates for a later step) nor an
    # optimizer step (no AdamW state); the critic's gets both, ppo_epochs x minibatches times a step
    assert {module for _, module in calls} == {"ScalarHeadModel"}
    assert (
        sum(kind == "step" for kind, _ in calls) == 2 * 2 * 2
    )  # 2 steps x ppo.gin's 2 epochs x 2 minibatches
    assert start.keys() == warmed.keys()
    assert all(torch.equal(start[k], warmed[k]) for k in start)  # 2 warm-up steps of 2: policy unmoved
    # the critic trained: its backbone (a copy of the warm start's decoder, value_init.policy) moved
    pairs = [(k, "model." + k.removeprefix("backbone.")) for k in critic_warmed if k.startswith("backbone.")]
    pairs = [(c, p) for c, p in pairs if p in start]
    assert len(pairs) > 10 and any(not torch.equal(critic_warmed[c], start[p]) for c, p in pairs)
    _, trained, _ = _run(tmp_path, "warm1", warmup=1)  # 1 of 2: the second step moves the policy
    assert any(not torch.equal(start[k], trained[k]) for k in start)
    assert os.path.isfile(tmp_path / "warm1" / "summary.json")
