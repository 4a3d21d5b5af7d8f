"""Leaderboards: the results CSV of a sweep, its markdown table and its learning-curve plot.

A sweep (`python -m polgrad.sweep experiments/X.gin`, see polgrad.sweep) writes, under the
results folder (default `results/`):

    X.csv                  one row per grid cell, upserted atomically as each cell ends
    X.md                   the grouped leaderboard (spec + swept bindings, mean ± 95% CI over seeds)
    X.png                  forest plot: each configuration − the baseline, paired by seed, 95% CI, Holm p
    X_curves.png           learning curves per configuration vs the baseline (smoothed train reward, eval)
    X/experiment.json      what the sweep expanded to (cells, swept columns, primary metric, command)
    X/runs/<cell-id>/      config.gin, metrics.jsonl, summary.json, stdout.log, cell.json, checkpoints/

CSV columns: experiment, cell_id, spec, spec_file, one column per swept binding (named by the
binding, value = its gin text, e.g. `Algorithm.kl` = `@kl.k3`), seed, not_read (the swept bindings
the cell's built config never reads, space-separated: its labels and md row leave them out), the
summary metrics
(final_train_reward, eval_accuracy, kl, entropy, tokens_per_s, wall_time_s, peak_mem_mb, steps),
how the run was spread (world_size: data-parallel ranks; zero_stage: its DeepSpeed ZeRO stage),
the run's Table-5 row (table5_method, table5_type, table5_reward_model, table5_value_function,
table5_reference_policy, table5_core_loss), status (ok | unstable | failed; only ok rows are ranked
and tested, unstable ones are listed apart), error (for unstable: why), run_dir, and where it ran:
git_commit (`<sha>-dirty` when a tracked file other than the experiment's own outputs differed from
the commit as the cell started, or an untracked file .gitignore does not ignore was there), git_diff
(then the first 12 hex digits of that diff's sha256; the diff is diff.patch in the run folder; empty
when clean), python, torch, transformers, deepspeed, hostname,
cpu_count, finished_at. X/experiment.json records paths relative to the repository root, so a run
from another checkout path rewrites it byte for byte.

    >>> import polgrad.results
    >>> df = polgrad.results.load("kl_ablation")          # results/kl_ablation/kl_ablation.csv

`python -m polgrad.results X [--results DIR]` rewrites X.md, X.png and X_curves.png from X.csv
(and the run folders under X/runs/, for the curves). `python -m polgrad.results X --check-provenance`
writes nothing: it checks that every row of X.csv comes from a clean commit in the history of the
working directory's HEAD, printing one line per row that does not (cell id, commit, why) and exiting 1,
else "all N rows from clean commits: <shas>" and 0. Analyses of particular experiments (a replication
beside its original, the over-optimisation fits, the check of a whole campaign) are studies outside
the library that an experiment names and its report loads (studies.py; this repository's in studies/).

The CSV is checked, never trusted: the sweep (before it runs) and `python -m polgrad.results` compare
it with the run folders and rebuild it whole from them when they disagree (a missing column or row, a
hand-edited value), saying so in one line; without run folders (a fresh clone) a CSV that is
incomplete in itself (a column the report needs, an ok row without the primary metric) is refused
in one line (polgrad/results/record.py).

Modules: provenance (where a row ran, and the check of a CSV's commits), store (the CSV and
metrics.jsonl), record (the CSV checked against the run folders, a row built from a run folder),
stats (Student-t intervals, paired t and sign-flip tests, TOST, noncentral-t power), health (failed
runs), compare, predictions and findings (paired comparisons, Holm, verdicts, the md's words),
warm_starts (which warm starts the rows started from), figures, curves and layout (forest plot,
learning curves, room for the text around their panels), report (leaderboard, markdown,
write_report), tuning (the md's Tuning section: the values a sweep's tuning stage chose), studies
(the plug-ins' interface and loader), __main__ (the CLI).
"""

from polgrad.io import atomic_write_text
from polgrad.results.figures import plot
from polgrad.results.provenance import (
    cell_environment,
    cpu_count,
    environment,
    git_commit,
    module_names,
    outputs,
    portable_command,
    repo_relative,
    repo_root,
)
from polgrad.results.ranking import TABLE5, leaderboard
from polgrad.results.record import FINISHED, cell_row, reconcile
from polgrad.results.report import experiment_meta, markdown, write_report
from polgrad.results.stats import format_mean_ci, mean_ci, t_cdf, t_ppf
from polgrad.results.store import (
    BACK_COLUMNS,
    FRONT_COLUMNS,
    METRICS,
    NOT_READ,
    OUTCOME_METRICS,
    RUN_COLUMNS,
    TABLE5_COLUMNS,
    csv_path,
    load,
    order_columns,
    read_metrics,
    read_rows,
    upsert_row,
)

__all__ = [
    "BACK_COLUMNS",
    "FINISHED",
    "FRONT_COLUMNS",
    "METRICS",
    "NOT_READ",
    "OUTCOME_METRICS",
    "RUN_COLUMNS",
    "TABLE5",
    "TABLE5_COLUMNS",
    "atomic_write_text",
    "cell_environment",
    "cell_row",
    "cpu_count",
    "csv_path",
    "environment",
    "experiment_meta",
    "format_mean_ci",
    "git_commit",
    "leaderboard",
    "load",
    "main",
    "markdown",
    "mean_ci",
    "order_columns",
    "outputs",
    "plot",
    "read_metrics",
    "read_rows",
    "reconcile",
    "portable_command",
    "repo_relative",
    "repo_root",
    "module_names",
    "t_cdf",
    "t_ppf",
    "upsert_row",
    "write_report",
]


def __getattr__(name: str):
    # `main` lives in __main__; importing it eagerly here would make `python -m polgrad.results`
    # warn that the module was imported before being run.
    if name == "main":
        from polgrad.results.__main__ import main

        return main
    raise AttributeError(f"module 'polgrad.results' has no attribute {name!r}")
