"""Composition overhead: the composed `Algorithm.loss` vs one hand-fused GRPO loss function."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from benchmarks.numerics import fused_grpo_loss, grpo_algorithm, loss_inputs
from benchmarks.timing import median
from benchmarks.workload import Workload


def composition_overhead(
    b: int = 64, t: int = 512, blocks: int = 150, block: int = 5, threads: int = 2, seed: int = 0
) -> list[dict[str, Any]]:
    """Time composed `Algorithm.loss` vs `fused_grpo_loss` (with the same metrics, and loss-only).

    Forward only and forward + backward (gradient w.r.t. logp), float64 as in the trainer. The three
    variants are interleaved finely so that machine drift cancels: `blocks` rounds, each running every
    variant for `block` calls (order rotated per round). Per round the ratio composed / fused is taken;
    reported are the median per-call times and the median (and 10th/90th percentile) of the ratios.
    """
    import gin
    import torch

    torch.set_num_threads(threads)
    try:
        return _composition_timings(grpo_algorithm(), b, t, blocks, block, threads, seed)
    finally:
        gin.clear_config()


def _quantile(xs: Sequence[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, round(q * (len(ys) - 1))))]


def _composition_timings(algo, b: int, t: int, blocks: int, block: int, threads: int, seed: int):
    from polgrad.registry import StepCounts

    x = loss_inputs(b, t, seed)
    counts = StepCounts.of_step([x["mask"]])
    leaf = x["logp"].clone().requires_grad_(True)

    def composed(backward: bool):
        loss, _, _ = algo.loss({**x, "logp": leaf}, counts, kl_coef=algo.kl_coef)
        if backward:
            loss.backward()

    def fused(backward: bool, with_metrics: bool):
        loss, _ = fused_grpo_loss(
            leaf,
            x["old_logp"],
            x["ref_logp"],
            x["adv"],
            x["mask"],
            x["entropy"],
            num_tokens=counts.num_tokens,
            num_seqs=counts.num_seqs,
            with_metrics=with_metrics,
        )
        if backward:
            loss.backward()

    variants = {
        "composed": composed,
        "fused_same_metrics": lambda bw: fused(bw, True),
        "fused_loss_only": lambda bw: fused(bw, False),
    }
    names = list(variants)
    out = []
    for backward in (False, True):
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn in variants.values():  # warm-up
            for _ in range(10):
                fn(backward)
        for r in range(blocks):
            for name in names[r % 3 :] + names[: r % 3]:
                fn = variants[name]
                t0 = time.perf_counter()
                for _ in range(block):
                    fn(backward)
                times[name].append((time.perf_counter() - t0) / block)
        same = [c / f for c, f in zip(times["composed"], times["fused_same_metrics"], strict=True)]
        only = [c / f for c, f in zip(times["composed"], times["fused_loss_only"], strict=True)]
        out.append(
            {
                "B": b,
                "T": t,
                "pass": "forward+backward" if backward else "forward",
                "composed_us": median(times["composed"]) * 1e6,
                "fused_same_metrics_us": median(times["fused_same_metrics"]) * 1e6,
                "fused_loss_only_us": median(times["fused_loss_only"]) * 1e6,
                "ratio_vs_same_metrics": median(same),
                "ratio_vs_same_metrics_p10": _quantile(same, 0.1),
                "ratio_vs_same_metrics_p90": _quantile(same, 0.9),
                "ratio_vs_loss_only": median(only),
                "ratio_vs_loss_only_p10": _quantile(only, 0.1),
                "ratio_vs_loss_only_p90": _quantile(only, 0.9),
                "blocks": blocks,
                "calls_per_block": block,
                "threads": threads,
            }
        )
    return out


def composition_worker(
    w: Workload, model_dir: str, work_dir: str, b: int = 64, t: int = 512, blocks: int = 150
) -> list[dict[str, Any]]:
    return composition_overhead(b, t, blocks=blocks, threads=w.threads, seed=w.seed)
