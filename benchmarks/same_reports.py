"""Do the committed results' reports regenerate identical? Every results/X/X.md rewritten from its CSV.

    python -m benchmarks.same_reports [--results results]

For every experiment folder of the results folder (results/X/ with X.csv and X.md; its tuning stage
results/X/X_tuning/ too), the report is written again from the committed CSV with this checkout's code
(`python -m polgrad.results X`; the over-optimisation analysis's X_gao.md with `python -m
studies.overoptimization EXP --report-only`) into a copy of the folder, and compared with the committed
.md line by line, the report's own date masked (the one line that says when it was written). A refactor
that moves no number leaves every report identical. Plots are not compared: the curve plots read the
per-cell run folders, which are not committed. Prints one line per report; the exit status is 1 when any
differs.
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

from polgrad.results.paths import experiments, md_path, output, stage_results
from polgrad.results.provenance import TUNING

REPO = Path(__file__).resolve().parent.parent
# The report's date ("· 2026-11-28 01:58 UTC ·"): when it was written, not what it says.
WHEN = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC")


def _masked(text: str) -> list[str]:
    return [WHEN.sub("<date>", line) for line in text.splitlines()]


def _reports(results: Path) -> list[tuple[str, str]]:
    """(report name, its results folder relative to `results`) of every committed report there."""
    out = []
    for name in experiments(results):
        if md_path(name, results).is_file():
            out.append((name, "."))
        if md_path(f"{name}{TUNING}", stage_results(name, results)).is_file():
            out.append((f"{name}{TUNING}", name))
        if output(name, results, "_gao.md").is_file():
            out.append((f"{name}_gao", "."))
    return out


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
    names = _reports(committed)
    if args.only:
        names = [(n, d) for n, d in names if n in args.only.split(",")]
    if not names:
        raise SystemExit(f"error: no report (X/X.md beside X/X.csv) in {committed}")
    differs = False
    with tempfile.TemporaryDirectory(prefix="same_reports_") as tmp:
        copy = Path(tmp) / "results"
        shutil.copytree(committed, copy, ignore=shutil.ignore_patterns("runs", "bench"))
        for name, where in names:
            proc = _regenerate(name, copy / where)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
                print(f"{name:<32} failed: {tail}")
                differs = True
                continue
            md = output(name.removesuffix("_gao"), ".", "_gao.md" if name.endswith("_gao") else ".md")
            before, after = (_masked((d / where / md).read_text()) for d in (committed, copy))
            diff = list(difflib.unified_diff(before, after, lineterm="", n=0))[2:]
            differs |= bool(diff)
            print(f"{name:<32} {'identical (date aside)' if not diff else f'{len(diff)} lines differ'}")
            for line in diff[:6]:
                print(f"    {line[:160]}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
