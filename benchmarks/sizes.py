"""`python -m benchmarks.bench --only sizes`: how the step grows with the model and the batch.

Each point is the bench's GRPO workload on one random-init Qwen2 (`make_model`) run by every
framework at every `--precision`, interleaved in the same rounds (`--sizes-pairs`, fresh processes,
A B / B A), with `--sizes-warmup` + `--sizes-steps` steps per run:

    size axis    0.6m (the tiny preset), 6m, 24m (the 24m preset), 96m, at the workload's batch
    batch axis   the 6m model at prompts 2, 8, 32 x the workload's G (8 by default: 16, 64, 256 rows)

Each point gets its model FLOPs per step (benchmarks/roofline.py) and the fraction of the fp32 /
bf16 torch.mm peak measured once in the same bench call. Written to <out>/sizes.csv (one row per
point and round, the compare's columns plus `point`, `axis`; rewritten after every point), a table
in summary.md and the figure <out>/sizes.png (s/step against parameters, tokens/s against batch,
and TRL's s/step over polgrad's at each point).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from benchmarks.report import pair_rows
from benchmarks.roofline import step_flops
from benchmarks.timing import median
from benchmarks.workers import interleaved
from benchmarks.workload import PRESETS, Workload, arm, make_model

SIZES: dict[str, dict[str, int]] = {
    "0.6m": PRESETS["tiny"],
    "6m": dict(hidden=256, layers=8, heads=4, kv_heads=2, intermediate=704),
    "24m": PRESETS["24m"],
    "96m": dict(hidden=768, layers=14, heads=12, kv_heads=4, intermediate=2304),
}
BATCH_MODEL = "6m"
BATCH_PROMPTS = (2, 8, 32)  # x the workload's G (8 by default: 16, 64, 256 rows)


def points(w: Workload, sizes: list[str], batch_prompts: list[int]) -> list[tuple[str, str, Workload]]:
    """(label, axis, workload) of every point: the sizes at w's batch, then the batch axis."""
    out = [(f"{s} x {w.batch}", "size", w.replace(**SIZES[s])) for s in sizes]
    for p in batch_prompts:
        wp = w.replace(**SIZES[BATCH_MODEL], prompts=p)
        if (BATCH_MODEL not in sizes) or wp.batch != w.batch:  # the size axis has this point already
            out.append((f"{BATCH_MODEL} x {wp.batch}", "batch", wp))
    return out


def sizes_bench(
    w: Workload,
    tmp: str,
    log_dir: str,
    sizes: list[str],
    batch_prompts: list[int],
    pairs: int,
    frameworks: list[str],
    precisions: list[str],
    peak: dict[str, Any],
    progress=print,
    on_point: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every point's rounds (module docstring); the rows of sizes.csv. After each point,
    `on_point(rows so far)`: the CLI writes sizes.csv there, so a run that dies at a later point
    (the 96M point once filled the disk after 15 minutes) keeps every point it finished."""
    rows = []
    for label, axis, wp in points(w, sizes, batch_prompts):
        info = make_model(os.path.join(tmp, f"model-{label.replace(' ', '')}"), wp)
        flops = step_flops(wp, info["vocab"], info["prompt_len"])["total"]
        progress(f"  [{label}] {info['n_params'] / 1e6:.1f}M parameters, {flops / 1e9:.0f} GFLOP per step")
        got = interleaved(
            wp, info["model_dir"], log_dir, pairs, frameworks, progress=progress, precisions=precisions
        )
        for r in pair_rows(wp, got, info["n_params"], flops, peak):
            rows.append({"point": label, "axis": axis, "batch": wp.batch, **r})
        if on_point is not None:
            on_point(rows)
    return rows


def _arms(rows: list[dict[str, Any]]) -> list[str]:
    """The arm prefixes ('polgrad', 'trl_bf16', ...) of rows with `<arm>_s_per_step` columns."""
    return list(dict.fromkeys(k[: -len("_s_per_step")] for r in rows for k in r if k.endswith("_s_per_step")))


def sizes_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One dict per point: medians over its rounds of every arm's s/step, tokens/s and roofline
    fraction, and of the per-round ratios TRL / polgrad (fp32, bf16) and polgrad fp32 / bf16."""
    out = []
    for label in dict.fromkeys(r["point"] for r in rows):
        rs = [r for r in rows if r["point"] == label]
        point: dict[str, Any] = {
            k: rs[0][k] for k in ("point", "axis", "params", "batch", "model_gflop_per_step")
        }
        point["rounds"] = len(rs)
        for a in _arms(rs):
            for col in ("s_per_step", "tokens_per_s", "roofline"):
                vals = [r[f"{a}_{col}"] for r in rs if f"{a}_{col}" in r]
                if vals:
                    point[f"{a}_{col}"] = median(vals)
        for key in ("speedup", "speedup_bf16", "polgrad_bf16_over_fp32"):
            vals = [r[key] for r in rs if key in r]
            if vals:
                point[key] = median(vals)
                point[f"{key}_min"], point[f"{key}_max"] = min(vals), max(vals)
        out.append(point)
    return out


def sizes_report(
    summary: list[dict[str, Any]], w: Workload, precisions: list[str], frameworks: list[str]
) -> list[str]:
    """The summary.md section: one line per point."""
    arms = [arm(fw, p) for p in precisions for fw in frameworks]
    head = "| point | params | rows | GFLOP/step | " + " | ".join(f"{a} s/step (roofline)" for a in arms)
    ratios = [
        k for k in ("speedup", "speedup_bf16", "polgrad_bf16_over_fp32") if any(k in s for s in summary)
    ]
    names = {
        "speedup": "TRL/polgrad fp32",
        "speedup_bf16": "TRL/polgrad bf16",
        "polgrad_bf16_over_fp32": "polgrad fp32/bf16",
    }
    head += "".join(f" | {names[k]} (min-max)" for k in ratios) + " |"
    rounds = summary[0]["rounds"] if summary else 0
    lines = [
        f"## Scaling with the model and the batch ({w.max_new_tokens} tokens per completion, "
        f"G = {w.group_size}; median of {rounds} interleaved rounds per point)",
        "",
        head,
        "|" + "---|" * (4 + len(arms) + len(ratios)),
    ]
    for s in summary:
        cells = [s["point"], f"{s['params'] / 1e6:.1f}M", str(s["batch"]), f"{s['model_gflop_per_step']:.0f}"]
        for a in arms:
            v = s.get(f"{a}_s_per_step")
            cells.append("-" if v is None else f"{v:.3f} ({s[f'{a}_roofline']:.0%})")
        for k in ratios:
            cells.append("-" if k not in s else f"{s[k]:.2f}x ({s[f'{k}_min']:.2f}-{s[f'{k}_max']:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def draw(summary: list[dict[str, Any]], path: str) -> None:
    """sizes.png: s/step against parameters, tokens/s against batch, TRL/polgrad at each point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = [s for s in summary if s["axis"] == "size"]
    batch = sorted(
        [s for s in summary if s["axis"] == "batch" or (s["point"].startswith(BATCH_MODEL + " "))],
        key=lambda s: s["batch"],
    )
    arms = _arms(summary)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for a in arms:
        xs = [s["params"] / 1e6 for s in size if f"{a}_s_per_step" in s]
        ys = [s[f"{a}_s_per_step"] for s in size if f"{a}_s_per_step" in s]
        axes[0].plot(xs, ys, "o-", label=a)
        xb = [s["batch"] for s in batch if f"{a}_tokens_per_s" in s]
        yb = [s[f"{a}_tokens_per_s"] for s in batch if f"{a}_tokens_per_s" in s]
        axes[1].plot(xb, yb, "o-", label=a)
    axes[0].set(
        xscale="log", yscale="log", xlabel="parameters (M)", ylabel="s / step", title="step time vs model"
    )
    axes[1].set(
        xscale="log",
        xlabel=f"rows per step ({BATCH_MODEL} model)",
        ylabel="tokens / s",
        title="throughput vs batch",
    )
    labels = [s["point"] for s in summary]
    for i, key in enumerate(("speedup", "speedup_bf16")):
        ys = [s.get(key, float("nan")) for s in summary]
        name = "TRL/polgrad fp32" if key == "speedup" else "TRL/polgrad bf16"
        axes[2].bar([x + 0.4 * i for x in range(len(summary))], ys, width=0.4, label=name)
    axes[2].axhline(1.0, color="k", lw=0.8)
    axes[2].set_xticks([x + 0.2 for x in range(len(summary))], labels, rotation=30, ha="right")
    axes[2].set(ylabel="TRL s/step / polgrad s/step", title="polgrad's lead (> 1: faster)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
