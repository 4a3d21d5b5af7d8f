"""Do the committed results' reports regenerate identical? Every results/X.md rewritten from its CSV.

    python -m benchmarks.same_reports [--results results]

For every CSV at the top of the results folder with its .md beside it, the report is written again
from the committed CSV with this checkout's code (`python -m polgrad.results X`; the over-optimisation
analysis's X_gao.md with `python -m studies.overoptimization EXP --report-only`) into a copy
of the folder, and compared with the committed .md line by line, the report's own date masked (the
one line that says when it was written). A refactor that moves no number leaves every report
identical. Plots are not compared: the curve plots read the per-cell run folders, which are not
committed. Prints one line per report; the exit status is 1 when any differs.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The report's date ("· 2026-11-28 01:58 UTC ·"): when it was written, not what it says.
WHEN = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")


def _masked(text: str) -> list[str]:
    return [WHEN.sub("<date>", line) for line in text.splitlines()]


def _regenerate(name: str, results: Path) -> subprocess.CompletedProcess:
    if name.endswith("_gao"):
        exp = REPO / "experiments" / f"{name.removesuffix('_gao')}.gin"
        cmd = ["-m", "studies.overoptimization", str(exp), "--report-only"]
    else:
        cmd = ["-m", "polgrad.results", name]
    return subprocess.run(
        [sys.executable, *cmd, "--results", str(results)], cwd=REPO, capture_output=True, text=True
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(REPO / "results"), help="the results folder (default: results)")
    ap.add_argument("--only", default=None, help="comma-separated report names (default: every one)")
    args = ap.parse_args(argv)
    committed = Path(args.results).resolve()
    names = sorted(p.stem for p in committed.glob("*.md") if (committed / f"{p.stem}.csv").exists())
    names += sorted(p.stem for p in committed.glob("*_gao.md"))
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    if not names:
        raise SystemExit(f"error: no report (X.md beside X.csv) in {committed}")
    differs = False
    with tempfile.TemporaryDirectory(prefix="same_reports_") as tmp:
        copy = Path(tmp) / "results"
        shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("runs", "bench"))
        for name in names:
            proc = _regenerate(name, copy)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(f"{name:<32} failed: {tail}")
                differs = True
                continue
            before, after = (_masked((d / f"{name}.md").read_text()) for d in (committed, copy))
            diff = list(difflib.unified_diff(before, after, lineterm="", n=0))[2:]
            differs |= bool(diff)
            print(f"{name:<32} {'identical (date aside)' if not diff else f'{len(diff)} lines differ'}")
            for line in diff[:6]:
                print(f"    {line[:160]}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
