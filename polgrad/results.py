"""Leaderboards: the results CSV of a sweep, its markdown table and its learning-curve plot.

A sweep (`python -m polgrad.sweep experiments/X.gin`, see polgrad/sweep.py) writes, under the
results folder (default `results/`):

    X.csv                  one row per grid cell, upserted atomically as each cell ends
    X.md                   the grouped leaderboard (spec + swept bindings, mean ± 95% CI over seeds)
    X.png                  learning curves: reward_mean (and eval_accuracy) vs step, band over seeds
    X/experiment.json      what the sweep expanded to (cells, swept columns, primary metric, command)
    X/runs/<cell-id>/      config.gin, metrics.jsonl, summary.json, stdout.log, cell.json, checkpoints/

CSV columns: experiment, cell_id, spec, spec_file, one column per swept binding (named by the
binding, value = its gin text, e.g. `Algorithm.kl` = `@kl.k3`), seed, the summary metrics
(final_train_reward, eval_accuracy, kl, entropy, tokens_per_s, wall_time_s, peak_mem_mb, steps),
status (ok | failed), error, run_dir, and where it ran: git_commit, python, torch,
transformers, deepspeed, hostname, cpu_count, finished_at.

    >>> import polgrad.results
    >>> df = polgrad.results.load("kl_ablation")          # results/kl_ablation.csv as a DataFrame

`python -m polgrad.results X [--results DIR]` rewrites X.md and X.png from X.csv.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import functools
import importlib.metadata
import io
import json
import math
import os
import platform
import socket
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from polgrad.errors import DataError
from polgrad.io import atomic_write_text  # noqa: F401  (re-exported: callers use results.atomic_write_text)

# The metrics a trainer's summary.json carries, in the order they appear in the CSV and the table.
METRICS = (
    "final_train_reward",
    "eval_accuracy",
    "kl",
    "entropy",
    "tokens_per_s",
    "wall_time_s",
    "peak_mem_mb",
)
FRONT_COLUMNS = ("experiment", "cell_id", "spec", "spec_file")
BACK_COLUMNS = (
    "seed",
    *METRICS,
    "steps",
    "status",
    "error",
    "run_dir",
    "git_commit",
    "python",
    "torch",
    "transformers",
    "deepspeed",
    "hostname",
    "cpu_count",
    "finished_at",
)
# Table 5 of the chapter, one row per spec, from polgrad.algorithm.table_row_from_file.
TABLE5 = (
    ("method", "method"),
    ("type", "type"),
    ("reward_model", "reward model"),
    ("value_function", "value function"),
    ("reference_policy", "reference policy"),
    ("core_loss", "core loss"),
)


# --------------------------------------------------------------------------------------------
# Where a row ran
# --------------------------------------------------------------------------------------------


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """Short sha of HEAD (with `-dirty` if tracked files changed), or 'unknown' outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0 or not sha.stdout.strip():
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask where there is one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """git commit, python/torch/transformers/deepspeed versions, hostname, cpu count (no heavy imports)."""
    return {
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "deepspeed": _version("deepspeed"),
        "hostname": socket.gethostname(),
        "cpu_count": cpu_count(),
    }


# --------------------------------------------------------------------------------------------
# The CSV: atomic upserts under a lock file
# --------------------------------------------------------------------------------------------


def csv_path(experiment: str, results_dir: str | os.PathLike = "results") -> Path:
    return Path(results_dir) / f"{experiment}.csv"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path.lock` (fcntl.flock; each open is its own lock, so threads exclude too)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the os.replace below still keeps the file whole
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def order_columns(columns: Iterable[str]) -> list[str]:
    """Fixed columns first and last; anything else (the swept bindings) between, in first-seen order."""
    seen: list[str] = []
    for c in columns:
        if c not in seen:
            seen.append(c)
    middle = [c for c in seen if c not in FRONT_COLUMNS and c not in BACK_COLUMNS]
    front = [c for c in FRONT_COLUMNS if c in seen]
    back = [c for c in BACK_COLUMNS if c in seen]
    return front + middle + back


def _read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    if not path.exists():
        return [], []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _cell_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and math.isnan(value):
        return ""
    return str(value)


def upsert_row(path: str | os.PathLike, row: dict[str, Any], order: Sequence[str] | None = None) -> None:
    """Insert `row` into the CSV at `path`, replacing any row with the same cell_id.

    The whole file is rewritten to a temp file and moved into place with os.replace, under a lock
    file, so a crash or a SIGKILL at any moment leaves either the old or the new file, and parallel
    writers never lose each other's rows. Rows are kept in `order` (a list of cell ids: the sweep's
    expansion order) so the file does not depend on which cell finished first.
    """
    path = Path(path)
    row = {k: _cell_text(v) for k, v in row.items()}
    with _locked(path):
        header, rows = _read_rows(path)
        rows = [r for r in rows if r.get("cell_id") != row["cell_id"]] + [row]
        if order is not None:
            rank = {cid: i for i, cid in enumerate(order)}
            rows.sort(
                key=lambda r: rank.get(r.get("cell_id", ""), len(rank))
            )  # stable: unknown ids keep order
        columns = order_columns([*header, *row])
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_text(path, buf.getvalue())


def read_rows(path: str | os.PathLike) -> list[dict[str, str]]:
    """The CSV's rows as dicts of text (no type guessing), [] if the file does not exist."""
    return _read_rows(Path(path))[1]


def load(experiment: str, results_dir: str | os.PathLike = "results"):
    """The results of `experiment` (results_dir/<experiment>.csv) as a pandas DataFrame."""
    import pandas as pd

    path = csv_path(experiment, results_dir)
    if not path.exists():
        found = sorted(p.stem for p in Path(results_dir).glob("*.csv")) if Path(results_dir).is_dir() else []
        have = f"; results there: {', '.join(found)}" if found else ""
        raise DataError(
            f"no results for experiment '{experiment}': {path} does not exist "
            f"(run python -m polgrad.sweep experiments/{experiment}.gin){have}"
        )
    return pd.read_csv(path)


# --------------------------------------------------------------------------------------------
# Confidence intervals (Student t, no scipy)
# --------------------------------------------------------------------------------------------


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes §6.4)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """CDF of Student's t with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_ppf(q: float, df: float) -> float:
    """Quantile of Student's t (bisection on t_cdf; |error| < 1e-10)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    if q < 0.5:
        return -t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 0.5 * (lo + hi)


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> tuple[float, float | None, int]:
    """(mean, half-width of the `confidence` CI of the mean, n) over the finite values.

    Half-width = t_{(1+confidence)/2, n-1} · s / sqrt(n) with s the sample standard deviation;
    None when n < 2 (one seed gives no interval). Mean is NaN when there is no finite value.
    """
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    n = len(xs)
    if n == 0:
        return math.nan, None, 0
    mean = sum(xs) / n
    if n < 2:
        return mean, None, 1
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    return mean, t_ppf(0.5 + confidence / 2.0, n - 1) * sd / math.sqrt(n), n


# --------------------------------------------------------------------------------------------
# The grouped leaderboard
# --------------------------------------------------------------------------------------------


def _float(text: Any) -> float:
    try:
        return float(text)
    except (TypeError, ValueError):
        return math.nan


def leaderboard(
    rows: Sequence[dict[str, Any]],
    group_columns: Sequence[str],
    primary_metric: str,
    higher_is_better: bool = True,
    metrics: Sequence[str] = METRICS,
) -> list[dict[str, Any]]:
    """One entry per group (same values in `group_columns`), aggregated over its seeds.

    Each entry: `group` (dict column -> text), `n` (ok seeds), `n_failed`, `cells` (ids), and per
    metric `(mean, half_width | None, n)`. Sorted by the primary metric's mean, best first;
    groups with no finished seed go last.
    """
    groups: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        key = tuple(str(r.get(c, "")) for c in group_columns)
        g = groups.setdefault(
            key, {"group": dict(zip(group_columns, key, strict=True)), "ok": [], "n_failed": 0, "cells": []}
        )
        g["cells"].append(r.get("cell_id", ""))
        if r.get("status") == "ok":
            g["ok"].append(r)
        else:
            g["n_failed"] += 1
    out = []
    for g in groups.values():
        entry = {"group": g["group"], "n": len(g["ok"]), "n_failed": g["n_failed"], "cells": g["cells"]}
        for m in dict.fromkeys([*metrics, primary_metric]):
            entry[m] = mean_ci(_float(r.get(m)) for r in g["ok"])
        out.append(entry)

    def sort_key(e):
        mean = e[primary_metric][0]
        if math.isnan(mean):
            return (1, 0.0)
        return (0, -mean if higher_is_better else mean)

    out.sort(key=sort_key)  # stable: ties keep expansion order
    return out


def format_mean_ci(stat: tuple[float, float | None, int]) -> str:
    mean, half, n = stat
    if n == 0 or math.isnan(mean):
        return "–"
    if half is None:
        return f"{mean:.4g} (n=1)"
    return f"{mean:.4g} ± {half:.2g}"


def _table5_rows(
    spec_files: dict[str, str], groups: Sequence[dict[str, str]] = (), swept_columns: Sequence[str] = ()
) -> tuple[dict[tuple, dict[str, str]], str | None]:
    """Table-5 row per leaderboard group via polgrad.algorithm.table_row_from_file; a note when unavailable.

    Each group's row is derived from its spec file *plus its swept bindings*, so a group that swaps
    the KL estimator or the clip rule shows the core loss it actually trained with. Keyed by
    (spec, binding, binding, ...).
    """
    try:
        from polgrad.algorithm import table_row_from_file
    except Exception as e:  # the module may fail to import
        return {}, f"Table-5 columns unavailable: polgrad.algorithm.table_row_from_file ({e})"
    out: dict[tuple, dict[str, str]] = {}
    problems = []
    wanted = {(g["spec"], *(f"{c} = {g[c]}" for c in swept_columns if g.get(c))) for g in groups}
    wanted |= {(spec,) for spec in spec_files if not groups}
    for key in sorted(wanted):
        spec, bindings = key[0], list(key[1:])
        path = spec_files.get(spec)
        if path is None:
            continue
        try:
            out[key] = {k: str(v) for k, v in table_row_from_file(path, bindings).items()}
        except Exception as e:
            problems.append(f"{spec}: {' '.join(str(e).split())}")
        finally:
            with contextlib.suppress(Exception):
                import gin

                gin.clear_config()
    return out, ("Table-5 columns unavailable for " + "; ".join(problems)) if problems else None


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(
    experiment: str,
    rows: Sequence[dict[str, str]],
    *,
    swept_columns: Sequence[str],
    primary_metric: str,
    higher_is_better: bool = True,
    spec_files: dict[str, str] | None = None,
    command: str = "",
    stale_rows: int = 0,
) -> str:
    """The leaderboard of `experiment` as markdown (see module docstring)."""
    group_columns = ["spec", *swept_columns]
    board = leaderboard(rows, group_columns, primary_metric, higher_is_better)
    envs = {
        k: sorted({str(r.get(k, "")) for r in rows if r.get(k)})
        for k in ("hostname", "cpu_count", "python", "torch", "transformers", "deepspeed", "git_commit")
    }

    def one(k):
        return ", ".join(envs[k]) or "?"

    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    direction = "higher is better" if higher_is_better else "lower is better"
    n_ok = sum(r.get("status") == "ok" for r in rows)
    lines = [
        f"# {experiment}",
        "",
        f"Machine: {one('hostname')} ({one('cpu_count')} CPUs) · python {one('python')} · torch "
        f"{one('torch')} · transformers {one('transformers')} · deepspeed {one('deepspeed')} · "
        f"commit {one('git_commit')} · {date} · command: `{command}`",
        "",
        f"{len(rows)} cells ({n_ok} ok, {len(rows) - n_ok} failed) in {len(board)} groups (spec + swept "
        f"bindings). Sorted by **{primary_metric}** ({direction}); ★ marks the best group. Each value is "
        "the mean over seeds ± the half-width of its 95% confidence interval (Student t, n−1 degrees of "
        "freedom); `(n=1)` means a single seed, so no interval.",
    ]
    if stale_rows:
        lines += [
            "",
            f"({stale_rows} rows of the CSV belong to cells no longer in the experiment file; "
            "they are left out here.)",
        ]
    table5, note = _table5_rows(spec_files or {}, [e["group"] for e in board], swept_columns)
    metric_cols = [primary_metric] + [m for m in METRICS if m != primary_metric]
    header = ["rank", "spec", *swept_columns, "seeds ok", *metric_cols, *(label for _, label in TABLE5)]
    lines += ["", "| " + " | ".join(_md_escape(h) for h in header) + " |", "|" + "---|" * len(header)]
    for i, e in enumerate(board):
        best = i == 0 and e["n"] > 0
        rank = f"**{i + 1} ★**" if best else str(i + 1)
        seeds = f"{e['n']}" + (f" ({e['n_failed']} failed)" if e["n_failed"] else "")
        g = e["group"]
        t5 = table5.get((g["spec"], *(f"{c} = {g[c]}" for c in swept_columns if g.get(c))), {})
        cells = [
            rank,
            e["group"]["spec"],
            *(f"`{e['group'][c]}`" if e["group"][c] else "" for c in swept_columns),
            seeds,
            *(format_mean_ci(e[m]) for m in metric_cols),
            *(t5.get(k, "n/a") for k, _ in TABLE5),
        ]
        if best:
            cells[1] = f"**{cells[1]}**"
            cells[len(swept_columns) + 3] = f"**{cells[len(swept_columns) + 3]}**"
        lines.append("| " + " | ".join(_md_escape(c) for c in cells) + " |")
    if note:
        lines += ["", note]
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["", "## Failed cells", ""]
        lines += [
            f"- `{r.get('cell_id')}`: {_md_escape(r.get('error', '')) or '(no message)'}" for r in failed
        ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Learning curves
# --------------------------------------------------------------------------------------------


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line is skipped; a step logged twice keeps its last row."""
    by_step: dict[Any, dict[str, Any]] = {}
    try:
        with open(path) as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and "step" in row:
                    by_step[row["step"]] = row
    except OSError:
        return []
    return [by_step[s] for s in sorted(by_step)]


def _group_label(group: dict[str, str], swept_columns: Sequence[str]) -> str:
    parts = [group["spec"]]
    for c in swept_columns:
        parts.append(f"{c.split('/')[-1]}={group[c]}")
    return " · ".join(parts)


def plot(
    path: str | os.PathLike,
    experiment: str,
    rows: Sequence[dict[str, str]],
    *,
    swept_columns: Sequence[str],
    results_dir: str | os.PathLike,
    primary_metric: str = "eval_accuracy",
    higher_is_better: bool = True,
) -> None:
    """Learning curves of every group: mean over seeds with a min–max band (Agg backend, PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    group_columns = ["spec", *swept_columns]
    board = leaderboard(rows, group_columns, primary_metric, higher_is_better)
    by_id = {r["cell_id"]: r for r in rows}
    panels = [("reward_mean", "train reward (mean over batch)"), ("eval_accuracy", "eval accuracy")]
    curves: dict[str, list[tuple[str, Any, Any, Any, Any]]] = {k: [] for k, _ in panels}
    for e in board:
        label = _group_label(e["group"], swept_columns)
        per_seed = [
            read_metrics(Path(results_dir) / by_id[c]["run_dir"] / "metrics.jsonl")
            for c in e["cells"]
            if by_id[c].get("run_dir")
        ]
        for key, _ in panels:
            series = [
                {r["step"]: r[key] for r in m if isinstance(r.get(key), (int, float))} for m in per_seed
            ]
            series = [s for s in series if s]
            if not series:
                continue
            steps = sorted(set().union(*series))
            table = np.array([[s.get(t, np.nan) for t in steps] for s in series], dtype=float)
            with np.errstate(all="ignore"):
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    mean, lo, hi = np.nanmean(table, 0), np.nanmin(table, 0), np.nanmax(table, 0)
            curves[key].append((label, np.array(steps), mean, lo, hi))
    shown = [(k, t) for k, t in panels if curves[k]] or panels[:1]
    n_labels = len(board)
    ncol = max(1, min(3 if len(shown) > 1 else 2, n_labels))
    legend_in = 0.2 * math.ceil(n_labels / ncol) + 0.2 if n_labels else 0.0  # inches under the axes
    height = 4.4 + legend_in
    fig, axes = plt.subplots(1, len(shown), figsize=(6.5 * len(shown), height), squeeze=False)
    cmap = plt.get_cmap("tab10" if len(board) <= 10 else "tab20")
    colors = {_group_label(e["group"], swept_columns): cmap(i % cmap.N) for i, e in enumerate(board)}
    for ax, (key, title) in zip(axes[0], shown, strict=True):
        for label, steps, mean, lo, hi in curves[key]:
            marker = "o" if len(steps) <= 30 else None  # sparse curves (evals) show their points
            ax.plot(steps, mean, color=colors[label], label=label, lw=1.6, marker=marker, ms=3)
            ax.fill_between(steps, lo, hi, color=colors[label], alpha=0.18, lw=0)
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        if not curves[key]:
            ax.text(0.5, 0.5, "no metrics recorded", ha="center", va="center", transform=ax.transAxes)
    handles, labels = [], []
    for ax in axes[0]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.suptitle(f"{experiment}: mean over seeds, band = min–max over seeds")
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
        fig.tight_layout(rect=(0, legend_in / height, 1, 0.95))
    else:
        fig.tight_layout(rect=(0, 0, 1, 0.95))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# The report: .md and .png of one experiment
# --------------------------------------------------------------------------------------------


def experiment_meta(experiment: str, results_dir: str | os.PathLike = "results") -> dict[str, Any]:
    path = Path(results_dir) / experiment / "experiment.json"
    if not path.exists():
        raise DataError(f"no sweep metadata for '{experiment}': {path} does not exist (run the sweep first)")
    return json.loads(path.read_text())


def write_report(experiment: str, results_dir: str | os.PathLike = "results") -> tuple[Path, Path]:
    """Write results_dir/<experiment>.md and .png from the CSV and the sweep's experiment.json."""
    meta = experiment_meta(experiment, results_dir)
    path = csv_path(experiment, results_dir)
    if not path.exists():
        raise DataError(f"no results for experiment '{experiment}': {path} does not exist")
    all_rows = read_rows(path)
    current = {c["id"] for c in meta["cells"]}
    rows = [r for r in all_rows if r.get("cell_id") in current]
    spec_files = {c["spec"]: c["spec_path"] for c in meta["cells"]}
    md = markdown(
        experiment,
        rows,
        swept_columns=meta["swept_columns"],
        primary_metric=meta["primary_metric"],
        higher_is_better=meta.get("higher_is_better", True),
        spec_files=spec_files,
        command=meta.get("command", ""),
        stale_rows=len(all_rows) - len(rows),
    )
    md_path = Path(results_dir) / f"{experiment}.md"
    atomic_write_text(md_path, md)
    png_path = Path(results_dir) / f"{experiment}.png"
    plot(
        png_path,
        experiment,
        rows,
        swept_columns=meta["swept_columns"],
        results_dir=results_dir,
        primary_metric=meta["primary_metric"],
        higher_is_better=meta.get("higher_is_better", True),
    )
    return md_path, png_path


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from polgrad.errors import PolgradError

    ap = argparse.ArgumentParser(
        prog="python -m polgrad.results", description="Rewrite a sweep's .md and .png."
    )
    ap.add_argument("experiment", help="experiment name (the CSV's stem)")
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    args = ap.parse_args(argv)
    try:
        md, png = write_report(args.experiment, args.results)
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    from polgrad.results import main as _main

    raise SystemExit(_main())
