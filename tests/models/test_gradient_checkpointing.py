"""train.gradient_checkpointing: the trained models recompute their layers in the backward.

What it must keep: the numbers (the recomputed forward is the same computation, so one update gives
the same weights), and what it is for: autograd holds far less of a training forward.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import built_run

from polgrad.errors import ConfigError
from polgrad.models import build_tiny, checkpoint_activations

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYERS = 3


def _built(tmp_path, spec: str, name: str, bindings: list[str]):
    return built_run(tmp_path, spec, name, bindings, layers=LAYERS)


def _weights(m) -> dict[str, torch.Tensor]:
    out = {f"policy.{k}": v.detach().clone() for k, v in m.engine.module.state_dict().items()}
    for name, engine in m.critic.engines():
        out.update({f"{name}.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()})
    return out


def _checkpointing(module) -> bool:
    return any(getattr(s, "is_gradient_checkpointing", False) for s in module.modules())


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, extra",
    [
        ("ppo", []),
        ("grpo", ["train.lora_r = 4", "train.lora_target_modules = ['q_proj', 'v_proj', 'down_proj']"]),
    ],
    ids=["ppo-policy-and-critic", "grpo-lora"],
)
def test_one_update_with_checkpointing_gives_the_weights_of_one_without(tmp_path, spec, extra):
    """The same spec built twice from one seed, without and with train.gradient_checkpointing, fed ONE
    rollout: one update (PPO: 2 epochs x 2 minibatches of policy and critic; GRPO with LoRA: the
    adapter) gives bit-identical weights. Checkpointing reruns each layer's forward on the same input
    with the same kernels in the backward, so the activations the backward reads are the same numbers
    and nothing may differ at all; a recomputation that changed a mask, a position or the mode
    (dropout is off in polgrad's models) would change the gradient by O(1) of itself."""
    from polgrad import trainer
    from polgrad.sampling import step_seed

    cfg, algo, task, plain = _built(tmp_path, spec, "plain", extra)
    _, _, _, ckpt = _built(tmp_path, spec, "ckpt", [*extra, "train.gradient_checkpointing = True"])
    assert not _checkpointing(plain.engine.module) and _checkpointing(ckpt.engine.module)
    for (_, e_plain), (_, e_ckpt) in zip(plain.critic.engines(), ckpt.critic.engines(), strict=True):
        assert not _checkpointing(e_plain.module) and _checkpointing(e_ckpt.module)
    w0 = _weights(plain)
    assert all(torch.equal(w0[k], v) for k, v in _weights(ckpt).items())  # the same starting weights
    seed = step_seed(cfg.seed, 0)
    got = trainer.collect_once(cfg, algo, plain, task, seed)
    # scores that split every group whatever the responses, so the update is not rounding noise
    n = got.batch.size
    batch = got.batch.replace(scores=torch.tensor([1.0, 0.0] * (n // 2), dtype=got.batch.scores.dtype))
    beta = algo.kl_coef
    prepared = algo.prepare(batch, kl_coef=beta)[0]
    # counted by the MLP's own forward (torch runs a checkpoint's recomputation without module hooks)
    calls = {"plain": 0, "ckpt": 0}

    def counted(name, forward):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return forward(*args, **kwargs)

        return wrapper

    for name, m in (("plain", plain), ("ckpt", ckpt)):
        mlp = next(mod for mod in m.engine.module.modules() if type(mod).__name__.endswith("MLP"))
        mlp.forward = counted(name, mlp.forward)
    out_p, n_p, _ = trainer.update(cfg, algo, plain, prepared, beta, seed, step=0)
    out_c, n_c, _ = trainer.update(cfg, algo, ckpt, prepared, beta, seed, step=0)
    assert n_p == n_c >= 1 and out_p == out_c
    # the checkpointed layer ran again in each backward: twice per training forward, not once
    assert calls["plain"] >= 1 and calls["ckpt"] == 2 * calls["plain"], calls
    w_p, w_c = _weights(plain), _weights(ckpt)
    moved = [k for k in w0 if not torch.equal(w_p[k], w0[k])]
    assert moved, "the update moved no weight: the comparison would hold for any code"
    for k in w0:
        assert torch.equal(w_p[k], w_c[k]), k


def _saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps from one training forward (outside checkpointed layers;
    a checkpointed layer keeps its input, counted here as one [B,S,hidden] per layer)."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, use_cache=False).logits
    out.sum().backward()
    if _checkpointing(model):
        total += model.config.num_hidden_layers * ids.numel() * model.config.hidden_size * 4
    return total


def test_a_checkpointed_training_forward_keeps_a_fraction_of_the_activations():
    """What the option is for: with 4 layers, 16 x 48 tokens, autograd keeps at most a quarter of the
    bytes it keeps without checkpointing (each layer's attention, MLP and norm intermediates become
    its one input; measured 0.08-0.09 here, and it falls with more layers), and the gradients are
    the same numbers. Deterministic: it counts tensors, not the process's memory."""
    from polgrad import registry

    task = registry.get("task", "add")()
    model, _ = build_tiny(task, seed=0, layers=4)
    model.train()
    ids = torch.randint(4, model.config.vocab_size, (16, 48), generator=torch.Generator().manual_seed(0))
    plain = _saved_bytes(model, ids)
    g_plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert checkpoint_activations(model, "policy") == 1
    ckpt = _saved_bytes(model, ids)
    print(f"autograd keeps {ckpt / plain:.3f} of the activations with checkpointing")
    assert ckpt <= plain / 4
    for p, g in zip(model.parameters(), g_plain, strict=True):
        assert torch.equal(p.grad, g)


def test_a_module_without_a_hugging_face_model_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match=r"^train.gradient_checkpointing = True: the critic \(Linear\) holds no"
    ):
        checkpoint_activations(torch.nn.Linear(2, 2), "critic")


@pytest.mark.slow
def test_a_critic_on_the_policys_lora_backbone_is_refused(tmp_path):
    """value_init.lora runs the critic under its own adapter and switches back to the policy's after
    its forward: a checkpointed backward would recompute the critic's layers under the policy's adapter
    (the same shapes, so torch would not notice) and train the critic on the wrong activations."""
    with pytest.raises(
        ConfigError, match=r"^train.gradient_checkpointing = True with a critic on the policy's LoRA"
    ):
        _built(tmp_path, "ppo_lora", "ckpt", ["train.gradient_checkpointing = True"])
