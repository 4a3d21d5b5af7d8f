"""`python -m polgrad.results EXPERIMENT [--results DIR]`: rewrite a sweep's .md and figures from its CSV.

The CSV is checked first (polgrad.results.record.reconcile): rebuilt whole from the run folders when
it disagrees with them (one line says so), refused in one line when it is incomplete and no run folder
can complete it."""

from __future__ import annotations

import argparse
import sys

from polgrad.errors import PolgradError
from polgrad.results.figures import curves_path
from polgrad.results.record import reconcile
from polgrad.results.report import experiment_meta, write_report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m polgrad.results",
        description="Rewrite a sweep's .md, .png (forest plot) and _curves.png.",
    )
    ap.add_argument("experiment", help="experiment name (the CSV's stem)")
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    args = ap.parse_args(argv)
    try:
        meta = experiment_meta(args.experiment, args.results)
        rebuilt = reconcile(
            args.experiment, meta["cells"], args.results, meta["primary_metric"], meta["swept_columns"]
        )
        if rebuilt:
            print(rebuilt, file=sys.stderr)
        md, png = write_report(args.experiment, args.results)
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {md}, {png} and {curves_path(png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
