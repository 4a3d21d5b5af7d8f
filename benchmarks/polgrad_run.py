"""polgrad's side of the comparison: `polgrad.train.run` on the bench workload, timed by its hooks.

polgrad is never patched: the trainer and the HF rollout announce their phases through
`polgrad.hooks`, and a listener maps them onto the bench's phases (HOOK_PHASES).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from benchmarks.timing import PhaseClock, median, summarise
from benchmarks.workload import POLGRAD_METRIC_PHASES, Workload, grpo_bindings

# polgrad hook path -> bench phase. The trainer's "sample" phase is the whole rollout call (the
# bench's `gen`), the rollout's "decode" inside it the sampling loop alone (the bench's `sample`).
# Paths not listed count towards `other`; "eval" and everything nested in it ("eval/decode") run
# outside the measured steps' phases, as evaluation is not part of a training step.
HOOK_PHASES = {
    "sample": "gen",
    "sample/decode": "sample",
    "reward": "reward",
    "ref": "ref",
    "policy_fwd": "policy_fwd",
    "loss": "loss",
    "backward": "backward",
    "optim": "optim",
}


def hook_listeners(clock: PhaseClock):
    """(on_phase, on_event) for `polgrad.hooks.listen`: each "step" event opens a bucket of `clock`."""

    def on_phase(path: str, seconds: float) -> None:
        name = HOOK_PHASES.get(path)
        if name is not None:
            clock.add(name, seconds)

    def on_event(name: str) -> None:
        if name == "step":
            clock.new_step()

    return on_phase, on_event


def polgrad_bindings(w: Workload, model_dir: str, steps: int) -> list[str]:
    """gin bindings on top of experiments/base_tiny.gin + registry/grpo.gin for the bench workload."""
    return [
        f"train.policy_path = '{model_dir}'",
        "task.add.digits = 2",
        "task.add.partial = True",
        f"train.prompts_per_step = {w.prompts}",
        f"MAX_NEW_TOKENS = {w.max_new_tokens}",
        f"train.max_new_tokens = {w.max_new_tokens}",
        f"train.steps = {steps}",
        "train.temperature = 1.0",
        "train.top_p = 1.0",
        f"train.lr = {w.lr!r}",
        f"train.grad_clip = {w.grad_clip!r}",
        f"train.micro_batch_size = {w.batch}",
        f"train.threads = {w.threads}",
        f"train.bf16 = {w.bf16}",
        f"train.gradient_checkpointing = {w.gradient_checkpointing}",
        f"train.seed = {w.seed}",
        "train.eval_every = 1000000000",  # eval still runs after the last step, which is not measured
        "train.eval_size = 1",
        "train.checkpoint_every = 1000000000",
        "Algorithm.ppo_epochs = 1",
        "Algorithm.minibatches = 1",
        *grpo_bindings(w),
    ]


def run_polgrad(w: Workload, model_dir: str, work_dir: str, compile: bool = False) -> dict[str, Any]:
    """`polgrad.train.run` in this process for warmup + steps + 1 steps; timings of the measured ones,
    and `startup_s`: from the run's start (after its warm start) to the end of the last warm-up step.
    `compile`: with train.compile = True (benchmarks/compile_bench.py)."""
    import gin
    import torch

    from polgrad import hooks
    from polgrad.config import parse_config
    from polgrad.results import read_metrics
    from polgrad.train import run as train

    torch.set_num_threads(w.threads)
    steps = w.warmup + w.steps + 1  # the last step also runs the (unmeasured) final eval
    gin.clear_config()
    bindings = polgrad_bindings(w, model_dir, steps) + (["train.compile = True"] if compile else [])
    parse_config(["registry/grpo.gin"], bindings)
    clock = PhaseClock()
    on_phase, on_event = hook_listeners(clock)
    out = os.path.join(work_dir, "polgrad-run")
    with hooks.listen(on_phase=on_phase, on_event=on_event):
        train(out, progress=False)
    gin.clear_config()
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    if len(clock.steps) != len(rows):
        raise RuntimeError(f"{len(clock.steps)} 'step' events for {len(rows)} metrics rows")
    ends = [r["time_s"] for r in rows]
    # interval k (0-based step k >= 1) = ends[k] - ends[k-1]; measured steps warmup .. warmup+steps-1
    idx = list(range(w.warmup, w.warmup + w.steps))
    intervals = [ends[k] - ends[k - 1] for k in idx]
    tokens = [rows[k]["response_len"] * w.batch for k in idx]
    res = summarise("polgrad", w, intervals, [clock.steps[k] for k in idx], tokens)
    res["metrics_phases"] = {p: median([rows[k][p] for k in idx]) for p in POLGRAD_METRIC_PHASES}
    res["min_tokens_per_completion"] = min(rows[k]["response_len"] for k in idx)
    res["startup_s"] = ends[w.warmup - 1]
    # One epoch of one minibatch: the update's ratio is trainer / sampler log-probs of the same
    # weights, so its approx_kl is the sampler/trainer mismatch (fp32 ~1e-14; bf16: rounding).
    res["approx_kl"] = median([rows[k]["clip/approx_kl"] for k in idx])
    shutil.rmtree(out, ignore_errors=True)
    return res
