"""HF vs vLLM rollout throughput on the same workload: `benchmark_backends(...) -> list[dict]`.

    python -m benchmarks.vllm_bench          # the tiny preset and a 512-hidden / 8-layer model

Each model is a freshly initialised `build_tiny(task, **kwargs)` (random weights: responses end at a
random EOS, so both backends generate roughly, not exactly, the same number of tokens; tokens/s counts
the generated tokens, EOS included, of the timed calls). Per model and backend: one untimed warm-up call,
then `repeats` timed `generate` calls with different seeds; `seconds` is their median. vLLM's engine
start (model load, KV-cache allocation, warm-up; the first one on a machine also compiles the sampler's
kernels into the torch-inductor cache, ~1 min) is reported apart, as `start_seconds`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

DEFAULT_CONFIGS: tuple[dict[str, Any], ...] = (
    {"name": "tiny", "model": {}},  # hidden 128, 4 layers, head_dim 32: 0.6M parameters
    # head_dim 64, GQA 8/2, SwiGLU 1408: 22.6M parameters
    {
        "name": "h512-l8",
        "model": {"hidden": 512, "layers": 8, "heads": 8, "kv_heads": 2, "intermediate": 1408},
    },
)


def _timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds of `repeats` calls fn(i) (after one warm-up) and the tokens they generated."""
    fn(-1)
    times, tokens = [], []
    for i in range(repeats):
        t0 = time.perf_counter()
        rollout = fn(i)
        times.append(time.perf_counter() - t0)
        tokens.append(int(rollout.response_lengths.sum()))
    return statistics.median(times), round(statistics.mean(tokens))


def benchmark_backends(
    configs: Sequence[dict[str, Any]] = DEFAULT_CONFIGS,
    *,
    task: Any = None,
    num_prompts: int = 8,
    group_size: int = 8,
    max_new_tokens: int = 32,
    temperature: float = 1.0,
    repeats: int = 3,
    num_threads: int | None = None,
    kv_cache_memory_bytes: int = 256 << 20,
    backends: Sequence[str] = ("hf", "vllm"),
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Time hf.generate and VLLMRollout.generate on `num_prompts` x `group_size` samples per config.

    `configs`: dicts with a `name` and `model` (kwargs of `polgrad.models.build_tiny`). `task` defaults
    to the built-in `add`. `num_threads` (None: as is) is torch's thread count for both backends. One
    row per (config, backend): model, parameters, backend, rows, tokens (generated, mean over the timed
    calls), seconds (median), tokens_per_s, start_seconds (vLLM engine start; 0 for hf), threads,
    load_avg_1m (the machine's load after the timing: on a shared machine, read numbers with it).
    """
    from polgrad.models import build_tiny
    from polgrad.rollout import hf

    if task is None:
        from polgrad.tasks.synthetic import add

        task = add()
    examples = task.examples("train", num_prompts, seed)
    threads_before = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    kw = dict(group_size=group_size, temperature=temperature, max_new_tokens=max_new_tokens)
    results = []
    try:
        for cfg in configs:
            model, tokenizer = build_tiny(task, **cfg.get("model", {}))
            base = {
                "model": cfg["name"],
                "parameters": sum(p.numel() for p in model.parameters()),
                "rows": num_prompts * group_size,
                "max_new_tokens": max_new_tokens,
                "threads": torch.get_num_threads(),
            }
            if "hf" in backends:

                def hf_call(i: int, model=model, tokenizer=tokenizer):
                    return hf.generate(model, tokenizer, examples, generator_seed=seed + i, **kw)

                sec, tok = _timed(hf_call, repeats)
                results.append(
                    {
                        **base,
                        "backend": "hf",
                        "tokens": tok,
                        "seconds": round(sec, 4),
                        "tokens_per_s": round(tok / sec, 1),
                        "start_seconds": 0.0,
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                    }
                )
            if "vllm" in backends:
                from polgrad.rollout.vllm import VLLMRollout

                with tempfile.TemporaryDirectory() as path:
                    model.save_pretrained(path)
                    tokenizer.save_pretrained(path)
                    with VLLMRollout(
                        path,
                        kv_cache_memory_bytes=kv_cache_memory_bytes,
                        seed=seed,
                        num_threads=torch.get_num_threads(),
                    ) as engine:
                        sec, tok = _timed(
                            lambda i: engine.generate(examples, generator_seed=seed + i, **kw), repeats
                        )
                        start = engine.start_seconds
                results.append(
                    {
                        **base,
                        "backend": "vllm",
                        "tokens": tok,
                        "seconds": round(sec, 4),
                        "tokens_per_s": round(tok / sec, 1),
                        "start_seconds": round(start, 2),
                        "load_avg_1m": round(os.getloadavg()[0], 2),
                    }
                )
    finally:
        torch.set_num_threads(threads_before)
    return results


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads for both backends")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny-only", action="store_true")
    parser.add_argument(
        "--out", default=os.path.join("results", "bench", "vllm_vs_hf.csv"), help="CSV to write ('' = none)"
    )
    args = parser.parse_args(argv)
    configs = DEFAULT_CONFIGS[:1] if args.tiny_only else DEFAULT_CONFIGS
    rows = benchmark_backends(configs, repeats=args.repeats, num_threads=args.threads)
    for row in rows:
        print(json.dumps(row))
    if args.out and rows:
        from benchmarks.report import write_csv

        write_csv(args.out, rows)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
