"""`python -m studies.overoptimization experiments/overoptimization.gin`: the over-optimisation
analysis of a finished (or resumed) sweep of that experiment (studies/overoptimization/fits.py).

    1. best-of-n: for each seed, the warm start of its cells sampled `--samples` times on each of the
       first `--prompts` held-out prompts and ranked by the seed's single reward model (best_of_n.py)
       -> results/<name>_best_of_n.csv (a seed already there is not redone)
    2. points: every ok cell's metrics.jsonl cut into windows of WINDOW steps
       -> results/<name>_points.csv (needs the run folders results/<name>/runs/)
    3. the report from those two CSVs and the sweep's CSV alone: Gao-style fits of the gold (and proxy)
       minus its start against d = sqrt(KL) per family, their peaks with seed-bootstrap CIs, the
       declared predictions' verdicts -> results/<name>_gao.md and results/<name>_gao.png

`--report-only` redoes step 3 from the committed CSVs (no run folders, no model).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import ConfigError, PolgradError
from polgrad.io import atomic_path
from polgrad.results.provenance import environment, outputs
from polgrad.results.report import write_report
from polgrad.results.store import read_metrics, read_rows
from polgrad.run_folder import RunFolder
from polgrad.sweep.experiment import Experiment, load_experiment
from polgrad.sweep.grid import expand
from studies.overoptimization import STUDY
from studies.overoptimization import fits as oo

KL_COLUMNS = ("Algorithm.kl_coef", "Algorithm.kl_controller")  # the KL control: varies within a family
ENSEMBLE = "train.rm_ensemble"
NS = (1, 2, 4, 8, 16, 32, 64)


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with atomic_path(path, suffix=".csv") as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def _rm_columns(exp: Experiment) -> list[str]:
    """The swept columns that are neither the KL control nor the seed: what makes a reward-model
    configuration (e.g. train.rm_ensemble, train.rm_combine); with the spec, a family."""
    return [c for c in exp.swept_columns if c not in KL_COLUMNS]


def _rm_cells(exp: Experiment, seed: int) -> dict[tuple[str, ...], Any]:
    """One cell of `seed` per reward-model configuration (the first in grid order)."""
    columns, out = _rm_columns(exp), {}
    for cell in expand(exp):
        swept = dict(cell.swept)
        key = tuple(swept.get(c, "") for c in columns)
        if cell.seed == seed and key not in out:
            out[key] = cell
    return out


def best_of_n_stage(exp: Experiment, path: Path, *, prompts: int, samples: int) -> list[dict[str, Any]]:
    """Best-of-n rows of every seed and reward-model configuration (the proxy the runs of that
    configuration train on; the same samples, seeded by the seed, for every configuration). Rows already
    in `path` are kept and not redone."""
    import gin

    from polgrad.config import build, parse_config
    from studies.overoptimization.best_of_n import best_of_n

    columns = _rm_columns(exp)
    rows = [dict(r) for r in read_rows(path)] if path.exists() else []
    done = {(int(r["seed"]), *(r.get(c, "") for c in columns)) for r in rows}
    for seed in exp.seeds:
        for key, cell in _rm_cells(exp, seed).items():
            if (seed, *key) in done:
                continue
            env = environment(ignore=outputs(exp.name, path.parent, STUDY.outputs))
            what = ", ".join(f"{c} = {v}" for c, v in zip(columns, key, strict=True))
            print(f"best-of-n: seed {seed}, {what} ({prompts} prompts x {samples} samples)", file=sys.stderr)
            gin.clear_config()
            parse_config(list(cell.config_files), [*cell.bindings, "train.progress = False"])
            try:
                cfg, algo, task = build()
                ns = [n for n in NS if n <= samples]
                found = best_of_n(cfg, algo, task, ns=ns, prompts=prompts, samples=samples, seed=seed)
            finally:
                gin.clear_config()
            for r in found:
                rm = dict(zip(columns, key, strict=True))
                rows.append({"seed": seed, **rm, **r, "git_commit": env["git_commit"], "cpu": env["cpu"]})
            _write_csv(path, rows)  # after every one: a stop loses at most the one in progress
    return rows


def points_stage(exp: Experiment, results_dir: Path, path: Path) -> list[dict[str, Any]]:
    """The points of every ok cell of the sweep's CSV, from its run folder's metrics.jsonl."""
    cells = [r for r in read_rows(results_dir / f"{exp.name}.csv") if r.get("status") == "ok"]
    swept = exp.swept_columns
    rows = []
    for r in cells:
        metrics = read_metrics(RunFolder(results_dir / r["run_dir"]).metrics)
        if not metrics:
            raise PolgradError(
                f"{results_dir / r['run_dir']}: no metrics.jsonl; the points need the sweep's run folders "
                "(or use --report-only with the committed results/<name>_points.csv)"
            )
        base = {"cell_id": r["cell_id"], "spec": r["spec"], "seed": int(r["seed"])}
        base.update({c: r.get(c, "") for c in swept})
        first = metrics[0]  # step 1 samples the warm start (KL 0): the run's own start, step 0
        if all(isinstance(first.get(k), (int, float)) for k in ("reward_mean", "gold_reward_mean")):
            start = {"proxy": first["reward_mean"], "gold": first["gold_reward_mean"]}
            rows.append({**base, "step": 0, "kl": 0.0, "d": 0.0, **start})
        rows += [{**base, **p} for p in oo.run_points(metrics)]
    _write_csv(path, rows)
    return rows


def _num(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    out = dict(row)
    for k in keys:
        out[k] = float(out[k])
    return out


def _short(value: str) -> str:
    return value.replace("@kl_controller.", "").replace("@reward_ensemble.", "")


def report(exp: Experiment, results_dir: Path, *, bootstrap: int = oo.BOOTSTRAP) -> Path:
    """results/<name>_gao.md and .png from the three CSVs alone."""
    name = exp.name
    points = [
        _num(r, "d", "kl", "proxy", "gold", "seed", "step")
        for r in read_rows(results_dir / f"{name}_points.csv")
    ]
    for p in points:
        p["seed"] = int(p["seed"])
    bon = [
        _num(r, "n", "kl", "sqrt_kl", "kl_bound", "proxy", "gold", "seed")
        for r in read_rows(results_dir / f"{name}_best_of_n.csv")
    ]
    sweep_rows = read_rows(results_dir / f"{name}.csv")
    if not points:
        raise PolgradError(
            f"{results_dir / f'{name}_points.csv'}: no points; run without --report-only first"
        )
    fam_cols = _rm_columns(exp)
    kl_cols = [c for c in exp.swept_columns if c in KL_COLUMNS]

    def rm_key(row) -> tuple[str, ...]:
        return tuple(str(row.get(c, "")) for c in fam_cols)

    def rm_label(key) -> str:
        return " · ".join(f"{c.split('.')[-1]} {_short(v)}" for c, v in zip(fam_cols, key, strict=True))

    def family(p) -> str:
        return " · ".join(x for x in (p["spec"], rm_label(rm_key(p))) if x)

    def control(p) -> str:
        return ", ".join(f"{c.split('.')[-1]} {_short(p[c])}" for c in kl_cols)

    # each seed's start under each reward-model configuration: best-of-1 of the warm start (its proxy is
    # that configuration's: an ensemble's worst case is not the single model's score)
    init: dict[tuple, dict[str, float]] = {}
    start_of: dict[tuple, str] = {}
    for key in sorted({rm_key(p) for p in points}):
        for s in sorted({p["seed"] for p in points}):
            one = [b for b in bon if int(b["seed"]) == s and b["n"] == 1 and rm_key(b) == key]
            if one:
                init[(s, key)] = {"proxy": one[0]["proxy"], "gold": one[0]["gold"]}
                start_of[(s, key)] = "best-of-1"
                continue
            # no best-of-n: the step-0 points of its runs (their first step samples the warm start)
            first = [p for p in points if p["seed"] == s and rm_key(p) == key and p["step"] == 0]
            if not first:
                raise PolgradError(
                    f"{results_dir / f'{name}_best_of_n.csv'}: no best-of-1 row and no step-0 point for "
                    f"seed {s}, {rm_label(key)}: run python -m studies.overoptimization without "
                    "--report-only"
                )
            init[(s, key)] = {k: sum(p[k] for p in first) / len(first) for k in ("proxy", "gold")}
            start_of[(s, key)] = "first step"
    seeds = sorted({s for s, _ in init})
    families = sorted({family(p) for p in points})
    by_family = {f: [p for p in points if family(p) == f] for f in families}
    starts = {f: {s: init[(s, rm_key(by_family[f][0]))] for s in seeds} for f in families}
    gold_fits = {f: oo.fit_family(by_family[f], starts[f], "gold", bootstrap=bootstrap) for f in families}
    proxy_fits = {f: oo.fit_family(by_family[f], starts[f], "proxy", bootstrap=bootstrap) for f in families}

    def delta(p, k: str) -> float:
        return p[k] - init[(p["seed"], rm_key(p))][k] if k in ("gold", "proxy") else p[k]

    # per configuration, the mean over seeds of each window (the figure's lines and the final values)
    curves: dict[str, list[dict[str, float]]] = {}
    family_of: dict[str, str] = {}
    for f in families:
        for c in sorted({control(p) for p in by_family[f]}):
            pts = [p for p in by_family[f] if control(p) == c]
            label = f"{f} · {c}"
            family_of[label] = f
            curves[label] = []
            for st in sorted({p["step"] for p in pts}):
                at = [p for p in pts if p["step"] == st]
                mean = {k: sum(delta(p, k) for p in at) / len(at) for k in ("d", "kl", "gold", "proxy")}
                curves[label].append({"step": st, **mean, "seeds": len(at)})
    # runs that over-optimised: the gold of their last window below its start while the proxy rose
    failures = []
    for cell in sorted({p["cell_id"] for p in points}):
        pts = sorted((p for p in points if p["cell_id"] == cell), key=lambda p: p["step"])
        last = pts[-1]
        if oo.over_optimised(delta(last, "gold"), delta(last, "proxy")):
            failures.append((cell, last, init[(last["seed"], rm_key(last))]))
    bon_curves: dict[str, list[dict[str, float]]] = {}
    for key in sorted({rm_key(b) for b in bon}):
        label = "best-of-n · " + rm_label(key)
        for n in sorted({b["n"] for b in bon if rm_key(b) == key}):
            at = [b for b in bon if b["n"] == n and rm_key(b) == key and (int(b["seed"]), key) in init]
            if not at:
                continue
            mean = {
                k: sum(b[k] - init[(int(b["seed"]), key)][k] for b in at) / len(at) for k in ("gold", "proxy")
            }
            mean.update({k: sum(b[k] for b in at) / len(at) for k in ("kl", "kl_bound")})
            mean["sqrt_kl"] = math.sqrt(max(mean["kl"], 0.0))  # the d of the mean KL over seeds
            bon_curves.setdefault(label, []).append({"n": n, **mean, "seeds": len(at)})
    png = results_dir / f"{name}{oo.SUFFIX}.png"
    title = f"{name}: gold and proxy against sqrt(KL), {len(seeds)} seeds"
    oo.draw(png, title, curves, family_of, gold_fits, bon_curves)
    md = _markdown(
        exp,
        sweep_rows,
        bon,
        bon_curves,
        curves,
        gold_fits,
        proxy_fits,
        by_family,
        starts,
        failures,
        bootstrap,
    ).replace("{START}", " and ".join(sorted(set(start_of.values()))))
    path = results_dir / f"{name}{oo.SUFFIX}.md"
    with atomic_path(path, suffix=".md") as tmp:
        tmp.write_text(md)
    return path


def _f(x: float, digits: int = 3) -> str:
    if isinstance(x, float) and math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if isinstance(x, float) and math.isnan(x):
        return "–"
    return f"{x:.{digits}g}"


def _markdown(
    exp, sweep_rows, bon, bon_curves, curves, gold_fits, proxy_fits, by_family, starts, failures, bootstrap
):
    seeds = sorted({s for st in starts.values() for s in st})
    commits = sorted({r.get("git_commit", "?") for r in sweep_rows} | {b.get("git_commit", "?") for b in bon})
    cpus = sorted({r.get("cpu", "") for r in sweep_rows if r.get("cpu")})
    rm_cols = _rm_columns(exp)
    rm_acc: dict[str, dict[int, list[float]]] = {}  # reward-model configuration -> seed -> its cells'
    for r in sweep_rows:
        if r.get("rm_heldout_accuracy") not in (None, ""):
            config = " · ".join(f"{c.split('.')[-1]} {_short(str(r.get(c, '')))}" for c in rm_cols)
            acc = float(r["rm_heldout_accuracy"])
            rm_acc.setdefault(config, {}).setdefault(int(r["seed"]), []).append(acc)
    lines = [
        f"# {exp.name}: gold and proxy against sqrt(KL) (Gao et al. 2023)",
        "",
        f"**Question.** {exp.question}",
        "",
        f"Seeds {', '.join(map(str, seeds))} ({len(seeds)}) · commits {', '.join(commits)} · "
        f"CPU {'; '.join(cpus) or '?'} · "
        f"bootstrap {bootstrap} resamples of the seeds · points: windows of {oo.WINDOW} steps.",
        "",
        "Reward models: held-out pairwise accuracy per seed (an ensemble's is its members' mean), per "
        "reward-model configuration, and its mean over seeds: "
        + "; ".join(
            f"{config or 'one'}: "
            + ", ".join(f"seed {s} {sum(v) / len(v):.3f}" for s, v in sorted(by_seed.items()))
            + f" (mean {sum(sum(v) / len(v) for v in by_seed.values()) / len(by_seed):.3f})"
            for config, by_seed in sorted(rm_acc.items())
        ),
        "",
        "Every gold and proxy value is minus the seed's start under its reward-model configuration, "
        "scored by that configuration's proxy; the start used here: {START} (best-of-1: the warm start's "
        "samples on the held-out prompts; first step: the runs' first step, sampled from the warm start). "
        "d = sqrt(KL(pi || pi_init)) in nats^0.5 per response: for RL the exact KL summed along each "
        "sampled response; for best-of-n the plug-in estimate from its samples (at most log n − (n−1)/n, "
        "the column 'bound').",
        "",
        "## Best-of-n (the warm start, no training), mean over seeds",
        "",
        "| ranked by | n | KL (nats) | bound | d | proxy − start | gold − start |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {label.removeprefix('best-of-n · ')} | {b['n']:g} | {_f(b['kl'])} | {_f(b['kl_bound'])} "
        f"| {_f(b['sqrt_kl'])} | {_f(b['proxy'])} | {_f(b['gold'])} |"
        for label, rows in bon_curves.items()
        for b in rows
    ]
    lines += [
        "",
        "## Fitted gold curves d (alpha − beta d), per family (all its KL controls pooled)",
        "",
        "| family | seeds | points | alpha | beta | peak d* | KL at peak | 95% CI of d* | d max "
        "| peak inside the data |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f, fit in gold_fits.items():
        kl_peak = fit.d_peak**2 if math.isfinite(fit.d_peak) else fit.d_peak
        lines.append(
            f"| {f} | {fit.seeds} | {fit.points} | {_f(fit.alpha)} | {_f(fit.beta)} | {_f(fit.d_peak)} "
            f"| {_f(kl_peak)} | "
            f"[{_f(fit.ci[0])}, {_f(fit.ci[1])}] | {_f(fit.d_max)} | {'yes' if fit.interior else 'no'} |"
        )
    lines += [
        "",
        "## Sensitivity, added after the data (not declared): the gold fit with a free intercept",
        "",
        "The declared fit passes through the start (0 at d = 0), while the runs' own first step (d = 0) sits "
        "off it ('first step', the mean of those points). c + alpha d − beta d^2 instead, by least squares "
        "on the same points: where its maximum over d ≥ 0 lies.",
        "",
        "| family | first step | c | alpha | beta | maximiser d | among the points (d > 0 to d max) |",
        "|---|---|---|---|---|---|---|",
    ]
    d_mins = {f: min((p["d"] for p in by_family[f] if p["d"] > 0), default=math.nan) for f in gold_fits}
    for f, fit in gold_fits.items():
        d, y = oo.deltas(by_family[f], starts[f], "gold")
        c, a, b = oo.fit_with_intercept(d, y)
        first = [yi for di, yi in zip(d, y, strict=True) if di == 0]
        top, d_min = oo.peak(a, b), d_mins[f]
        lines.append(
            f"| {f} | {_f(sum(first) / len(first)) if first else '–'} | {_f(c)} | {_f(a)} | {_f(b)} "
            f"| {_f(top)} | {'yes' if d_min < top < fit.d_max else f'no (smallest d > 0: {_f(d_min)})'} |"
        )
    lines += ["", "## Per configuration: the last window, mean over seeds", ""]
    lines += [
        "| configuration | final KL (nats) | final d | proxy − start | gold − start | failure |",
        "|---|---|---|---|---|---|",
    ]
    for label, pts in curves.items():
        last = pts[-1]
        fail = (
            "gold fell below its start while the proxy rose (over-optimised)"
            if oo.over_optimised(last["gold"], last["proxy"])
            else ""
        )
        lines.append(
            f"| {label} | {_f(last['kl'])} | {_f(last['d'])} | {_f(last['proxy'])} | {_f(last['gold'])} "
            f"| {fail} |"
        )
    lines += ["", "## Runs that over-optimised (named, not averaged away)", ""]
    lines += [
        f"- {cell} (seed {last['seed']}): gold {_f(start['gold'])} → {_f(last['gold'])} while its proxy "
        f"rose {_f(start['proxy'])} → {_f(last['proxy'])}, at KL {_f(last['kl'])} nats (last window, "
        f"step {last['step']:g})"
        for cell, last, start in failures
    ] or ["None: no run ended with its gold below its start while its proxy rose."]
    lines += ["", "## Declared predictions (experiment file), checked by the declared method", ""]
    verdicts: dict[str, list[str]] = {}  # claim -> "verdict: family (numbers)" for the answer
    for f in gold_fits:
        pf, gf = proxy_fits[f], gold_fits[f]
        rho = oo.spearman(*oo.deltas(by_family[f], starts[f], "proxy"))
        # P1 in two readings, both declared at the tag: the gin's words (its fit has no peak inside the
        # measured range) and the report code's, which also wants the fit rising from d = 0 (alpha > 0)
        no_peak = "undetermined" if math.isnan(pf.d_peak) else ("does not hold" if pf.interior else "holds")
        rises = (
            "undetermined"
            if no_peak == "undetermined"
            else "holds"
            if no_peak == "holds" and pf.alpha > 0
            else "does not hold"
        )
        gold_word = (
            "undetermined"
            if math.isnan(gf.d_peak)
            else "supported"
            if gf.interior and 0 < gf.ci[0] and gf.ci[1] < gf.d_max
            else ("not established" if gf.interior else "not seen")
        )
        gold_why = {
            "undetermined": "the fit is undetermined",
            "supported": "the fitted peak and its 95% CI lie inside (0, d max)",
            "not established": "the fitted peak lies inside the data but its CI does not",
            "not seen": "no peak inside the measured range",
        }[gold_word]
        peak = f"d* {_f(gf.d_peak)}, CI [{_f(gf.ci[0])}, {_f(gf.ci[1])}]"
        verdicts.setdefault("gold", []).append(f"{gold_word}: {f} ({peak})")
        verdicts.setdefault("proxy_gin", []).append(f"{no_peak}: {f}")
        verdicts.setdefault("proxy", []).append(f"{rises}: {f}")
        lines.append(
            f"- **{f}**: proxy rises monotonically with KL — as the gin words the test (its fit has no peak "
            f"inside the measured range): {no_peak}; as the report code also requires (the fit rising from "
            f"d = 0, alpha > 0): {rises} ({oo.shape(pf.alpha, pf.beta, d_mins[f], pf.d_max)}; proxy fit "
            f"peak d* {_f(pf.d_peak)} vs d max {_f(pf.d_max)}; Spearman rho(d, proxy) {_f(rho)}). Gold peaks "
            f"at an intermediate KL — {gold_word}: {gold_why} ({peak})."
        )
    singles = [f for f in gold_fits if f"{ENSEMBLE.split('.')[-1]} 1" in f.split(" · ")]
    for f in gold_fits:
        if f in singles:
            continue
        base = next((s for s in singles if s.split(" · ")[0] == f.split(" · ")[0]), None)
        if base is None:
            continue
        diff, ci = oo.peak_difference(
            by_family[f], by_family[base], starts[f], starts[base], bootstrap=bootstrap
        )
        verdict = "supported" if ci[0] > 0 else ("refuted" if ci[1] < 0 else "not established")
        verdicts.setdefault("ensemble", []).append(
            f"{verdict}: {f.split(' · ')[0]} ({_f(diff, 2)} [{_f(ci[0], 2)}, {_f(ci[1], 2)}])"
        )
        lines.append(
            f"- **{f}** vs **{base}**: the ensemble's gold peaks at a larger KL — {verdict} "
            f"(d* difference {_f(diff)}, paired seed-bootstrap 95% CI [{_f(ci[0])}, {_f(ci[1])}])."
        )
    answer = (
        f"**Answer.** These {len(seeds)} seeds cannot answer the question: a bootstrap over "
        f"{len(seeds)} seeds has at most {len(seeds) ** len(seeds)} distinct resamples, so its intervals "
        "describe these warm "
        "starts, not warm starts in general; the experiment's declared run on 10 other seeds is what would."
        if len(seeds) < 10
        else oo.answer(verdicts)
    )
    lines += [
        "",
        answer,
        "",
        f"![gold and proxy against sqrt(KL)]({exp.name}{oo.SUFFIX}.png)",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m studies.overoptimization",
        description="After a sweep of an experiment trained on a learned reward model: best-of-n per seed, "
        "the runs' gold and proxy against sqrt(KL), Gao-style fits with seed-bootstrap CIs, "
        "results/<name>_gao.md and .png (see the module docstring).",
    )
    parser.add_argument("experiment", help="experiment gin file, e.g. experiments/overoptimization.gin")
    parser.add_argument("--results", default="results", help="results folder (default: results)")
    parser.add_argument("--prompts", type=int, default=64, help="held-out prompts of best-of-n (default 64)")
    parser.add_argument(
        "--samples", type=int, default=64, help="samples per prompt of best-of-n (default 64)"
    )
    parser.add_argument(
        "--bootstrap", type=int, default=oo.BOOTSTRAP, help=f"seed resamples (default {oo.BOOTSTRAP})"
    )
    parser.add_argument("--report-only", action="store_true", help="only step 3, from the committed CSVs")
    args = parser.parse_args(argv)
    try:
        exp = load_experiment(args.experiment)
        if "studies.overoptimization" not in exp.studies:  # else its md would not quote this analysis
            line = exp.lines.get("studies")
            where = f"line {line}: Sweep.studies" if line else "Sweep.studies"
            raise ConfigError(
                f"{args.experiment}: {where} does not name 'studies.overoptimization': add it, so that "
                "the experiment's report quotes this analysis and its sweeps count its files as their own"
            )
        results_dir = Path(args.results)
        if not args.report_only:
            best_of_n_stage(
                exp, results_dir / f"{exp.name}_best_of_n.csv", prompts=args.prompts, samples=args.samples
            )
            points_stage(exp, results_dir, results_dir / f"{exp.name}_points.csv")
        path = report(exp, results_dir, bootstrap=args.bootstrap)
        if (results_dir / exp.name / "experiment.json").exists():  # its md quotes this one's answer
            write_report(exp.name, results_dir)
    except PolgradError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(os.fspath(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
