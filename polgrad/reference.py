"""The run's reference policy π_ref: one `Reference`, chosen once when the models are built.

The loop asks every reference the same things and never whether it has one:

    collect(policy, rollout, temperature)   {"ref_logp": [B,T] float64, "kl_exact": [B,T] float64}
                                            of the sampled batch, from one no-grad reference forward
                                            ({None, None} without a reference)
    logits(out, rollout, temperature)       the training forward's full-vocabulary fields for an
                                            exact-KL part ({"logits", "ref_logits"}: [B,T,V] float64
                                            LogitRows, made a chunk at a time at a large vocabulary),
                                            or {} for every other spec
    row(batch, update_seqs)                 the step's KL metrics (kl, kl_exact per token; kl_seq,
                                            kl_exact_seq per sequence), or {} without a reference
    next_kl_coef(algo, kl_coef, row)        the coefficient of the next step: the spec's KL controller
                                            reads the step's kl_seq; unchanged without a reference

Three implementations, picked by `polgrad.build.build_models` from the spec (`needs_reference`,
`needs_logits`) and train.measure_kl:

    NoReference        no part reads π_ref and KL is not measured (e.g. Dr.GRPO without KL)
    FrozenReference    a frozen model (a second copy, or with LoRA the policy's own module with its
                       adapter disabled: polgrad/models/lora.py `AdapterDisabled`)
    LogitsReference    a FrozenReference whose spec's KL part needs the full distributions
                       (`kl.full`, meta needs_logits): the training forward keeps [B,T,V] logits
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from polgrad import collective, hooks
from polgrad.evaluation import exact_kl
from polgrad.rollout import hf as hf_rollout


class Reference(Protocol):
    """What the loop asks of π_ref (module docstring). `module` is the frozen model (None without one)."""

    module: Any

    def collect(
        self, policy: Any, rollout: hf_rollout.Rollout, temperature: float
    ) -> dict[str, Tensor | None]: ...
    def logits(self, out: Any, rollout: hf_rollout.Rollout, temperature: float) -> dict[str, Tensor]: ...
    def row(self, batch: Any, update_seqs: float) -> dict[str, float]: ...
    def next_kl_coef(self, algo: Any, kl_coef: float, row: dict[str, Any]) -> float: ...


class NoReference:
    """No part reads π_ref and the run does not measure KL: no forward, no KL metrics, a fixed coefficient."""

    module = None

    def collect(
        self, policy: Any, rollout: hf_rollout.Rollout, temperature: float
    ) -> dict[str, Tensor | None]:
        return {"ref_logp": None, "kl_exact": None}

    def logits(self, out: Any, rollout: hf_rollout.Rollout, temperature: float) -> dict[str, Tensor]:
        return {}

    def row(self, batch: Any, update_seqs: float) -> dict[str, float]:
        return {}

    def next_kl_coef(self, algo: Any, kl_coef: float, row: dict[str, Any]) -> float:
        return kl_coef


class FrozenReference:
    """A frozen π_ref: one no-grad forward per batch gives ref_logp and the exact per-token KL."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def collect(
        self, policy: Any, rollout: hf_rollout.Rollout, temperature: float
    ) -> dict[str, Tensor | None]:
        # One reference forward gives ref_logp and the exact KL (a metric: what the estimators
        # approximate; π_θ's side: the rollout's sampling distributions, or a policy forward).
        # no_grad keeps autograd from even looking at the frozen model's forward.
        with torch.no_grad(), hooks.phase("ref"):
            kl_exact, ref_logp = exact_kl(policy, self.module, rollout, temperature=temperature)
        return {"ref_logp": ref_logp.double(), "kl_exact": kl_exact}

    def logits(self, out: Any, rollout: hf_rollout.Rollout, temperature: float) -> dict[str, Tensor]:
        return {}

    def row(self, batch: Any, update_seqs: float) -> dict[str, float]:
        """Per token (kl, kl_exact) and per sequence (the sum over its tokens: kl_seq, the unit of a KL
        target; kl_exact_seq, the exact KL along each response, by the chain rule an unbiased estimate
        of the sequence-level KL(π ‖ π_ref) in nats: the x-axis of over-optimisation curves), over every
        rank. {} when every sequence was filtered out (no KL to report, none for the controller)."""
        if not update_seqs:
            return {}
        mask = batch.mask
        kl_tok = (batch.old_logp - batch.ref_logp) * mask
        sums = torch.stack([kl_tok.sum(), (batch.kl_exact * mask).sum(), mask.sum()])
        kl_sum, kl_exact_sum, tokens = collective.all_sum(sums).tolist()
        return {
            "kl": kl_sum / max(tokens, 1.0),
            "kl_exact": kl_exact_sum / max(tokens, 1.0),
            "kl_seq": kl_sum / update_seqs,
            "kl_exact_seq": kl_exact_sum / update_seqs,
        }

    def next_kl_coef(self, algo: Any, kl_coef: float, row: dict[str, Any]) -> float:
        """The spec's KL controller on the step's per-sequence KL (the unit of its target); a step that
        trained on nothing (no kl_seq) leaves the coefficient where it was."""
        if "kl_seq" not in row:
            return kl_coef
        return algo.next_kl_coef(kl_coef, row["kl_seq"], n_steps=int(row["update_seqs"]))


class LogitsReference(FrozenReference):
    """A FrozenReference for a KL part that needs the full distributions (meta needs_logits): the
    training forward's policy logits and a no-grad reference forward's logits, [B,T,V] float64, as
    LogitRows (polgrad/components/logit_rows.py): at a large vocabulary made a chunk at a time from
    each model's hidden states, never held whole."""

    def logits(self, out: Any, rollout: hf_rollout.Rollout, temperature: float) -> dict[str, Tensor]:
        with torch.no_grad():
            ref = hf_rollout.response_logprobs(self.module, rollout, temperature=temperature, logit_rows=True)
        return {"logits": out.logits.to(torch.float64), "ref_logits": ref.logits.to(torch.float64)}
