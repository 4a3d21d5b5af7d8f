"""The chapter's Table 5 ("comparing policy-gradient algorithms and related ones"), derived from specs.

Columns, with the chapter's meanings:
    method            the Algorithm's name; for a preference spec the method of its preference part
                      (its `method` metadata): registry/dpo.gin run with @preference.ipo is 'ipo'
    type              'On-policy' (trains on its own samples) or 'Off-policy' (on fixed data: DPO)
    reward_model      'Yes' when a scalar reward (a reward model or a verifier) is optimised;
                      'No' for a preference loss, which learns from the pairs directly
    value_function    'Yes' when a learned critic is trained
    reference_policy  'Yes' when the optimisation itself uses the reference policy: a KL term that
                      enters the loss or the reward (a KL part with beta > 0 or a moving
                      controller), or a preference loss; 'No' otherwise (e.g. beta = 0)
    core_loss         the spec's loss from its parts' formulas; the KL term is written only when
                      the reference enters it

`CHAPTER` holds the chapter's own five rows (REINFORCE, RLOO, PPO, GRPO, DPO): its core-loss text
and, for the spec of the same name in registry/, how polgrad's loss deviates from that text.
Importing nothing from polgrad, this module reads an `Algorithm` by its attributes.
"""

from __future__ import annotations

from typing import Any

COLUMNS = ("method", "type", "reward_model", "value_function", "reference_policy", "core_loss")

# name -> (the chapter's core loss, how the registry spec of that name deviates from it)
CHAPTER: dict[str, tuple[str, str]] = {
    "reinforce": (
        "−(1/T) Σ_t log π_θ(a_t|s_t) (G_t − b(s_t))",
        "deviation: b is the batch mean of the sequence rewards (the chapter leaves b open), and the "
        "loss is also averaged over the batch's sequences",
    ),
    "rloo": (
        "−(1/K) Σ_i Σ_t log π_θ(a_i,t|s_i,t) (R_i − 1/(K−1) Σ_{j≠i} R_j)",
        "as the chapter (per-sequence token sum, mean over the K samples)",
    ),
    "ppo": (
        "−(1/T) Σ_t min(ρ_t A_t, clip(ρ_t, 1−ε, 1+ε) A_t), ρ_t = π_θ/π_θold",
        "deviation: the mean is over every token of the batch, GAE advantages are whitened over the "
        "batch, the KL penalty is folded into the reward, and a clipped value loss trains the "
        "critic: the chapter's core loss shows the clipped surrogate only",
    ),
    "grpo": (
        "−(1/G) Σ_i min(ρ_i A_i, clip(ρ_i, 1−ε, 1+ε) A_i), ρ_i = π_θ(a_i|s)/π_θold(a_i|s), "
        "A_i = (r_i − mean r)/std r",
        "deviation: the ratio and the clip are per token (as DeepSeekMath's implementation, verl "
        "and TRL), averaged over each response's tokens and then over the G responses, and the KL "
        "penalty to the reference is added in the loss (the chapter's core loss leaves it out)",
    ),
    "dpo": (
        "−E[log σ(β[Δlog π_θ(x) − Δlog π_ref(x)])]",
        "as the chapter (Δ = chosen − rejected, log-probs summed over each response)",
    ),
}


def _formula(entry: Any) -> str:
    return entry.meta.get("formula", entry.name)


def method(algo: Any) -> str:
    """The Table-5 method: a preference spec is the method of its loss (the part's declared `method`,
    default its name: @preference.ipo gives 'ipo' under registry/dpo.gin's Algorithm.name 'dpo'); an
    RL spec is its Algorithm.name."""
    if algo.offline:
        entry = algo.parts["Algorithm.preference"]
        return entry.meta.get("method", entry.name)
    return algo.name


def table_row(algo: Any) -> dict[str, str]:
    """The Table-5 row of an `Algorithm`, from its parts and their metadata (column meanings above)."""
    parts = algo.parts
    if algo.offline:
        core = f"mean over pairs of {_formula(parts['Algorithm.preference'])}"
    else:
        adv, clip, agg = (parts[f"Algorithm.{k}"] for k in ("advantage", "clip", "aggregate"))
        core = f"{_formula(agg)} over −[{_formula(clip)}]; {_formula(adv)}"
        if algo.kl_in_loss() or algo.kl_in_reward():
            where = "+ β·KL in loss" if algo.kl_in_loss() else "r − β·KL in reward"
            core += f"; {where} ({_formula(parts['Algorithm.kl'])}, β={algo.kl_coef:g})"
        if algo.entropy_coef > 0:
            core += f"; − {algo.entropy_coef:g}·entropy"
    return {
        "method": method(algo),
        "type": "Off-policy" if algo.offline else "On-policy",
        "reward_model": "No" if algo.offline else "Yes",
        "value_function": "Yes" if algo.needs_critic else "No",
        "reference_policy": "Yes" if algo.needs_reference else "No",
        "core_loss": core,
    }
