"""How a run's critic is trained: one `Critic`, chosen once when the models are built.

The loop calls every critic the same way and never asks which one it has:

    old_values(rollout, mask)   V(s_t) of the sampled batch before the update [B,T] float64, or None
    fresh(rollout)              the training forward's {"values": [B,T] float64}, or {} without a critic
    backward(engine, policy_loss, value_loss, last=...)   the micro-batch's backward(s); engine None:
                                the value loss's alone (a critic warm-up: the policy does not move)
    step()                      the critic's own optimizer step, after the policy's
    engines()                   what a checkpoint saves beside the policy: (("critic", engine),) or ()

Three implementations, picked by `polgrad.build.build_models` from the spec's `value_init` part and
its `lora` metadata:

    NoCritic           a spec without a value function (GRPO, RLOO, ...): one backward of the policy loss
    OwnEngineCritic    a critic model with its own DeepSpeed engine and optimizer (PPO's default)
    PolicyEngineCritic a LoRA critic (polgrad/models/lora.py `LoraCritic`): a head (and adapter) on the
                       policy's backbone, trained by the policy's engine with one backward of
                       policy_loss + value_loss, so a shared adapter gets both gradients in one step
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from polgrad import distributed as dist_lib
from polgrad import hooks
from polgrad.rollout import hf as hf_rollout


class Critic(Protocol):
    """What the loop asks of a value function (module docstring). `model` is what computes the values
    (a DeepSpeed engine or a LoraCritic module; None without a critic), `engine` its own DeepSpeed
    engine (None without one)."""

    model: Any
    engine: Any

    def old_values(self, rollout: hf_rollout.Rollout, mask: Tensor) -> Tensor | None: ...
    def fresh(self, rollout: hf_rollout.Rollout) -> dict[str, Tensor]: ...
    def backward(self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool) -> None: ...
    def step(self) -> None: ...
    def engines(self) -> tuple[tuple[str, Any], ...]: ...


class NoCritic:
    """A spec without a value function."""

    model = None
    engine = None

    def old_values(self, rollout: hf_rollout.Rollout, mask: Tensor) -> Tensor | None:
        return None

    def fresh(self, rollout: hf_rollout.Rollout) -> dict[str, Tensor]:
        return {}

    def backward(self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool) -> None:
        dist_lib.backward(engine, policy_loss, boundary=last)

    def step(self) -> None:
        pass

    def engines(self) -> tuple[tuple[str, Any], ...]:
        return ()


class _Values:
    """The value forwards both critics share: `model` computes V(s_t) per response token."""

    model: Any

    def old_values(self, rollout: hf_rollout.Rollout, mask: Tensor) -> Tensor | None:
        """The critic's values before the update (old_values), in eval mode without a graph."""
        self.model.module.eval()
        with torch.no_grad(), hooks.phase("values"):
            return hf_rollout.response_values(self.model.module, rollout).double() * mask

    def fresh(self, rollout: hf_rollout.Rollout) -> dict[str, Tensor]:
        # Through the engine, not its module, where it has one: ZeRO-3 counts micro-batches in the
        # engine's forward (see polgrad/trainer.py micro_step).
        self.model.module.train()
        return {"values": hf_rollout.response_values(self.model, rollout).double()}


class OwnEngineCritic(_Values):
    """A critic with its own DeepSpeed engine: two backwards, two optimizer steps."""

    def __init__(self, engine: Any):
        self.model = self.engine = engine

    def backward(self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool) -> None:
        if engine is not None:  # None: a warm-up step trains the critic alone
            dist_lib.backward(engine, policy_loss, boundary=last)
        dist_lib.backward(self.engine, value_loss, boundary=last)

    def step(self) -> None:
        dist_lib.step(self.engine)

    def engines(self) -> tuple[tuple[str, Any], ...]:
        return (("critic", self.engine),)


class PolicyEngineCritic(_Values):
    """A LoRA critic whose head (and own adapter) the policy's engine trains, at the critic's lr
    (a second param group, polgrad/build.py): one backward of the sum, no engine of its own."""

    engine = None

    def __init__(self, module: Any):
        self.model = module

    def backward(self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool) -> None:
        dist_lib.backward(engine, policy_loss + value_loss, boundary=last)

    def step(self) -> None:
        pass  # the policy's optimizer step is this critic's

    def engines(self) -> tuple[tuple[str, Any], ...]:
        return ()  # its weights are in the policy's checkpoint
