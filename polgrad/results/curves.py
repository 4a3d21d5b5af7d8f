"""The learning curves of an experiment (results/<experiment>/<experiment>_curves.png), read from its
run folders.

Per configuration, against the experiment's reference in grey: train reward (metrics.jsonl
`reward_mean`) smoothed per seed by an exponential moving average of span `EMA_SPAN` steps, and
held-out accuracy from eval.jsonl (step 0 = the starting policy); line = mean over seeds, band = the
95% CI of that mean over seeds (Student t, n - 1 dof), per step (per common count, below). The x
axis is the cumulative number of sampled sequences when every run's metrics.jsonl rows have
`sampled_sequences` (the budget's unit; 0 at step 0), else the optimizer step; the axis label says
which (`SEQUENCES`, `STEPS`). Against sequences, the seeds are averaged at common counts
(`sequences_band`: each seed interpolated between its own points), so a run whose seeds sample
differently per step (DAPO) still draws means over all its seeds. An experiment whose primary
metric is logged per step (`STEP_METRICS`: kl_exact) gets a third row of curves, that metric
smoothed as the train reward is. An experiment that asks about response lengths (its primary metric
or a prediction is one of store.LENGTH_COLUMNS, as length_bias_checks') gets a row of length curves:
the train samples' mean length of wrong responses (solid) and of right ones (dashed), smoothed so
over the steps that had such a response (Liu et al. 2025: a length bias shows as the wrong ones
growing apart from the right ones). Against the optimizer step, a step where one seed had none is a
mean over the other seeds (against sampled sequences each seed is interpolated).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

from polgrad.io import atomic_path
from polgrad.results.layout import clear_top
from polgrad.results.stats import mean_ci
from polgrad.results.store import read_metrics
from polgrad.run_folder import RunFolder

EMA_SPAN = 10  # steps; a = 2 / 11
GOLD = "gold reward"  # a reward-model run's gold (its task verifier), drawn dashed over its train reward
SEQUENCES = "sampled sequences (cumulative)"
STEPS = "optimizer step"
# per-step metrics (metrics.jsonl) that get a row of curves when they are the experiment's primary
# metric: kl_ablation asks about kl_exact, which the accuracy and reward rows do not show
STEP_METRICS = ("kl_exact", "kl")
# the row of response lengths (plot(..., lengths=True)): wrong responses drawn solid, right ones dashed
WRONG_LEN = "wrong-response length"
RIGHT_LEN = "right-response length"
LENGTH_SERIES = ((WRONG_LEN, "response_len_incorrect"), (RIGHT_LEN, "response_len_correct"))


def ema(values: Sequence[float], span: int = EMA_SPAN) -> list[float]:
    """Exponential moving average: y_1 = x_1, y_t = a x_t + (1 - a) y_{t-1}, a = 2 / (span + 1).

    [T] -> [T]. A non-finite x_t carries y_{t-1} forward (NaN until the first finite value).
    """
    if span < 1:
        raise ValueError(f"ema span must be >= 1, got {span}")
    a = 2.0 / (span + 1.0)
    out: list[float] = []
    y = math.nan
    for x in values:
        x = float(x)
        if math.isfinite(x):
            y = x if math.isnan(y) else a * x + (1.0 - a) * y
        out.append(y)
    return out


Curve = tuple[dict[int, float], "dict[int, float] | None"]  # one seed's {step: value}, {step: sequences}


def seed_curves(
    run_dirs: Sequence[Path], extra: Sequence[str] = (), lengths: bool = False
) -> dict[str, list[Curve]]:
    """Per kind, per seed: ({step: value}, {step: cumulative sampled sequences} or None when a metrics
    row lacks `sampled_sequences`; 0 at step 0). Kinds: smoothed train reward (EMA), eval accuracy
    (eval.jsonl), for a run trained on a reward model its smoothed gold reward (`GOLD`:
    metrics.jsonl's `gold_reward_mean`, the task verifier's reward of the same samples), and each
    per-step metric of `extra` (`STEP_METRICS`, e.g. kl_exact), smoothed the same way, and with
    `lengths` the mean lengths of wrong and right responses (`LENGTH_SERIES`; a step without such a
    response is no point, the EMA runs over the steps that had one). A seed's values and its counts
    stay paired: a seed without evaluations is left out of that kind only."""
    from polgrad.evaluation import read_evals

    out: dict[str, list[Curve]] = {"train reward": [], "eval accuracy": []}
    for d in run_dirs:
        rows = read_metrics(RunFolder(d).metrics)
        counted = bool(rows) and all("sampled_sequences" in r for r in rows)
        seq = {0: 0.0} | {int(r["step"]): float(r["sampled_sequences"]) for r in rows} if counted else None
        m = [r for r in rows if isinstance(r.get("reward_mean"), (int, float))]
        if m:
            ys = ema([r["reward_mean"] for r in m])
            out["train reward"].append((dict(zip((int(r["step"]) for r in m), ys, strict=True)), seq))
        series = ((GOLD, "gold_reward_mean"), *((k, k) for k in extra), *(LENGTH_SERIES if lengths else ()))
        for kind, key in series:
            g = [r for r in rows if isinstance(r.get(key), (int, float))]
            if g:  # GOLD: a run trained on a reward model, the task verifier's reward of the same samples
                ys = ema([r[key] for r in g])
                out.setdefault(kind, []).append(
                    (dict(zip((int(r["step"]) for r in g), ys, strict=True)), seq)
                )
        try:
            evals = read_evals(str(d))
        except ValueError:  # a torn last line of a run still writing
            evals = []
        acc = {int(e["step"]): float(e["accuracy"]) for e in evals if e.get("accuracy") is not None}
        if acc:
            out["eval accuracy"].append((acc, seq))
    return out


def mean_band(series: list[dict[int, float]]) -> tuple[list, list, list]:
    """(steps, mean over seeds, half-width of its 95% CI: t_{0.975, n-1} s / sqrt(n); NaN where n < 2)."""
    steps = sorted(set().union(*series))
    means, halves = [], []
    for s in steps:
        m, h = _mean_half([d[s] for d in series if s in d])
        means.append(m)
        halves.append(h)
    return steps, means, halves


def _mean_half(values: Sequence[float]) -> tuple[float, float]:
    """(mean, 95% CI half-width) of the finite values: stats.mean_ci, NaN where it has no interval."""
    mean, half, _ = mean_ci(values)
    return mean, math.nan if half is None else half


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """Linear interpolation of the points (xs increasing) at x, inside [xs[0], xs[-1]]."""
    j = next(i for i, v in enumerate(xs) if v >= x)
    if xs[j] == x or j == 0:
        return ys[j]
    w = (x - xs[j - 1]) / (xs[j] - xs[j - 1])
    return (1.0 - w) * ys[j - 1] + w * ys[j]


def sequences_band(curves: list[Curve]) -> tuple[list, list, list]:
    """The seeds' curves at common numbers of sampled sequences: (x, mean over seeds, 95% CI half-width).

    A run that samples a varying number of sequences per step (DAPO's refills) reaches a step at another
    count on each seed, and a run stopped by a sequence budget evaluates last at its own step: averaged
    by step, such points hold one seed each. Here the grid is, for every step all seeds have, the mean
    over seeds of its count, plus the first and the last count every seed covers (max over seeds of
    its first count, min over seeds of its last); each seed's value at a grid point is the linear
    interpolation between its two nearest points (its own counts), so every point is a mean over all
    the seeds, and nothing is drawn before or past a seed's own range. Seeds counted alike (same count
    at each step) give their step means unchanged. Seeds without a finite value are left out."""
    seeds = []
    for values, seq in curves:
        xy = sorted((seq[s], v, s) for s, v in values.items() if s in seq and math.isfinite(v))
        if xy:
            seeds.append(([x for x, _, _ in xy], [y for _, y, _ in xy], {s: x for x, _, s in xy}))
    if not seeds:
        return [], [], []
    steps = set.intersection(*(set(at) for _, _, at in seeds))
    low, high = max(xs[0] for xs, _, _ in seeds), min(xs[-1] for xs, _, _ in seeds)
    grid = sorted({sum(at[s] for _, _, at in seeds) / len(seeds) for s in steps} | {low, high})
    grid = [x for x in grid if low <= x <= high]
    means, halves = [], []
    for x in grid:
        m, h = _mean_half([_interp(x, xs, ys) for xs, ys, _ in seeds])
        means.append(m)
        halves.append(h)
    return grid, means, halves


def save_png(fig, path: Path) -> None:
    """Write the PNG atomically (polgrad.io.atomic_path: no temp file left behind, a full disk is one
    line naming the file, the PNG readable with the user's umask)."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight")  # long configuration labels stay inside
    finally:
        plt.close(fig)


# Series that cannot leave a range: a t-interval over 3 seeds near 0 accuracy reaches below 0, which
# no accuracy can be; its band is cut at the range (the mean and the CI's inner side are unchanged).
BOUNDED = {"eval accuracy": (0.0, 1.0), WRONG_LEN: (0.0, math.inf)}  # a length (EOS counted) is >= 1


def band_limits(kind: str, mean: Sequence[float], half: Sequence[float]) -> tuple[list, list]:
    """The band mean ± half-width, cut to the series' range where it has one (`BOUNDED`)."""
    low, high = BOUNDED.get(kind, (-math.inf, math.inf))
    return (
        [max(m - h, low) for m, h in zip(mean, half, strict=True)],
        [min(m + h, high) for m, h in zip(mean, half, strict=True)],
    )


def _row_name(kind: str) -> str:
    """A bottom row's name in the figure's title."""
    if kind == WRONG_LEN:
        return "the response lengths of wrong (solid) and right (dashed) train samples"
    return kind


def _rows_text(step_kinds: Sequence[str]) -> str:
    """The title's words for the rows under held-out accuracy, up to its 'EMA of span ...'."""
    if not step_kinds:
        return "(bottom; "
    if len(step_kinds) == 1:
        return f"(middle) and {_row_name(step_kinds[0])} (bottom; both "
    ordinals = ["2nd", "3rd", "4th", "5th"]
    rows = [f"{_row_name(k)} ({ordinals[i + 1]} row)" for i, k in enumerate(step_kinds[:-1])]
    last = f"{_row_name(step_kinds[-1])} ({ordinals[len(step_kinds)]} row; all "
    return f"({ordinals[0]} row), {', '.join(rows)} and {last}"


TITLE_CHARS = 36  # a panel title's line at 9.5 pt: ~0.08 in a character, inside a 3.7 in column


def draw_curves(path: Path, experiment: str, figs, labels: Sequence[str]):
    """Small multiples: per configuration (forest order) a column of panels, held-out accuracy above,
    train reward below (their scales differ: a reward model's scores are not in [0, 1]) and, when
    curves of a `STEP_METRICS` metric were read (the primary metric's), that metric at the bottom;
    against the reference in grey; an experiment about lengths, a last row of the wrong (solid) and right
    (dashed) responses' lengths. Panels of one kind share their y axis; all share the x axis."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if figs.note:  # nothing to draw: one panel that says why
        fig, ax = plt.subplots(figsize=(8.0, 2.2))
        ax.axis("off")
        ax.text(0.5, 0.5, textwrap.fill(figs.note, 80), ha="center", va="center", fontsize=10)
        ax.set_title(f"{experiment}: learning curves", fontsize=11)
        fig.tight_layout()
        save_png(fig, path)
        return fig
    ref = figs.reference if figs.reference in figs.curves else ""
    panels = (
        [lab for lab in figs.order if lab in figs.curves] or [lab for lab in labels if lab != ref] or [ref]
    )
    step_kinds = [k for k in STEP_METRICS if any(k in c for c in figs.curves.values())]
    step_kinds += [WRONG_LEN] if any(WRONG_LEN in c or RIGHT_LEN in c for c in figs.curves.values()) else []
    kinds = ("eval accuracy", "train reward", *step_kinds)
    per = len(kinds)  # panel rows per configuration
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    height = 2.2 * per * nrows + 1.5
    fig, axes = plt.subplots(
        per * nrows, ncols, figsize=(3.7 * ncols + 0.7, height), sharex=True, squeeze=False
    )
    for row in range(per * nrows):
        for ax in axes[row]:
            ax.sharey(axes[row % per, 0]) if ax is not axes[row % per, 0] else None
    for i in range(len(panels), nrows * ncols):
        for k in range(per):
            axes[per * (i // ncols) + k, i % ncols].set_visible(False)
    for i, lab in enumerate(panels):
        pair = [axes[per * (i // ncols) + k, i % ncols] for k in range(per)]
        for ax, kind in zip(pair, kinds, strict=True):
            shown = [(ref, "0.45")] if ref and lab != ref else []
            for who, color in [*shown, (lab, "0.45" if lab == ref else "tab:blue")]:
                if kind == WRONG_LEN and RIGHT_LEN in figs.curves.get(who, {}):  # the right ones, dashed
                    steps, mean, half = figs.curves[who][RIGHT_LEN]
                    ax.plot(steps, mean, color=color, ls="--", lw=1.5)
                    lo, hi = band_limits(kind, mean, half)
                    ax.fill_between(steps, lo, hi, color=color, alpha=0.08, lw=0)
                if kind not in figs.curves.get(who, {}):
                    continue
                steps, mean, half = figs.curves[who][kind]
                marker = "o" if kind == "eval accuracy" else None
                ax.plot(steps, mean, color=color, marker=marker, ms=3.5, lw=1.5)
                lo, hi = band_limits(kind, mean, half)
                ax.fill_between(steps, lo, hi, color=color, alpha=0.15, lw=0)
                if kind == "train reward" and GOLD in figs.curves[who]:  # the gold beside the proxy
                    steps, mean, _ = figs.curves[who][GOLD]
                    ax.plot(steps, mean, color=color, ls="--", lw=1.5)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=8.5)
            drawn = figs.curves.get(lab, {})
            if kind not in drawn and not (kind == WRONG_LEN and RIGHT_LEN in drawn):
                ax.text(
                    0.98,
                    0.05,
                    "no response lengths logged" if kind == WRONG_LEN else f"no {kind} logged",
                    ha="right",
                    va="bottom",
                    transform=ax.transAxes,
                    fontsize=8,
                    color="tab:blue",
                )
            if i % ncols == 0:
                name = "response length,\ntokens" if kind == WRONG_LEN else kind
                ax.set_ylabel(
                    name if kind == "eval accuracy" else f"{name}\n(EMA span {EMA_SPAN})", fontsize=9
                )
        n_seeds = figs.seeds.get(lab, 0)
        title = f"{lab} ({n_seeds} seed{'s' if n_seeds != 1 else ''})" if lab else ""
        # long labels (several swept bindings) wrap inside their panel's width
        pair[0].set_title(textwrap.fill(title.replace(" · ", " ·\u00a0"), width=TITLE_CHARS), fontsize=9.5)
    for j in range(ncols):
        last = max(r for r in range(per * nrows) if axes[r, j].get_visible())
        axes[last, j].set_xlabel(figs.x_axis, fontsize=9)
        axes[last, j].xaxis.set_tick_params(labelbottom=True)
    handles = [
        *([Line2D([], [], color="tab:blue", lw=2, label="this configuration")] if panels != [ref] else []),
        *([Line2D([], [], color="0.45", lw=2, label=f"{figs.reference_kind}: {ref}")] if ref else []),
        *(
            [
                Line2D(
                    [],
                    [],
                    color="0.2",
                    lw=1.5,
                    ls="--",
                    label="gold reward (the task's verifier; solid: the reward model's)",
                )
            ]
            if any(GOLD in c for c in figs.curves.values())
            else []
        ),
        *(
            [
                Line2D([], [], color="0.2", lw=1.5, label="response length: wrong responses (solid)"),
                Line2D([], [], color="0.2", lw=1.5, ls="--", label="response length: right responses"),
            ]
            if WRONG_LEN in step_kinds
            else []
        ),
    ]
    width = 3.7 * ncols + 0.7
    title = textwrap.fill(
        f"{experiment}: per configuration, held-out accuracy (top; step 0 = the start) and train reward "
        + _rows_text(step_kinds)
        + f"EMA of span {EMA_SPAN} steps, a = 2/{EMA_SPAN + 1}, per seed); line = mean over seeds, "
        "band = 95% CI of that mean over seeds (Student t)",
        width=int(width * 10.5),
    )
    head = 0.2 * (title.count("\n") + 1)  # inches of title
    sup = fig.suptitle(title, fontsize=10.5, y=1 - 0.06 / height)
    legend = fig.legend(
        handles=handles,
        loc="upper center",
        ncol=1 if any(len(h.get_label()) > 60 for h in handles) else (3 if len(handles) == 3 else 2),
        fontsize=9,
        frameon=False,
        bbox_to_anchor=(0.5, 1 - (head + 0.1) / height),
    )
    fig.tight_layout()
    # room for the title, the legend and the panels' own (possibly several-line) titles
    fig.subplots_adjust(top=1 - (head + 0.95) / height)
    clear_top(fig, [sup, legend])
    save_png(fig, path)
    return fig
