"""`python -m polgrad.bench`: a full polgrad GRPO step against TRL's GRPOTrainer on one CPU workload.

One command runs, interleaved A B / B A so that machine drift cancels within each pair:

    compare      polgrad (`polgrad.trainer.train`, registry/grpo.gin) vs TRL (`trl.GRPOTrainer`), >= 5 pairs
    numerics     one identical batch through TRL's `_compute_loss` and polgrad's `Algorithm.loss`
    composition  the composed `Algorithm.loss` vs one hand-fused GRPO loss function (same numbers)
    scaling      seconds per step vs group size G and vs completion length L, both frameworks

and writes results/bench/ (override with --out):

    grpo_vs_trl.csv        one row per interleaved pair: seconds per step, tokens/s (end to end and
                           sampling alone), peak RSS, phases, speedup = TRL s/step / polgrad s/step
                           (higher is better), load average before and after the pair
    grpo_vs_trl_runs.csv   one row per run (framework, pair, every step time, every phase median)
    numerics.json          polgrad vs TRL on one batch: loss functions, advantages, end to end
    composition.csv        composed vs fused loss timings (forward, forward+backward)
    scaling.csv            one row per run of the G and L sweeps
    summary.md             what the printout shows

The workload (defaults; flags change G, L, prompts, model size, threads, pairs, steps):
  model     one random-init Qwen2 from `polgrad.models.build_tiny` (hidden 128, 4 layers, 4 query / 2 kv
            heads, SwiGLU 256, tied embeddings: 594k parameters) and its character tokenizer, saved
            once with `save_pretrained`; both frameworks load policy and reference from it (fp32, sdpa).
  data      prompts of polgrad's `add` task (digits=2); 8 prompts x G=8 samples per step = 64 rows.
  sampling  temperature 1, top_p 1, no top_k, exactly L=32 new tokens per completion (EOS below).
  loss      GRPO: group advantages (r - mean) / (std + 1e-4), Bessel's std (TRL's eps; polgrad's spec
            is rebound to advantage.grpo.eps = 1e-4), PPO clip eps 0.2, KL beta 0.04 with k3 in the
            loss, seq-mean-token-mean aggregation (TRL loss_type="grpo"), one gradient step per batch
            (num_iterations=1, one minibatch, one micro-batch of all 64 rows). TRL runs with
            use_bias_correction_kl=False: its default multiplies k3 by the (differentiable) ratio,
            which changes the KL gradient even on-policy, so it is not GRPO's loss.
  optimiser AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay, constant LR, grad-norm clip
            1.0 (each framework's own AdamW: polgrad torch AdamW via DeepSpeed, TRL adamw_torch_fused).
  reward    the task's verifiable reward with partial credit (task.add.partial=True), the same
            function for both (so advantages are not all zero); its cost is negligible.
  threads   torch.set_num_threads(2) and OMP/MKL_NUM_THREADS=2 in each run's process, and
            OMP_WAIT_POLICY=PASSIVE (`--omp-wait-policy`): with libgomp's default spinning, a
            2-thread run stalls 5-20x whenever another process competes for the 2 cores (measured
            here), which swamps any comparison; passive waiting costs both frameworks alike on a
            quiet machine (~1.9x on every step) and keeps the ratio stable under load.

EOS: a random-init model emits its EOS token now and then, and the two frameworks would then stop
different rows at different times. To give both exactly L tokens per completion without touching
either framework's code, the saved tokenizer gets one extra special token `<|never|>` as its EOS,
with an id equal to the model's vocabulary size: no logit exists for it, so neither sampler can
ever draw it, and both decode exactly L tokens (the old `<|eos|>` id stays an ordinary token).
The bench checks that every completion has exactly L tokens on both sides. `--eos natural` keeps
the model's real EOS instead (same model and sampling distribution, so the same length
distribution in expectation; compare tokens/s then).

Timing: each run is a fresh subprocess (`python -m polgrad.bench --worker ...`; its peak RSS is its
own, and neither framework's global state leaks into the other). Seconds per step is the wall time
between the ends of consecutive optimizer steps, the first `--warmup` steps discarded, median over
the rest. Phases are timed by wrapping each framework's own functions inside the worker (no source
change): `sample` is the sampling loop alone (polgrad `rollout.hf._decode`, TRL `model.generate`),
`gen` the whole rollout function around it (tokenise, sample, decode text), then `reward`, `ref`
(reference log-probs), `policy_fwd` (policy forward with entropy), `loss` (the loss from
log-probs), `backward`, `optim` (grad clip + AdamW), and `other` = step - everything else.
polgrad's own metrics.jsonl phases (time_gen, time_ref, time_update, ...) are reported too.

The numbers are the machine's: 2 shared cores, so the bench never asserts a timing;
tests/test_bench.py checks the machinery and the loss identities only.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import inspect
import io
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from polgrad.results import atomic_write_text, read_metrics

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("polgrad", "trl")
TRL_PIN = "trl==1.16.0"  # the `bench` extra; tested with torch 2.13.0, transformers 5.19.0
NEVER_EOS = "<|never|>"
OMP_WAIT_POLICIES = ("passive", "active", "default")
# Phases timed in both frameworks (see the module docstring); `sample` is inside `gen`.
PHASES = ("gen", "sample", "reward", "ref", "policy_fwd", "loss", "backward", "optim", "other")
# polgrad's own per-step timings in metrics.jsonl.
POLGRAD_METRIC_PHASES = ("time_gen", "time_ref", "time_values", "time_adv", "time_update")


# ----------------------------------------------------------------------------------------------
# The workload
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """One benchmark configuration; the same for both frameworks."""

    prompts: int = 8
    group_size: int = 8
    max_new_tokens: int = 32
    threads: int = 2
    steps: int = 8  # measured optimizer steps per run
    warmup: int = 2  # steps discarded at the start of each run (>= 1)
    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 256
    lr: float = 1e-4
    beta: float = 0.04
    clip_eps: float = 0.2
    adv_eps: float = 1e-4  # TRL's constant in (r - mean) / (std + eps)
    grad_clip: float = 1.0
    seed: int = 0
    eos: str = "never"  # 'never': exactly max_new_tokens per completion; 'natural': the model's EOS
    omp_wait_policy: str = "passive"  # OMP_WAIT_POLICY of each run's process ('default': leave unset)

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"need warmup >= 1 and steps >= 1, got {self.warmup}, {self.steps}")
        if self.group_size < 2 or self.prompts < 1 or self.max_new_tokens < 1 or self.threads < 1:
            raise ValueError("need group_size >= 2, prompts >= 1, max_new_tokens >= 1, threads >= 1")
        if self.eos not in ("never", "natural"):
            raise ValueError(f"eos must be 'never' or 'natural', got {self.eos!r}")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ValueError(
                f"omp_wait_policy must be one of {OMP_WAIT_POLICIES}, got {self.omp_wait_policy!r}"
            )

    @property
    def batch(self) -> int:
        return self.prompts * self.group_size

    @property
    def model_kwargs(self) -> dict[str, int]:
        return dict(
            hidden=self.hidden,
            layers=self.layers,
            heads=self.heads,
            kv_heads=self.kv_heads,
            intermediate=self.intermediate,
        )

    def replace(self, **changes: Any) -> Workload:
        return Workload(**{**asdict(self), **changes})


def _task(partial: bool = True):
    import polgrad  # noqa: F401  (registers the built-in tasks)
    from polgrad.registry import get

    return get("task", "add")(digits=2, partial=partial)


def make_model(out_dir: str, w: Workload) -> dict[str, Any]:
    """Build the random-init tiny Qwen2 + char tokenizer once and save it to `out_dir`.

    With w.eos == 'never' the tokenizer's EOS becomes an id no logit exists for (module docstring).
    The context window is widened to hold the longest prompt plus max_new_tokens.
    """
    from polgrad import models

    task = _task()
    model, tok = models.build_tiny(task, seed=w.seed, **w.model_kwargs)
    need = 2 + int(task.max_prompt_chars) + w.max_new_tokens + 1
    model.config.max_position_embeddings = max(
        model.config.max_position_embeddings, 2 ** math.ceil(math.log2(need))
    )
    vocab = model.config.vocab_size
    if w.eos == "never":
        tok.add_special_tokens({"eos_token": NEVER_EOS})
        if tok.eos_token_id != vocab:
            raise RuntimeError(f"expected the new EOS id to be {vocab}, got {tok.eos_token_id}")
        # No EOS id in the model's configs: TRL stops on tokenizer EOS + generation_config EOS ids.
        model.config.eos_token_id = None
        model.generation_config.eos_token_id = None
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    return {"model_dir": out_dir, "n_params": n_params, "vocab": vocab, "eos_id": tok.eos_token_id}


# ----------------------------------------------------------------------------------------------
# Phase timing by wrapping functions (no framework source changes)
# ----------------------------------------------------------------------------------------------


class PhaseClock:
    """Per-step phase seconds: `new_step()` opens a bucket, `add(phase, dt)` accumulates into it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.step_ends: list[float] = []
        self.extra: dict[str, float] = {}

    def new_step(self) -> None:
        self.steps.append({})

    def add(self, phase: str, dt: float) -> None:
        if not self.steps:
            self.extra[phase] = self.extra.get(phase, 0.0) + dt
            return
        bucket = self.steps[-1]
        bucket[phase] = bucket.get(phase, 0.0) + dt

    def timed(self, phase: str | Callable[..., str | None], fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn` wrapped to add its wall time to `phase` (or to phase(*args, **kwargs); None: untimed)."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            name = phase(*args, **kwargs) if callable(phase) else phase
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if name is not None:
                    self.add(name, time.perf_counter() - t0)

        return wrapper


@contextlib.contextmanager
def _patched(patches: Sequence[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set obj.name = value for each patch; restore (or delete instance attributes) afterwards."""
    saved = []
    for obj, name, value in patches:
        had = name in vars(obj) if hasattr(obj, "__dict__") else True
        saved.append((obj, name, getattr(obj, name, None), had))
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, old, had in reversed(saved):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _summarise(
    framework: str, w: Workload, intervals: list[float], buckets: list[dict[str, float]], tokens: list[float]
) -> dict[str, Any]:
    """Medians over the measured steps (intervals[i] is the step whose phases are buckets[i])."""
    phase_rows = []
    for dt, b in zip(intervals, buckets, strict=True):
        row = {p: b.get(p, 0.0) for p in PHASES if p != "other"}
        row["other"] = dt - sum(v for p, v in row.items() if p != "sample")
        phase_rows.append(row)
    s_per_step = _median(intervals)
    tok = _median(tokens)
    sample_s = _median([r["sample"] for r in phase_rows])
    return {
        "framework": framework,
        "s_per_step": s_per_step,
        "step_times": intervals,
        "tokens_per_step": tok,
        "tokens_per_completion": tok / w.batch,
        "tokens_per_s": tok / s_per_step,
        "gen_tokens_per_s": tok / sample_s if sample_s > 0 else float("nan"),
        "phases": {p: _median([r[p] for r in phase_rows]) for p in PHASES},
        "peak_rss_mb": _peak_rss_mb(),
        "threads": _torch_threads(),
    }


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------
# polgrad
# ----------------------------------------------------------------------------------------------


def grpo_bindings(w: Workload) -> list[str]:
    """The bench's GRPO hyperparameters on top of registry/grpo.gin (shared by every bench part)."""
    return [
        f"Algorithm.group_size = {w.group_size}",
        f"Algorithm.kl_coef = {w.beta!r}",
        f"clip.ppo.eps_low = {w.clip_eps!r}",
        f"clip.ppo.eps_high = {w.clip_eps!r}",
        f"advantage.grpo.eps = {w.adv_eps!r}",
    ]


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
        f"train.seed = {w.seed}",
        "train.eval_every = 1000000000",  # eval still runs after the last step, which is not measured
        "train.eval_size = 1",
        "train.checkpoint_every = 1000000000",
        "Algorithm.ppo_epochs = 1",
        "Algorithm.minibatches = 1",
        *grpo_bindings(w),
    ]


def run_polgrad(w: Workload, model_dir: str, work_dir: str) -> dict[str, Any]:
    """`polgrad.trainer.train` in this process for warmup + steps + 1 steps; timings of the measured ones."""
    import gin
    import torch

    import polgrad.trainer as trainer_mod
    from polgrad import distributed as dist_lib
    from polgrad.algorithm import Algorithm
    from polgrad.config import parse_config
    from polgrad.rollout import hf as hf_rollout

    torch.set_num_threads(w.threads)
    steps = w.warmup + w.steps + 1  # the last step also runs the (unmeasured) final eval
    gin.clear_config()
    parse_config(["registry/grpo.gin"], polgrad_bindings(w, model_dir, steps))
    clock = PhaseClock()
    in_eval = [False]

    def gen_phase(*args, **kwargs):
        in_eval[0] = kwargs.get("group_size") == 1 and kwargs.get("temperature") == 0.0
        if in_eval[0]:
            return "eval"
        clock.new_step()
        return "gen"

    def logprob_phase(model, *args, **kwargs):
        return "policy_fwd" if next(model.parameters()).requires_grad else "ref"

    task_cls = type(_task())
    patches = [
        (hf_rollout, "generate", clock.timed(gen_phase, hf_rollout.generate)),
        (
            hf_rollout,
            "_decode",
            clock.timed(lambda *a, **k: None if in_eval[0] else "sample", hf_rollout._decode),
        ),
        (hf_rollout, "response_logprobs", clock.timed(logprob_phase, hf_rollout.response_logprobs)),
        (Algorithm, "loss", clock.timed("loss", Algorithm.loss)),
        (dist_lib, "backward", clock.timed("backward", dist_lib.backward)),
        (dist_lib, "step", clock.timed("optim", dist_lib.step)),
        (task_cls, "reward", clock.timed("reward", task_cls.reward)),
    ]
    out = os.path.join(work_dir, "polgrad-run")
    with _patched(patches):
        trainer_mod.train(out, progress=False)
    gin.clear_config()
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    ends = [r["time_s"] for r in rows]
    # interval k (0-based step k >= 1) = ends[k] - ends[k-1]; measured steps warmup .. warmup+steps-1
    idx = list(range(w.warmup, w.warmup + w.steps))
    intervals = [ends[k] - ends[k - 1] for k in idx]
    tokens = [rows[k]["response_len"] * w.batch for k in idx]
    res = _summarise("polgrad", w, intervals, [clock.steps[k] for k in idx], tokens)
    res["metrics_phases"] = {p: _median([rows[k][p] for k in idx]) for p in POLGRAD_METRIC_PHASES}
    res["min_tokens_per_completion"] = min(rows[k]["response_len"] for k in idx)
    shutil.rmtree(out, ignore_errors=True)
    return res


# ----------------------------------------------------------------------------------------------
# TRL
# ----------------------------------------------------------------------------------------------


def trl_config(w: Workload, out_dir: str, steps: int):
    """The GRPOConfig of the bench workload (CPU, no vLLM, no logging, no saving)."""
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
        max_steps=steps,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        log_completions=False,
        seed=w.seed,
        bf16=False,
        fp16=False,
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
    task = _task()
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
    with _patched(patches):
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
    res = _summarise("trl", w, intervals, buckets, tokens)
    res["min_tokens_per_completion"] = min(lengths[k][1] for k in idx)
    res["optimizer"] = str(trainer.args.optim)
    return res


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no TRL side
        return False
    return True


# ----------------------------------------------------------------------------------------------
# Loss numerics: one identical batch through both losses
# ----------------------------------------------------------------------------------------------


def loss_numerics(w: Workload, model_dir: str, work_dir: str) -> dict[str, Any]:
    """polgrad's Algorithm.loss vs TRL's GRPOTrainer._compute_loss on one batch, at two levels.

    Models: the reference (the bench checkpoint), the sampling policy `old` (reference + noise) and the
    current policy (old + more noise), so that KL, ratios and clipping are all non-trivial. One polgrad
    rollout from `old` on equal-length prompts (no left padding: TRL's training forward uses positions
    0..S-1 while polgrad counts attended tokens; without padding they coincide); random rewards.

    `fn_*`: the loss functions alone. Both get the same float64 inputs: the current policy's log-probs
    (one leaf tensor; TRL's log-prob function is replaced by one returning it), old and reference
    log-probs, polgrad's advantages. Differences here are the formulas' (expected ~1e-16).
    `e2e_*`: each framework end to end on the same weights: its own fp32 forward (TRL: its fused,
    chunked LM head), its own advantage formula, its own dtype (TRL fp32, polgrad float64 after the
    forward). Differences here are fp32 rounding (log-probs differ by ~1e-7 per token).
    """
    import copy

    import gin
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOTrainer
    from trl.trainer.utils import nanstd

    from polgrad import models
    from polgrad.components import kl as kl_parts
    from polgrad.components.protocols import StepCounts
    from polgrad.rollout import hf as hf_rollout

    transformers.logging.set_verbosity_error()
    torch.manual_seed(w.seed)
    ref = models.load_reference(model_dir)
    tok = models.load_tokenizer(model_dir)

    def noisy(m, scale):
        m = copy.deepcopy(m)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(scale * p.abs().mean() * torch.randn_like(p))
        return m

    old = noisy(ref, 0.1)
    policy_pg = noisy(old, 0.3)
    for p in policy_pg.parameters():
        p.requires_grad_(True)
    policy_pg.train()
    policy_trl = copy.deepcopy(policy_pg)

    task = _task()
    pool = task.examples("train", 50 * w.prompts, seed=w.seed)
    examples = [e for e in pool if len(e.prompt) == 6][: w.prompts]  # "dd+dd=": no left padding
    rollout = hf_rollout.generate(
        old,
        tok,
        examples,
        group_size=w.group_size,
        temperature=1.0,
        max_new_tokens=w.max_new_tokens,
        generator_seed=w.seed,
    )
    b = len(rollout)
    rewards = torch.rand(b, generator=torch.Generator().manual_seed(w.seed), dtype=torch.float64)
    mask = rollout.mask.double()
    with torch.no_grad():
        old_logp = hf_rollout.response_logprobs(old, rollout)
        ref_logp = hf_rollout.response_logprobs(ref, rollout)

    algo = grpo_algorithm(w)
    batch = {
        "scores": rewards,
        "mask": mask,
        "truncated": rollout.truncated,
        "group_ids": rollout.group_ids,
        "old_logp": old_logp.double(),
        "rollout_logp": old_logp.double(),
        "ref_logp": ref_logp.double(),
    }
    batch, _ = algo.prepare(batch)
    counts = StepCounts.of_step([mask])

    # TRL's trainer around the same weights (its __init__ patches the fused LM head onto the model)
    dataset = Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])
    tok_trl = AutoTokenizer.from_pretrained(model_dir)
    tok_trl.padding_side = "left"
    config = trl_config(w, os.path.join(work_dir, "trl-numerics"), 1)
    config.model_init_kwargs = None  # the model is passed instantiated
    trainer = GRPOTrainer(
        model=policy_trl,
        reward_funcs=_trl_reward_fn(task),
        args=config,
        train_dataset=dataset,
        processing_class=tok_trl,
    )
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    grouped = rewards.view(-1, w.group_size)
    adv_trl = (rewards - grouped.mean(1).repeat_interleave(w.group_size)) / (
        nanstd(grouped, dim=1).repeat_interleave(w.group_size) + w.adv_eps
    )
    trl_inputs = {
        "prompt_ids": rollout.prompt_ids,
        "prompt_mask": rollout.prompt_mask,
        "completion_ids": rollout.response_ids,
        "completion_mask": rollout.mask.long(),
        "num_items_in_batch": rollout.mask.sum(),
    }

    # --- 1. the loss functions alone, identical float64 inputs
    with torch.no_grad():
        out = hf_rollout.response_logprobs(policy_pg, rollout, with_entropy=True)
    leaf_pg = out.logp.double().requires_grad_(True)
    leaf_trl = out.logp.double().requires_grad_(True)
    loss_fn_pg, _, _ = algo.loss(dict(batch, logp=leaf_pg, entropy=out.entropy.double()), counts)
    loss_fn_pg.backward()
    given = {"logps": (leaf_trl, out.entropy.double(), None)}
    with _patched([(trainer, "_get_per_token_logps_and_entropies", lambda *a, **k: given["logps"])]):
        loss_fn_trl = trainer._compute_loss(
            trainer.model,
            dict(
                trl_inputs,
                advantages=batch["adv"][:, 0],
                old_per_token_logps=old_logp.double(),
                ref_per_token_logps=ref_logp.double(),
            ),
        )
    loss_fn_trl.backward()
    m = rollout.mask.bool()
    fn_grad_diff = float((leaf_pg.grad - leaf_trl.grad)[m].abs().max())
    # polgrad's k3 guards (log-ratio and value clamps; TRL has none) switched off, then back to the
    # part's own defaults (registry/grpo.gin does not bind them)
    guards = inspect.signature(kl_parts.k3).parameters
    max_value, max_log_ratio = guards["max_value"].default, guards["max_log_ratio"].default
    with gin.unlock_config():
        gin.bind_parameter("kl.k3.max_value", None)
        gin.bind_parameter("kl.k3.max_log_ratio", None)
    leaf_ng = out.logp.double().requires_grad_(True)
    loss_fn_ng, _, _ = algo.loss(dict(batch, logp=leaf_ng, entropy=out.entropy.double()), counts)
    loss_fn_ng.backward()
    with gin.unlock_config():
        gin.bind_parameter("kl.k3.max_value", max_value)
        gin.bind_parameter("kl.k3.max_log_ratio", max_log_ratio)
    x_ref = out.logp.double() - ref_logp.double()
    k3 = torch.expm1(-x_ref) + x_ref
    guard_tokens = int((((k3 > max_value) | (x_ref.abs() > max_log_ratio)) & rollout.mask.bool()).sum())

    # --- 2. end to end: each framework's own forward, advantage formula and dtype
    out = hf_rollout.response_logprobs(policy_pg, rollout, with_entropy=True)
    loss_pg, _, _ = algo.loss(dict(batch, logp=out.logp.double(), entropy=out.entropy.double()), counts)
    loss_pg.backward()
    loss_trl = trainer._compute_loss(
        trainer.model,
        dict(
            trl_inputs,
            advantages=adv_trl.float(),
            old_per_token_logps=old_logp,
            ref_per_token_logps=ref_logp,
        ),
    )
    loss_trl.backward()
    with torch.no_grad():
        logp_trl, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            rollout.input_ids,
            torch.cat([rollout.prompt_mask, rollout.mask.long()], 1),
            rollout.response_ids.shape[1],
        )
    gin.clear_config()

    loss_fn_pg, loss_fn_trl, loss_fn_ng = loss_fn_pg.detach(), loss_fn_trl.detach(), loss_fn_ng.detach()
    loss_pg, loss_trl = loss_pg.detach(), loss_trl.detach()
    g_pg = torch.cat([p.grad.flatten() for p in policy_pg.parameters()]).double()
    g_trl = torch.cat([p.grad.flatten() for p in trainer.model.parameters()]).double()
    lp = out.logp.detach()
    ratio = (lp - old_logp).exp()
    adv = batch["adv"][:, :1].expand_as(lp)
    clipped = ((adv < 0) & (ratio < 1 - w.clip_eps)) | ((adv > 0) & (ratio > 1 + w.clip_eps))
    # the natural scale of the loss: the mean of |per-token terms| (the loss itself is a cancelling sum)
    scale = float(((ratio * adv).abs() * mask).sum(-1).div(mask.sum(-1)).mean())
    diff = abs(float(loss_pg) - float(loss_trl))
    return {
        "batch": b,
        "tokens_per_completion": float(mask.sum(1).mean()),
        "frac_tokens_clipped": float(clipped[m].float().mean()),
        "mean_kl_k3": float(((ref_logp - lp).exp() - (ref_logp - lp) - 1)[m].mean()),
        "fn_loss_polgrad": float(loss_fn_pg),
        "fn_loss_trl": float(loss_fn_trl),
        "fn_loss_abs_diff": abs(float(loss_fn_pg) - float(loss_fn_trl)),
        "fn_grad_max_abs_diff": fn_grad_diff,
        "fn_grad_max_abs": float(leaf_pg.grad.abs().max()),
        "k3_guard_tokens": guard_tokens,
        "fn_noguard_loss_polgrad": float(loss_fn_ng),
        "fn_noguard_loss_abs_diff": abs(float(loss_fn_ng) - float(loss_fn_trl)),
        "fn_noguard_grad_max_abs_diff": float((leaf_ng.grad - leaf_trl.grad)[m].abs().max()),
        "adv_max_abs_diff": float((batch["adv"][:, 0] - adv_trl).abs().max()),
        "e2e_loss_polgrad": float(loss_pg),
        "e2e_loss_trl": float(loss_trl),
        "e2e_loss_abs_diff": diff,
        "e2e_loss_scale": scale,
        "e2e_loss_diff_over_scale": diff / scale,
        "e2e_logp_max_abs_diff": float((lp - logp_trl)[m].abs().max()),
        "e2e_grad_rel_diff": float((g_pg - g_trl).norm() / g_trl.norm()),
        "e2e_grad_cosine": float(torch.nn.functional.cosine_similarity(g_pg, g_trl, dim=0)),
    }


# ----------------------------------------------------------------------------------------------
# Composition overhead: the composed Algorithm loss vs one hand-fused function
# ----------------------------------------------------------------------------------------------


def fused_grpo_loss(
    logp,
    old_logp,
    ref_logp,
    adv,
    mask,
    entropy=None,
    *,
    num_tokens: float,
    num_seqs: float,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    beta: float = 0.04,
    max_log_ratio: float = 20.0,
    kl_max_log_ratio: float = 20.0,
    kl_max_value: float = 10.0,
    with_metrics: bool = True,
):
    """GRPO's micro-batch loss in one function: what registry/grpo.gin composes from parts.

    With ρ = exp(clamp(logp - old_logp, ±20)), x = clamp(logp - ref_logp, ±20), valid = mask > 0:

        l_t  = max(-ρA, -clip(ρ, 1-ε_low, 1+ε_high)A) + β·clamp(e^{-x} - 1 + x, 0, 10)     (clip.ppo + kl.k3)
        loss = (1/N_seqs) Σ_i Σ_t m_it l_it / max(|a_i|, 1)               (aggregate.seq_mean_token_mean)

    padding zeroed before any arithmetic, as the parts do. `num_tokens`/`num_seqs` are the step's
    StepCounts. With `with_metrics` also the Algorithm's metrics (clip/clip_low, clip/clip_high,
    clip/approx_kl, pg_loss, kl_loss, entropy), else an empty dict. Returns (loss, metrics).
    """
    import torch

    valid = mask > 0
    m = mask.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype)
    lp = torch.where(valid, logp, zero)
    log_ratio = torch.clamp(lp - torch.where(valid, old_logp.detach(), zero), -max_log_ratio, max_log_ratio)
    a = torch.where(valid, adv.detach(), zero)
    ratio = torch.exp(log_ratio)
    pg = torch.where(
        valid, torch.maximum(-ratio * a, -torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * a), zero
    )
    x = torch.clamp(torch.where(valid, logp - ref_logp, zero), -kl_max_log_ratio, kl_max_log_ratio)
    kl = torch.where(valid, torch.clamp(torch.expm1(-x) + x, min=0.0, max=kl_max_value), zero)
    per_token = pg + beta * kl
    seq_len = m.sum(-1).clamp_min(1.0)

    def aggregate(t):
        return ((torch.where(valid, t, zero) * m).sum(-1) / seq_len).sum() / num_seqs

    loss = aggregate(per_token)
    if not with_metrics:
        return loss, {}
    r = ratio.detach()
    d = log_ratio.detach()
    metrics = {
        "clip/clip_low": (((a < 0) & (r < 1.0 - eps_low)).to(m.dtype) * m).sum() / num_tokens,
        "clip/clip_high": (((a > 0) & (r > 1.0 + eps_high)).to(m.dtype) * m).sum() / num_tokens,
        "clip/approx_kl": (torch.where(valid, torch.expm1(d) - d, zero) * m).sum() / num_tokens,
        "pg_loss": aggregate(pg.detach()),
        "kl_loss": (kl.detach() * m).sum() / num_tokens,
    }
    if entropy is not None:
        metrics["entropy"] = (entropy.detach() * m).sum() / num_tokens
    return loss, metrics


def grpo_algorithm(w: Workload | None = None):
    """registry/grpo.gin as an Algorithm with the bench constants.

    The gin bindings stay in place (parts read their hyperparameters from gin at call time): call
    `gin.clear_config()` when done with the Algorithm.
    """
    from polgrad.config import load_spec

    w = w or Workload()
    return load_spec(os.path.join(REPO_ROOT, "registry", "grpo.gin"), grpo_bindings(w))


def loss_inputs(b: int, t: int, seed: int = 0, dtype=None) -> dict[str, Any]:
    """A random micro-batch as the trainer builds it (float64, ragged mask, |log-ratios| up to ~0.5)."""
    import torch

    dtype = dtype or torch.float64
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    old = -torch.rand(b, t, generator=g, dtype=dtype) * 3.0
    logp = (old + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)).clamp(max=0.0)
    ref = (old + 0.3 * torch.randn(b, t, generator=g, dtype=dtype)).clamp(max=0.0)
    adv = torch.randn(b, 1, generator=g, dtype=dtype) * mask
    entropy = torch.rand(b, t, generator=g, dtype=dtype) * 2.0
    return {"logp": logp, "old_logp": old, "ref_logp": ref, "adv": adv, "mask": mask, "entropy": entropy}


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
    from polgrad.components.protocols import StepCounts

    x = loss_inputs(b, t, seed)
    counts = StepCounts.of_step([x["mask"]])
    leaf = x["logp"].clone().requires_grad_(True)

    def composed(backward: bool):
        loss, _, _ = algo.loss({**x, "logp": leaf}, counts)
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
                "composed_us": _median(times["composed"]) * 1e6,
                "fused_same_metrics_us": _median(times["fused_same_metrics"]) * 1e6,
                "fused_loss_only_us": _median(times["fused_loss_only"]) * 1e6,
                "ratio_vs_same_metrics": _median(same),
                "ratio_vs_same_metrics_p10": _quantile(same, 0.1),
                "ratio_vs_same_metrics_p90": _quantile(same, 0.9),
                "ratio_vs_loss_only": _median(only),
                "ratio_vs_loss_only_p10": _quantile(only, 0.1),
                "ratio_vs_loss_only_p90": _quantile(only, 0.9),
                "blocks": blocks,
                "calls_per_block": block,
                "threads": threads,
            }
        )
    return out


def _composition_worker(
    w: Workload, model_dir: str, work_dir: str, b: int = 64, t: int = 512, blocks: int = 150
) -> list[dict[str, Any]]:
    return composition_overhead(b, t, blocks=blocks, threads=w.threads, seed=w.seed)


# ----------------------------------------------------------------------------------------------
# Subprocess workers and the interleaved driver
# ----------------------------------------------------------------------------------------------


def _worker_env(w: Workload) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "POLGRAD_NUM_THREADS"):
        env[var] = str(w.threads)
    env.pop("OMP_WAIT_POLICY", None)
    if w.omp_wait_policy != "default":
        env["OMP_WAIT_POLICY"] = w.omp_wait_policy.upper()
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_worker(
    kind: str, w: Workload, model_dir: str, log_dir: str, timeout: float = 1800.0, **extra: Any
) -> Any:
    """Run `kind` (a key of WORKERS) in a fresh `python -m polgrad.bench --worker` process; its result.

    The process gets the workload's thread count and OMP_WAIT_POLICY in its environment; `extra` goes
    to the worker function as keyword arguments.
    """
    os.makedirs(log_dir, exist_ok=True)
    fd, spec_path = tempfile.mkstemp(suffix=".json", dir=log_dir)
    os.close(fd)
    out_path = spec_path[:-5] + ".out.json"
    log_path = spec_path[:-5] + ".log"
    with open(spec_path, "w") as f:
        json.dump(
            {"kind": kind, "workload": asdict(w), "model_dir": model_dir, "out": out_path, "extra": extra}, f
        )
    cmd = [sys.executable, "-m", "polgrad.bench", "--worker", spec_path]
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run(
                cmd, cwd=REPO_ROOT, env=_worker_env(w), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = "".join(open(log_path).readlines()[-25:])
            raise RuntimeError(f"bench worker {kind} failed (exit {proc.returncode}):\n{tail}")
        with open(out_path) as f:
            return json.load(f)
    finally:
        for p in (spec_path, out_path, log_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(p)


def _worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    w = Workload(**spec["workload"])
    import torch

    torch.set_num_threads(w.threads)
    work = tempfile.mkdtemp(prefix=f"bench-{spec['kind']}-")
    try:
        result = WORKERS[spec["kind"]](w, spec["model_dir"], work, **spec.get("extra", {}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


WORKERS: dict[str, Callable[..., Any]] = {
    "polgrad": run_polgrad,
    "trl": run_trl,
    "numerics": loss_numerics,
    "composition": _composition_worker,
}


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - platforms without it
        return float("nan")


def interleaved(
    w: Workload, model_dir: str, log_dir: str, pairs: int, frameworks: Sequence[str], progress=print
) -> list[dict[str, Any]]:
    """`pairs` pairs of runs, order A B then B A alternately; one dict per pair with both results."""
    out = []
    for i in range(pairs):
        order = list(frameworks) if i % 2 == 0 else list(reversed(frameworks))
        load_before = _loadavg()
        res = {}
        for fw in order:
            res[fw] = run_worker(fw, w.replace(seed=w.seed + i), model_dir, log_dir)
        pair = {
            "pair": i + 1,
            "order": ",".join(order),
            "load_before": load_before,
            "load_after": _loadavg(),
            **res,
        }
        if "trl" in res and "polgrad" in res:
            pair["speedup"] = res["trl"]["s_per_step"] / res["polgrad"]["s_per_step"]
        out.append(pair)
        msg = (
            f"  pair {i + 1}/{pairs} ({pair['order']}, load {load_before:.2f}->{pair['load_after']:.2f}): "
            + ", ".join(f"{fw} {res[fw]['s_per_step']:.3f} s/step" for fw in order)
        )
        if "speedup" in pair:
            msg += f", speedup {pair['speedup']:.2f}x"
        progress(msg)
    return out


def _check_lengths(w: Workload, run: dict[str, Any]) -> None:
    if w.eos == "never" and abs(run["min_tokens_per_completion"] - w.max_new_tokens) > 1e-9:
        raise RuntimeError(
            f"{run['framework']}: a completion had {run['min_tokens_per_completion']} tokens, "
            f"expected exactly {w.max_new_tokens} (EOS should be unreachable)"
        )


def pair_rows(w: Workload, pairs: list[dict[str, Any]], n_params: int) -> list[dict[str, Any]]:
    rows = []
    for p in pairs:
        row: dict[str, Any] = {
            "pair": p["pair"],
            "order": p["order"],
            "load_before": round(p["load_before"], 2),
            "load_after": round(p["load_after"], 2),
        }
        for fw in FRAMEWORKS:
            if fw not in p:
                continue
            r = p[fw]
            _check_lengths(w, r)
            row.update(
                {
                    f"{fw}_s_per_step": r["s_per_step"],
                    f"{fw}_tokens_per_s": r["tokens_per_s"],
                    f"{fw}_gen_tokens_per_s": r["gen_tokens_per_s"],
                    f"{fw}_tokens_per_step": r["tokens_per_step"],
                    f"{fw}_peak_rss_mb": r["peak_rss_mb"],
                }
            )
            for ph in PHASES:
                row[f"{fw}_{ph}_s"] = r["phases"][ph]
            if fw == "polgrad":
                for ph in POLGRAD_METRIC_PHASES:
                    row[f"polgrad_metrics_{ph}_s"] = r["metrics_phases"][ph]
        if "speedup" in p:
            row["speedup"] = p["speedup"]
        row.update(
            prompts=w.prompts,
            group_size=w.group_size,
            max_new_tokens=w.max_new_tokens,
            threads=w.threads,
            params=n_params,
            steps=w.steps,
            warmup=w.warmup,
            eos=w.eos,
            omp_wait_policy=w.omp_wait_policy,
        )
        rows.append(row)
    return rows


def write_csv(path: str, rows: list[dict[str, Any]]) -> None:
    """`rows` as a CSV (columns in first-seen order, floats to 6 significant digits), written atomically."""
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    wr = csv.DictWriter(buf, fieldnames=keys)
    wr.writeheader()
    for r in rows:
        wr.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    atomic_write_text(path, buf.getvalue())


def _stats(xs: Sequence[float]) -> str:
    return f"median {_median(xs):.3f}  min {min(xs):.3f}  max {max(xs):.3f}"


def compare_report(w: Workload, rows: list[dict[str, Any]], frameworks: Sequence[str]) -> list[str]:
    lines = [
        f"## polgrad vs TRL GRPOTrainer: {w.prompts} prompts x G={w.group_size}, "
        f"{w.max_new_tokens} new tokens, "
        f"{w.threads} threads, {len(rows)} interleaved pairs, {w.steps} measured steps per run",
        "",
        "| framework | s/step (median of pair medians) | tokens/s end to end | tokens/s sampling alone "
        "| peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    for fw in frameworks:
        lines.append(
            f"| {fw} | {_median([r[f'{fw}_s_per_step'] for r in rows]):.3f} | "
            f"{_median([r[f'{fw}_tokens_per_s'] for r in rows]):.0f} | "
            f"{_median([r[f'{fw}_gen_tokens_per_s'] for r in rows]):.0f} | "
            f"{_median([r[f'{fw}_peak_rss_mb'] for r in rows]):.0f} |"
        )
    if "speedup" in rows[0]:
        sp = [r["speedup"] for r in rows]
        lines += ["", f"speedup = TRL s/step / polgrad s/step per pair: {_stats(sp)}  (bar: >= 1.5)"]
    loads = [r["load_before"] for r in rows] + [r["load_after"] for r in rows]
    lines += [f"load average (1 min) over the pairs: {min(loads):.2f} .. {max(loads):.2f}", ""]
    lines += ["Phase medians (seconds per step; `sample` is inside `gen`):", ""]
    lines += ["| phase | " + " | ".join(frameworks) + " |", "|---|" + "---|" * len(frameworks)]
    for ph in PHASES:
        vals = [_median([r[f"{fw}_{ph}_s"] for r in rows]) for fw in frameworks]
        lines.append(f"| {ph} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    if "polgrad" in frameworks:
        lines += [
            "",
            "polgrad metrics.jsonl phases (median s): "
            + ", ".join(
                f"{ph}={_median([r[f'polgrad_metrics_{ph}_s'] for r in rows]):.4f}"
                for ph in POLGRAD_METRIC_PHASES
            ),
        ]
    return lines


def scaling(
    base: Workload,
    model_dir: str,
    log_dir: str,
    group_sizes: Sequence[int],
    lengths: Sequence[int],
    pairs: int,
    frameworks: Sequence[str],
    progress=print,
) -> list[dict[str, Any]]:
    """Seconds per step vs G (at base L) and vs L (at base G); interleaved per point."""
    points = [("G", g, base.replace(group_size=g)) for g in group_sizes]
    points += [("L", n, base.replace(max_new_tokens=n)) for n in lengths]
    rows = []
    for sweep, value, w in points:
        for p in interleaved(w, model_dir, log_dir, pairs, frameworks, progress=lambda *_: None):
            for fw in frameworks:
                r = p[fw]
                _check_lengths(w, r)
                rows.append(
                    {
                        "sweep": sweep,
                        "value": value,
                        "pair": p["pair"],
                        "framework": fw,
                        "group_size": w.group_size,
                        "max_new_tokens": w.max_new_tokens,
                        "batch": w.batch,
                        "s_per_step": r["s_per_step"],
                        "tokens_per_s": r["tokens_per_s"],
                        "gen_tokens_per_s": r["gen_tokens_per_s"],
                        "peak_rss_mb": r["peak_rss_mb"],
                        **{f"{ph}_s": r["phases"][ph] for ph in PHASES},
                        "load": round(p["load_before"], 2),
                    }
                )
        got = {
            fw: _median(
                [
                    r["s_per_step"]
                    for r in rows
                    if r["sweep"] == sweep and r["value"] == value and r["framework"] == fw
                ]
            )
            for fw in frameworks
        }
        progress(f"  {sweep}={value}: " + ", ".join(f"{fw} {v:.3f} s/step" for fw, v in got.items()))
    return rows


def scaling_report(rows: list[dict[str, Any]], frameworks: Sequence[str]) -> list[str]:
    """Per sweep: s/step and per-phase cost per unit of the swept variable, normalised to the smallest."""
    lines = []
    for sweep, unit in (("G", "group size G (batch = prompts x G)"), ("L", "completion length L")):
        sub = [r for r in rows if r["sweep"] == sweep]
        if not sub:
            continue
        values = sorted({r["value"] for r in sub})
        lines += ["", f"### time per step vs {unit}", ""]
        head = (
            "| "
            + sweep
            + " | "
            + " | ".join(f"{fw} s/step | {fw} s/step per {sweep} (rel.)" for fw in frameworks)
            + " |"
        )
        lines += [head, "|---|" + "---|---|" * len(frameworks)]
        base = {fw: None for fw in frameworks}
        for v in values:
            cells = []
            for fw in frameworks:
                s = _median([r["s_per_step"] for r in sub if r["value"] == v and r["framework"] == fw])
                per = s / v
                base[fw] = base[fw] or per
                cells.append(f"{s:.3f} | {per / base[fw]:.2f}")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        for fw in frameworks:
            lines += ["", f"{fw} phases (median s/step) by {sweep}:", ""]
            lines += ["| " + sweep + " | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
            for v in values:
                vals = [
                    _median([r[f"{ph}_s"] for r in sub if r["value"] == v and r["framework"] == fw])
                    for ph in PHASES
                ]
                lines.append(f"| {v} | " + " | ".join(f"{x:.4f}" for x in vals) + " |")
    return lines


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m polgrad.bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pairs", type=int, default=5, help="interleaved polgrad/TRL pairs (>= 5 for the report)"
    )
    ap.add_argument("--steps", type=int, default=8, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="discarded steps at the start of each run")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", "-G", type=int, default=8)
    ap.add_argument("--max-new-tokens", "-L", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--eos", choices=("never", "natural"), default="never")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--omp-wait-policy",
        choices=OMP_WAIT_POLICIES,
        default="passive",
        help="OMP_WAIT_POLICY for every run (passive: idle OpenMP threads sleep instead of spinning, which "
        "keeps a shared, oversubscribed CPU from stalling both frameworks; 'default': leave it unset)",
    )
    ap.add_argument(
        "--only",
        default="compare,numerics,composition,scaling",
        help="comma list of parts to run: compare, numerics, composition, scaling",
    )
    ap.add_argument("--frameworks", default="polgrad,trl", help="'polgrad' alone skips TRL")
    ap.add_argument("--scaling-group-sizes", default="2,4,8,16")
    ap.add_argument("--scaling-lengths", default="16,32,64,128")
    ap.add_argument("--scaling-pairs", type=int, default=1)
    ap.add_argument("--composition-shape", default="64x512", help="BxT of the loss micro-benchmark")
    ap.add_argument("--composition-blocks", type=int, default=150, help="interleaved rounds of 5 calls each")
    ap.add_argument("--out", default=os.path.join("results", "bench"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker)

    parts = set(_ints_or_names(args.only))
    frameworks = [f for f in args.frameworks.split(",") if f]
    if "trl" in frameworks and not trl_available():
        print(f"TRL is not importable: polgrad side only (pip install '{TRL_PIN}' or the `bench` extra)")
        frameworks = [f for f in frameworks if f != "trl"]
    w = Workload(
        prompts=args.prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        threads=args.threads,
        steps=args.steps,
        warmup=args.warmup,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        eos=args.eos,
        seed=args.seed,
        omp_wait_policy=args.omp_wait_policy,
    )
    out = args.out
    os.makedirs(out, exist_ok=True)
    report: list[str] = [
        "# polgrad bench",
        "",
        f"`python -m polgrad.bench {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(
            "  ", " "
        ),
        "",
        f"versions: {_versions()}; torch threads {w.threads}; OMP_WAIT_POLICY {w.omp_wait_policy}; "
        f"load average at start {_loadavg():.2f}",
    ]

    def say(line: str = "") -> None:
        print(line, flush=True)

    longest = max(w.max_new_tokens, *(_ints(args.scaling_lengths) if "scaling" in parts else [0]))
    with tempfile.TemporaryDirectory(prefix="polgrad-bench-") as tmp:
        info = make_model(os.path.join(tmp, "model"), w.replace(max_new_tokens=longest))
        model_dir = info["model_dir"]
        log_dir = os.path.join(tmp, "logs")
        report += [
            f"model: random-init Qwen2 from build_tiny({w.model_kwargs}), {info['n_params']} parameters, "
            f"vocab {info['vocab']}, EOS id {info['eos_id']} ({w.eos})",
        ]
        say("\n".join(report))

        if "compare" in parts:
            say(f"\n[compare] {args.pairs} interleaved pairs of {w.warmup}+{w.steps} steps ...")
            pairs = interleaved(w, model_dir, log_dir, args.pairs, frameworks, progress=say)
            rows = pair_rows(w, pairs, info["n_params"])
            write_csv(os.path.join(out, "grpo_vs_trl.csv"), rows)
            runs = []
            for p in pairs:
                for fw in frameworks:
                    r = p[fw]
                    runs.append(
                        {
                            "pair": p["pair"],
                            "framework": fw,
                            "s_per_step": r["s_per_step"],
                            "tokens_per_s": r["tokens_per_s"],
                            "gen_tokens_per_s": r["gen_tokens_per_s"],
                            "peak_rss_mb": r["peak_rss_mb"],
                            "step_times": " ".join(f"{x:.4f}" for x in r["step_times"]),
                            **{f"{ph}_s": r["phases"][ph] for ph in PHASES},
                        }
                    )
            write_csv(os.path.join(out, "grpo_vs_trl_runs.csv"), runs)
            lines = compare_report(w, rows, frameworks)
            report += ["", *lines]
            say("\n" + "\n".join(lines))

        if "numerics" in parts and "trl" in frameworks:
            say("\n[numerics] one batch through both losses ...")
            num = run_worker("numerics", w, model_dir, log_dir)
            with open(os.path.join(out, "numerics.json"), "w") as f:
                json.dump(num, f, indent=2, sort_keys=True)
            lines = [
                "## Loss numerics: one batch and the same weights through polgrad and TRL",
                "",
                f"batch {num['batch']} x {num['tokens_per_completion']:.0f} tokens; "
                f"{100 * num['frac_tokens_clipped']:.1f}% of tokens clipped, "
                f"mean k3 KL {num['mean_kl_k3']:.4f}",
                f"- loss functions on identical float64 inputs, polgrad's k3 guards off: polgrad "
                f"{num['fn_noguard_loss_polgrad']:.15g}, TRL {num['fn_loss_trl']:.15g}, |diff| "
                f"{num['fn_noguard_loss_abs_diff']:.1e}; d loss / d logp max |diff| "
                f"{num['fn_noguard_grad_max_abs_diff']:.1e} (max |grad| {num['fn_grad_max_abs']:.1e})",
                f"- the same with polgrad's spec as trained (k3 clamped at 10, log-ratio at 20; "
                f"{num['k3_guard_tokens']} tokens hit a guard): |loss diff| {num['fn_loss_abs_diff']:.1e}, "
                f"d loss / d logp max |diff| {num['fn_grad_max_abs_diff']:.1e}",
                f"- advantages (polgrad float64 vs TRL's formula on the same float64 rewards): max |diff| "
                f"{num['adv_max_abs_diff']:.1e} (TRL's nanstd computes its Bessel factor count/(count-1) "
                f"in float32)",
                f"- end to end (each its own fp32 forward and dtype): "
                f"loss polgrad {num['e2e_loss_polgrad']:.7g}, "
                f"TRL {num['e2e_loss_trl']:.7g}, |diff| {num['e2e_loss_abs_diff']:.1e} = "
                f"{num['e2e_loss_diff_over_scale']:.1e} x the mean |per-token term|; log-prob max |diff| "
                f"{num['e2e_logp_max_abs_diff']:.1e}; gradient rel. diff {num['e2e_grad_rel_diff']:.1e} "
                f"(cosine {num['e2e_grad_cosine']:.9f})",
            ]
            report += ["", *lines]
            say("\n".join(lines))

        if "composition" in parts:
            b, t = (int(x) for x in args.composition_shape.lower().split("x"))
            say(f"\n[composition] Algorithm.loss vs fused_grpo_loss at B={b}, T={t} ...")
            comp = run_worker("composition", w, model_dir, log_dir, b=b, t=t, blocks=args.composition_blocks)
            write_csv(os.path.join(out, "composition.csv"), comp)
            lines = [
                "## Loss-composition overhead (float64; target composed <= 1.05x fused)",
                "",
                "| pass | composed us | fused, same metrics us | fused, loss only us | "
                "composed / fused same metrics: median [p10..p90] | composed / fused loss only |",
                "|---|---|---|---|---|---|",
            ]
            for c in comp:
                lines.append(
                    f"| {c['pass']} | {c['composed_us']:.0f} | {c['fused_same_metrics_us']:.0f} | "
                    f"{c['fused_loss_only_us']:.0f} | {c['ratio_vs_same_metrics']:.3f} "
                    f"[{c['ratio_vs_same_metrics_p10']:.3f}..{c['ratio_vs_same_metrics_p90']:.3f}] | "
                    f"{c['ratio_vs_loss_only']:.3f} [{c['ratio_vs_loss_only_p10']:.3f}.."
                    f"{c['ratio_vs_loss_only_p90']:.3f}] |"
                )
            report += ["", *lines]
            say("\n".join(lines))

        if "scaling" in parts:
            gs, ls = _ints(args.scaling_group_sizes), _ints(args.scaling_lengths)
            say(
                f"\n[scaling] G in {gs} (L={w.max_new_tokens}), L in {ls} (G={w.group_size}), "
                f"{args.scaling_pairs} pair(s) per point ..."
            )
            sw = w.replace(steps=max(3, w.steps // 2))
            rows = scaling(sw, model_dir, log_dir, gs, ls, args.scaling_pairs, frameworks, progress=say)
            write_csv(os.path.join(out, "scaling.csv"), rows)
            lines = [
                "## Scaling (seconds per step; 'per G' / 'per L' = s/step divided by the swept value, "
                "relative to the smallest value: 1.00 everywhere = linear)",
                *scaling_report(rows, frameworks),
            ]
            report += ["", *lines]
            say("\n".join(lines))

    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("\n".join(report) + "\n")
    say(f"\nwrote {out}/")
    return 0


def _ints_or_names(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in ("compare", "numerics", "composition", "scaling")]
    if bad:
        raise SystemExit(f"error: unknown --only parts {bad}; valid: compare, numerics, composition, scaling")
    return names


def _versions() -> str:
    import importlib.metadata as md

    out = []
    for pkg in ("torch", "transformers", "deepspeed", "trl", "accelerate"):
        with contextlib.suppress(md.PackageNotFoundError):
            out.append(f"{pkg} {md.version(pkg)}")
    return ", ".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
