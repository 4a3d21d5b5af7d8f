"""The algorithm spec: one choice per axis, composed by gin, validated at construction.

    Algorithm.name = 'grpo'
    Algorithm.advantage = @advantage.grpo
    Algorithm.kl = @kl.k3
    Algorithm.kl_placement = 'loss'
    Algorithm.kl_coef = 0.04
    Algorithm.clip = @clip.ppo
    Algorithm.aggregate = @aggregate.seq_mean_token_mean

An `Algorithm` is immutable once built: it holds no model, no optimizer and no loop state (the
KL coefficient that a controller moves is the loop's, passed in as `kl_coef`). Given a rollout
batch it computes advantages (`prepare`), and given a micro-batch with fresh log-probs it
computes the policy and value losses with metrics (`loss`). It never branches on an algorithm's
name: every decision is a part's call or a part's declared metadata (`needs_critic`,
`needs_groups`, ...). The same metadata gives the spec's row of the chapter's Table 5 (`table_row`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from polgrad import collective, registry, spec_checks, table5
from polgrad.batch import Batch
from polgrad.components.advantage import last_token
from polgrad.registry import StepCounts


def _global_sums(*values: float | Tensor) -> list[float]:
    """The values summed over the data-parallel ranks (collective; as they are on one process)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return collective.all_sum(t).tolist()


class Algorithm:
    """A policy-gradient algorithm as a composition of registered parts, one per axis.

    Built from gin by the config layer (`config_parts.algorithm()`, gin's `Algorithm`), which hands
    every part over as a `registry.Bound`: its hyperparameters fixed then, read from nothing later.
    A part passed here directly (a plain registered function) runs with its own defaults.

    Args (all bound in gin; the parts by reference, e.g. `@advantage.rloo`):
      name: the spec's name, as it appears in CSVs and in Table 5.
      advantage, clip, aggregate: the parts of a policy-gradient spec (all three required).
      preference: instead of those three, a `preference` part (e.g. @preference.dpo): the spec then
        trains offline on the task's preference pairs against the frozen reference (DPO and its
        relatives); no sampling, reward, advantage, clip, KL term, critic or filter.
      kl: a `kl` part or None (no KL to a reference policy, no reference model loaded).
      kl_placement: 'reward' (subtract kl_coef * kl from per-token rewards before the advantage,
        the classic RLHF-PPO convention) or 'loss' (add kl_coef * kl to the per-token loss, GRPO).
      kl_coef: initial KL coefficient beta (>= 0); `kl_controller` moves it between steps.
      entropy_coef: weight of the entropy bonus subtracted from the per-token loss (>= 0).
      value_init: a `value_init` part when a part needs a critic, else None.
      value_loss, vf_coef: the critic's per-token loss and its weight.
      ppo_epochs, minibatches: passes over each rollout batch and minibatches per pass.
      group_size: samples per prompt (G); group estimators need G >= 2.
      reward_shaping: `reward_shaping` parts applied in order to the task scores.
      filters: `filter` parts; a sequence dropped by any of them does not enter the update.
      max_sampling_rounds: with filters, the loop samples fresh prompts again (up to this many
        rounds per step) until the step holds `train.prompts_per_step` groups that the filters
        keep, as DAPO's dynamic sampling does; 1 means no refill (a smaller batch).
      source: citation shown in the spec's header and in the comparison table.
    """

    # The part an axis gets when its binding is left out (the config layer binds it like any other).
    DEFAULT_PARTS = MappingProxyType(
        {"kl_controller": ("kl_controller", "fixed"), "value_loss": ("value_loss", "clipped")}
    )

    def __init__(
        self,
        name: str,
        advantage: Callable[..., Any] | None = None,
        clip: Callable[..., Any] | None = None,
        aggregate: Callable[..., Any] | None = None,
        preference: Callable[..., Any] | None = None,
        kl: Callable[..., Any] | None = None,
        kl_placement: str = "loss",
        kl_coef: float = 0.0,
        kl_controller: Callable[..., Any] | None = None,
        entropy_coef: float = 0.0,
        value_init: Callable[..., Any] | None = None,
        value_loss: Callable[..., Any] | None = None,
        vf_coef: float = 0.5,
        ppo_epochs: int = 1,
        minibatches: int = 1,
        group_size: int = 1,
        reward_shaping: Sequence[Callable[..., Any]] = (),
        filters: Sequence[Callable[..., Any]] = (),
        max_sampling_rounds: int = 1,
        source: str = "",
    ):
        self.name = name
        self.source = source
        self.preference = preference
        self.advantage = advantage
        self.clip = clip
        self.aggregate = aggregate
        self.kl = kl
        self.kl_placement = kl_placement
        self.kl_coef = float(kl_coef)
        self.kl_controller = kl_controller or registry.get(*self.DEFAULT_PARTS["kl_controller"])
        self.entropy_coef = float(entropy_coef)
        self.value_init = value_init
        self.value_loss = value_loss or registry.get(*self.DEFAULT_PARTS["value_loss"])
        self.vf_coef = float(vf_coef)
        self.ppo_epochs = int(ppo_epochs)
        self.minibatches = int(minibatches)
        self.group_size = int(group_size)
        self.filters = tuple(filters or ())
        self.max_sampling_rounds = int(max_sampling_rounds)
        self.reward_shaping = tuple(reward_shaping or ())
        spec_checks.validate(self)  # sets self.parts; every check and the probe (polgrad/spec_checks.py)
        self.parts = MappingProxyType(self.parts)  # read-only, like every other attribute
        # The optional terms of the formulas, each chosen here once: `prepare` and `loss` apply them
        # without asking which the spec has (an absent term passes its input through unchanged).
        self._reward_kl = KLPenalty(self.kl) if self.kl_in_reward() else NO_TERM
        self._loss_kl = KLPenalty(self.kl) if self.kl_in_loss() else NO_TERM
        self._critic_term = ValueTerm(self.value_loss, self.vf_coef) if self.needs_critic else NO_TERM
        self._baseline = GreedyBaselineScores() if self.needs_baseline_rollout else NO_TERM
        self._frozen = True

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(
                f"Algorithm is immutable (tried to set {name!r}); the KL coefficient is loop state: "
                "pass kl_coef to prepare/loss"
            )
        super().__setattr__(name, value)

    def part(self, binding: str) -> Any:
        """The part bound to `binding`, a key of `parts` ('Algorithm.kl', 'Algorithm.filters[0]')."""
        attr, _, index = binding.removeprefix("Algorithm.").partition("[")
        value = getattr(self, attr)
        return value[int(index.rstrip("]"))] if index else value

    # ------------------------------------------------------------------ what the loop must provide
    def _any(self, key: str) -> bool:
        return any(e.meta.get(key) for e in self.parts.values())

    @property
    def offline(self) -> bool:
        """Trains on the task's fixed preference pairs (a `preference` part), not on its own samples."""
        return self.preference is not None

    @property
    def needs_critic(self) -> bool:
        return self._any("needs_critic")

    @property
    def needs_reward_model(self) -> bool:
        """A part (e.g. value_init.reward_model) needs a trained reward model, whatever scores the rewards."""
        return self._any("needs_reward_model")

    @property
    def needs_reference(self) -> bool:
        """A reference model is loaded when the optimisation uses it: a preference loss, or a KL term
        that can be non-zero."""
        controller_moves = not self.parts["Algorithm.kl_controller"].meta.get("constant", False)
        return self.offline or (self.kl is not None and (self.kl_coef > 0 or controller_moves))

    @property
    def needs_logits(self) -> bool:
        return self.needs_reference and self._any("needs_logits")

    @property
    def needs_baseline_rollout(self) -> bool:
        return self._any("needs_baseline_rollout")

    @property
    def needs_rollout_logp(self) -> bool:
        return self._any("off_policy")

    # ------------------------------------------------------------------ the math of one step
    def kl_in_reward(self) -> bool:
        return self.kl is not None and self.needs_reference and self.kl_placement == "reward"

    def kl_in_loss(self) -> bool:
        return self.kl is not None and self.needs_reference and self.kl_placement == "loss"

    @torch.no_grad()
    def prepare(
        self, batch: Batch | Mapping[str, Tensor], *, kl_coef: float
    ) -> tuple[Batch, dict[str, float]]:
        """Scores to advantages for a whole rollout batch (no gradient).

        batch: `scores` [B] task/RM scores, `mask` [B,T], `truncated` [B] bool, `group_ids` [B],
          `old_logp` [B,T]; plus `ref_logp` [B,T] if needs_reference, `values` [B,T] if
          needs_critic, `baseline_scores` [B] if needs_baseline_rollout (a `Batch`, or a mapping
          of its field names). Every field and the rollout are filtered with the rows.
        kl_coef: this step's KL coefficient (the loop state's: `Algorithm.kl_coef` is only where it
          starts; the controller moves it).
        Returns the batch with `rewards` [B], `token_rewards` [B,T], `adv` [B,T], `returns`
        [B,T] (if a critic), and rows dropped by the filters removed; plus scalar metrics.
        """
        kl_coef = float(kl_coef)
        batch = Batch.of(batch)
        mask = batch.mask
        # Means over the batch of every data-parallel rank (polgrad.collective; as is on one process).
        n_rows, score_sum = _global_sums(float(mask.shape[0]), batch.scores.double().sum())
        metrics: dict[str, float] = {"score_mean": score_sum / max(n_rows, 1.0)}
        scores, keep = self._shaped_and_kept(batch)
        (kept,) = _global_sums(keep.double().sum())
        metrics["filtered_frac"] = 1.0 - kept / max(n_rows, 1.0)
        out = batch.select(keep)
        mask, scores = out.mask, scores[keep]
        if mask.shape[0] == 0:
            return out, metrics

        # Per-token rewards: the score on the last valid token of each row; minus kl_coef * KL with
        # the KL in the reward (the sequence-level reward too).
        token_rewards, rewards = self._reward_kl.in_reward(
            last_token(scores, mask), scores, out, kl_coef, metrics
        )
        adv, returns = self.advantage(
            rewards,
            mask,
            group_ids=out.group_ids,
            values=out.values,
            token_rewards=token_rewards,
            baseline_rewards=self._baseline.scores(out),  # [B] in mask's dtype (ReMax), or None
        )
        out = out.replace(rewards=rewards, token_rewards=token_rewards, adv=adv, returns=returns)
        adv_sum, tokens = _global_sums((adv * mask).sum(), mask.sum())
        metrics["adv_mean"] = adv_sum / max(tokens, 1.0)
        return out, metrics

    @torch.no_grad()
    def keep(self, batch: Batch | Mapping[str, Tensor]) -> Tensor:
        """[B] bool: the rows the filters keep (all True without filters), judged on the shaped scores.

        The same decision `prepare` makes; the loop asks it first to refill a filtered batch."""
        return self._shaped_and_kept(Batch.of(batch))[1]

    def _shaped_and_kept(self, batch: Batch) -> tuple[Tensor, Tensor]:
        mask = batch.mask
        scores = batch.scores.to(mask.dtype)
        for fn in self.reward_shaping:
            scores = fn(scores, mask, truncated=batch.truncated)
        keep = torch.ones(mask.shape[0], dtype=torch.bool)
        for fn in self.filters:
            keep &= fn(scores, batch.group_ids)
        return scores, keep

    def loss(
        self, mb: Batch | Mapping[str, Tensor], counts: StepCounts, *, kl_coef: float
    ) -> tuple[Tensor, Tensor | None, dict[str, Tensor]]:
        """Policy loss, critic loss and metrics of one micro-batch, as its share of the step.

        mb: `logp` [B,T] (with grad), `old_logp`, `adv`, `mask`; `entropy` [B,T] if entropy_coef > 0;
          `ref_logp` (and `logits`, `ref_logits` if needs_logits) when KL is in the loss;
          `rollout_logp` for off-policy corrections; `values` (with grad), `old_values`, `returns`
          if a critic is trained.
        counts: the whole optimizer step's denominators (StepCounts.of_step over every micro-batch).
        kl_coef: this step's KL coefficient (the loop state's, as in `prepare`).
        Summing the returned losses over the step's micro-batches gives the step loss; metrics
        are likewise shares (token-weighted sums over counts.num_tokens) that add up to step means.
        """
        mb = Batch.of(mb)
        mask = mb.mask
        per_token, clip_metrics = self.clip(mb.logp, mb.old_logp, mb.adv, mask, rollout_logp=mb.rollout_logp)
        metrics: dict[str, Tensor] = {
            f"clip/{k}": (v.detach() * mask).sum() / counts.num_tokens for k, v in clip_metrics.items()
        }
        del clip_metrics  # the [B,T] metric tensors are reduced: free them before the KL term is built
        metrics["pg_loss"] = self.aggregate(per_token.detach(), mask, counts)
        per_token = self._loss_kl.in_loss(per_token, mb, counts, kl_coef, metrics)  # + kl_coef * KL
        if self.entropy_coef > 0:
            per_token = per_token - self.entropy_coef * mb.entropy
        if mb.entropy is not None:
            metrics["entropy"] = (mb.entropy.detach() * mask).sum() / counts.num_tokens
        policy_loss = self.aggregate(per_token, mask, counts)

        value_loss = self._critic_term.value_loss(mb, counts, self.aggregate, metrics)  # None: no critic
        return policy_loss, value_loss, metrics

    def next_kl_coef(self, kl_coef: float, measured_kl: float, n_steps: int) -> float:
        """The KL coefficient after this step: the controller moves it (the loop calls this once per step)."""
        return float(self.kl_controller(kl_coef, measured_kl, n_steps))

    # ------------------------------------------------------------------ offline (preference) loss
    def pair_loss(
        self,
        chosen_logp: Tensor,
        rejected_logp: Tensor,
        ref_chosen: Tensor,
        ref_rejected: Tensor,
        n_pairs: float,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The preference loss of one micro-batch of pairs, as its share of the step's mean.

        *_logp [P]: each response's log-prob summed over its tokens, under the policy (with grad)
        and under the frozen reference. n_pairs: the step's pairs over every micro-batch and rank,
        so that the shares of a step add up to its mean. Metrics are shares too: the loss, the
        implicit-reward accuracy (chosen reward > rejected reward), margin and the two rewards.
        """
        loss, chosen, rejected = self.preference(chosen_logp - ref_chosen, rejected_logp - ref_rejected)

        def share(x: Tensor) -> Tensor:
            return x.sum() / n_pairs

        metrics = {
            "pref_loss": share(loss.detach()),
            "reward_accuracy": share((chosen > rejected).to(loss.dtype)),
            "reward_margin": share(chosen - rejected),
            "chosen_reward": share(chosen),
            "rejected_reward": share(rejected),
        }
        return share(loss), metrics

    # ------------------------------------------------------------------ Table 5
    def table_row(self) -> dict[str, str]:
        """This spec's row of the chapter's Table 5 (column meanings: polgrad.table5)."""
        return table5.table_row(self)


# --------------------------------------------------------------------------- the optional terms
class KLPenalty:
    """The KL to the reference as a penalty, in the reward or in the loss (`Algorithm.kl_placement`).

    in the reward:  r_t <- r_t - beta * KL_t on each valid token, and the sequence reward
                    R <- R - beta * sum_t KL_t (sequence-level estimators see the same penalty);
                    KL_t = kl(old_logp, ref_logp) (the rollout's policy, no gradient); metric kl_reward
    in the loss:    loss_t <- loss_t + beta * KL_t with KL_t = kl(logp, ref_logp) (with gradient, and
                    the logits for a full-vocabulary part); metric kl_loss (its token share)"""

    def __init__(self, kl: Callable[..., Any]):
        self.kl = kl

    def in_reward(
        self, token_rewards: Tensor, scores: Tensor, out: Batch, kl_coef: float, metrics: dict
    ) -> tuple[Tensor, Tensor]:
        mask = out.mask
        kl_tok = self.kl(out.old_logp, out.ref_logp, mask) * mask
        token_rewards = token_rewards - kl_coef * kl_tok
        rewards = scores - kl_coef * kl_tok.sum(-1)
        kl_sum, tokens = _global_sums(kl_tok.sum(), mask.sum())
        metrics["kl_reward"] = kl_sum / max(tokens, 1.0)
        return token_rewards, rewards

    def in_loss(
        self, per_token: Tensor, mb: Batch, counts: StepCounts, kl_coef: float, metrics: dict
    ) -> Tensor:
        mask = mb.mask
        kl_tok = self.kl(mb.logp, mb.ref_logp, mask, logits=mb.logits, ref_logits=mb.ref_logits)
        metrics["kl_loss"] = (kl_tok.detach() * mask).sum() / counts.num_tokens
        return per_token + float(kl_coef) * kl_tok


class ValueTerm:
    """The critic's loss: vf_coef * aggregate(value_loss(values, old_values, returns, mask)), with the
    policy loss's aggregation and denominators; metric value_loss."""

    def __init__(self, value_loss: Callable[..., Any], vf_coef: float):
        self.loss, self.vf_coef = value_loss, vf_coef

    def value_loss(
        self, mb: Batch, counts: StepCounts, aggregate: Callable[..., Any], metrics: dict
    ) -> Tensor:
        v_tok = self.loss(mb.values, mb.old_values, mb.returns, mb.mask)
        value_loss = self.vf_coef * aggregate(v_tok, mb.mask, counts)
        metrics["value_loss"] = value_loss.detach()
        return value_loss


class GreedyBaselineScores:
    """ReMax's baseline: the greedy responses' scores [B] in the computation's dtype (mask's)."""

    def scores(self, out: Batch) -> Tensor | None:
        scores = out.baseline_scores  # None: the advantage part says in one line what is missing
        return None if scores is None else scores.to(out.mask.dtype)


class _NoTerm:
    """A term the spec leaves out: the reward, the loss and the metrics pass through unchanged."""

    def in_reward(self, token_rewards: Tensor, scores: Tensor, out: Batch, kl_coef: float, metrics: dict):
        return token_rewards, scores

    def in_loss(
        self, per_token: Tensor, mb: Batch, counts: StepCounts, kl_coef: float, metrics: dict
    ) -> Tensor:
        return per_token

    def value_loss(self, mb: Batch, counts: StepCounts, aggregate: Callable[..., Any], metrics: dict) -> None:
        return None

    def scores(self, out: Batch) -> None:
        return None


NO_TERM = _NoTerm()
