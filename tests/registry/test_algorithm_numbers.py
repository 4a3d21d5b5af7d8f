"""Algorithm.prepare / Algorithm.loss on hand-worked numbers: where the KL-in-reward penalty lands,
and the sign and size of the entropy bonus.

Every number below is worked out by hand in the comments (dyadic rationals where possible, so
float64 represents them and the sums that produce them exactly).
"""

from __future__ import annotations

import gin
import pytest
import torch

from polgrad import config_parts
from polgrad.registry import StepCounts

F64 = torch.float64
EPS = torch.finfo(F64).eps

# ---------------------------------------------------------------------------------------------
# KL in the reward: r_t = [t = last] * score - beta * k1_t on EVERY valid token
# (Ziegler et al. 2019; Ouyang et al. 2022: the per-token penalty of the chapter's RLHF reward).
# Kills the mutant that puts the whole row's penalty beta * sum_t k1_t on the first valid token
# (row sums, the only thing tests/loop/test_algorithm.py checks, are the same under that mutant).
# ---------------------------------------------------------------------------------------------

KL_IN_REWARD = """
Algorithm.name = 't'
Algorithm.advantage = @advantage.gae
advantage.gae.gamma = 1.0
advantage.gae.lam = 1.0
Algorithm.value_init = @value_init.policy
Algorithm.clip = @clip.ppo
Algorithm.aggregate = @aggregate.token_mean
Algorithm.kl = @kl.k1
Algorithm.kl_placement = 'reward'
Algorithm.kl_coef = 0.5
"""

# Row 0 has 3 valid tokens, row 1 has 2; the padding holds garbage log-probs (-7) that must not
# reach the rewards.
MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]], dtype=F64)
OLD = torch.tensor([[-1.0, -0.5, -2.0, -7.0], [-0.25, -1.0, -7.0, -7.0]], dtype=F64)
REF = torch.tensor([[-1.5, -0.25, -1.0, 0.0], [-0.75, -1.5, 0.0, 0.0]], dtype=F64)
# k1 = OLD - REF on valid tokens: row 0 [0.5, -0.25, -1.0], row 1 [0.5, 0.5].
SCORES = torch.tensor([1.0, 2.0], dtype=F64)


def _kl_in_reward_batch() -> dict:
    return {
        "scores": SCORES,
        "mask": MASK,
        "truncated": torch.zeros(2, dtype=torch.bool),
        "group_ids": torch.tensor([0, 1]),
        "old_logp": OLD,
        "ref_logp": REF,
        "values": torch.zeros(2, 4, dtype=F64),  # a zero critic: GAE(1, 1) is the return-to-go
    }


def test_kl_in_reward_penalises_each_token_where_it_occurs():
    gin.parse_config(KL_IN_REWARD)
    algo = config_parts.algorithm()
    out, _ = algo.prepare(_kl_in_reward_batch(), kl_coef=algo.kl_coef)
    # beta = 0.5: -beta * k1 = row 0 [-0.25, +0.125, +0.5], row 1 [-0.25, -0.25];
    # the score sits on the last valid token (row 0: t = 2, row 1: t = 1).
    #   row 0: [-0.25, 0.125, 1 + 0.5 = 1.5, 0]
    #   row 1: [-0.25, 2 - 0.25 = 1.75, 0, 0]
    # (The first-token mutant gives row 0 [0.375, 0, 1, 0] and row 1 [-0.5, 2, 0, 0].)
    expected_tok = torch.tensor([[-0.25, 0.125, 1.5, 0.0], [-0.25, 1.75, 0.0, 0.0]], dtype=F64)
    # sequence reward = score - beta * sum_t k1_t: 1 - 0.5 * (-0.75) = 1.375, 2 - 0.5 * 1.0 = 1.5
    expected_seq = torch.tensor([1.375, 1.5], dtype=F64)
    # Dyadic numbers with few bits: every operation is exact, so the comparison is exact.
    torch.testing.assert_close(out["token_rewards"], expected_tok, rtol=0, atol=0)
    torch.testing.assert_close(out["rewards"], expected_seq, rtol=0, atol=0)


def test_kl_in_reward_advantage_is_the_return_to_go_of_per_token_penalties():
    gin.parse_config(KL_IN_REWARD)
    algo = config_parts.algorithm()
    out, _ = algo.prepare(_kl_in_reward_batch(), kl_coef=algo.kl_coef)
    # GAE with gamma = lam = 1 and V = 0: A_t = sum_{s >= t} r_s over the valid tokens.
    #   row 0: [-0.25 + 0.125 + 1.5, 0.125 + 1.5, 1.5] = [1.375, 1.625, 1.5]
    #   row 1: [-0.25 + 1.75, 1.75] = [1.5, 1.75]
    # (The first-token mutant gives row 0 [1.375, 1, 1].)
    expected = torch.tensor([[1.375, 1.625, 1.5, 0.0], [1.5, 1.75, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(out["adv"], expected, rtol=0, atol=0)
    torch.testing.assert_close(out["returns"], expected, rtol=0, atol=0)  # returns = A + V, V = 0


# ---------------------------------------------------------------------------------------------
# Entropy bonus: L = agg(l_t - c * H_t), so raising the entropy LOWERS the loss, by exactly
# c * agg(H). Kills the mutant `per_token + entropy_coef * entropy` (the bonus with the wrong sign,
# which turns it into an entropy penalty).
# ---------------------------------------------------------------------------------------------

ENTROPY = """
Algorithm.name = 't'
Algorithm.advantage = @advantage.grpo
Algorithm.clip = @clip.ppo
Algorithm.aggregate = @aggregate.token_mean
Algorithm.entropy_coef = 0.25
Algorithm.group_size = 2
"""

E_MASK = torch.tensor([[1.0, 1, 0], [1, 0, 0]], dtype=F64)
# Entropies of the valid tokens 0.5, 1.0 and 2.0; garbage (9, 7) on padding must not count.
E_ENT = torch.tensor([[0.5, 1.0, 9.0], [2.0, 7.0, 7.0]], dtype=F64)


def _entropy_mb(adv: torch.Tensor, entropy: torch.Tensor) -> dict:
    logp = torch.tensor([[-1.0, -0.5, 0.0], [-2.0, 0.0, 0.0]], dtype=F64)
    return {"logp": logp, "old_logp": logp.clone(), "adv": adv, "mask": E_MASK, "entropy": entropy}


def test_entropy_bonus_lowers_the_loss_by_coef_times_the_aggregated_entropy():
    gin.parse_config(ENTROPY)
    a = config_parts.algorithm()
    counts = StepCounts.of_step(E_MASK)  # 3 valid tokens
    # adv = 0: the clipped surrogate is 0 on every token, so the loss is the bonus alone:
    #   token_mean(-0.25 * H) = -0.25 * (0.5 + 1.0 + 2.0) / 3 = -0.875 / 3 = -7/24.
    zero = torch.zeros(2, 3, dtype=F64)
    loss, _, metrics = a.loss(_entropy_mb(zero, E_ENT), counts, kl_coef=a.kl_coef)
    # -7/24 is one division of exact dyadics (-0.875 / 3): at most half an ulp, within EPS * 7/24.
    assert float(loss) == pytest.approx(-7 / 24, rel=EPS, abs=0)
    assert float(metrics["entropy"]) == pytest.approx(3.5 / 3, rel=EPS, abs=0)

    # With a non-zero advantage, the difference between entropy H and entropy 0 is still exactly
    # -c * token_mean(H) = -7/24 (ratio = 1, the surrogate -A is the same on both sides). Both
    # losses are sums of 3 terms / 3; the terms are O(1), so the difference carries <= ~8 roundings
    # of size <= EPS * 2: 1e-14 is ample and 13 orders below the mutant's error (+7/12).
    adv = torch.tensor([[1.0, -2.0, 0.0], [0.5, 0.0, 0.0]], dtype=F64)
    with_h, _, _ = a.loss(_entropy_mb(adv, E_ENT), counts, kl_coef=a.kl_coef)
    without, _, _ = a.loss(_entropy_mb(adv, zero), counts, kl_coef=a.kl_coef)
    # surrogate alone: -(1 - 2 + 0.5) / 3 = 0.5 / 3 = 1/6
    assert float(without) == pytest.approx(1 / 6, rel=2 * EPS, abs=0)
    assert float(with_h) - float(without) == pytest.approx(-7 / 24, abs=1e-14)


def test_entropy_gradient_is_minus_coef_over_the_step_tokens():
    """d loss / d H_t = -c / N_tokens on valid tokens, 0 on padding: -0.25 / 3 = -1/12."""
    gin.parse_config(ENTROPY)
    a = config_parts.algorithm()
    ent = E_ENT.clone().requires_grad_(True)
    loss, _, _ = a.loss(
        _entropy_mb(torch.zeros(2, 3, dtype=F64), ent), StepCounts.of_step(E_MASK), kl_coef=a.kl_coef
    )
    loss.backward()
    # one product -0.25 * (1/3) per entry: <= one rounding.
    torch.testing.assert_close(ent.grad, -E_MASK / 12, rtol=EPS, atol=0)
