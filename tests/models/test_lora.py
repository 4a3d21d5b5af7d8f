"""LoRA (train.lora_r; polgrad/models/lora.py): one frozen backbone for actor, reference and critic.

Unit level on a fresh tiny Qwen2 (random weights, no warm start): the reference (adapter disabled)
is the backbone bit for bit even after the adapter trained; the critic's own adapter gets no
gradient from the policy loss and the actor's adapter none from the value loss, while a shared
adapter gets both; the merged export equals the adapted forward. End to end (slow): a PPO run with
a shared LoRA critic learns, and the engines, ZeRO stages and export behave.
"""

from __future__ import annotations

import copy
import json
import math
import os

import gin
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from learning import assert_learns

from polgrad.critic import OwnEngineCritic, PolicyEngineCritic
from polgrad.errors import ConfigError
from polgrad.models import build_tiny, lora
from polgrad.tasks.synthetic import add

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO_LORA = os.path.join(REPO, "registry", "ppo_lora.gin")

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny(seed: int = 0):
    torch.manual_seed(seed)
    model, _tok = build_tiny(add())
    return model.float()


def _cfg(r: int = 4, alpha: float = 32.0):
    return lora.lora_config(r=r, alpha=alpha, target_modules=["q_proj", "v_proj"], dropout=0.0)


def _batch(seed: int, b: int = 3, s: int = 9, vocab: int = 16):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (b, s), generator=g)
    attn = torch.ones(b, s, dtype=torch.long)
    attn[0, :2] = 0  # left padding, as the rollouts have
    pos = (attn.cumsum(-1) - 1).clamp_min(0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "use_cache": False}


def _lora_params(model, adapter: str):
    return {n: p for n, p in model.named_parameters() if f".{adapter}." in n}


def _train_adapter_one_step(peft_model, lr: float = 0.05) -> None:
    """One AdamW step on the adapted forward: B moves away from 0 (Adam's first step is ~lr * sign)."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    out = peft_model(**_batch(123)).logits
    out.logsumexp(-1).mean().backward()
    opt.step()
    opt.zero_grad()


# ----------------------------------------------------------------------------- (a) the reference
@pytest.fixture(scope="module")
def trained_pair():
    base = _tiny()
    peft_model = lora.add_policy_adapter(copy.deepcopy(base), _cfg())
    _train_adapter_one_step(peft_model)
    return base.eval(), peft_model


def test_the_adapter_is_the_only_trainable_part_and_starts_as_the_backbone():
    base = _tiny()
    peft_model = lora.add_policy_adapter(copy.deepcopy(base), _cfg())
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    # 4 layers x (q_proj, v_proj) x (lora_A, lora_B): nothing of the backbone, not the LM head
    assert len(trainable) == 16 and all(".policy." in n for n in trainable), trainable
    with torch.no_grad():  # B = 0 at the start (Hu et al. 2021): the adapted forward is the backbone's
        assert torch.equal(peft_model(**_batch(0)).logits, base(**_batch(0)).logits)


@settings(max_examples=20)
@given(seed=st.integers(0, 2**16), b=st.integers(1, 4), s=st.integers(4, 12))  # row 0 has 2 pads
def test_reference_is_the_backbone_bit_for_bit_after_the_adapter_trained(trained_pair, seed, b, s):
    """Exact equality, no tolerance: a disabled LoraLayer computes base_layer(x) only, the very
    nn.Linear op of the backbone on the same weights and inputs, so every logit is the same float;
    the adapter has trained (B != 0), and the adapted forward does differ."""
    base, peft_model = trained_pair
    assert any(
        float(p.detach().abs().max()) > 0
        for n, p in _lora_params(peft_model, "policy").items()
        if "lora_B" in n
    )
    ref = lora.AdapterDisabled(peft_model)
    batch = _batch(seed, b, s)
    with torch.no_grad():
        want = base(**batch).logits
        assert torch.equal(ref(**batch).logits, want)
        assert not torch.equal(peft_model(**batch).logits, want)
    assert list(ref.parameters()) == []  # no weights of its own: no second copy


def test_the_reference_and_critic_forwards_keep_what_the_engines_train():
    """peft's disable_adapter() freezes every adapter and re-enables only the active one, and its
    set_adapter() freezes the inactive ones: with a critic of its own adapter, either would leave
    the critic's (or the actor's) adapter frozen after one forward. Both forwards restore the flags
    they found, so both adapters stay trainable."""
    peft_model = lora.add_policy_adapter(_tiny(), _cfg())
    critic = lora.add_critic(peft_model, own_adapter=True)
    before = {n: p.requires_grad for n, p in peft_model.named_parameters()}
    assert all(before[n] for n in _lora_params(peft_model, "critic"))
    batch = _batch(1)
    with torch.no_grad():
        lora.AdapterDisabled(peft_model)(**batch)
        assert {n: p.requires_grad for n, p in peft_model.named_parameters()} == before
        critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
        assert {n: p.requires_grad for n, p in peft_model.named_parameters()} == before


# ----------------------------------------------------------------------------- (b) the critic's gradients
def _critic_setup(own_adapter: bool):
    peft_model = lora.add_policy_adapter(_tiny(), _cfg())
    critic = lora.add_critic(peft_model, own_adapter=own_adapter, head_init_std=0.1, seed=0)
    # B = 0 at the start makes dL/dA = 0 and the adapted forward the backbone's; one step on both
    # adapters first, so every A and B gets a gradient where a path exists.
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.1)
    return peft_model, critic


def _grads(peft_model, adapter: str) -> dict[str, torch.Tensor | None]:
    return {
        n: (None if p.grad is None else p.grad.clone()) for n, p in _lora_params(peft_model, adapter).items()
    }


def _nonzero(g: torch.Tensor | None) -> bool:
    return g is not None and bool((g != 0).any())


def _losses(peft_model, critic, seed: int = 3):
    batch = _batch(seed)
    policy_loss = peft_model(**batch).logits.logsumexp(-1).mean()
    values = critic(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    value_loss = (values**2).mean()
    return policy_loss, value_loss


def test_own_adapter_the_value_loss_never_reaches_the_actor_adapter():
    peft_model, critic = _critic_setup(own_adapter=True)
    assert critic.adapter == lora.CRITIC_ADAPTER
    _, value_loss = _losses(peft_model, critic)
    value_loss.backward()
    actor, own = _grads(peft_model, "policy"), _grads(peft_model, "critic")
    assert all(g is None or not bool((g != 0).any()) for g in actor.values()), "value loss reached the actor"
    assert len(own) == 16 and all(_nonzero(g) for g in own.values())
    assert _nonzero(critic.head.weight.grad)


def test_own_adapter_the_joint_backward_gives_the_actor_exactly_its_policy_gradient():
    """The loop backpropagates policy_loss + value_loss through the policy's engine in one go; with
    its own adapter the actor's gradient is the policy loss's, bit for bit (no path from the value
    loss, so autograd adds nothing), and the critic's adapter gets the value loss's only."""
    peft_model, critic = _critic_setup(own_adapter=True)
    policy_loss, value_loss = _losses(peft_model, critic)
    (policy_loss + value_loss).backward()
    joint_actor, joint_own = _grads(peft_model, "policy"), _grads(peft_model, "critic")
    peft_model.zero_grad(set_to_none=True)
    policy_loss, value_loss = _losses(peft_model, critic)
    policy_loss.backward()
    alone = _grads(peft_model, "policy")
    assert all(torch.equal(joint_actor[n], alone[n]) for n in alone)
    assert all(g is None for g in _grads(peft_model, "critic").values())  # the policy loss: no critic grad
    assert all(_nonzero(g) for g in joint_own.values())


def test_shared_adapter_the_value_loss_reaches_the_actor_adapter():
    peft_model, critic = _critic_setup(own_adapter=False)
    assert critic.adapter == lora.POLICY_ADAPTER
    assert not _lora_params(peft_model, "critic")  # no second adapter
    _, value_loss = _losses(peft_model, critic)
    value_loss.backward()
    assert all(_nonzero(g) for g in _grads(peft_model, "policy").values())
    assert _nonzero(critic.head.weight.grad)


def test_the_critic_parameters_are_the_head_and_its_own_adapter_only():
    for own, n_adapter in ((True, 16), (False, 0)):
        peft_model, _ = _critic_setup(own_adapter=own)
        names = {
            n
            for n, p in peft_model.named_parameters()
            if any(p is q for q in lora.critic_parameters(peft_model))
        }
        assert names == {"value_head.weight", "value_head.bias"} | {n for n in names if ".critic." in n}
        assert len(names) == 2 + n_adapter


# ----------------------------------------------------------------------------- export
def test_merged_export_is_the_adapted_forward_and_loads_with_automodel(tmp_path, trained_pair):
    """final/ is W + (alpha/r) B A folded into the weights by peft's merge_and_unload: the merged
    model's logits equal the adapted forward's up to float reassociation ((W + sBA)x vs Wx + s B(Ax):
    a few fp32 ulps of the hidden-128 activations, 1e-5 absolute is ~100x what we see)."""
    from transformers import AutoModelForCausalLM

    _, peft_model = trained_pair
    state = {k: v.detach().clone() for k, v in peft_model.state_dict().items()}
    merged = lora.merged_causal_lm(peft_model.config, state, lora.peft_configs(peft_model), "policy")
    merged.save_pretrained(tmp_path / "final")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    batch = _batch(5)
    with torch.no_grad():
        want = peft_model(**batch).logits
        got = loaded(**batch).logits
    assert not any("lora" in n for n, _ in loaded.named_parameters())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(
    "binding, message",
    [
        ("train.lora_r = -1", r"^train.lora_r must be an integer >= 0"),
        ("train.lora_alpha = 0", r"^train.lora_alpha must be a finite number > 0"),
        ("train.lora_target_modules = []", r"^train.lora_target_modules must be a non-empty list"),
        ("train.lora_dropout = 1.0", r"^train.lora_dropout must be in \[0, 1\)"),
        (
            "train.max_staleness = 1\ntrain.zero_stage = 3",
            r"^train.lora_r > 0 with train.max_staleness > 0 needs train.zero_stage 0, 1 or 2, got 3",
        ),
    ],
)
def test_bad_lora_bindings_are_one_line_errors(binding, message):
    from polgrad.config import build, parse_config

    parse_config([PPO_LORA], [binding])
    with pytest.raises(ConfigError, match=message) as e:
        build()
    assert "\n" not in str(e.value)


def test_a_lora_critic_without_lora_is_a_one_line_error():
    from polgrad.config import build, parse_config

    parse_config([PPO_LORA], ["train.lora_r = 0"])
    with pytest.raises(
        ConfigError, match=r"^Algorithm.value_init = @value_init.shared_lora needs a LoRA policy"
    ):
        build()


def test_lora_is_off_by_default():
    from polgrad.config import build, parse_config

    parse_config([os.path.join(REPO, "registry", "ppo.gin")], [])
    cfg, _, _ = build()
    assert cfg.lora_r == 0


# ----------------------------------------------------------------------------- end to end
FAST = ["train.checkpoint_every = 100", "train.progress = False", "train.eval_size = 16"]


def _kl_from_a_policy_forward(monkeypatch) -> None:
    """The loop's exact KL from a policy forward, not from the sampler's distributions (a KV-cached
    decode rounds differently, ~1e-9), so that a first-step KL of exactly 0 says: the reference (the
    adapter disabled) is the policy whose adapter B is still 0, bit for bit."""
    from polgrad.rollout import hf

    monkeypatch.setattr(hf, "MAX_KEPT_DISTRIBUTION", 0)


def _run(tmp_path, bindings, name="run", spec=PPO_LORA):
    from polgrad.config import parse_config
    from polgrad.train import run as train

    gin.clear_config()
    parse_config([spec], [*FAST, *bindings])
    out = tmp_path / name
    try:
        summary = train(str(out))
    finally:
        gin.clear_config()
    return summary, [json.loads(line) for line in open(out / "metrics.jsonl")]


@pytest.mark.slow
def test_ppo_with_a_shared_lora_critic_learns(tmp_path, monkeypatch):
    """registry/ppo_lora.gin on the base task, fixed seed, 40 steps of 16 prompts (PPO samples one
    response per prompt: 16 sequences a step) at lr 5e-4 (LoRA trains at a higher lr than full
    fine-tuning; the paper's GPT-2 runs use 2e-4). The final policy solves more held-out prompts
    than its warm start, paired prompt by prompt, as in test_trainer's GRPO learning test
    (tests/learning.py; a fixed rise of the train reward does not hold on every CPU). The reference
    is the policy with its adapter disabled, so the exact KL of the first step (adapter B = 0) is 0
    exactly; later it is > 0."""
    binds = ["train.steps = 40", "train.prompts_per_step = 16", "train.lr = 5e-4", "train.eval_every = 100"]
    binds.append("train.eval_size = None")
    _kl_from_a_policy_forward(monkeypatch)
    summary, rows = _run(tmp_path, binds)
    assert summary["status"] == "ok"
    assert rows[0]["kl_exact"] == 0.0 and rows[-1]["kl_exact"] > 0
    assert all(math.isfinite(r["value_loss"]) and r["skipped_steps"] == 0 for r in rows)
    assert_learns(tmp_path / "run")


def _built(bindings, spec=PPO_LORA):
    """The run's Models as `trainer.train` builds them (cached warm start; nothing trains)."""
    from polgrad import distributed
    from polgrad.build import build_models
    from polgrad.config import build, parse_config
    from polgrad.sampling import step_seed

    parse_config([spec], [*FAST, *bindings])
    cfg, algo, task = build()
    distributed.setup(seed=cfg.seed)
    return cfg, build_models(cfg, algo, task, out_dir=".", seed_of=lambda s: step_seed(cfg.seed, s))


@pytest.mark.slow
def test_lora_off_builds_the_full_model_run():
    """LoRA off (the default) is the run of before: a plain HF policy, a frozen reference of its
    own, a critic with its own engine, one AdamW group (a ppo.gin run's metrics and final weights
    were also compared bit for bit with the commit before LoRA: identical)."""
    _, m = _built([], spec=os.path.join(REPO, "registry", "ppo.gin"))
    assert not lora.is_peft(m.engine.module)
    assert isinstance(m.reference.module, torch.nn.Module) and not isinstance(
        m.reference.module, lora.AdapterDisabled
    )
    assert isinstance(m.critic, OwnEngineCritic) and m.critic.engine is m.critic.model is not None
    assert len(m.engine.optimizer.param_groups) == 1
    assert all(p.requires_grad for p in m.engine.module.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("value_init, adapter", [("shared_lora", "policy"), ("lora", "critic")])
def test_lora_builds_one_backbone_and_one_engine(value_init, adapter):
    """With LoRA: one copy of the backbone (the reference and the critic hold no weights of their
    own), the critic trained by the policy's engine, its head (and own adapter) at train.critic_lr."""
    cfg, m = _built([f"Algorithm.value_init = @value_init.{value_init}", "train.critic_lr = 3e-4"])
    module = m.engine.module
    assert lora.is_peft(module) and isinstance(m.reference.module, lora.AdapterDisabled)
    assert isinstance(m.critic, PolicyEngineCritic) and m.critic.engine is None
    assert m.critic.model.adapter == adapter
    assert list(m.reference.module.parameters()) == [] and list(m.critic.model.parameters()) == []
    groups = m.engine.optimizer.param_groups
    assert [g["lr"] for g in groups] == [cfg.lr, 3e-4]
    critic_ids = {id(p) for p in groups[1]["params"]}
    assert critic_ids == {id(p) for p in lora.critic_parameters(module)}
    frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
    assert frozen and all("lora_" not in n and "value_head" not in n for n in frozen)


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage, value_init", [(0, "lora"), (2, "shared_lora"), (2, "lora"), (3, "shared_lora"), (3, "lora")]
)
def test_lora_trains_through_every_zero_stage(tmp_path, stage, value_init, monkeypatch):
    """Shared and own-adapter critics train a few steps at ZeRO 0, 2 and 3 (world size 1; ZeRO-3 at
    world size 2 under torchrun was run by hand), the reference exact at step 1, and every stage's
    final/ is a plain causal LM plus the adapter and the critic."""
    binds = [
        f"train.zero_stage = {stage}",
        f"Algorithm.value_init = @value_init.{value_init}",
        "train.steps = 2",
    ]
    _kl_from_a_policy_forward(monkeypatch)
    summary, rows = _run(tmp_path, [*binds, "train.prompts_per_step = 8", "train.eval_every = 100"])
    assert summary["status"] == "ok" and len(rows) == 2
    assert rows[0]["kl_exact"] == 0.0
    assert all(math.isfinite(r["pg_loss"]) and math.isfinite(r["value_loss"]) for r in rows)
    final = tmp_path / "run" / "final"
    assert (final / "model.safetensors").is_file() and (final / "critic" / "value_head.safetensors").is_file()
    assert (final / "adapter" / "policy" / "adapter_config.json").is_file()
    from safetensors.torch import load_file

    head = load_file(final / "critic" / "value_head.safetensors")["weight"]
    assert bool((head != 0).any())  # zero at the start: the value loss reached the head through the engine


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_lora_final_loads_as_a_plain_model_and_equals_the_adapted_policy(tmp_path, stage):
    """final/ (the adapter merged by peft's merge_and_unload) loads with AutoModelForCausalLM and
    gives the logits of the warm-start backbone + final/adapter/ (peft) up to float reassociation
    ((W + sBA)x vs Wx + sB(Ax); tolerance derived below). final/critic/ loads as a ScalarHeadModel, and
    `python -m polgrad.export` of the last checkpoint writes the same weights as final/."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from polgrad.export import export_checkpoint
    from polgrad.models import ScalarHeadModel, load_policy

    binds = ["Algorithm.value_init = @value_init.lora", "train.steps = 2", "train.checkpoint_every = 2"]
    binds.append(f"train.zero_stage = {stage}")  # ZeRO-3: gathered for final/, consolidated for export
    _run(tmp_path, [*binds, "train.prompts_per_step = 8", "train.eval_every = 100"])
    final = tmp_path / "run" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapter_dir = final / "adapter" / "policy"
    base_path = json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
    adapted = PeftModel.from_pretrained(load_policy(base_path), adapter_dir).eval()
    batch = _batch(11, vocab=merged.config.vocab_size)
    with torch.no_grad():
        got, want = merged(**batch).logits, adapted(**batch).logits
        base = load_policy(base_path).eval()(**batch).logits
    assert not torch.allclose(want, base, atol=1e-5)  # the adapter has trained
    # Merging changes where each adapted matmul rounds: O(eps |Wx|) per layer (eps = 2^-24), carried
    # through 4 layers and the LM head. Measured 1.6e-5 at max |logit| 15.9, i.e. 1e-6 of the logit
    # scale (~8 fp32 ulps there); we allow 8x that.
    torch.testing.assert_close(got, want, atol=8e-6 * float(want.abs().max()), rtol=0)
    ScalarHeadModel.from_pretrained(final / "critic")
    exported = export_checkpoint(tmp_path / "run", step=2, out=str(tmp_path / "exported"))
    a, b = load_file(final / "model.safetensors"), load_file(exported / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c, d = (
        load_file(final / "critic" / "model.safetensors"),
        load_file(exported / "critic" / "model.safetensors"),
    )
    assert all(torch.equal(c[k], d[k]) for k in c)


@pytest.mark.slow
def test_the_lora_reward_model_is_an_adapter_and_head_on_the_policy_backbone():
    """train.reward_source = 'reward_model' with LoRA: the reward model is trained (cached) as an
    adapter 'reward' + head on the frozen backbone and loaded onto the policy module, frozen, with no
    weights of its own and outside the optimizer. Its scores are those of the model as trained
    (the same backbone weights and ops, bit for bit) and do not move when the actor's adapter
    does (the actor's adapter is skipped in its forward). On task.sort it ranks held-out pairs well
    above chance (measured 0.82; the full reward model 0.94)."""
    from peft import get_peft_model
    from safetensors.torch import load_file

    from polgrad.models import ScalarHeadModel, sequence_scores

    cfg, m = _built(["train.task = @task.sort", "train.reward_source = 'reward_model'"])
    rm, module = m.score.model, m.engine.module  # the RewardModelScorer's model
    assert isinstance(rm, lora.LoraCritic) and rm.adapter == lora.REWARD_ADAPTER and rm.frozen
    assert list(rm.parameters()) == [] and m.row_fields["rm_heldout_accuracy"] > 0.6
    reward_params = [
        p for n, p in module.named_parameters() if ".reward." in n or n.startswith("reward_head.")
    ]
    assert len(reward_params) == 2 + 2 * 2 * 4 and not any(p.requires_grad for p in reward_params)
    in_optimizer = {id(p) for g in m.engine.optimizer.param_groups for p in g["params"]}
    assert not in_optimizer & {id(p) for p in reward_params}
    # the reward model as trained: ScalarHeadModel over the warm start + the saved adapter and head
    # this run's: LoRA, the single model (no member), the default steps; other tests running beside
    # this one write LoRA reward models of their own (ensemble members, shorter runs) into the cache
    rm_dir = next(p for p in _rm_dirs() if _is_the_single_default_lora_rm(p, cfg.lora.settings()))
    policy_path = json.loads((rm_dir / "polgrad.json").read_text())["policy_path"]
    ref = ScalarHeadModel.from_backbone(policy_path)
    lcfg = lora.lora_config(r=4, alpha=32.0, target_modules=["q_proj", "v_proj"], dropout=0.0)
    lcfg.task_type = None
    ref.backbone = get_peft_model(ref.backbone, lcfg, adapter_name=lora.REWARD_ADAPTER)
    own = dict(ref.backbone.get_base_model().named_parameters())
    with torch.no_grad():
        for name, value in load_file(rm_dir / lora.REWARD_FILE).items():
            own[name].copy_(value)
        head = load_file(rm_dir / "value_head.safetensors")
        ref.head.weight.copy_(head["weight"])
        ref.head.bias.copy_(head["bias"])
    batch = _batch(2, vocab=module.config.vocab_size)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        want = sequence_scores(ref.eval(), ids, attn)
        got = sequence_scores(rm, ids, attn)
        assert torch.equal(got, want)
        for name, p in module.named_parameters():  # the actor's adapter trains: the scores stay
            if "lora_B.policy" in name:
                p.add_(0.5)
        assert torch.equal(sequence_scores(rm, ids, attn), want)
    assert cfg.lora_r == 4


def _rm_dirs():
    from polgrad.models import default_cache_dir

    return sorted((default_cache_dir() / "rm").glob("sort-*"), key=lambda p: p.stat().st_mtime, reverse=True)


def _is_the_single_default_lora_rm(folder, settings: dict) -> bool:
    from polgrad import pretrain

    rm = json.loads((folder / "polgrad.json").read_text())["rm"]
    single = (
        rm.get("lora") == settings and "member" not in rm and rm["steps"] == pretrain.reward_model.RM_STEPS
    )
    return single and (folder / lora.REWARD_FILE).is_file()


TIMING = {
    "time_gen",
    "time_ref",
    "time_values",
    "time_adv",
    "time_update",
    "tokens_per_s",
    "time_s",
    "peak_mem_mb",
}


@pytest.mark.slow
def test_a_resumed_lora_run_ends_where_an_uninterrupted_one_ends(tmp_path):
    """The adapter, the critic's head and their AdamW state live in the policy engine's checkpoint:
    stopped after step 2 and resumed to 4, a shared-LoRA PPO run writes the rows of a straight run."""
    common = ["train.checkpoint_every = 2", "train.eval_every = 100", "train.prompts_per_step = 8"]
    _, full = _run(tmp_path, [*common, "train.steps = 4"], name="full")
    _run(tmp_path, [*common, "train.steps = 2"], name="cut")
    from polgrad import hooks
    from polgrad.config import parse_config
    from polgrad.train import run as train

    steps_run = []
    gin.clear_config()
    parse_config([PPO_LORA], [*FAST, *common, "train.steps = 4"])
    try:
        with hooks.listen(on_event=lambda name: steps_run.append(name) if name == "step" else None):
            train(str(tmp_path / "cut"), resume=True)
    finally:
        gin.clear_config()
    assert len(steps_run) == 2  # it did resume from the step-2 checkpoint
    resumed = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")]
    strip = TIMING | {"eval_accuracy"}
    assert [{k: v for k, v in r.items() if k not in strip} for r in resumed] == [
        {k: v for k, v in r.items() if k not in strip} for r in full
    ]


@pytest.mark.cpu_matrix
@pytest.mark.slow
def test_zero3_with_micro_batches_is_the_zero0_run(tmp_path):
    """The LoRA critic's forward runs outside the engine's forward (the policy's forward counts the
    micro-batch); at ZeRO-3 with 4 micro-batches per optimizer step the gradients still accumulate,
    not overwrite: the run is the ZeRO-0 run up to float summation order (partitioned flat buffers
    and reduce-scatter instead of per-parameter grads). Measured: losses agree to ~1e-6 relative
    after 12 optimizer steps; 1e-4 leaves room, while overwritten micro-batches would keep one
    quarter of each step's gradient (the ZeRO-0 run accumulates in p.grad) and move the later steps'
    losses far more. kl_exact is the exception: a divergence between the policy and its reference
    (the adapter-disabled model), so it is ~quadratic in the adapter's small movement d from zero
    (KL ~ d'Fd / 2, ~4e-5 here), and a rounding error e in the weights is a relative error ~2|e|/|d|
    in it: with e ~ 1e-7 (fp32 sums in another order) and |d| ~ lr x steps = 1e-4 x 3, up to ~1e-3
    (measured 1.3e-4 on an AVX-512 CPU, under 1e-4 on an AMX one): 1e-2 for it; the losses guard."""
    binds = ["train.steps = 3", "train.prompts_per_step = 8", "train.micro_batch_size = 2"]
    binds += ["train.grad_clip = None", "train.eval_every = 100"]
    _, z0 = _run(tmp_path, [*binds, "train.zero_stage = 0"], name="z0")
    _, z3 = _run(tmp_path, [*binds, "train.zero_stage = 3"], name="z3")
    for a, b in zip(z0, z3, strict=True):
        for key, rel in (("pg_loss", 1e-4), ("value_loss", 1e-4), ("kl_exact", 1e-2), ("reward_mean", 1e-4)):
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-9), (key, a["step"])


def test_sampling_never_takes_the_lean_decoder_that_would_skip_the_adapter():
    """rollout/static_decode.py's lean decode step reads the backbone's weights directly (W only, no
    adapter branch): a peft policy must fall back to the HF forward, which applies W + (alpha/r) B A."""
    from polgrad.rollout.static_decode import StaticDecoder

    base = _tiny()
    assert StaticDecoder.unsupported(base) is None  # the plain model takes the lean path
    peft_model = lora.add_policy_adapter(base, _cfg())
    assert StaticDecoder.unsupported(peft_model) is not None


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec, bindings",
    [
        ("grpo.gin", []),  # no critic: the actor's adapter and the adapter-disabled reference only
        ("ppo.gin", []),  # value_init.policy: a full critic copy in its own engine beside a LoRA actor
        ("dpo.gin", []),  # the offline step: the reference is the adapter disabled too
    ],
)
def test_other_specs_train_with_lora(tmp_path, spec, bindings):
    binds = ["train.lora_r = 4", "train.steps = 2", "train.prompts_per_step = 4", "train.eval_every = 100"]
    summary, rows = _run(tmp_path, [*binds, *bindings], spec=os.path.join(REPO, "registry", spec))
    assert summary["status"] == "ok" and len(rows) == 2
    for r in rows:
        assert all(math.isfinite(v) for k, v in r.items() if k.endswith("_loss") and isinstance(v, float))
    final = tmp_path / "run" / "final"
    assert (final / "model.safetensors").is_file() and (final / "adapter" / "policy").is_dir()
    assert (final / "critic").is_dir() == (spec == "ppo.gin")
