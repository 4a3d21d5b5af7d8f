"""TRL's side of the comparison: `trl.GRPOTrainer` on the bench workload, timed by wrapping its functions.

TRL has no phase hooks, so the worker wraps the trainer's own methods (`_generate`, `model.generate`,
`_calculate_rewards`, `_get_per_token_logps_and_entropies`, `compute_loss`, `accelerator.backward`)
for the duration of the run; TRL's source is not changed.
"""

from __future__ import annotations

import os
import time
from typing import Any

from benchmarks.timing import PhaseClock, patched, summarise
from benchmarks.workload import Workload, bench_task


def trl_config(w: Workload, out_dir: str, steps: int):
    """The GRPOConfig of the bench workload (CPU, no vLLM, no logging, no saving).

    With `w.bf16`, TRL's own `bf16=True`: the model stays fp32 (fp32 master weights and AdamW state,
    as polgrad's train.bf16) and Accelerate runs its forwards, generation included, under bf16 autocast.
    """
    import torch
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        use_vllm=False,
        model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"},
        per_device_train_batch_size=w.batch,
        gradient_accumulation_steps=1,
        num_generations=w.group_size,
        max_completion_length=w.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=w.beta,
        # TRL >= 1.x multiplies the k3 term by the (differentiable) ratio by default, which changes the
        # KL gradient even on-policy; GRPO as in registry/grpo.gin (and DeepSeekMath) adds plain k3.
        use_bias_correction_kl=False,
        epsilon=w.clip_eps,
        loss_type="grpo",
        scale_rewards="group",
        num_iterations=1,
        learning_rate=w.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=w.grad_clip,
        bf16=w.bf16,
        fp16=False,
        # TRL's default is True; the bench gives both frameworks the workload's setting (polgrad's
        # default, False, in the headline)
        gradient_checkpointing=w.gradient_checkpointing,
        **quiet_args(w, steps),
    )


def quiet_args(w: Workload, steps: int) -> dict[str, Any]:
    """What every TRL trainer of the bench is given alike: `steps` optimizer steps, the workload's seed,
    and no logging, checkpoints, trackers, progress bars or data-loader workers."""
    return dict(
        max_steps=steps,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        log_completions=False,
        seed=w.seed,
        dataloader_num_workers=0,
    )


def _trl_reward_fn(task):
    from polgrad.tasks.base import Example

    def reward(prompts, completions, answer, **kwargs):
        return [task.reward(Example(p, a), c) for p, c, a in zip(prompts, completions, answer, strict=True)]

    return reward


def run_trl(w: Workload, model_dir: str, work_dir: str) -> dict[str, Any]:
    """TRL's GRPOTrainer in this process for warmup + steps steps; timings of the measured ones."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(w.threads)
    steps = w.warmup + w.steps
    task = bench_task()
    examples = task.examples("train", w.prompts * steps, seed=w.seed)
    dataset = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    clock = PhaseClock()
    last_backward_end = [0.0]
    lengths: list[tuple[float, float]] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.new_step()

        def on_optimizer_step(self, args, state, control, **kwargs):
            clock.add("optim", time.perf_counter() - last_backward_end[0])

        def on_step_end(self, args, state, control, **kwargs):
            clock.step_ends.append(time.perf_counter())
            # TRL's log() clears _metrics: read this step's completion lengths now
            m = trainer._metrics["train"]
            lengths.append((m["completions/mean_length"][-1], m["completions/min_length"][-1]))

    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=_trl_reward_fn(task),
        args=trl_config(w, os.path.join(work_dir, "trl-run"), steps),
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Timer()],
    )
    torch.set_num_threads(w.threads)

    def backward(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return orig_backward(*args, **kwargs)
        finally:
            last_backward_end[0] = time.perf_counter()
            clock.add("backward", last_backward_end[0] - t0)

    orig_backward = trainer.accelerator.backward
    ref = trainer.ref_model
    patches = [
        (trainer, "_generate", clock.timed("gen", trainer._generate)),
        (trainer.model, "generate", clock.timed("sample", trainer.model.generate)),
        (trainer, "_calculate_rewards", clock.timed("reward", trainer._calculate_rewards)),
        (
            trainer,
            "_get_per_token_logps_and_entropies",
            clock.timed(
                lambda model, *a, **k: "ref" if model is ref else "policy_fwd",
                trainer._get_per_token_logps_and_entropies,
            ),
        ),
        (trainer, "compute_loss", clock.timed("loss", trainer.compute_loss)),
        (trainer.accelerator, "backward", backward),
    ]
    with patched(patches):
        trainer.train()
    ends = clock.step_ends
    idx = list(range(w.warmup, steps))
    intervals = [ends[k] - ends[k - 1] for k in idx]
    buckets = []
    for k in idx:
        b = dict(clock.steps[k])
        b["loss"] = b.get("loss", 0.0) - b.get("policy_fwd", 0.0)  # compute_loss includes the forward
        buckets.append(b)
    tokens = [lengths[k][0] * w.batch for k in idx]
    res = summarise("trl", w, intervals, buckets, tokens)
    res["min_tokens_per_completion"] = min(lengths[k][1] for k in idx)
    res["optimizer"] = str(trainer.args.optim)
    return res


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no TRL side
        return False
    return True
