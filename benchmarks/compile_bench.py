"""`python -m benchmarks.bench --only compile`: polgrad's GRPO step eager vs `train.compile = True`.

Both arms run the bench workload (`--preset`, prompts x G x L, the precision of `--precision`'s
first entry) in fresh worker processes, interleaved A B / B A over `--compile-pairs` rounds:

    polgrad           the default, eager
    polgrad_compiled  train.compile = True: the policy's, reference's and critic's forwards (and the
                      backward) and the lean decode step compiled by inductor (polgrad/models/compiled.py)

Per round: each arm's s/step (median of the measured steps, as the compare), the compile
overhead = (compiled - eager time to the end of the warm-up steps) - warm-up steps x (compiled - eager
s/step), and the break-even step = overhead / (eager - compiled s/step): a run with more steps
than that gains from compiling. Inductor caches compiled kernels on disk: the bench points
TORCHINDUCTOR_CACHE_DIR at a fresh folder, so round 1 compiles cold (a user's first run) and
later rounds find the cache warm (every later run on that machine); both are reported.
"""

from __future__ import annotations

from typing import Any

from benchmarks.timing import median

ARMS = ("polgrad", "polgrad_compiled")


def compile_rows(pairs: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """One CSV row per round: each arm's s/step and start-up, the speedup, overhead and break-even
    (`warmup`: the workload's warm-up steps, inside each arm's `startup_s`)."""
    rows = []
    for p in pairs:
        e, c = p["polgrad"], p["polgrad_compiled"]
        saving = e["s_per_step"] - c["s_per_step"]
        overhead = (c["startup_s"] - e["startup_s"]) - warmup * (c["s_per_step"] - e["s_per_step"])
        rows.append(
            {
                "pair": p["pair"],
                "order": p["order"],
                "cache": "cold" if p["pair"] == 1 else "warm",
                "load_before": p["load_before"],
                "eager_s_per_step": e["s_per_step"],
                "compiled_s_per_step": c["s_per_step"],
                "speedup": e["s_per_step"] / c["s_per_step"],
                "compile_overhead_s": overhead,
                "break_even_steps": overhead / saving if saving > 0 else float("inf"),
            }
        )
    return rows


def compile_report(rows: list[dict[str, Any]], label: str) -> list[str]:
    """The summary.md section: per-round table and the medians."""
    lines = [
        f"## train.compile = True vs eager ({label}; {len(rows)} interleaved rounds, round 1 with a cold "
        "inductor cache)",
        "",
        "| round | cache | eager s/step | compiled s/step | speedup | compile overhead, s | break-even |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pair']} | {r['cache']} | {r['eager_s_per_step']:.3f} | {r['compiled_s_per_step']:.3f} "
            f"| {r['speedup']:.2f}x | {r['compile_overhead_s']:.1f} | {r['break_even_steps']:.0f} |"
        )
    warm = [r for r in rows if r["cache"] == "warm"]
    line = (
        f"Median speedup {median([r['speedup'] for r in rows]):.2f}x; compile overhead cold "
        f"{rows[0]['compile_overhead_s']:.1f} s, break-even step cold {rows[0]['break_even_steps']:.0f}"
    )
    if warm:
        overhead = median([r["compile_overhead_s"] for r in warm])
        line += (
            f"; warm (median of {len(warm)}): overhead {overhead:.1f} s, "
            f"break-even step {median([r['break_even_steps'] for r in warm]):.0f}"
        )
    lines += ["", line + ". Recompiles for new shapes after the warm-up steps are inside the medians."]
    return lines
