"""preference.*: DPO (Rafailov et al. 2023 eq. 7), IPO (Azar et al. 2023 eq. 17), label-smoothed cDPO.

Numbers are worked by hand in the comments. Notation: m = chosen_logratio - rejected_logratio,
s(x) = softplus(x) = log(1 + e^x), so -log sigmoid(x) = s(-x) and s(x) - s(-x) = x.
The last test runs TRL 1.16's own DPOTrainer loss code on the same inputs.
"""

from __future__ import annotations

import collections
import math
import os
import types

import gin
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.trl_run import trl_available
from polgrad.components import preference
from polgrad.config_parts import part
from polgrad.errors import ConfigError, ShapeError

HAS_TRL = trl_available()
# CI's set-up installs the `bench` extra (tests/project/test_bench.py's convention): there a missing TRL
# is an error, not a skip.
if os.environ.get("CI") == "true" and not HAS_TRL:
    raise ImportError("CI=true but TRL is not installed: `bash .ci/setup --test` installs the bench extra")

F64 = torch.float64
SOFTPLUS_M1 = 0.31326168751822286  # s(-1) = log(1 + e^-1) = log(1.36787944117144233)


def _t(*xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def _own_message(exc: BaseException) -> str:
    """The part's own message: gin appends "\n  In call to configurable ..." to what a part raises."""
    return str(exc).split("\n  In call to configurable")[0]


# --------------------------------------------------------------------------------------------
# 1. Known values
# --------------------------------------------------------------------------------------------


def test_dpo_known_values():
    # m = 0: -log sigmoid(0) = -log(1/2) = log 2, whatever beta.
    loss, _, _ = preference.dpo(_t(1.5), _t(1.5), beta=0.7)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-15)
    # beta = 0.5, m = 2: -log sigmoid(1) = s(-1) = log(1 + e^-1) = 0.31326168751822286.
    loss, _, _ = preference.dpo(_t(0.5), _t(-1.5), beta=0.5)
    assert loss.item() == pytest.approx(SOFTPLUS_M1, rel=1e-15)
    # default beta = 0.1, chosen 3, rejected -7: m = 10, beta m = 1 -> s(-1) again;
    # rewards 0.1 * 3 = 0.3 and 0.1 * -7 = -0.7. m = -10: s(1) = 1 + s(-1) = 1.31326168751822286.
    loss, rc, rr = preference.dpo(_t(3.0, -7.0), _t(-7.0, 3.0))
    assert loss.tolist() == pytest.approx([SOFTPLUS_M1, 1 + SOFTPLUS_M1], rel=1e-15)
    assert rc.tolist() == pytest.approx([0.3, -0.7], rel=1e-15)
    assert rr.tolist() == pytest.approx([-0.7, 0.3], rel=1e-15)


def test_ipo_known_values():
    # beta = 0.5: target 1/(2*0.5) = 1. m = 1 -> 0; m = 3 -> (3-1)^2 = 4; m = -1 -> (-2)^2 = 4.
    loss, rc, rr = preference.ipo(_t(1.0, 2.0, -0.5), _t(0.0, -1.0, 0.5), beta=0.5)
    assert loss.tolist() == [0.0, 4.0, 4.0]
    # rewards beta * logratio: 0.5 * (1, 2, -0.5) and 0.5 * (0, -1, 0.5)
    assert rc.tolist() == [0.5, 1.0, -0.25] and rr.tolist() == [0.0, -0.5, 0.25]
    # default beta = 0.1: target 5; m = 2 - (-1) = 3 -> (3-5)^2 = 4; m = 0 -> 25.
    loss, _, _ = preference.ipo(_t(2.0, 0.0), _t(-1.0, 0.0))
    assert loss.tolist() == pytest.approx([4.0, 25.0], rel=1e-14)


def test_cdpo_known_values():
    # m = 0: -(1-eps) log(1/2) - eps log(1/2) = log 2, whatever eps and beta.
    loss, _, _ = preference.cdpo(_t(0.0), _t(0.0), beta=1.0, label_smoothing=0.3)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-15)
    # beta = 0.5, m = 2, eps = 0.25: 0.75 s(-1) + 0.25 s(1) = 0.75 s(-1) + 0.25 (1 + s(-1))
    #   = s(-1) + 0.25 = 0.56326168751822286
    loss, rc, rr = preference.cdpo(_t(2.5), _t(0.5), beta=0.5, label_smoothing=0.25)
    assert loss.item() == pytest.approx(SOFTPLUS_M1 + 0.25, rel=1e-15)
    assert (rc.item(), rr.item()) == (1.25, 0.25)
    # defaults beta = 0.1, eps = 0.1; m = 10: 0.9 s(-1) + 0.1 s(1) = s(-1) + 0.1 = 0.41326168751822286
    loss, _, _ = preference.cdpo(_t(10.0), _t(0.0))
    assert loss.item() == pytest.approx(SOFTPLUS_M1 + 0.1, rel=1e-15)


def test_gin_binds_beta_by_the_parts_full_name():
    gin.parse_config(["preference.dpo.beta = 0.5", "preference.cdpo.label_smoothing = 0.25"])
    loss, rc, _ = part("preference", "dpo")(_t(2.0), _t(0.0))  # beta m = 1 -> s(-1)
    assert loss.item() == pytest.approx(SOFTPLUS_M1, rel=1e-15) and rc.item() == 1.0
    # cdpo keeps its default beta = 0.1; m = 10 -> 0.75 s(-1) + 0.25 s(1) = s(-1) + 0.25
    loss, _, _ = part("preference", "cdpo")(_t(10.0), _t(0.0))
    assert loss.item() == pytest.approx(SOFTPLUS_M1 + 0.25, rel=1e-15)


# --------------------------------------------------------------------------------------------
# 2. Gradients
# --------------------------------------------------------------------------------------------

margins = st.floats(-60.0, 60.0, allow_nan=False)
betas = st.floats(0.01, 5.0)
epss = st.floats(0.0, 0.49)
vectors = st.lists(st.floats(-40.0, 40.0, allow_nan=False), min_size=1, max_size=6)


@given(m=margins, beta=betas)
def test_dpo_gradient_identity(m, beta):
    # d/dm s(-beta m) = -beta sigmoid(-beta m); through m = c - r: dL/dc = that, dL/dr = its negative.
    # |dL/dm| <= beta <= 5, so float64 rounding is ~1e-15 absolute: 1e-12 leaves a wide margin.
    c = torch.tensor([m], dtype=F64, requires_grad=True)
    r = torch.zeros(1, dtype=F64, requires_grad=True)
    loss, rc, rr = preference.dpo(c, r, beta=beta)
    loss.sum().backward()
    expected = -beta * torch.sigmoid(torch.tensor(-beta * m, dtype=F64)).item()
    assert c.grad.item() == pytest.approx(expected, abs=1e-12)
    assert r.grad.item() == pytest.approx(-expected, abs=1e-12)
    assert not rc.requires_grad and not rr.requires_grad  # rewards are detached


@given(c=vectors, beta=betas)
def test_dpo_gradient_per_pair_through_both_logratios(c, beta):
    # Pairs are independent: d loss_i / d chosen_j = 0 for i != j, so the gradient of the sum is
    # per pair (rejected = chosen / 2, so m = chosen / 2).
    ch = torch.tensor(c, dtype=F64, requires_grad=True)
    rej = (torch.tensor(c, dtype=F64) * 0.5).requires_grad_(True)
    loss, _, _ = preference.dpo(ch, rej, beta=beta)
    loss.sum().backward()
    m = ch.detach() - rej.detach()
    g = -beta * torch.sigmoid(-beta * m)
    torch.testing.assert_close(ch.grad, g, rtol=0, atol=1e-12)
    torch.testing.assert_close(rej.grad, -g, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# 3. Properties
# --------------------------------------------------------------------------------------------


@given(c=vectors, r=vectors, beta=betas)
def test_dpo_swapping_chosen_and_rejected_negates_the_margin(c, r, beta):
    n = min(len(c), len(r))
    ch, rej = torch.tensor(c[:n], dtype=F64), torch.tensor(r[:n], dtype=F64)
    loss, rc, rr = preference.dpo(ch, rej, beta=beta)
    loss_sw, rc_sw, rr_sw = preference.dpo(rej, ch, beta=beta)
    # L(m) - L(-m) = s(-beta m) - s(beta m) = -beta m. Values are at most ~|beta m| + log 2 <= 401,
    # each rounded to a few ulp: tolerance 1e-12 * (1 + |beta m|).
    bm = beta * (ch - rej)
    torch.testing.assert_close(loss - loss_sw, -bm, rtol=0, atol=1e-12 * (1 + bm.abs().max().item()))
    assert torch.equal(rc, rr_sw) and torch.equal(rr, rc_sw)  # the rewards swap exactly


@given(beta=betas, d=st.floats(-50.0, 50.0, allow_nan=False))
def test_ipo_minimiser_is_one_over_two_beta(beta, d):
    # loss(m) = (m - t)^2, t = 1/(2 beta): at m = t the value and gradient are exactly 0, the
    # curvature is 2, and loss(t + d) = d^2 (up to the rounding of t + d and its difference).
    t = 1 / (2 * beta)
    m = torch.tensor([t], dtype=F64, requires_grad=True)
    loss, _, _ = preference.ipo(m, torch.zeros(1, dtype=F64), beta=beta)
    (g,) = torch.autograd.grad(loss.sum(), m, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), m)
    assert loss.item() == 0.0 and g.item() == 0.0 and h.item() == 2.0
    shifted, _, _ = preference.ipo(_t(t + d), _t(0.0), beta=beta)
    dd = (t + d) - t  # the offset float64 actually represents
    assert shifted.item() == pytest.approx(dd * dd, rel=1e-12, abs=1e-300)
    assert shifted.item() >= 0.0


@given(c=vectors, beta=betas)
def test_cdpo_with_zero_smoothing_is_dpo_exactly(c, beta):
    ch = torch.tensor(c, dtype=F64)
    rej = ch.flip(0) - 0.25
    a = preference.cdpo(ch, rej, beta=beta, label_smoothing=0.0)
    b = preference.dpo(ch, rej, beta=beta)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@given(c=vectors, beta=betas, eps=epss)
def test_cdpo_is_the_eps_mixture_of_dpo_on_both_labels(c, beta, eps):
    ch = torch.tensor(c, dtype=F64)
    rej = 0.5 - ch
    loss, _, _ = preference.cdpo(ch, rej, beta=beta, label_smoothing=eps)
    loss_sw, _, _ = preference.cdpo(rej, ch, beta=beta, label_smoothing=eps)
    d, _, _ = preference.dpo(ch, rej, beta=beta)
    d_sw, _, _ = preference.dpo(rej, ch, beta=beta)
    bm = beta * (ch - rej)
    tol = 1e-12 * (1 + bm.abs().max().item())
    # cdpo_eps(m) = (1-eps) s(-beta m) + eps s(beta m) = (1-eps) dpo(m) + eps dpo(-m)
    torch.testing.assert_close(loss, (1 - eps) * d + eps * d_sw, rtol=0, atol=tol)
    # cdpo_eps(m) - cdpo_eps(-m) = (1-2eps)(s(-beta m) - s(beta m)) = -(1-2eps) beta m
    torch.testing.assert_close(loss - loss_sw, -(1 - 2 * eps) * bm, rtol=0, atol=tol)
    # cdpo_eps(m) + cdpo_eps(-m) = s(beta m) + s(-beta m) = dpo(m) + dpo(-m), whatever eps
    torch.testing.assert_close(loss + loss_sw, d + d_sw, rtol=0, atol=tol)


@given(beta=betas, eps=st.floats(0.01, 0.49))
def test_cdpo_margin_stops_at_log_odds_of_the_smoothing(beta, eps):
    # dL/dm = -(1-eps) beta sigmoid(-beta m) + eps beta sigmoid(beta m) = beta (sigmoid(beta m) - (1-eps)):
    # zero where sigmoid(beta m) = 1 - eps, i.e. beta m = log((1-eps)/eps). |grad| <= beta <= 5.
    m = torch.tensor([math.log((1 - eps) / eps) / beta], dtype=F64, requires_grad=True)
    loss, _, _ = preference.cdpo(m, torch.zeros(1, dtype=F64), beta=beta, label_smoothing=eps)
    (g,) = torch.autograd.grad(loss.sum(), m)
    assert g.item() == pytest.approx(0.0, abs=1e-12)


# --------------------------------------------------------------------------------------------
# Entry checks
# --------------------------------------------------------------------------------------------

PARTS = ["dpo", "ipo", "cdpo"]


@pytest.mark.parametrize("name", PARTS)
@pytest.mark.parametrize(
    ("chosen", "rejected", "says"),
    [
        (torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64), "chosen_logratio must be a 1-D float"),
        (
            torch.zeros(3, dtype=F64),
            torch.zeros(3, dtype=torch.int64),
            "rejected_logratio must be a 1-D float",
        ),
        ([0.0], torch.zeros(1, dtype=F64), "chosen_logratio must be a 1-D float tensor .P., got list"),
        (
            torch.zeros(3, dtype=F64),
            torch.zeros(2, dtype=F64),
            r"chosen_logratio and rejected_logratio must have the same length P >= 1, got \[3\] and \[2\]",
        ),
        (
            torch.zeros(0, dtype=F64),
            torch.zeros(0, dtype=F64),
            "chosen_logratio and rejected_logratio must have the same length",
        ),
        (_t(0.0, math.nan), _t(0.0, 0.0), "chosen_logratio must be finite"),
        (_t(0.0, 0.0), _t(-math.inf, 0.0), "rejected_logratio must be finite"),
    ],
)
def test_bad_tensors_fail_at_the_part_in_one_line(name, chosen, rejected, says):
    with pytest.raises(ShapeError, match=f"^preference.{name}: {says}") as exc:
        getattr(preference, name)(chosen, rejected)
    assert "\n" not in _own_message(exc.value)


@pytest.mark.parametrize("name", PARTS)
@pytest.mark.parametrize("beta", [0.0, -0.1, math.inf, math.nan, True, "0.1", None])
def test_bad_beta_names_the_binding(name, beta):
    with pytest.raises(ConfigError, match=rf"^preference\.{name}\.beta must be a number > 0 and finite"):
        getattr(preference, name)(_t(1.0), _t(0.0), beta=beta)


@pytest.mark.parametrize("eps", [-0.01, 0.5, 1.0, math.nan, False, "0.1"])
def test_bad_label_smoothing_names_the_binding(eps):
    with pytest.raises(ConfigError, match=r"^preference\.cdpo\.label_smoothing must be in \[0, 0\.5\)"):
        preference.cdpo(_t(1.0), _t(0.0), label_smoothing=eps)


# --------------------------------------------------------------------------------------------
# 4. TRL 1.16's DPOTrainer on the same inputs
# --------------------------------------------------------------------------------------------


class _Accelerator:
    """What DPOTrainer._compute_loss asks of `self.accelerator` on one process: a device, gathers."""

    device = torch.device("cpu")

    def gather_for_metrics(self, x):
        return x

    def gather(self, x):
        return x


def _trl_pair(loss_type, beta, eps, logp, ref, lengths):
    """TRL 1.16's `DPOTrainer._compute_loss` (trl/trainer/dpo_trainer.py) on ONE pair.

    A stand-in `self` holds the attributes the method reads (what `__init__` sets from DPOConfig:
    beta, loss_type as a list, label_smoothing, precompute_ref_log_probs=True so the reference
    log-probs come from the inputs, f_divergence_type='reverse_kl', ld_alpha=None, no WPO
    weighting) and a stand-in model returns per-token log-probs whose row sums are logp = (chosen,
    rejected): the whole sum on the first completion token, exact zeros elsewhere. The completion
    masks hold lengths = (n_chosen, n_rejected) ones (only IPO reads them). Returns the loss (the
    mean over one pair: that pair's loss) and TRL's logged rewards/chosen and rewards/rejected.
    """
    from trl.trainer.dpo_trainer import DPOTrainer

    width = max(lengths) + 1
    completion_mask = torch.zeros(2, width, dtype=torch.int64)
    for row, n in enumerate(lengths):
        completion_mask[row, :n] = 1
    per_token = torch.zeros(2, width - 1, dtype=F64)
    per_token[:, 0] = torch.tensor(logp, dtype=F64)
    outputs = types.SimpleNamespace(
        log_probs=per_token,
        entropy=torch.zeros_like(per_token),
        mean_logits=torch.zeros_like(per_token),
        is_top1=torch.zeros(per_token.shape, dtype=torch.bool),
    )
    trainer = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        beta=beta,
        loss_types=[loss_type],
        loss_weights=[1.0],
        label_smoothing=eps,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        ld_alpha=None,
        use_weighting=False,
        aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(2, width, dtype=torch.int64),
        "attention_mask": torch.ones(2, width, dtype=torch.int64),
        "completion_mask": completion_mask,
        "ref_chosen_logps": torch.tensor([ref[0]], dtype=F64),
        "ref_rejected_logps": torch.tensor([ref[1]], dtype=F64),
    }
    loss = DPOTrainer._compute_loss(trainer, lambda **_: outputs, inputs, return_outputs=False)
    logged = trainer._metrics["train"]
    return loss.item(), logged["rewards/chosen"][0], logged["rewards/rejected"][0]


# TRL's name for each part, and how polgrad's inputs relate to TRL's summed log-probs:
#   dpo  <- "sigmoid":       -logsigmoid(beta * (chosen_logratio - rejected_logratio)), summed log-probs
#   ipo  <- "ipo":           TRL divides each log-ratio by its completion length first, so polgrad is
#                            given those length-averaged log-ratios (its own input is summed ones)
#   cdpo <- "aot_unpaired":  TRL 1.16's sigmoid ignores label_smoothing; aot_unpaired computes
#                            -(1-eps) logsigmoid(beta d) - eps logsigmoid(-beta d) on the sorted
#                            log-ratios, and sorting one pair is the identity.
TRL_LOSS = {"dpo": "sigmoid", "ipo": "ipo", "cdpo": "aot_unpaired"}


@pytest.mark.skipif(not HAS_TRL, reason="needs the `bench` extra (trl)")
@pytest.mark.parametrize("name", PARTS)
def test_losses_and_rewards_equal_trl_dpo_trainer(name):
    gen = torch.Generator().manual_seed(12)
    checked = 0
    for beta in (0.05, 0.1, 0.5, 2.0):
        for _ in range(8):
            logp = (-20 * torch.rand(2, generator=gen, dtype=F64)).tolist()
            ref = (-20 * torch.rand(2, generator=gen, dtype=F64)).tolist()
            lengths = torch.randint(1, 12, (2,), generator=gen).tolist()
            eps = 0.2 if name == "cdpo" else 0.0
            trl_loss, trl_rc, trl_rr = _trl_pair(TRL_LOSS[name], beta, eps, logp, ref, lengths)
            chosen, rejected = _t(logp[0] - ref[0]), _t(logp[1] - ref[1])  # TRL's logratios, same op
            kwargs = {"label_smoothing": eps} if name == "cdpo" else {}
            if name == "ipo":
                loss, _, _ = preference.ipo(chosen / lengths[0], rejected / lengths[1], beta=beta)
                summed, rc, rr = preference.ipo(chosen, rejected, beta=beta)  # TRL logs unaveraged rewards
                if lengths != [1, 1]:  # the documented deviation: polgrad's own input is the summed one
                    assert abs(summed.item() - trl_loss) > 1e-9 * trl_loss
            else:
                loss, rc, rr = getattr(preference, name)(chosen, rejected, beta=beta, **kwargs)
            # Identical float64 inputs and the same handful of operations on values <= ~1e3:
            # the results agree to a few ulp; 1e-12 relative is a margin of ~1e3 over that.
            assert loss.item() == pytest.approx(trl_loss, rel=1e-12, abs=1e-300), (beta, logp, ref)
            assert rc.item() == pytest.approx(trl_rc, rel=1e-12) and rr.item() == pytest.approx(
                trl_rr, rel=1e-12
            )
            checked += 1
    assert checked == 32
