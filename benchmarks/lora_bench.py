"""`python -m benchmarks.bench --only lora`: PPO with full copies vs PPO with a shared LoRA, measured.

Both arms train the bench's random-init model (`--preset`) with polgrad's PPO on the same workload,
each in a fresh worker process, interleaved A B / B A:

    ppo_full   registry/ppo.gin: the policy, a frozen reference copy and a critic copy (backbone +
               value head), each trained model with its own AdamW state (3 copies of the weights,
               2 of them with fp32 Adam moments)
    ppo_lora   registry/ppo_lora.gin: one frozen backbone; the actor's LoRA adapter (r 4, alpha 32 on
               q_proj and v_proj), the reference = the adapter disabled, the critic = the actor's
               adapter + a value head (value_init.shared_lora): one copy of the weights, Adam state
               for the adapter and head only

Per run: seconds per step (median of the measured steps, as the GRPO compare), the worker's peak
RSS (its `ru_maxrss`, the whole process: Python, torch, DeepSpeed, the models), the trainable
parameter count. PPO samples one response per prompt, so each step takes `prompts x G` prompts to
train on as many sequences as the GRPO workload. Written to <out>/lora.csv (one row per round) and
a section of summary.md.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from benchmarks.timing import median, peak_rss_mb
from benchmarks.workload import Workload

ARMS = ("ppo_full", "ppo_lora")
SPECS = {"ppo_full": "registry/ppo.gin", "ppo_lora": "registry/ppo_lora.gin"}


def ppo_bindings(w: Workload, model_dir: str, steps: int) -> list[str]:
    """gin bindings of both arms: the bench model and task, prompts x G sequences per step."""
    return [
        f"train.policy_path = '{model_dir}'",
        "task.add.digits = 2",
        "task.add.partial = True",
        f"train.prompts_per_step = {w.prompts * w.group_size}",
        f"MAX_NEW_TOKENS = {w.max_new_tokens}",
        f"train.max_new_tokens = {w.max_new_tokens}",
        f"train.steps = {steps}",
        f"train.lr = {w.lr!r}",
        f"train.critic_lr = {w.lr!r}",
        f"train.grad_clip = {w.grad_clip!r}",
        f"train.micro_batch_size = {w.batch}",
        f"train.threads = {w.threads}",
        f"train.bf16 = {w.bf16}",
        f"train.seed = {w.seed}",
        "train.eval_every = 1000000000",
        "train.eval_size = 1",
        "train.checkpoint_every = 1000000000",
    ]


def run_ppo(w: Workload, model_dir: str, work_dir: str, arm: str) -> dict[str, Any]:
    """One arm's PPO run in this (fresh) process: s/step of the measured steps, peak RSS, parameters."""
    import gin
    import torch

    from polgrad.config import parse_config
    from polgrad.results import read_metrics
    from polgrad.train import run as train

    torch.set_num_threads(w.threads)
    steps = w.warmup + w.steps + 1  # the last step also runs the (unmeasured) final eval
    gin.clear_config()
    parse_config([SPECS[arm]], ppo_bindings(w, model_dir, steps))
    out = os.path.join(work_dir, f"{arm}-run")
    try:
        train(out, progress=False)
    finally:
        gin.clear_config()
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    ends = [r["time_s"] for r in rows]
    idx = list(range(w.warmup, w.warmup + w.steps))
    res = {
        "framework": arm,
        "s_per_step": median([ends[k] - ends[k - 1] for k in idx]),
        "peak_rss_mb": peak_rss_mb(),
        "reward_mean": median([rows[k]["reward_mean"] for k in idx]),
    }
    shutil.rmtree(out, ignore_errors=True)
    return res


def trainable_params(model_dir: str) -> dict[str, int]:
    """Each arm's trainable parameter count, counted here (in the parent, never in a measured worker):
    full = policy + critic (backbone + head); LoRA = the spec's adapter + the value head."""
    import gin

    from polgrad.config import parse_config
    from polgrad.models import ScalarHeadModel, load_policy, lora

    parse_config([SPECS["ppo_lora"]], [])
    try:
        cfg = lora.lora_config(
            r=gin.query_parameter("train.lora_r"),
            alpha=gin.query_parameter("train.lora_alpha"),
            target_modules=gin.query_parameter("train.lora_target_modules"),
            dropout=gin.query_parameter("train.lora_dropout"),
        )
    finally:
        gin.clear_config()
    policy = load_policy(model_dir)
    critic = ScalarHeadModel.from_backbone(model_dir)
    full = sum(p.numel() for p in policy.parameters()) + sum(p.numel() for p in critic.parameters())
    peft_model = lora.add_policy_adapter(policy, cfg)
    lora.add_critic(peft_model, own_adapter=False)
    return {"ppo_full": full, "ppo_lora": sum(p.numel() for p in peft_model.parameters() if p.requires_grad)}


def lora_rows(pairs: list[dict[str, Any]], trainable: dict[str, int]) -> list[dict[str, Any]]:
    """One CSV row per interleaved round: each arm's s/step, peak RSS and trainable parameters, and
    the ratios full / LoRA (RSS saved in MB too)."""
    rows = []
    for p in pairs:
        row: dict[str, Any] = {"pair": p["pair"], "order": p["order"], "load_before": p["load_before"]}
        for a in ARMS:
            for k in ("s_per_step", "peak_rss_mb"):
                row[f"{a}_{k}"] = p[a][k]
            row[f"{a}_trainable_params"] = trainable[a]
        full, lora = p["ppo_full"], p["ppo_lora"]
        row["rss_saved_mb"] = full["peak_rss_mb"] - lora["peak_rss_mb"]
        row["rss_full_over_lora"] = full["peak_rss_mb"] / lora["peak_rss_mb"]
        row["s_per_step_full_over_lora"] = full["s_per_step"] / lora["s_per_step"]
        row["load_after"] = p["load_after"]
        rows.append(row)
    return rows


def lora_report(rows: list[dict[str, Any]], n_params: int) -> list[str]:
    """summary.md's section: medians over the rounds, side by side."""

    def med(key: str) -> float:
        return median([float(r[key]) for r in rows])

    lines = [
        "## LoRA: PPO with full copies vs PPO with a shared LoRA (medians over the rounds)",
        "",
        f"{len(rows)} interleaved round(s), each arm in a fresh process; model {n_params} parameters.",
        "",
        "| arm | s/step | peak RSS MB | trainable parameters |",
        "|---|---|---|---|",
    ]
    for a, what in (("ppo_full", "registry/ppo.gin (policy, reference, critic copies)"),
                    ("ppo_lora", "registry/ppo_lora.gin (one backbone, shared adapter)")):  # fmt: skip
        lines.append(
            f"| {a}: {what} | {med(f'{a}_s_per_step'):.3f} | {med(f'{a}_peak_rss_mb'):.0f} | "
            f"{int(med(f'{a}_trainable_params'))} |"
        )
    lines += [
        "",
        f"peak RSS saved {med('rss_saved_mb'):.0f} MB (full / LoRA {med('rss_full_over_lora'):.2f}x); "
        f"s/step full / LoRA {med('s_per_step_full_over_lora'):.2f}x",
    ]
    return lines
