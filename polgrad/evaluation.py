"""What a run measures besides its training metrics: held-out accuracy per prompt, the exact KL, and
the critic's explained variance.

`Evaluator` scores the policy greedily on a fixed list of distinct held-out prompts (the task's
`eval_examples`: the whole held-out split by default), the same list at every evaluation and in
every run of the task, and appends one record per evaluation to `eval.jsonl`:

    {"step": 20, "accuracy": 0.41, "n": 1008, "prompts": [...], "correct": [0, 1, ...]}

so that two runs can be compared prompt by prompt as well as by seed. A run trained on a reward model
also records that model's score of the same greedy responses (`rm_score`, `rm_scores`): the proxy
beside the gold accuracy. Step 0 is the starting
policy (the warm start), evaluated before the first update.

`exact_kl` is KL(π‖π_ref) summed over the whole vocabulary at each sampled position, computed a chunk
of positions at a time from each model's hidden states where it can (else in chunks of rows), so that
no [B,T,V] logits are held.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from polgrad import collective
from polgrad.components.kl import full as exact_kl_part
from polgrad.components.logit_rows import HeadLogits, TensorLogits, chunk_rows
from polgrad.errors import ShapeError
from polgrad.io import atomic_write_text
from polgrad.rollout import hf as hf_rollout
from polgrad.rollout.fused_logprobs import fuses, head_inputs, output_projection
from polgrad.run_folder import RunFolder
from polgrad.tasks.base import Example, is_correct
from polgrad.tasks.rewards import RewardGuard


@torch.no_grad()
def greedy_results(
    model,
    tokenizer,
    task,
    examples: Sequence[Example],
    max_new_tokens: int,
    rewards: RewardGuard | None = None,
    proxy: Callable[[Any], Tensor] | None = None,
) -> tuple[list[int], list[float] | None]:
    """(per example 1 where its greedy response earns the full reward (== 1), else 0; with `proxy`
    its score of the same greedy responses: a reward model's, the proxy of the gold reward a
    reward-model run trains on; else None).

    `rewards` checks each reward (train.reward_errors; default 'raise'): a faulty one stops the
    run in one line, or counts as wrong."""
    model.eval()
    rollout = hf_rollout.generate(
        model,
        tokenizer,
        list(examples),
        group_size=1,
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        generator_seed=0,
    )
    scores = (rewards or RewardGuard()).task_scores(task, rollout.examples, rollout.texts)
    correct = [int(is_correct(s)) for s in scores.tolist()]
    return correct, (None if proxy is None else [float(x) for x in proxy(rollout).tolist()])


@dataclass
class Evaluator:
    """Greedy held-out accuracy on `examples`, recorded per prompt in `<out_dir>/eval.jsonl`.

    With `proxy` (a reward-model run: the reward model's scorer) each record also holds the reward
    model's score of the same greedy responses, per prompt (`rm_scores`) and as a mean (`rm_score`),
    the proxy beside the gold accuracy; `fields` is then {"eval_rm_score": that mean} for the step's
    row, else {}."""

    task: object
    examples: list[Example]
    max_new_tokens: int
    out_dir: str
    write: bool = True  # only rank 0 writes
    rewards: RewardGuard = field(default_factory=RewardGuard)  # train.reward_errors in evaluation
    proxy: Callable[[Any], Tensor] | None = None
    fields: dict[str, float] = field(default_factory=dict)  # what the last evaluation adds to a row

    @property
    def path(self) -> str:
        return str(RunFolder(self.out_dir).eval)

    def __call__(self, model, tokenizer, step: int) -> float:
        """The accuracy at `step` (recorded when `write`). Collective at world size > 1: every rank
        calls it; each decodes its share of the prompts (rank r takes prompts r, r + W, ...) and the
        per-prompt results are gathered, so the record is the same whatever the world size (up to
        greedy ties that rounding may break differently in a differently padded batch)."""
        correct, proxy = self._results(model, tokenizer)
        accuracy = sum(correct) / len(correct)
        self.fields = {} if proxy is None else {"eval_rm_score": sum(proxy) / len(proxy)}
        if self.write:
            record = {
                "step": step,
                "accuracy": accuracy,
                "n": len(correct),
                "prompts": [ex.prompt for ex in self.examples],
                "correct": correct,
            }
            if proxy is not None:
                record.update(rm_score=self.fields["eval_rm_score"], rm_scores=proxy)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return accuracy

    def _results(self, model, tokenizer) -> tuple[list[int], list[float] | None]:
        import torch.distributed as tdist

        args = (model, tokenizer, self.task)
        ws = tdist.get_world_size() if tdist.is_available() and tdist.is_initialized() else 1
        if ws == 1 or len(self.examples) < ws:  # too few prompts to share: every rank decodes all
            return greedy_results(*args, self.examples, self.max_new_tokens, self.rewards, self.proxy)

        rank = collective.rank()
        share = greedy_results(*args, self.examples[rank::ws], self.max_new_tokens, self.rewards, self.proxy)
        shares: list[tuple | None] = [None] * ws
        tdist.all_gather_object(shares, share)
        correct: list[int] = [0] * len(self.examples)
        proxy: list[float] | None = None if self.proxy is None else [0.0] * len(self.examples)
        for r, (got, got_proxy) in enumerate(shares):
            correct[r::ws] = got
            if proxy is not None:
                proxy[r::ws] = got_proxy
        return correct, proxy

    def keep_until(self, step: int) -> None:
        """Drop the records after `step` (a resumed run evaluates those steps again); writer only."""
        if not self.write or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
        atomic_write_text(self.path, "".join(lines))

    def start(self) -> None:
        """A fresh run: no records of an older run in this folder (the writer removes them)."""
        if self.write:
            Path(self.path).unlink(missing_ok=True)


def read_evals(run_dir: str) -> list[dict]:
    """The eval.jsonl records of a run, oldest first ([] if it has none)."""
    path = RunFolder(run_dir).eval
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@torch.no_grad()
def exact_kl(
    policy,
    reference,
    rollout,
    *,
    temperature: float,
    max_elements: int = 2**24,
) -> tuple[Tensor, Tensor]:
    """Per-token KL(π_θ(·|s_t) ‖ π_ref(·|s_t)) over the full vocabulary at each response position [B,T],
    and the reference's log-probs of the sampled tokens [B,T] from the same forward (so the loop
    needs no second reference forward for `ref_logp`).

    Same temperature scaling as the sampler's log-probs. π_θ's side comes from
    `rollout.policy_logp_all` [B,T,V] when the rollout carries it: the log-softmax the sampler drew
    each token from (the HF samplers keep it when asked and drop it from a stale rollout, so it is
    `policy`'s own). Then only the reference runs a forward, and the KL equals the two-forward one up
    to the float difference between a KV-cached decode and one full forward
    (tests/loop/test_evaluation.py; in bf16 that rounding is ~1e-6 per token, so a step-1 KL is not
    exactly 0), and `policy` is not called. Without it, `policy` runs a no-grad forward.

    Memory: where both models' output projections can be fused and the logits exceed one chunk
    (`fused_logprobs.output_projection`, `fuses`), each model runs one forward over the whole batch
    that stops at its hidden states, and the logits are made a chunk of positions at a time from them
    (HeadLogits), each chunk giving its KL (`kl.full`) and the reference's log-probs: no [B,T,V]
    logits are made (the sampler's kept distributions, when the rollout carries them, are at most
    2^25 values), the body's matmuls see the whole batch, and each output projection runs once per position.
    Otherwise rows are processed in chunks of at most `max_elements / (T·V)` rows, so memory is O(B·T)
    for the result plus one chunk's logits (plus the rollout's own [B,T,V] distributions when it
    carries them). Zero where the rollout's mask is 0.
    """
    b, t = rollout.response_ids.shape
    policy_logp_all = rollout.policy_logp_all
    vocab = int(getattr(reference.config, "vocab_size", 1) or 1)
    if policy_logp_all is not None and (policy_logp_all.dim() != 3 or policy_logp_all.shape[:2] != (b, t)):
        raise ShapeError(
            f"exact_kl: rollout.policy_logp_all must be [B,T,V] with [B,T]=[{b},{t}] (the rollout's), "
            f"got {list(policy_logp_all.shape)}"
        )
    ref_head = output_projection(reference)
    pol_head = None if policy_logp_all is not None else output_projection(policy)
    if fuses(ref_head, b * t) and (policy_logp_all is not None or pol_head is not None):
        return _exact_kl_from_hidden(policy, reference, rollout, temperature, ref_head, pol_head)
    rows_per_chunk = max(1, max_elements // max(1, t * vocab))
    out, ref_logp = [], []
    for rows in torch.arange(b).split(rows_per_chunk):
        ids = (rollout.prompt_ids[rows], rollout.prompt_mask[rows], rollout.response_ids[rows])
        ref = hf_rollout.response_logprobs(reference, *ids, temperature=temperature, return_logits=True)
        if policy_logp_all is None:
            pol = hf_rollout.response_logprobs(policy, *ids, temperature=temperature, return_logits=True)
            pol_logp, pol_logits = pol.logp, pol.logits
        else:  # log_softmax of a log-softmax is itself: the sampler's distribution serves as logits
            pol_logits = policy_logp_all[rows].to(ref.logits.dtype)
            pol_logp = pol_logits.gather(-1, ids[2][..., None]).squeeze(-1)
        mask = rollout.mask[rows].to(pol_logp.dtype)
        out.append(exact_kl_part(pol_logp, ref.logp, mask, logits=pol_logits, ref_logits=ref.logits))
        ref_logp.append(ref.logp)
    return torch.cat(out).double(), torch.cat(ref_logp)


def _exact_kl_from_hidden(
    policy, reference, rollout, temperature, ref_head, pol_head
) -> tuple[Tensor, Tensor]:
    """`exact_kl` from each model's last hidden states (one forward each over the whole batch), the
    logits of a chunk of positions at a time: per chunk the KL (`kl.full`, the part's own formula)
    and the reference's log-probs of the sampled tokens."""
    b, t = rollout.response_ids.shape
    ids, attn, pos = hf_rollout.sequence_inputs(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids)

    def rows_of(model, head) -> HeadLogits:
        hidden = head_inputs(model, head, ids, attn, pos, t + 1)[:, :-1]
        return HeadLogits(hidden, head.weight, head.bias, temperature)

    ref_rows = rows_of(reference, ref_head)
    if rollout.policy_logp_all is not None:  # the sampler's log-softmax serves as logits
        pol_rows = TensorLogits(rollout.policy_logp_all.to(ref_rows.dtype))
    else:
        pol_rows = rows_of(policy, pol_head)
    targets = rollout.response_ids.reshape(-1)
    mask = rollout.mask.reshape(1, -1).to(ref_rows.dtype)
    n = b * t
    device = rollout.response_ids.device
    kl = torch.empty(n, dtype=ref_rows.dtype, device=device)
    ref_logp = torch.empty(n, dtype=ref_rows.dtype, device=device)
    step = chunk_rows(ref_rows.shape[2])
    for s in range(0, n, step):
        e = min(s + step, n)
        zq = ref_rows.rows(s, e)
        ref_logp[s:e] = torch.log_softmax(zq, dim=-1).gather(-1, targets[s:e, None]).squeeze(-1)
        unused = zq.new_zeros(1, e - s)  # kl.full reads the logits, not the log-probs
        part = exact_kl_part(
            unused, unused, mask[:, s:e], logits=pol_rows.rows(s, e)[None], ref_logits=zq[None]
        )
        kl[s:e] = part[0]
    return kl.view(b, t).double(), ref_logp.view(b, t)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the valid tokens of every rank (sample variances)."""
    valid = mask.bool()
    n, _, var_r = collective.moments(returns[valid].double(), ddof=1)
    _, _, var_d = collective.moments((returns[valid] - values[valid]).double(), ddof=1)
    if n < 2:
        return math.nan
    var_r, var_d = float(var_r), float(var_d)
    return 1.0 - var_d / var_r if var_r > 0 else math.nan
