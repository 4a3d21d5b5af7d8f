"""Rows, CSVs and markdown for the bench's results: pairs, runs, numerics, composition, scaling."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from benchmarks.roofline import roofline_columns
from benchmarks.timing import median
from benchmarks.workers import interleaved
from benchmarks.workload import FRAMEWORKS, PHASES, POLGRAD_METRIC_PHASES, PRECISIONS, Workload, arm
from polgrad.io import atomic_write_text


def _check_lengths(w: Workload, run: dict[str, Any]) -> None:
    if w.eos == "never" and abs(run["min_tokens_per_completion"] - w.max_new_tokens) > 1e-9:
        raise RuntimeError(
            f"{run['framework']}: a completion had {run['min_tokens_per_completion']} tokens, "
            f"expected exactly {w.max_new_tokens} (EOS should be unreachable)"
        )


def arms_in(pair: dict[str, Any]) -> list[str]:
    """The arm keys (framework x precision, `workload.arm`) one round holds, in a fixed order."""
    return [arm(fw, p) for p in PRECISIONS for fw in FRAMEWORKS if arm(fw, p) in pair]


SPEEDUPS = ("speedup", "speedup_bf16", "polgrad_bf16_over_fp32", "trl_bf16_over_fp32")


def pair_rows(
    w: Workload,
    pairs: list[dict[str, Any]],
    n_params: int,
    flops: float | None = None,
    peak: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per round: every arm's s/step, tokens/s, RSS, phases, GFLOP/s and roofline fraction."""
    rows = []
    for p in pairs:
        row: dict[str, Any] = {
            "pair": p["pair"],
            "order": p["order"],
            "load_before": round(p["load_before"], 2),
            "load_after": round(p["load_after"], 2),
        }
        for key in arms_in(p):
            r = p[key]
            _check_lengths(w, r)
            row.update(
                {
                    f"{key}_s_per_step": r["s_per_step"],
                    f"{key}_tokens_per_s": r["tokens_per_s"],
                    f"{key}_gen_tokens_per_s": r["gen_tokens_per_s"],
                    f"{key}_tokens_per_step": r["tokens_per_step"],
                    f"{key}_peak_rss_mb": r["peak_rss_mb"],
                }
            )
            if flops is not None and peak is not None:
                precision = "bf16" if key.endswith("_bf16") else "fp32"
                cols = roofline_columns(flops, r["s_per_step"], peak[f"{precision}_gflops"])
                row.update({f"{key}_{k}": v for k, v in cols.items()})
            for ph in PHASES:
                row[f"{key}_{ph}_s"] = r["phases"][ph]
            if key.startswith("polgrad"):
                for ph in POLGRAD_METRIC_PHASES:
                    row[f"{key}_metrics_{ph}_s"] = r["metrics_phases"][ph]
                row[f"{key}_approx_kl"] = r["approx_kl"]
        row.update({k: p[k] for k in SPEEDUPS if k in p})
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
        if flops is not None:
            row["model_gflop_per_step"] = flops / 1e9
        if peak is not None:
            row.update(peak_fp32_gflops=peak["fp32_gflops"], peak_bf16_gflops=peak["bf16_gflops"])
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
    return f"median {median(xs):.3f}  min {min(xs):.3f}  max {max(xs):.3f}"


def logits_share(w: Workload, vocab: int, rows: list[dict[str, Any]], frameworks: Sequence[str]) -> list[str]:
    """Issue 41: the size of one fp32 copy of the logits a training forward keeps, [B, L+1, V] (the
    response positions and the last prompt position), its share of each fp32 run's median peak RSS, and
    what polgrad holds of them."""
    from polgrad.components.logit_rows import CHUNK_ELEMENTS

    b, t = w.batch, w.max_new_tokens + 1
    mb = b * t * vocab * 4 / 2**20
    shares = [
        f"{mb / median([r[f'{fw}_peak_rss_mb'] for r in rows]):.1%} of {fw}'s"
        for fw in frameworks
        if f"{fw}_peak_rss_mb" in rows[0]
    ]
    held = (
        f"above one chunk polgrad's fused path holds {CHUNK_ELEMENTS} of them "
        f"({CHUNK_ELEMENTS * 4 / 2**20:.0f} MiB fp32) at a time"
        if b * t * vocab > CHUNK_ELEMENTS
        else "they fit one chunk, which polgrad holds whole"
    )
    return [
        f"Logits: one fp32 copy of the [B, L+1, V] = [{b}, {t}, {vocab}] logits a training forward keeps "
        f"is {mb:,.0f} MiB, {' and '.join(shares)} fp32 peak RSS (median); {held}."
    ]


def compare_report(w: Workload, rows: list[dict[str, Any]], frameworks: Sequence[str]) -> list[str]:
    keys = [k for k in (arm(fw, p) for p in PRECISIONS for fw in frameworks) if f"{k}_s_per_step" in rows[0]]
    lines = [
        f"## polgrad vs TRL GRPOTrainer: {w.prompts} prompts x G={w.group_size}, "
        f"{w.max_new_tokens} new tokens, "
        f"{w.threads} threads, {len(rows)} interleaved rounds, {w.steps} measured steps per run",
        "",
        "| run | s/step (median of run medians) | tokens/s end to end | tokens/s sampling alone "
        "| peak RSS MB | GFLOP/s | roofline |",
        "|---|---|---|---|---|---|---|",
    ]

    def med(col: str, fmt: str) -> str:
        return format(median([r[col] for r in rows]), fmt) if col in rows[0] else "-"

    for k in keys:
        lines.append(
            f"| {k} | {med(f'{k}_s_per_step', '.3f')} | {med(f'{k}_tokens_per_s', '.0f')} | "
            f"{med(f'{k}_gen_tokens_per_s', '.0f')} | {med(f'{k}_peak_rss_mb', '.0f')} | "
            f"{med(f'{k}_gflops', '.1f')} | {med(f'{k}_roofline', '.3f')} |"
        )
    names = {
        "speedup": "TRL / polgrad s/step, fp32",
        "speedup_bf16": "TRL / polgrad s/step, bf16",
        "polgrad_bf16_over_fp32": "polgrad fp32 / polgrad bf16 s/step",
        "trl_bf16_over_fp32": "TRL fp32 / TRL bf16 s/step",
    }
    speedups = [k for k in SPEEDUPS if k in rows[0]]
    if speedups:
        lines += ["", "Per round (each ratio from runs of the same round; higher is better):", ""]
        lines += [f"- {names[k]}: {_stats([r[k] for r in rows])}" for k in speedups]
    kls = [k for k in keys if f"{k}_approx_kl" in rows[0]]
    if kls:
        lines += [
            "",
            "sampler/trainer approx_kl (polgrad, first update of each step: k3 of the trainer's log-probs "
            "against the sampler's, same weights): "
            + ", ".join(f"{k} {median([r[f'{k}_approx_kl'] for r in rows]):.2e}" for k in kls),
        ]
    loads = [r["load_before"] for r in rows] + [r["load_after"] for r in rows]
    lines += [f"load average (1 min) over the rounds: {min(loads):.2f} .. {max(loads):.2f}", ""]
    lines += ["Phase medians (seconds per step; `sample` is inside `gen`):", ""]
    lines += ["| phase | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for ph in PHASES:
        vals = [median([r[f"{k}_{ph}_s"] for r in rows]) for k in keys]
        lines.append(f"| {ph} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    for k in keys:
        if k.startswith("polgrad"):
            lines += [
                "",
                f"{k} metrics.jsonl phases (median s): "
                + ", ".join(
                    f"{ph}={median([r[f'{k}_metrics_{ph}_s'] for r in rows]):.4f}"
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
            fw: median(
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
                s = median([r["s_per_step"] for r in sub if r["value"] == v and r["framework"] == fw])
                per = s / v
                base[fw] = base[fw] or per
                cells.append(f"{s:.3f} | {per / base[fw]:.2f}")
            lines.append(f"| {v} | " + " | ".join(cells) + " |")
        for fw in frameworks:
            lines += ["", f"{fw} phases (median s/step) by {sweep}:", ""]
            lines += ["| " + sweep + " | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
            for v in values:
                vals = [
                    median([r[f"{ph}_s"] for r in sub if r["value"] == v and r["framework"] == fw])
                    for ph in PHASES
                ]
                lines.append(f"| {v} | " + " | ".join(f"{x:.4f}" for x in vals) + " |")
    return lines


def run_rows(pairs: list[dict[str, Any]], frameworks: Sequence[str]) -> list[dict[str, Any]]:
    """One row per run (arm, pair, every step time, every phase median): grpo_vs_trl_runs.csv."""
    runs = []
    for p in pairs:
        for key in arms_in(p):
            r = p[key]
            runs.append(
                {
                    "pair": p["pair"],
                    "framework": key.split("_")[0],
                    "precision": "bf16" if key.endswith("_bf16") else "fp32",
                    "s_per_step": r["s_per_step"],
                    "tokens_per_s": r["tokens_per_s"],
                    "gen_tokens_per_s": r["gen_tokens_per_s"],
                    "peak_rss_mb": r["peak_rss_mb"],
                    "step_times": " ".join(f"{x:.4f}" for x in r["step_times"]),
                    **{f"{ph}_s": r["phases"][ph] for ph in PHASES},
                }
            )
    return runs


def numerics_report(num: dict[str, Any]) -> list[str]:
    """The summary's section on `loss_numerics`' result."""
    return [
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


def composition_report(comp: list[dict[str, Any]]) -> list[str]:
    """The summary's section on `composition_overhead`'s rows."""
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
    return lines
