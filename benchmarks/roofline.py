"""Model FLOPs per step, the matmul peak measured in the same bench run, and the roofline fraction.

Model FLOPs count the work the GRPO step needs, the same for both frameworks (an implementation that
does more, e.g. polgrad's extra no-grad policy forward for the exact-KL metric, pays for it in time):

    F(rows, S, n_logits) = rows * (2 N S + 4 n_layers d_attn S(S+1)/2 + 2 V H n_logits)

is one causal forward of S positions per row: 2 FLOPs per weight per position for the N linear weights
of the decoder layers (q, k, v, o, gate, up, down), QK^T and AV over the causal context (d_attn = heads x
head_dim; positions 1..S attend to 1..s keys), and the lm-head (V x H) at the n_logits positions whose
logits are used. With P = BOS + the task's longest prompt (rows are left-padded to it) and L new tokens,

    step = F(B, P+L-1, L)          sampling (prefill + L-1 cached decode steps: causal positions 1..P+L-1)
         + F(B, P+L, L)            reference log-probs
         + 3 F(B, P+L, L)          policy forward + backward (backward = 2x forward: input and weight grads)

Achieved FLOP/s = step FLOPs / median s/step; roofline fraction = that / the peak of the run's
precision, where the peak is the best torch.mm GFLOP/s of square fp32 / bf16 matrices on the bench's
thread count and OMP setting, measured in a fresh worker process of the same bench run.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from benchmarks.workload import Workload

PEAK_SIZES = (1024, 2048)


def model_shape(w: Workload, vocab: int) -> dict[str, int]:
    """N (decoder linear weights), d_attn, H, V, layers of the workload's model."""
    head_dim = w.hidden // w.heads
    d_q, d_kv = w.heads * head_dim, w.kv_heads * head_dim
    per_layer = w.hidden * (d_q + 2 * d_kv) + d_q * w.hidden + 3 * w.hidden * w.intermediate
    return {"N": w.layers * per_layer, "d_attn": d_q, "H": w.hidden, "V": vocab, "layers": w.layers}


def forward_flops(shape: dict[str, int], rows: int, positions: int, n_logits: int) -> float:
    """F(rows, S, n_logits) of the module docstring."""
    s = positions
    body = 2 * shape["N"] * s
    attention = 4 * shape["layers"] * shape["d_attn"] * s * (s + 1) / 2
    head = 2 * shape["V"] * shape["H"] * n_logits
    return float(rows * (body + attention + head))


def step_flops(w: Workload, vocab: int, prompt_len: int) -> dict[str, float]:
    """Model FLOPs of one GRPO step of `w`, by part (gen, ref, train) and in total."""
    shape = model_shape(w, vocab)
    b, p, n = w.batch, prompt_len, w.max_new_tokens
    parts = {
        "gen": forward_flops(shape, b, p + n - 1, n),
        "ref": forward_flops(shape, b, p + n, n),
        "train": 3 * forward_flops(shape, b, p + n, n),
    }
    return {**parts, "total": sum(parts.values())}


def matmul_peak(
    w: Workload, model_dir: str, work_dir: str, reps: int = 5, sizes: Sequence[int] = PEAK_SIZES
) -> dict[str, Any]:
    """Worker: best torch.mm GFLOP/s per precision over `sizes` (2 warm-up calls, best of `reps`).

    The default sizes find the peak of a large matmul; on a CPU without native bf16 (AVX2) one bf16
    mm of 2048 takes ~45 s, so a smoke test passes small ones (`--peak-sizes`)."""
    import torch

    torch.set_num_threads(w.threads)
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "sizes": [int(n) for n in sizes]}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        best = 0.0
        for n in sizes:
            g = torch.Generator().manual_seed(n)
            a = torch.randn(n, n, generator=g).to(dtype)
            b = torch.randn(n, n, generator=g).to(dtype)
            for _ in range(2):
                torch.mm(a, b)
            for _ in range(reps):
                t0 = time.perf_counter()
                torch.mm(a, b)
                best = max(best, 2 * n**3 / (time.perf_counter() - t0) / 1e9)
        out[f"{name}_gflops"] = best
    return out


def roofline_columns(flops: float, s_per_step: float, peak_gflops: float) -> dict[str, float]:
    """Achieved GFLOP/s of one run and its fraction of the peak."""
    achieved = flops / s_per_step / 1e9
    return {"gflops": achieved, "roofline": achieved / peak_gflops if peak_gflops > 0 else float("nan")}


def roofline_report(w: Workload, flops: dict[str, float], peak: dict[str, Any], prompt_len: int) -> list[str]:
    """The summary's roofline lines: the formula's numbers and the measured peaks."""
    return [
        "## Roofline",
        "",
        f"model FLOPs per step (benchmarks/roofline.py: gen F(B,P+L-1,L) + ref F(B,P+L,L) + train "
        f"3F(B,P+L,L), B={w.batch}, P={prompt_len}, L={w.max_new_tokens}): "
        f"{flops['total'] / 1e9:.1f} GFLOP (gen {flops['gen'] / 1e9:.1f}, ref {flops['ref'] / 1e9:.1f}, "
        f"train {flops['train'] / 1e9:.1f})",
        f"matmul peak measured in this run (torch.mm, square {'/'.join(map(str, peak['sizes']))}, "
        f"{peak['threads']} threads, best of 5): fp32 {peak['fp32_gflops']:.0f} GFLOP/s, "
        f"bf16 {peak['bf16_gflops']:.0f} GFLOP/s",
    ]
