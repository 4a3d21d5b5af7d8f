"""`python -m studies.overoptimization experiments/overoptimization.gin`: the over-optimisation
analysis of a finished (or resumed) sweep of that experiment (studies/overoptimization/fits.py).

    1. best-of-n: for each seed, the warm start of its cells sampled `--samples` times on each of the
       first `--prompts` held-out prompts and ranked by the seed's single reward model (best_of_n.py)
       -> results/<name>/<name>_best_of_n.csv (a seed already there is not redone)
    2. points: every ok cell's metrics.jsonl cut into windows of WINDOW steps
       -> results/<name>/<name>_points.csv (needs the run folders results/<name>/runs/)
    3. the report from those two CSVs and the sweep's CSV alone: Gao-style fits of the gold (and proxy)
       minus its start against d = sqrt(KL) per family, their peaks with seed-bootstrap CIs, the
       declared predictions' verdicts -> results/<name>/<name>_gao.md and _gao.png

`--report-only` redoes step 3 from the committed CSVs (no run folders, no model).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import ConfigError, PolgradError
from polgrad.io import atomic_path
from polgrad.results.migrate import refuse_old_layout
from polgrad.results.paths import csv_path, meta_path, output
from polgrad.results.provenance import environment, outputs
from polgrad.results.report import write_report
from polgrad.results.store import read_metrics, read_rows
from polgrad.run_folder import RunFolder
from polgrad.sweep.experiment import Experiment, load_experiment
from polgrad.sweep.grid import expand
from studies.overoptimization import fits as oo
from studies.overoptimization import scaling
from studies.overoptimization.columns import KL_COLUMNS
from studies.overoptimization.columns import rm_columns as _rm_columns
from studies.overoptimization.columns import short as _short
from studies.overoptimization.gao_md import markdown

NS = (1, 2, 4, 8, 16, 32, 64)


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with atomic_path(path, suffix=".csv") as tmp, open(tmp, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def _rm_cells(exp: Experiment, seed: int) -> dict[tuple[str, ...], Any]:
    """One cell of `seed` per reward-model configuration (the first in grid order)."""
    columns, out = _rm_columns(exp), {}
    for cell in expand(exp):
        swept = dict(cell.swept)
        key = tuple(swept.get(c, "") for c in columns)
        if cell.seed == seed and key not in out:
            out[key] = cell
    return out


def best_of_n_stage(
    exp: Experiment, results_dir: Path, *, prompts: int, samples: int
) -> list[dict[str, Any]]:
    """Best-of-n rows of every seed and reward-model configuration (the proxy the runs of that
    configuration train on; the same samples, seeded by the seed, for every configuration), in
    <name>_best_of_n.csv of the experiment's folder. Rows already there are kept and not redone."""
    path = output(exp.name, results_dir, "_best_of_n.csv")
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
            env = environment(ignore=outputs(exp.name, results_dir))
            what = ", ".join(f"{c} = {v}" for c, v in zip(columns, key, strict=True))
            gin.clear_config()
            parse_config(list(cell.config_files), [*cell.bindings, "train.progress = False"])
            try:
                cfg, algo, task = build()
                if cfg.reward_source != "reward_model":  # trained on the gold itself: no proxy to rank by
                    continue
                print(f"best-of-n: seed {seed}, {what} ({prompts} x {samples} samples)", file=sys.stderr)
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
    cells = [r for r in read_rows(csv_path(exp.name, results_dir)) if r.get("status") == "ok"]
    swept = exp.swept_columns
    rows = []
    for r in cells:
        metrics = read_metrics(RunFolder(results_dir / r["run_dir"]).metrics)
        if scaling.is_gold(r) and not any("gold_reward_mean" in m for m in metrics):
            # a run on the task's own reward logs no gold beside it: its reward is the gold (and its proxy)
            metrics = [{**m, "gold_reward_mean": m.get("reward_mean")} for m in metrics]
        if not metrics:
            raise PolgradError(
                f"{results_dir / r['run_dir']}: no metrics.jsonl; the points need the sweep's run folders "
                "(or use --report-only with the committed results/<name>/<name>_points.csv)"
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


def report(exp: Experiment, results_dir: Path, *, bootstrap: int = oo.BOOTSTRAP) -> Path:
    """results/<name>/<name>_gao.md and .png from the three CSVs alone."""
    name = exp.name
    points = [
        _num(r, "d", "kl", "proxy", "gold", "seed", "step")
        for r in read_rows(output(name, results_dir, "_points.csv"))
    ]
    for p in points:
        p["seed"] = int(p["seed"])
    bon = [
        _num(r, "n", "kl", "sqrt_kl", "kl_bound", "proxy", "gold", "seed")
        for r in read_rows(output(name, results_dir, "_best_of_n.csv"))
    ]
    sweep_rows = read_rows(csv_path(name, results_dir))
    if not points:
        raise PolgradError(
            f"{output(name, results_dir, '_points.csv')}: no points; run without --report-only first"
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
    scaled: list[scaling.Scaled] = []
    if scaling.AXIS in fam_cols:  # the proxy's preference pairs are swept: how the RL fit moves with them
        scaled = scaling.scale(
            {f: (scaling.pairs_of(by_family[f][0]), by_family[f], starts[f]) for f in families},
            bootstrap=bootstrap,
        )
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
    gao = gao_forms(
        bon, init, rm_key, rm_label, by_family, starts, curves, family_of, bon_curves, gold_fits, bootstrap
    )
    png = output(name, results_dir, f"{oo.SUFFIX}.png")
    title = f"{name}: gold and proxy against sqrt(KL), {len(seeds)} seeds"
    oo.draw(png, title, curves, family_of, gold_fits, bon_curves, rl_fits=gao.rl, bon_fits=gao.bon)
    md = markdown(
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
        gao,
        scaled,
    ).replace("{START}", " and ".join(sorted(set(start_of.values()))))
    path = output(name, results_dir, f"{oo.SUFFIX}.md")
    with atomic_path(path, suffix=".md") as tmp:
        tmp.write_text(md)
    return path


@dataclasses.dataclass(frozen=True)
class GaoForms:
    """Gao et al.'s two forms on the data (not declared): best-of-n fitted with d (alpha - beta d) per
    reward-model configuration (`bon`, keyed by its best-of-n label), RL with d (alpha - beta log d) per
    family (`rl`), and the R^2 of every fit over the means over seeds (`r2_means`, keyed by (curve, form):
    best-of-n's per n, RL's per configuration and window), the declared RL fits' too."""

    bon: dict[str, oo.Fit]
    rl: dict[str, oo.Fit]
    r2_means: dict[tuple[str, str], float]
    free: dict[tuple[str, str], oo.FreeFit]  # (family, 'bon' declared / 'rl') -> its free-intercept fit


def gao_forms(
    bon, init, rm_key, rm_label, by_family, starts, curves, family_of, bon_curves, declared, bootstrap
):
    """GaoForms from the best-of-n rows and the RL points, each seed's start subtracted (`init`)."""
    rl = {
        f: oo.fit_family(pts, starts[f], "gold", bootstrap=bootstrap, form="rl")
        for f, pts in by_family.items()
    }
    bon_fits: dict[str, oo.Fit] = {}
    for key in sorted({rm_key(b) for b in bon}):
        pts = [
            {"seed": int(b["seed"]), "d": b["sqrt_kl"], "gold": b["gold"], "proxy": b["proxy"]}
            for b in bon
            if rm_key(b) == key and (int(b["seed"]), key) in init
        ]
        if pts:
            start = {s: init[(s, key)] for s in {p["seed"] for p in pts}}
            bon_fits["best-of-n · " + rm_label(key)] = oo.fit_family(pts, start, "gold", bootstrap=bootstrap)

    def r2(fit: oo.Fit, means: list[tuple[float, float]]) -> float:
        if not means or math.isnan(fit.alpha):
            return math.nan
        d, y = zip(*means, strict=True)
        return oo.r_squared(y, oo.predict(fit.form, fit.alpha, fit.beta, d))

    r2_means: dict[tuple[str, str], float] = {}
    for label, fit in bon_fits.items():
        r2_means[(label, "bon")] = r2(fit, [(m["sqrt_kl"], m["gold"]) for m in bon_curves.get(label, [])])
    for f, fit in rl.items():
        means = [(m["d"], m["gold"]) for c, pts in curves.items() if family_of[c] == f for m in pts]
        r2_means[(f, "rl")] = r2(fit, means)
        r2_means[(f, "bon")] = r2(declared[f], means)
    free = {
        (f, fit.form): oo.free_fit(by_family[f], starts[f], fit)
        for fits in (declared, rl)
        for f, fit in fits.items()
    }
    return GaoForms(bon_fits, rl, r2_means, free)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m studies.overoptimization",
        description="After a sweep of an experiment trained on a learned reward model: best-of-n per seed, "
        "the runs' gold and proxy against sqrt(KL), Gao-style fits with seed-bootstrap CIs, "
        "results/<name>/<name>_gao.md and .png (see the module docstring).",
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
                "the experiment's report quotes this analysis"
            )
        results_dir = Path(args.results)
        refuse_old_layout(exp.name, results_dir)  # else best-of-n would be sampled again beside the old
        if not args.report_only:
            best_of_n_stage(exp, results_dir, prompts=args.prompts, samples=args.samples)
            points_stage(exp, results_dir, output(exp.name, results_dir, "_points.csv"))
        path = report(exp, results_dir, bootstrap=args.bootstrap)
        if meta_path(exp.name, results_dir).exists():  # its md quotes this one's answer
            write_report(exp.name, results_dir)
    except PolgradError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(os.fspath(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
