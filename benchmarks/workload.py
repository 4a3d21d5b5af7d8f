"""The bench workload: one configuration for both frameworks, the model both load, GRPO's bindings."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FRAMEWORKS = ("polgrad", "trl")
TRL_PIN = "trl==1.16.0"  # the `bench` extra; tested with torch 2.13.0, transformers 5.19.0
NEVER_EOS = "<|never|>"
OMP_WAIT_POLICIES = ("default", "passive", "active")  # default: the user's environment, untouched
PRECISIONS = ("fp32", "bf16")
# `--preset`: the model; the workload (prompts, G, L) is the same unless PRESET_WORKLOADS says.
# 24m: 23.6M parameters, head_dim 64. vocab 0 is the task's character tokenizer (16 tokens); a real
# vocabulary pads it with filler tokens (models.build_tokenizer) and the embedding to that size.
# qwen05b: Qwen2.5-0.5B's configuration (random init, tied embeddings; no weights can be downloaded).
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256),
    "24m": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408),
    "24m_v32k": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, vocab=32_000),
    "24m_v152k": dict(hidden=512, layers=8, heads=8, kv_heads=4, intermediate=1408, vocab=151_936),
    "qwen05b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151_936),
}
# A preset's own workload where the default one would not fit 24 GiB with both frameworks' models,
# references, AdamW states and logits: Qwen2.5-0.5B at 4 prompts x G=8 (32 rows; one fp32 copy of
# its [32, 39, 151,936] logits is 0.76 GB).
PRESET_WORKLOADS: dict[str, dict[str, int]] = {"qwen05b": dict(prompts=4)}
# Phases timed in both frameworks (see benchmarks/bench.py's docstring); `sample` is inside `gen`.
PHASES = ("gen", "sample", "reward", "ref", "policy_fwd", "loss", "backward", "optim", "other")
# polgrad's own per-step timings in metrics.jsonl.
POLGRAD_METRIC_PHASES = ("time_gen", "time_ref", "time_values", "time_adv", "time_update")


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
    vocab: int = 0  # 0: the task's characters (16 tokens); else padded to this many (PRESETS)
    lr: float = 1e-4
    beta: float = 0.04
    clip_eps: float = 0.2
    adv_eps: float = 1e-4  # TRL's constant in (r - mean) / (std + eps)
    grad_clip: float = 1.0
    seed: int = 0
    eos: str = "never"  # 'never': exactly max_new_tokens per completion; 'natural': the model's EOS
    omp_wait_policy: str = "default"  # OMP_WAIT_POLICY of each run ('default': the environment's own)
    bf16: bool = False  # polgrad train.bf16 / TRL bf16=True (fp32 master weights in both)
    # polgrad train.gradient_checkpointing / TRL's GRPOConfig gradient_checkpointing, the same in both:
    # TRL turns it on by default and polgrad does not, and a comparison of peak memory or time with it
    # on in one framework alone measures the setting, not the framework (issue 41's profile)
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.steps < 1:
            raise ValueError(f"need warmup >= 1 and steps >= 1, got {self.warmup}, {self.steps}")
        if self.group_size < 2 or self.prompts < 1 or self.max_new_tokens < 1 or self.threads < 1:
            raise ValueError("need group_size >= 2, prompts >= 1, max_new_tokens >= 1, threads >= 1")
        if self.vocab < 0:
            raise ValueError(
                f"vocab must be 0 (the task's characters) or a vocabulary size, got {self.vocab}"
            )
        if self.eos not in ("never", "natural"):
            raise ValueError(f"eos must be 'never' or 'natural', got {self.eos!r}")
        if self.omp_wait_policy not in OMP_WAIT_POLICIES:
            raise ValueError(
                f"omp_wait_policy must be one of {OMP_WAIT_POLICIES}, got {self.omp_wait_policy!r}"
            )

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16 else "fp32"

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


def bench_task(partial: bool = True):
    """polgrad's `add` task (digits=2) as the bench uses it (partial credit: advantages are not all 0)."""
    import polgrad  # noqa: F401  (registers the built-in tasks)
    from polgrad.registry import get

    return get("task", "add")(digits=2, partial=partial)


def make_model(out_dir: str, w: Workload) -> dict[str, Any]:
    """Build the random-init tiny Qwen2 + char tokenizer once and save it to `out_dir`.

    With w.eos == 'never' the tokenizer's EOS becomes an id no logit exists for (see bench.py).
    The context window is widened to hold the longest prompt plus max_new_tokens.
    """
    from polgrad import models

    task = bench_task()
    model, tok = models.build_tiny(task, seed=w.seed, **w.model_kwargs)
    if w.vocab:  # a real vocabulary size: filler tokens, the embedding (tied: and the head) resized
        import torch

        tok = models.build_tokenizer(task.alphabet, vocab_size=w.vocab)
        with torch.random.fork_rng():
            torch.manual_seed(w.seed)  # the new rows' init (normal, the config's initializer_range)
            model.resize_token_embeddings(w.vocab, mean_resizing=False)
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
    return {
        "model_dir": out_dir,
        "n_params": n_params,
        "vocab": vocab,
        "eos_id": tok.eos_token_id,
        "prompt_len": 1 + int(task.max_prompt_chars),  # BOS + the longest prompt (rows are left-padded)
    }


def grpo_bindings(w: Workload) -> list[str]:
    """The bench's GRPO hyperparameters on top of registry/grpo.gin (shared by every bench part)."""
    return [
        f"Algorithm.group_size = {w.group_size}",
        f"Algorithm.kl_coef = {w.beta!r}",
        f"clip.ppo.eps_low = {w.clip_eps!r}",
        f"clip.ppo.eps_high = {w.clip_eps!r}",
        f"advantage.grpo.eps = {w.adv_eps!r}",
    ]


def arm(framework: str, precision: str) -> str:
    """The column prefix of one framework at one precision: 'polgrad', 'trl' (fp32), 'polgrad_bf16', ..."""
    return framework if precision == "fp32" else f"{framework}_{precision}"
