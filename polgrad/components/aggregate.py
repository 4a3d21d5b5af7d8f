"""Built-in aggregate parts: per-token loss [B,T] -> this micro-batch's share of the step's scalar loss.

Call signature: `polgrad.registry.kinds.AggregateFn`.

The RLHF book's policy-gradient chapter (section "loss aggregation") lists three strategies; they
differ only in what the masked per-token losses l_{i,t} are divided by (`token_sum`, verl's
"token-sum", divides by nothing). Here every denominator
comes from `counts`, the counts of the WHOLE optimizer step (all micro-batches, all data-parallel
ranks), never from the micro-batch in hand. Each function therefore returns its micro-batch's
share of the step loss, and summing the returned scalars over micro-batches and ranks (which is
what gradient accumulation and the data-parallel all-reduce do) yields exactly the full-batch
loss and gradient, whatever the split, row order or padding.

Masked positions are selected out with `torch.where`, not only multiplied by the mask, so that a
non-finite value in padding (say, -inf log-probs past the end) cannot turn the sum into NaN.
"""

from __future__ import annotations

from torch import Tensor

from polgrad.checks import check_bt, is_int, zero_pad
from polgrad.errors import ConfigError, ShapeError
from polgrad.registry import StepCounts, register


def _enter(where: str, loss: Tensor, mask: Tensor, counts: StepCounts) -> tuple[Tensor, Tensor]:
    """Shape checks shared by every aggregator; returns (masked loss, mask in loss's dtype)."""
    check_bt(where, mask, loss=loss)
    if not isinstance(counts, StepCounts):
        raise ShapeError(
            f"{where}: counts must be a StepCounts, got {type(counts).__name__}; build it once per "
            "optimizer step with StepCounts.of_step([mask of every micro-batch of the step])"
        )
    m = mask.to(loss.dtype)
    # mask.bool() is mask != 0 (for every float, nan and -0.0 included) at a quarter of the cost.
    return zero_pad(mask.bool(), loss) * m, m


@register("aggregate", "token_mean", formula="sum(l*m) / N_tokens", denominator="tokens")
def token_mean(loss: Tensor, mask: Tensor, counts: StepCounts) -> Tensor:
    """Token mean over the step: every valid token weighs the same (DAPO).

        L = sum_{i,t} m_{i,t} l_{i,t} / sum_{i,t} m_{i,t}     (numerator: this micro-batch;
                                                               denominator: counts.num_tokens)

    Source: RLHF book, policy-gradient chapter, "loss aggregation", strategy 2 (per-token
    normalisation); Yu et al. 2025 (DAPO), token-level policy-gradient loss.

    Shapes: loss [B,T], mask [B,T] float 0/1, counts of the whole step -> scalar.
    """
    masked, _ = _enter("aggregate.token_mean", loss, mask, counts)
    return masked.sum() / counts.num_tokens


@register(
    "aggregate",
    "seq_mean_token_mean",
    formula="mean_i [ sum_t(l*m) / |a_i| ]",
    denominator="sequences",
)
def seq_mean_token_mean(loss: Tensor, mask: Tensor, counts: StepCounts) -> Tensor:
    """Mean over sequences of each sequence's token mean: every sequence weighs the same (GRPO).

        L = (1 / N_seqs) sum_i [ sum_t m_{i,t} l_{i,t} / max(|a_i|, 1) ],   |a_i| = sum_t m_{i,t}

    N_seqs = counts.num_seqs counts the step's sequences with at least one valid token; a row of
    this micro-batch with no valid token contributes 0 (it is padding).

    Source: RLHF book, policy-gradient chapter, "loss aggregation", strategy 1 (per-sequence
    normalisation); Shao et al. 2024 (DeepSeekMath, GRPO objective).

    Shapes: loss [B,T], mask [B,T] float 0/1, counts of the whole step -> scalar.
    """
    masked, m = _enter("aggregate.seq_mean_token_mean", loss, mask, counts)
    per_seq = masked.sum(-1) / m.sum(-1).clamp_min(1.0)
    return per_seq.sum() / counts.num_seqs


@register(
    "aggregate",
    "seq_mean_token_sum",
    formula="mean_i [ sum_t(l*m) ]",
    denominator="sequences",
)
def seq_mean_token_sum(loss: Tensor, mask: Tensor, counts: StepCounts) -> Tensor:
    """Mean over sequences of each sequence's token sum (a sequence-level sum of token losses).

        L = (1 / N_seqs) sum_{i,t} m_{i,t} l_{i,t}

    Source: verl's loss_agg_mode "seq-mean-token-sum"; it is the RLHF book's strategy 3
    ("loss aggregation") without the constant 1/L_max, i.e. the per-sequence REINFORCE objective
    sum_t log pi(a_t|s_t) * A averaged over sequences.

    Shapes: loss [B,T], mask [B,T] float 0/1, counts of the whole step -> scalar.
    """
    masked, _ = _enter("aggregate.seq_mean_token_sum", loss, mask, counts)
    return masked.sum() / counts.num_seqs


@register(
    "aggregate",
    "seq_mean_token_sum_norm",
    formula="mean_i [ sum_t(l*m) / L_max ]",
    denominator="sequences*L_max",
)
def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, counts: StepCounts, *, max_len: int) -> Tensor:
    """Sequence mean of token sums divided by a constant L_max (Dr. GRPO).

        L = (1 / N_seqs) sum_i (1 / L_max) sum_t m_{i,t} l_{i,t}

    L_max = `max_len` is a constant (bind it to the generation budget, max new tokens), so every
    token weighs the same within and across sequences, and padding never changes the loss.

    Source: RLHF book, policy-gradient chapter, "loss aggregation", strategy 3 (fixed-length
    normalisation); Liu et al. 2025 (Dr. GRPO, "Understanding R1-Zero-like training").

    Shapes: loss [B,T], mask [B,T] float 0/1, counts of the whole step -> scalar.
    """
    if not is_int(max_len, abc=True) or max_len <= 0:
        raise ConfigError(f"aggregate.seq_mean_token_sum_norm.max_len must be > 0 (an int), got {max_len!r}")
    masked, _ = _enter("aggregate.seq_mean_token_sum_norm", loss, mask, counts)
    return masked.sum() / (float(max_len) * counts.num_seqs)


@register("aggregate", "token_sum", formula="sum(l*m)", denominator="none")
def token_sum(loss: Tensor, mask: Tensor, counts: StepCounts) -> Tensor:
    """Plain sum over every valid token of the step: no denominator at all.

        L = sum_{i,t} m_{i,t} l_{i,t}                          (this micro-batch's share)

    The shares add up over micro-batches and ranks to the sum over all the step's tokens, so the
    loss is invariant to the split without any count (`counts` is checked, then unused). Relation
    to the others: token_sum = N_tokens * token_mean = N_seqs * seq_mean_token_sum
    = N_seqs * L_max * seq_mean_token_sum_norm (N from `counts`); its gradient therefore grows
    with the batch (tokens and sequences), so the learning rate has to absorb the batch size.

    Source: verl's loss_agg_mode "token-sum" (`agg_loss` in verl/trainer/ppo/core_algos.py: the
    masked sum of the local micro-batch, scaled by the data-parallel size there because DDP/FSDP
    average gradients over ranks; the global token sum either way). It is the per-token form of
    the REINFORCE objective sum_i sum_t log pi(a_t|s_t) A_{i,t} with no 1/N.

    Shapes: loss [B,T], mask [B,T] float 0/1, counts of the whole step -> scalar.
    """
    masked, _ = _enter("aggregate.token_sum", loss, mask, counts)
    return masked.sum()
