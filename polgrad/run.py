"""What a run holds around the RL step: its models, its loop state and checkpoints, its summary.

`polgrad.trainer.train` uses these; the step itself (collect, advantages, update, log) is in
polgrad/trainer.py, readable top to bottom.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import gin
import torch
from torch import Tensor

from polgrad import config, export, hooks, models, pretrain
from polgrad import distributed as dist_lib
from polgrad.algorithm import Algorithm
from polgrad.evaluation import Evaluator, read_evals
from polgrad.io import atomic_write_text
from polgrad.rollout import hf as hf_rollout

SUMMARY_LAST_K = 5  # final_train_reward: mean over the last k steps


# --------------------------------------------------------------------------- 1. models
@dataclasses.dataclass
class Models:
    """The run's models: the policy's DeepSpeed engine and whatever else the parts need (else None)."""

    engine: Any
    tokenizer: Any
    reference: torch.nn.Module | None = None
    critic: Any = None  # the critic's DeepSpeed engine
    reward_model: torch.nn.Module | None = None
    rm_accuracy: float | None = None  # the reward model's held-out pairwise accuracy
    vllm: Any = None  # a vLLM sampler that gets the policy's weights after every step

    def sample(self, examples, **kwargs) -> hf_rollout.Rollout:
        if self.vllm is not None:
            return self.vllm.generate(examples, **kwargs)
        return hf_rollout.generate(self.engine.module, self.tokenizer, examples, **kwargs)

    def score(self, rollout: hf_rollout.Rollout, task) -> Tensor:
        """One scalar per sequence [B] float64: the reward model's, else the task's verifier's."""
        if self.reward_model is not None:
            return hf_rollout.rollout_scores(self.reward_model, rollout).double()
        return torch.tensor(
            [task.reward(ex, txt) for ex, txt in zip(rollout.examples, rollout.texts, strict=True)],
            dtype=torch.float64,
        )


def build_models(cfg: config.TrainConfig, algo: Algorithm, task) -> Models:
    """Policy (built and warm-started by cached SFT unless train.policy_path), then what the parts need."""
    policy_path = cfg.policy_path
    if policy_path is None:
        sft = {} if cfg.sft_steps is None else {"sft_steps": cfg.sft_steps}
        policy_path = pretrain.warm_start(
            cfg.task_name,
            cfg.task_kwargs(),
            cfg.model_kwargs,
            seed=cfg.init_seed,
            progress=cfg.progress,
            **sft,
        )
    policy, tokenizer = models.load_policy(policy_path), models.load_tokenizer(policy_path)
    # A reward model is trained (cached) when it scores the responses or initialises the critic.
    rm_path, rm_accuracy, reward_model = None, None, None
    if cfg.reward_source == "reward_model" or algo.needs_reward_model:
        rm = {} if cfg.rm_steps is None else {"steps": cfg.rm_steps}
        rm_path, rm_accuracy = pretrain.train_reward_model(
            policy_path, task, seed=cfg.init_seed, progress=cfg.progress, **rm
        )
    if cfg.reward_source == "reward_model":
        reward_model = models.load_reward_model(rm_path)
    reference = models.load_reference(policy_path) if (algo.needs_reference or cfg.measure_kl) else None
    if reference is not None and cfg.bf16:
        # The policy's engine module at step 0, exactly (KL 0, as in fp32): DeepSpeed's bf16 casts
        # the parameters only (buffers such as RoPE's inv_freq stay fp32, as in a bf16 HF load).
        for p in reference.parameters():
            p.data = p.data.to(torch.bfloat16)
    critic = (
        algo.value_init(policy_path=policy_path, reward_model_path=rm_path) if algo.needs_critic else None
    )

    ds = dict(
        zero_stage=cfg.zero_stage,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=1,
        bf16=cfg.bf16,
        grad_clip=cfg.grad_clip,
    )
    engine = dist_lib.make_engine(policy, lr=cfg.lr, eps=cfg.adam_eps, **ds)
    critic_engine = None
    if critic is not None:
        critic_engine = dist_lib.make_engine(critic, lr=cfg.critic_lr, eps=cfg.adam_eps, **ds)
    vllm = None
    if cfg.rollout_backend == "vllm":
        from polgrad.rollout.vllm import VLLMRollout  # optional extra: imported only when chosen

        vllm = VLLMRollout(policy_path, seed=cfg.seed)
    return Models(engine, tokenizer, reference, critic_engine, reward_model, rm_accuracy, vllm)


# --------------------------------------------------------------------------- 2. loop state
@dataclasses.dataclass(frozen=True)
class LoopState:
    """What the loop carries from step to step and saves in checkpoints."""

    step: int = 0  # steps done
    kl_coef: float = 0.0  # the KL coefficient of the next step
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient


def start_or_resume(
    cfg: config.TrainConfig, algo: Algorithm, m: Models, out_dir: str, evaluate: Evaluator
) -> LoopState:
    """The loop state at the spec's initial KL coefficient, or the last checkpoint's with `resume`.

    A fresh run evaluates its starting policy (step 0) first; a resumed one keeps the evaluations
    its checkpoint covers. Only the writing rank (rank 0, `evaluate.write`) touches the run's files."""
    state, writer = LoopState(kl_coef=algo.kl_coef), evaluate.write
    ckpt = os.path.join(out_dir, "checkpoints")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if cfg.resume and dist_lib.has_checkpoint(os.path.join(ckpt, "policy")):
        # Our counters live under one key: DeepSpeed keeps its own (e.g. 'skipped_steps') beside them.
        saved = dist_lib.load_checkpoint(m.engine, os.path.join(ckpt, "policy"))["polgrad"]
        if m.critic is not None:
            dist_lib.load_checkpoint(m.critic, os.path.join(ckpt, "critic"))
        state = LoopState(step=saved["step"], kl_coef=saved["kl_coef"], skipped_steps=saved["skipped_steps"])
        if writer:
            _truncate_metrics(metrics_path, state.step)
        evaluate.keep_until(state.step)
        if m.vllm is not None:
            m.vllm.sync_weights(m.engine.module)
    elif writer:
        Path(metrics_path).unlink(missing_ok=True)  # a fresh run never appends to an older run's metrics
    export.save_run_model_files(m, out_dir, algo.name, algo.source)  # what polgrad.export needs
    if state.step == 0:
        if writer:
            with open(os.path.join(out_dir, "config.gin"), "w") as f:
                f.write(gin.config_str())
        evaluate.start()
        with hooks.phase("eval"):
            evaluate(m.engine.module, m.tokenizer, 0)
    return state


def save_checkpoint(m: Models, out_dir: str, state: LoopState) -> None:
    client_state = {"polgrad": dataclasses.asdict(state)}
    ckpt, tag = os.path.join(out_dir, "checkpoints"), f"step{state.step}"
    dist_lib.save_checkpoint(m.engine, os.path.join(ckpt, "policy"), tag, client_state)
    if m.critic is not None:
        dist_lib.save_checkpoint(m.critic, os.path.join(ckpt, "critic"), tag, client_state)


def summarize(out_dir: str, wall_time_s: float) -> dict[str, Any]:
    """The run's summary: means over the last steps, the last and the starting eval accuracy."""
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    init = [e["accuracy"] for e in read_evals(out_dir) if e["step"] == 0]
    last = rows[-SUMMARY_LAST_K:]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in last if key in r]
        return float(sum(vals) / len(vals)) if vals else None

    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    return {
        "status": "ok",
        "steps": len(rows),
        "final_train_reward": mean("reward_mean"),
        "eval_accuracy": evals[-1] if evals else None,
        "eval_accuracy_init": init[0] if init else None,
        "kl": mean("kl"),
        "kl_exact": mean("kl_exact"),
        "entropy": mean("entropy"),
        "tokens_per_s": mean("tokens_per_s"),
        "wall_time_s": wall_time_s,
        "peak_mem_mb": max((r.get("peak_mem_mb", 0.0) for r in rows), default=None),
        "skipped_steps": rows[-1].get("skipped_steps", 0) if rows else 0,
    }


def _truncate_metrics(path: str, steps: int) -> None:
    """Keep the first `steps` rows (those the checkpoint covers); a resumed run rewrites the rest."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip()][:steps]
    atomic_write_text(path, "".join(rows))


def _progress(it, *, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, unit="step", dynamic_ncols=True)
