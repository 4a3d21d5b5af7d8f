"""How a run's critic is trained: one `Critic`, chosen once when the models are built.

The loop calls every critic the same way and never asks which one it has:

    old_values(rollout, mask)   V(s_t) of the sampled batch before the update [B,T] float64, or None
    fresh(rollout)              the training forward's {"values": [B,T] float64}, or {} without a critic
    backward(engine, policy_loss, value_loss, last=..., step=...)   the micro-batch's backward(s): the
                                value loss's alone while the critic warms up (train.critic_warmup_steps:
                                steps 0 .. N-1 train the critic, the policy does not move)
    optimizer_step(engine, step)   the policy's optimizer step (its `distributed.step` result: False
                                when skipped; None in a warm-up step, which takes none), then the
                                critic's own
    row(batch, update_seqs)     the step's critic metrics (explained_variance), or {} without a critic
    engines()                   what a checkpoint saves beside the policy: (("critic", engine),) or ()
    write_model_files(root)     RUN_DIR/model/critic/config.json, what an export of a checkpoint needs
    save_final(final)           final/critic/ (collective: ZeRO-3 gathers); a LoRA critic is written
                                with the policy by the model layout (polgrad/layout.py)

Three implementations, picked by `polgrad.build.build_models` from where the model layout
(polgrad/layout.py `critic`) places the spec's `value_init` part's critic:

    NoCritic           a spec without a value function (GRPO, RLOO, ...): one backward of the policy loss
    OwnEngineCritic    a critic model with its own DeepSpeed engine and optimizer (PPO's default)
    PolicyEngineCritic a LoRA critic (polgrad/models/lora.py `LoraCritic`): a head (and adapter) on the
                       policy's backbone, trained by the policy's engine with one backward of
                       policy_loss + value_loss, so a shared adapter gets both gradients in one step
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from polgrad import distributed as dist_lib
from polgrad import hooks
from polgrad.evaluation import explained_variance
from polgrad.layout import save_gathered
from polgrad.rollout import hf as hf_rollout


class Critic(Protocol):
    """What the loop asks of a value function (module docstring). `model` is what computes the values
    (a DeepSpeed engine or a LoraCritic module; None without a critic), `engine` its own DeepSpeed
    engine (None without one)."""

    model: Any
    engine: Any

    def old_values(self, rollout: hf_rollout.Rollout, mask: Tensor) -> Tensor | None: ...
    def fresh(self, rollout: hf_rollout.Rollout) -> dict[str, Tensor]: ...
    def backward(
        self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool, step: int
    ) -> None: ...
    def optimizer_step(self, engine: Any, step: int) -> bool | None: ...
    def row(self, batch: Any, update_seqs: float) -> dict[str, float]: ...
    def engines(self) -> tuple[tuple[str, Any], ...]: ...
    def write_model_files(self, root: Path) -> None: ...
    def save_final(self, final: Path) -> None: ...


class NoCritic:
    """A spec without a value function."""

    model = None
    engine = None

    def old_values(self, rollout: hf_rollout.Rollout, mask: Tensor) -> Tensor | None:
        return None

    def fresh(self, rollout: hf_rollout.Rollout) -> dict[str, Tensor]:
        return {}

    def backward(
        self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool, step: int
    ) -> None:
        dist_lib.backward(engine, policy_loss, boundary=last)

    def optimizer_step(self, engine: Any, step: int) -> bool | None:
        return dist_lib.step(engine)

    def row(self, batch: Any, update_seqs: float) -> dict[str, float]:
        return {}

    def engines(self) -> tuple[tuple[str, Any], ...]:
        return ()

    def write_model_files(self, root: Path) -> None:
        pass

    def save_final(self, final: Path) -> None:
        pass


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

    def row(self, batch: Any, update_seqs: float) -> dict[str, float]:
        """explained_variance of the batch's values against its returns (none when nothing was trained on)."""
        if not update_seqs or batch.returns is None:
            return {}
        return {"explained_variance": explained_variance(batch.values, batch.returns, batch.mask)}

    def write_model_files(self, root: Path) -> None:
        self.model.module.config.save_pretrained(root / "critic")


class OwnEngineCritic(_Values):
    """A critic with its own DeepSpeed engine: two backwards, two optimizer steps; its first
    `warmup_steps` steps (train.critic_warmup_steps; verl's critic_warmup, OpenRLHF's
    freezing_actor_steps) train the critic alone, the policy untouched."""

    def __init__(self, engine: Any, warmup_steps: int = 0):
        self.model = self.engine = engine
        self.warmup_steps = warmup_steps

    def backward(
        self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool, step: int
    ) -> None:
        if step >= self.warmup_steps:  # a warm-up step trains the critic alone
            dist_lib.backward(engine, policy_loss, boundary=last)
        dist_lib.backward(self.engine, value_loss, boundary=last)

    def optimizer_step(self, engine: Any, step: int) -> bool | None:
        applied = dist_lib.step(engine) if step >= self.warmup_steps else None
        dist_lib.step(self.engine)
        return applied

    def engines(self) -> tuple[tuple[str, Any], ...]:
        return (("critic", self.engine),)

    def save_final(self, final: Path) -> None:
        save_gathered(self.engine.module, final / "critic")


class PolicyEngineCritic(_Values):
    """A LoRA critic whose head (and own adapter) the policy's engine trains, at the critic's lr
    (a second param group, from the layout: polgrad/layout.py): one backward of the sum, no engine of
    its own."""

    engine = None

    def __init__(self, module: Any):
        self.model = module

    def backward(
        self, engine: Any, policy_loss: Tensor, value_loss: Tensor, *, last: bool, step: int
    ) -> None:
        dist_lib.backward(engine, policy_loss + value_loss, boundary=last)

    def optimizer_step(self, engine: Any, step: int) -> bool | None:
        return dist_lib.step(engine)  # the policy's optimizer step is this critic's

    def engines(self) -> tuple[tuple[str, Any], ...]:
        return ()  # its weights are in the policy's checkpoint

    def save_final(self, final: Path) -> None:
        pass  # written with the policy (its adapter merged + its head): the layout's save_final
