"""The Algorithm spec: validation with one-line errors naming the binding; prepare and loss."""

from __future__ import annotations

import gin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from polgrad import config_parts, registry
from polgrad.algorithm import Algorithm
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import StepCounts, register

GRPO = """
Algorithm.name = 'grpo'
Algorithm.advantage = @advantage.grpo
Algorithm.clip = @clip.ppo
Algorithm.aggregate = @aggregate.seq_mean_token_mean
Algorithm.kl = @kl.k3
Algorithm.kl_placement = 'loss'
Algorithm.kl_coef = 0.04
Algorithm.entropy_coef = 0.01
Algorithm.group_size = 4
"""


def build(extra: str = "", base: str = GRPO) -> Algorithm:
    gin.parse_config(base + "\n" + extra)
    return config_parts.algorithm()


@pytest.mark.parametrize(
    "extra, fragment",
    [
        ("Algorithm.group_size = 1", "Algorithm.group_size >= 2"),
        ("Algorithm.kl_placement = 'both'", "Algorithm.kl_placement must be one of"),
        ("Algorithm.kl_coef = -0.1", "Algorithm.kl_coef must be >= 0"),
        ("Algorithm.ppo_epochs = 0", "Algorithm.ppo_epochs must be >= 1"),
        ("Algorithm.advantage = @kl.k1", "Algorithm.advantage = @kl.k1 is a kl part, not a advantage part"),
        ("Algorithm.advantage = @advantage.gae", "needs a critic: set Algorithm.value_init"),
        (
            "Algorithm.value_init = @value_init.policy",
            "Algorithm.value_init = @value_init.policy is set but no part",
        ),
        ("clip.ppo.eps_low = -0.2", "Algorithm.clip = @clip.ppo"),
        (
            "Algorithm.kl = @kl.full\nAlgorithm.kl_placement = 'reward'",
            "Algorithm.kl = @kl.full needs the full logits",
        ),
    ],
)
def test_validation_errors_are_one_line_and_name_the_binding(extra, fragment):
    with pytest.raises(ConfigError) as e:
        build(extra)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_needs_follow_the_parts():
    a = build()
    assert a.needs_reference and not a.needs_critic and not a.needs_logits and not a.needs_baseline_rollout
    gin.clear_config()
    b = build("Algorithm.kl = @kl.full")
    assert b.needs_logits
    gin.clear_config()
    c = build("Algorithm.kl_coef = 0.0")
    assert not c.needs_reference  # fixed controller and beta = 0: no reference model is loaded


def _batch(gen: torch.Generator, b: int = 8, t: int = 5) -> dict:
    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).double()
    old = -torch.rand(b, t, generator=gen, dtype=torch.float64) * mask
    return {
        "scores": torch.randint(0, 2, (b,), generator=gen).double(),
        "mask": mask,
        "truncated": torch.zeros(b, dtype=torch.bool),
        "group_ids": torch.arange(b) // 4,
        "old_logp": old,
        "ref_logp": old - 0.1 * torch.rand(b, t, generator=gen, dtype=torch.float64) * mask,
    }


def test_prepare_kl_in_reward_folds_the_penalty_into_both_reward_forms():
    a = build("Algorithm.kl_placement = 'reward'\nAlgorithm.kl = @kl.k1\nAlgorithm.kl_coef = 0.5")
    batch = _batch(torch.Generator().manual_seed(0))
    out, _ = a.prepare(batch, kl_coef=a.kl_coef)
    kl = (batch["old_logp"] - batch["ref_logp"]) * batch["mask"]
    # rewards = score - beta * sum_t kl_t ; token_rewards sum to the same number per row.
    torch.testing.assert_close(out["rewards"], batch["scores"] - 0.5 * kl.sum(-1), rtol=0, atol=1e-12)
    torch.testing.assert_close(out["token_rewards"].sum(-1), out["rewards"], rtol=0, atol=1e-12)


def test_prepare_filters_rows():
    gin.parse_config("Algorithm.filters = [@filter.zero_variance_groups]")
    a = build()
    batch = _batch(torch.Generator().manual_seed(1))
    batch["scores"] = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1])  # group 0 has zero variance
    out, metrics = a.prepare(batch, kl_coef=a.kl_coef)
    assert out["mask"].shape[0] == 4 and metrics["filtered_frac"] == 0.5
    assert torch.equal(out["group_ids"], torch.tensor([1, 1, 1, 1]))


@given(seed=st.integers(0, 2**31 - 1), cut=st.integers(1, 7))
def test_total_loss_is_the_sum_of_micro_batch_shares(seed, cut):
    """Policy loss incl. KL-in-loss and the entropy bonus: split into two micro-batches with
    global StepCounts, the shares add up to the full-batch loss (same float64 sums, reordered:
    agreement to 1e-12)."""
    gin.clear_config()
    a = build()
    gen = torch.Generator().manual_seed(seed)
    batch, _ = a.prepare(_batch(gen), kl_coef=a.kl_coef)
    batch = batch.replace(
        logp=batch["old_logp"] + 0.3 * torch.randn(batch["mask"].shape, generator=gen, dtype=torch.float64)
    )
    batch = batch.replace(entropy=torch.rand(batch["mask"].shape, generator=gen, dtype=torch.float64))
    rows = torch.randperm(8, generator=gen)
    parts = [rows[:cut], rows[cut:]]
    full, _, _ = a.loss(batch, StepCounts.of_step([batch["mask"]]), kl_coef=a.kl_coef)
    counts = StepCounts.of_step([batch["mask"][r] for r in parts])
    split = sum(a.loss({k: v[r] for k, v in batch.items()}, counts, kl_coef=a.kl_coef)[0] for r in parts)
    torch.testing.assert_close(split, full, rtol=0, atol=1e-12)


def test_one_gradient_step_grpo_is_plain_policy_gradient():
    """With logp == old_logp, beta = 0 and no entropy, GRPO's gradient is -A/|o_i|/B per token
    (eq. 64 with seq_mean_token_mean): ratio = 1 is inside the trust region."""
    a = build("Algorithm.kl_coef = 0.0\nAlgorithm.entropy_coef = 0.0")
    batch, _ = a.prepare(_batch(torch.Generator().manual_seed(2)), kl_coef=a.kl_coef)
    logp = batch["old_logp"].clone().requires_grad_(True)
    loss, _, _ = a.loss({**batch, "logp": logp}, StepCounts.of_step([batch["mask"]]), kl_coef=a.kl_coef)
    loss.backward()
    lengths = batch["mask"].sum(-1, keepdim=True)
    expected = -batch["adv"] / lengths / batch["mask"].shape[0] * batch["mask"]
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The probe: each part is called once at construction; any failure names the binding
# ---------------------------------------------------------------------------------------------


@register("clip", "t_probe_typeerror")
def _clip_raising_typeerror(logp, old_logp, adv, mask, *, rollout_logp=None):
    """Test part: a bug that only shows when called (torch.exp takes one tensor)."""
    return torch.exp(logp, old_logp), {}


@register("clip", "t_probe_hparam")
def _clip_with_required_hparam(logp, old_logp, adv, mask, *, rollout_logp=None, scale, power=gin.REQUIRED):
    """Test part: hyperparameters a spec may leave to the base config."""
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    return -torch.exp(logp - old_logp) * adv * mask * scale**power, {}


def test_probe_reraises_any_exception_as_a_config_error_naming_the_binding():
    with pytest.raises(ConfigError) as e:
        build("Algorithm.clip = @clip.t_probe_typeerror")
    msg = str(e.value)
    assert msg.startswith("Algorithm.clip = @clip.t_probe_typeerror: TypeError: exp()"), msg
    assert "\n" not in msg


def test_probe_defers_hyperparameters_left_to_a_later_config():
    """A spec built on its own (Table 5, tests/registry/test_specs.py) may leave a required hyperparameter
    or a %MACRO to the base config: the probe skips the part; a bad value, once bound, fails."""
    part = "Algorithm.clip = @clip.t_probe_hparam\n"
    build(part + "clip.t_probe_hparam.power = 1")  # keyword-only `scale` unbound
    gin.clear_config()
    build(part + "clip.t_probe_hparam.scale = 2.0")  # `power = gin.REQUIRED` unbound
    gin.clear_config()
    part += "clip.t_probe_hparam.power = 1\n"
    build(part + "clip.t_probe_hparam.scale = %SCALE")  # macro without a value
    gin.clear_config()
    with pytest.raises(ConfigError, match=r"^Algorithm.clip = @clip.t_probe_hparam: ValueError: scale"):
        build(part + "SCALE = -1.0\nclip.t_probe_hparam.scale = %SCALE")
    gin.clear_config()
    with pytest.raises(ConfigError, match="TypeError: unsupported operand"):
        build(part + "clip.t_probe_hparam.scale = 2.0\nclip.t_probe_hparam.power = 'x'")


PROBED = ("advantage", "clip", "kl", "value_loss", "kl_controller")


@pytest.mark.parametrize(
    "kind, name",
    [(k, n) for k in PROBED for n in registry.names(k) if registry.lookup(k, n).where.startswith("polgrad.")],
)
def test_every_builtin_part_passes_the_probe(kind, name):
    """The probe's fake inputs are valid for every built-in, so it fires only on real problems."""
    extra = f"Algorithm.{kind} = @{kind}.{name}"
    if registry.lookup(kind, name).meta.get("needs_critic"):
        extra += "\nAlgorithm.value_init = @value_init.policy"
    a = build(extra)
    assert a.parts[f"Algorithm.{kind}"].full_name == f"{kind}.{name}"


@register("advantage", "t_probe_strict_keywords", needs_groups=True)
def _adv_without_keyword_defaults(rewards, mask, *, group_ids, values, token_rewards, baseline_rewards):
    """Test part: takes the loop's keywords with no defaults, which the contract allows."""
    return token_rewards * mask, None


def test_probe_calls_the_advantage_with_every_keyword_the_loop_passes():
    a = build("Algorithm.advantage = @advantage.t_probe_strict_keywords")
    assert a.parts["Algorithm.advantage"].full_name == "advantage.t_probe_strict_keywords"


# Wrong user parts that register and build without these checks, and fail later or train silently:
# each is refused in one line, at registration or in the spec's build (the dry run builds every cell).
@register("advantage", "t_wrong_tensor_only", needs_groups=True)
def _adv_tensor_only(
    rewards, mask, *, group_ids=None, values=None, token_rewards=None, baseline_rewards=None
):
    """Test part: returns adv alone, not the pair (adv, returns)."""
    return (rewards - rewards.mean())[:, None] * mask


@register("advantage", "t_wrong_per_sequence", needs_groups=True)
def _adv_per_sequence(
    rewards, mask, *, group_ids=None, values=None, token_rewards=None, baseline_rewards=None
):
    """Test part: a [B] advantage, not [B,T]."""
    return rewards - rewards.mean(), None


@register("advantage", "t_wrong_unmasked", needs_groups=True)
def _adv_unmasked(rewards, mask, *, group_ids=None, values=None, token_rewards=None, baseline_rewards=None):
    """Test part: the advantage broadcast over every position, padding included (trains silently)."""
    return (rewards - rewards.mean())[:, None].expand_as(mask).clone(), None


@register("advantage", "t_wrong_reads_padding", needs_groups=True)
def _adv_reads_padding(
    rewards, mask, *, group_ids=None, values=None, token_rewards=None, baseline_rewards=None
):
    """Test part: sums token_rewards over padding too, then masks (its valid values depend on padding)."""
    return token_rewards.sum(-1, keepdim=True).expand_as(mask) * mask, None


@register("kl", "t_wrong_unmasked_kl")
def _kl_unmasked(logp, ref_logp, mask, *, logits=None, ref_logits=None):
    """Test part: k1 without the mask."""
    return logp - ref_logp


@register("clip", "t_wrong_loss_only")
def _clip_loss_only(logp, old_logp, adv, mask, *, rollout_logp=None):
    """Test part: returns the loss alone, not (loss, metrics)."""
    return -torch.exp(logp - old_logp) * adv


@pytest.mark.parametrize(
    ("binding", "says"),
    [
        (
            "Algorithm.advantage = @advantage.t_wrong_tensor_only",
            "it returned a tensor of shape [2, 2], not the pair",
        ),
        (
            "Algorithm.advantage = @advantage.t_wrong_per_sequence",
            "returned a tensor of shape [2] as adv, not [B,T]",
        ),
        ("Algorithm.advantage = @advantage.t_wrong_unmasked", "adv is not zero where the mask is 0"),
        ("Algorithm.advantage = @advantage.t_wrong_reads_padding", "changed when only inputs at masked-out"),
        ("Algorithm.kl = @kl.t_wrong_unmasked_kl", "kl is not zero where the mask is 0"),
        ("Algorithm.clip = @clip.t_wrong_loss_only", "not the pair (loss, metrics dict)"),
    ],
)
def test_a_part_that_breaks_its_kinds_contract_is_refused_when_the_spec_is_built(binding, says):
    with pytest.raises(ConfigError) as e:
        build(binding)
    msg = str(e.value)
    assert msg.startswith(binding.split(" = ")[0] + " = @") and says in msg and "\n" not in msg, msg
    assert "polgrad/registry/kinds.py" in msg  # where the contract is written


def test_a_part_with_swapped_arguments_is_refused_at_registration():
    """(mask, rewards) where the loop passes (rewards, mask): both [.,.] float tensors, so nothing fails
    until the numbers are wrong."""
    from polgrad.errors import RegistryError

    def swapped(mask, rewards, *, group_ids=None, values=None, token_rewards=None, baseline_rewards=None):
        return rewards[:, None] * mask, None

    with pytest.raises(RegistryError) as e:
        register("advantage", "t_swapped_arguments")(swapped)
    msg = str(e.value)
    assert "its parameter 1 is named 'mask' but the loop passes 'rewards' there" in msg, msg
    assert "\n" not in msg and "t_swapped_arguments" not in registry.names("advantage")

    def renamed(r, m, *, group_ids=None, values=None, token_rewards=None, baseline_rewards=None):
        return r[:, None] * m, None  # other names, the loop's order: fine

    register("advantage", "t_renamed_arguments")(renamed)


def test_a_remax_batch_without_its_greedy_baseline_is_the_parts_one_line():
    """ReMax's baseline term hands the batch's baseline scores to the advantage part, cast to the
    computation's dtype; a batch without them gets the part's one-line error, not a traceback."""
    a = build("Algorithm.advantage = @advantage.remax\nAlgorithm.group_size = 1")
    assert a.needs_baseline_rollout
    batch = _batch(torch.Generator().manual_seed(2))
    with pytest.raises(ShapeError, match="needs baseline_rewards") as e:
        a.prepare(batch, kl_coef=a.kl_coef)
    assert "\n" not in str(e.value)
    batch["baseline_scores"] = torch.full((8,), 0.5, dtype=torch.float32)  # cast to the mask's float64
    out, _ = a.prepare(batch, kl_coef=a.kl_coef)
    valid = batch["mask"] > 0
    assert out["adv"].dtype == torch.float64 and torch.equal(
        out["adv"][valid], (out["rewards"][:, None] - 0.5).expand_as(out["adv"])[valid]
    )
