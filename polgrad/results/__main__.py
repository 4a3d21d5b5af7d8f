"""`python -m polgrad.results EXPERIMENT [--results DIR]`: rewrite a sweep's .md and figures from its CSV
(all in DIR/EXPERIMENT/; a tuning stage's are in its experiment's folder: `X_tuning --results results/X`).

The CSV is checked first (polgrad.results.record.reconcile): rebuilt whole from the run folders when
it disagrees with them (one line says so), refused in one line when it is incomplete and no run folder
can complete it.

`--check-provenance` writes nothing: every row of the CSV must come from a clean commit in the history
of the working directory's HEAD (polgrad.results.provenance.check); exit 1 with one line per row that
does not (cell id, commit, why) and a summary, else 0 with "all N rows from clean commits: <shas>".
`--compare-verdicts OTHER.md` writes nothing: the verdicts of the experiment's md beside OTHER.md's,
prediction by prediction (polgrad.results.verdicts); exit 1 when a prediction is decided differently,
0 when none is. `--record FILE` also appends the outcome to the CSV FILE (results/replications/verdicts.csv).
(The check of a whole campaign, every CSV of the results folder at once, is a study of this
repository's: `python -m studies.campaign TAG`.)"""

from __future__ import annotations

import argparse
import sys

from polgrad.errors import DataError, PolgradError
from polgrad.results import verdicts
from polgrad.results.figures import curves_path
from polgrad.results.migrate import refuse_old_layout
from polgrad.results.paths import csv_path, md_path, png_path
from polgrad.results.provenance import DIRTY, check, git_commit, repo_root
from polgrad.results.record import reconcile
from polgrad.results.report import experiment_meta, write_report
from polgrad.results.store import read_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m polgrad.results",
        description="Rewrite a sweep's .md, .png (forest plot) and _curves.png.",
    )
    ap.add_argument("experiment", nargs="?", help="experiment name (the CSV's stem)")
    ap.add_argument(
        "--results", default="results", help="results folder (default: results; for X_tuning: results/X)"
    )
    ap.add_argument(
        "--check-provenance",
        action="store_true",
        help="write nothing; check that every row comes from a clean commit in the history of HEAD",
    )
    ap.add_argument(
        "--compare-verdicts",
        metavar="OTHER.md",
        help="write nothing; the experiment md's verdicts beside OTHER.md's, or beside the md as commit "
        "REV has it with git:REV (git:HEAD: the committed md)",
    )
    ap.add_argument(
        "--record", metavar="FILE", help="with --compare-verdicts: append the outcome to this CSV"
    )
    args = ap.parse_args(argv)
    if not args.experiment:
        ap.error("give an experiment (the CSV's stem)")
    if args.record and not args.compare_verdicts:
        ap.error("--record goes with --compare-verdicts OTHER.md")
    try:
        refuse_old_layout(args.experiment, args.results)
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.compare_verdicts:
        try:
            return verdicts.main(
                str(md_path(args.experiment, args.results)), args.compare_verdicts, args.record
            )
        except PolgradError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.check_provenance:
        return check_provenance(args.experiment, args.results)
    try:
        meta = experiment_meta(args.experiment, args.results)
        rebuilt = reconcile(
            args.experiment, meta["cells"], args.results, meta["primary_metric"], meta["swept_columns"]
        )
        if rebuilt:
            print(rebuilt, file=sys.stderr)
        curves = curves_path(png_path(args.experiment, args.results))
        before = curves.stat().st_mtime_ns if curves.exists() else None
        md, png = write_report(args.experiment, args.results)
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    redrawn = curves.exists() and curves.stat().st_mtime_ns != before  # else kept (no run folders)
    print(f"wrote {md}, {png}" + (f" and {curves}" if redrawn else f"; kept {curves}"))
    return 0


def check_provenance(experiment: str, results_dir: str) -> int:
    """0 when every row of the experiment's CSV comes from a clean commit in the history of
    HEAD, 1 (one line per bad row and a summary) when not, 2 when there is nothing to check against."""
    path = csv_path(experiment, results_dir)
    try:
        if repo_root() is None:
            raise DataError(
                "--check-provenance: the working directory is not in a git repository; run it in the "
                f"checkout {path} belongs to"
            )
        if not path.is_file():
            raise DataError(
                f"--check-provenance: {path} does not exist (run the sweep, or give --results DIR)"
            )
        rows = read_table(path)[1]
        if not rows:
            raise DataError(f"--check-provenance: {path} has no rows")
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad, clean = check(rows, results_dir=results_dir)
    for line in bad:
        print(line)
    if bad:
        head = git_commit().removesuffix(DIRTY)
        print(
            f"error: {len(bad)} of {len(rows)} rows of {path} do not come from a clean commit in the history "
            f"of HEAD ({head}); re-run those cells from a clean checkout (--restart CELL_ID ...)",
            file=sys.stderr,
        )
        return 1
    print(f"all {len(rows)} rows from clean commits: {', '.join(clean)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
