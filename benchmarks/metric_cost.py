"""`python -m benchmarks.bench --only metrics`: what each per-step metric costs polgrad's step.

Issue 25's goal: no metric costs more than 2% of a step. Each metric's cost is the time of the
code that computes it, measured in one worker process on the bench workload's own batch (the
`--preset` model, prompts x G rows of exactly L tokens), as the difference of two timings of the
same work with and without the metric, interleaved, median over `repeats`:

    kl_exact        keeping the sampler's distributions (decode with vs without them) + the KL over
                    the vocabulary (`exact_kl` with them vs the reference forward it needs anyway)
    kl_exact, before  the separate no-grad policy forward it ran until then (`exact_kl` without the
                    distributions vs the reference forward alone): the cost the change removed
    entropy         the entropy of the training forward (forward + backward with vs without it)
    the row         `trainer.step_row`: reward, length, KL and accuracy statistics of the batch

and divided by polgrad's own s/step of the same workload (one `polgrad` worker run in the same
bench call). Small differences of two timings are noisy on a shared machine: the table gives the
spread (min to max over the repeats) beside each median.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.timing import median
from benchmarks.workload import Workload


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def metric_cost(w: Workload, model_dir: str, work_dir: str, repeats: int = 21) -> dict[str, Any]:
    """The worker: seconds of each metric's computation (module docstring), `repeats` interleaved times."""
    import dataclasses

    import torch

    from polgrad import registry, trainer
    from polgrad.batch import Batch
    from polgrad.build import Models
    from polgrad.evaluation import exact_kl
    from polgrad.loop_state import LoopState
    from polgrad.models import load_policy, load_tokenizer
    from polgrad.reference import FrozenReference
    from polgrad.rollout import hf

    torch.manual_seed(w.seed)
    policy = load_policy(model_dir)
    reference = load_policy(model_dir)
    if w.bf16:
        policy, reference = policy.to(torch.bfloat16), reference.to(torch.bfloat16)
    tok = load_tokenizer(model_dir)
    task = registry.get("task", "add")(digits=2, partial=True)
    examples = task.examples("train", w.prompts, seed=w.seed)
    kw = dict(
        group_size=w.group_size, max_new_tokens=w.max_new_tokens, generator_seed=w.seed, temperature=1.0
    )
    rollout = hf.generate(policy, tok, examples, keep_distribution=True, **kw)
    without = dataclasses.replace(rollout, policy_logp_all=None)

    def sample(keep: bool):
        return lambda: hf.generate(policy, tok, examples, keep_distribution=keep, **kw)

    def ref_only():
        with torch.no_grad():
            hf.response_logprobs(reference, rollout, return_logits=True)

    def kl(with_dist: bool):
        def go():
            with torch.no_grad():
                exact_kl(policy, reference, rollout if with_dist else without, temperature=1.0)

        return go

    def train_pass(entropy: bool):
        def go():
            out = hf.response_logprobs(policy, rollout, with_entropy=entropy)
            logp = out.logp if entropy else out
            (logp * rollout.mask).sum().backward()
            policy.zero_grad(set_to_none=True)

        return go

    scores = torch.tensor([task.reward(ex, t) for ex, t in zip(rollout.examples, rollout.texts, strict=True)])
    mask = rollout.mask.double()
    with torch.no_grad():
        kl_tok, ref_logp = exact_kl(policy, reference, rollout, temperature=1.0)
    batch = Batch(
        mask=mask,
        group_ids=rollout.group_ids,
        old_logp=rollout.rollout_logp.double(),
        scores=scores,
        truncated=rollout.truncated,
        rollout_logp=rollout.rollout_logp.double(),
        ref_logp=ref_logp.double(),
        kl_exact=kl_tok,
        rollout=rollout,
    )
    # the run's bundle with a frozen reference: the row holds the KL metrics, as a GRPO step's does
    models = Models(engine=None, tokenizer=None, sampler=None, reference=FrozenReference(reference))
    state = LoopState(step=1, kl_coef=w.beta, skipped_steps=0)

    def row():
        trainer.step_row(models, batch, batch, state, {}, {})

    work = {
        "sample": sample(False),
        "sample_keep": sample(True),
        "ref": ref_only,
        "kl_dist": kl(True),
        "kl_forward": kl(False),
        "train": train_pass(False),
        "train_entropy": train_pass(True),
        "row": row,
    }
    for fn in work.values():  # one untimed call each: allocator and kernel caches warm
        fn()
    times: dict[str, list[float]] = {k: [] for k in work}
    for r in range(repeats):
        for k in list(work) if r % 2 == 0 else reversed(list(work)):  # A B / B A
            times[k].append(_timed(work[k]))
    costs = {
        "kl_exact": [a - b + c - d for a, b, c, d in zip(
            times["sample_keep"], times["sample"], times["kl_dist"], times["ref"], strict=True)],
        "kl_exact, before (policy forward)": [
            a - b for a, b in zip(times["kl_forward"], times["ref"], strict=True)],
        "entropy": [a - b for a, b in zip(times["train_entropy"], times["train"], strict=True)],
        "the row (step_row)": times["row"],
    }  # fmt: skip
    return {
        "repeats": repeats,
        "times": {k: median(v) for k, v in times.items()},
        "costs": {k: {"median": median(v), "min": min(v), "max": max(v)} for k, v in costs.items()},
    }


WHERE = {
    "kl_exact": "the sampler's distributions + a KL over the vocabulary (the reference forward: ref_logp's)",
    "kl_exact, before (policy forward)": "a second, no-grad policy forward (polgrad until issue 25)",
    "entropy": "the training forward's log-softmax, no backward through it",
    "the row (step_row)": "sums over the batch (reward, length, accuracy, KL) and their all-reduce",
}


def metric_report(res: dict[str, Any], s_per_step: float, w: Workload) -> list[str]:
    """The per-metric cost table of summary.md / profile.md."""
    lines = [
        f"## What each metric costs ({w.prompts} prompts x G={w.group_size} x {w.max_new_tokens} tokens, "
        f"{w.precision}; {res['repeats']} interleaved repeats in one process)",
        "",
        f"polgrad's step in the same bench call: {s_per_step:.3f} s (median of its measured steps). "
        "Goal: no metric above 2% of it.",
        "",
        "| metric | computed from | cost, s/step (median; min to max) | % of the step | <= 2% |",
        "|---|---|---|---|---|",
    ]
    for name, c in res["costs"].items():
        share = 100 * c["median"] / s_per_step
        ok = "" if "before" in name else ("yes" if share <= 2 else "no")
        lines.append(
            f"| {name} | {WHERE[name]} | {c['median']:.4f} ({c['min']:.4f} to {c['max']:.4f}) "
            f"| {share:.1f}% | {ok} |"
        )
    return lines
