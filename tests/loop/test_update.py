"""polgrad.trainer.update: micro-batching does not change the optimizer step.

Kills the mutant that builds `StepCounts` per micro-batch inside the micro-batch loop (from that
micro-batch's mask alone) instead of once per minibatch over every micro-batch's mask. The trainer
tests run one micro-batch per step, where both are the same; here one minibatch of B = 6 ragged
sequences is split into 3 micro-batches of 2 and compared with one micro-batch holding all 6.

The model is the tiny fp32 Qwen2 of tests/dist_worker.py in a real ZeRO-0 DeepSpeed engine (the
trainer's `Models`, `update` and `micro_step` as they are); the gradient is read through the
public phase hooks at the end of the last micro-batch's backward, before the optimizer step.

Tolerances (fp32 model, float64 loss):
- gradient: the two runs do the same arithmetic but for (a) the forward of 2 rows against 6 rows
  (matrix kernels may block the batch differently: last-bit differences of the fp32 log-probs)
  and (b) three accumulations into p.grad instead of one. Both reorder fp32 sums of O(1e2) terms,
  relative error <= ~1e2 * 2^-24 ~ 6e-6 of the summed magnitudes in the worst case; measured
  it is ~1e-7. We allow GRAD_REL = 1e-5 of the model's largest gradient entry. The mutant changes
  each micro-batch's weight by N_step / N_micro (here between 1.4 and 4.5, i.e. an O(1) relative
  error of the gradient), five orders of magnitude above the tolerance.
- parameters after the step: AdamW with eps = 1 (so its first step lr * g / (|g| + 1) is nearly
  linear in g, and a rescaled or reweighted gradient moves the parameters, which Adam with a
  tiny eps, ~ lr * sign(g), would hide): |dp| <= lr * |dg| + 1 ulp of |p|
  = LR * GRAD_REL * max|g| + 2^-23 * max|p|.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import gin
import pytest
import torch

from polgrad import config_parts, distributed, hooks, trainer
from polgrad.batch import Batch
from polgrad.build import Models
from polgrad.rollout.hf import Rollout, response_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("polgrad_test_update_worker", HERE / "dist_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

B, P, T = 6, 3, 6
LENGTHS = [1, 6, 2, 5, 3, 4]  # ragged: 21 valid tokens; micro-batches of 2 hold 3 to 11 of them
LR, ADAM_EPS = 1e-1, 1.0
GRAD_REL = 1e-5  # see the module docstring

SPEC = """
Algorithm.name = 't'
Algorithm.advantage = @advantage.reinforce
Algorithm.clip = @clip.ppo
Algorithm.aggregate = @aggregate.{agg}
Algorithm.entropy_coef = 0.01
Algorithm.minibatches = 1
Algorithm.ppo_epochs = 1
"""


def _batch(model: torch.nn.Module) -> Batch:
    """B rows, full prompts of P tokens, ragged responses, random advantages, old_logp = the
    model's own log-probs (ratio 1: inside the clip range, every token has a gradient)."""
    g = torch.Generator().manual_seed(5)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).float()
    rollout = Rollout(
        prompt_ids=torch.randint(0, worker.VOCAB, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        response_ids=torch.randint(0, worker.VOCAB, (B, T), generator=g),
        mask=mask,
        rollout_logp=torch.zeros(B, T),
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
        response_lengths=torch.tensor(LENGTHS),
        texts=[""] * B,
        examples=[None] * B,
    )
    with torch.no_grad():
        old_logp = response_logprobs(model, rollout).double() * mask.double()
    adv = torch.randn(B, T, generator=g, dtype=torch.float64) * mask.double()
    return Batch(mask=mask.double(), group_ids=rollout.group_ids, old_logp=old_logp, adv=adv, rollout=rollout)


def _one_update(agg: str, micro_batch_size: int):
    """One optimizer step of `trainer.update`; (gradient before the step, parameters after, metrics)."""
    from deepspeed.utils import safe_get_full_grad

    gin.clear_config()
    gin.parse_config(SPEC.format(agg=agg))
    algo = config_parts.algorithm()
    distributed.setup()
    engine = distributed.make_engine(
        worker.build_model(),
        lr=LR,
        eps=ADAM_EPS,
        zero_stage=0,
        micro_batch_size=micro_batch_size,
        grad_accum=1,
        bf16=False,
        grad_clip=None,
    )
    m = Models(engine=engine, tokenizer=None, sampler=None)  # update() never samples
    batch = _batch(engine.module)
    cfg = types.SimpleNamespace(micro_batch_size=micro_batch_size, temperature=1.0)
    grads: dict[str, torch.Tensor] = {}

    def on_phase(path: str, _seconds: float) -> None:
        if path == "backward":  # after each micro-batch's backward; the last one is the step's
            for n, p in engine.module.named_parameters():
                grads[n] = safe_get_full_grad(p).detach().clone()

    with hooks.listen(on_phase=on_phase):
        metrics, n_updates, skipped = trainer.update(cfg, algo, m, batch, kl_coef=0.0, seed=11, step=0)
    assert (n_updates, skipped) == (1, 0)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return grads, params, metrics


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_give_the_step_of_one_full_batch(agg):
    g_full, p_full, met_full = _one_update(agg, micro_batch_size=B)
    g_split, p_split, met_split = _one_update(agg, micro_batch_size=2)

    scale = max(g.abs().max().item() for g in g_full.values())
    assert scale > 0
    err = {n: (g_split[n] - g_full[n]).abs().max().item() for n in g_full}
    worst = max(err, key=err.get)
    assert err[worst] <= GRAD_REL * scale, f"{worst}: gradient error {err[worst]:.3g}, scale {scale:.3g}"

    p_scale = max(p.abs().max().item() for p in p_full.values())
    p_tol = LR * GRAD_REL * scale + 2.0**-23 * p_scale
    p_err = {n: (p_split[n] - p_full[n]).abs().max().item() for n in p_full}
    worst = max(p_err, key=p_err.get)
    assert p_err[worst] <= p_tol, f"{worst}: parameter error {p_err[worst]:.3g} > {p_tol:.3g}"

    # The metrics are shares of the step's means: summed over the micro-batches they are the
    # full-batch values (float64 sums of fp32 log-probs that differ in the last bits: rel 1e-5).
    assert met_split.keys() == met_full.keys()
    for k in ("pg_loss", "entropy"):
        assert met_split[k] == pytest.approx(met_full[k], rel=1e-5, abs=1e-9), k
