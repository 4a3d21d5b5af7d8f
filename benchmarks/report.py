"""Rows, CSVs and markdown for the bench's results: pairs, runs, numerics, composition, scaling."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from benchmarks.timing import median
from benchmarks.workers import interleaved
from benchmarks.workload import FRAMEWORKS, PHASES, POLGRAD_METRIC_PHASES, Workload
from polgrad.io import atomic_write_text


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
    return f"median {median(xs):.3f}  min {min(xs):.3f}  max {max(xs):.3f}"


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
            f"| {fw} | {median([r[f'{fw}_s_per_step'] for r in rows]):.3f} | "
            f"{median([r[f'{fw}_tokens_per_s'] for r in rows]):.0f} | "
            f"{median([r[f'{fw}_gen_tokens_per_s'] for r in rows]):.0f} | "
            f"{median([r[f'{fw}_peak_rss_mb'] for r in rows]):.0f} |"
        )
    if "speedup" in rows[0]:
        sp = [r["speedup"] for r in rows]
        lines += ["", f"speedup = TRL s/step / polgrad s/step per pair: {_stats(sp)}  (bar: >= 1.5)"]
    loads = [r["load_before"] for r in rows] + [r["load_after"] for r in rows]
    lines += [f"load average (1 min) over the pairs: {min(loads):.2f} .. {max(loads):.2f}", ""]
    lines += ["Phase medians (seconds per step; `sample` is inside `gen`):", ""]
    lines += ["| phase | " + " | ".join(frameworks) + " |", "|---|" + "---|" * len(frameworks)]
    for ph in PHASES:
        vals = [median([r[f"{fw}_{ph}_s"] for r in rows]) for fw in frameworks]
        lines.append(f"| {ph} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    if "polgrad" in frameworks:
        lines += [
            "",
            "polgrad metrics.jsonl phases (median s): "
            + ", ".join(
                f"{ph}={median([r[f'polgrad_metrics_{ph}_s'] for r in rows]):.4f}"
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
    """One row per run (framework, pair, every step time, every phase median): grpo_vs_trl_runs.csv."""
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
