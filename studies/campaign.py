"""Study: the results campaign's check: every committed results/X/*.csv comes from one tagged clean
commit, with the protocol's seeds and warm starts (`python -m studies.campaign TAG [--results DIR]`).

What it checks, per CSV of each experiment folder (results/<name>/<name>.csv, its tuning stage's
results/<name>/<name>_tuning/<name>_tuning.csv and its analyses' results/<name>/<name>_points.csv, ...;
pilots and other exploratory runs live in results/pilots/, which holds no pilots.csv, and are not the
campaign's):

- **one commit**: every row's `git_commit` is the commit TAG names (its short or full sha), clean
  (no `-dirty`, no `git_diff`); a CSV without the column (an analysis CSV such as
  overoptimization_points.csv) is checked through the sweep CSV beside it;
- **seeds**: in a sweep's CSV (one with results/<name>/experiment.json) that is not a tuning stage
  (`<name>_tuning`), every configuration (spec + swept columns) has at least `MIN_SEEDS` seeds whose
  run finished ok;
- **warm starts**: the rows of one seed share one warm start and different seeds have different ones
  (the CSV's `warm_start` column), so pairing holds and the spread includes the warm start's.

Raises DataError when TAG names no commit. Returns one line per problem (the CSV, what is wrong and
how to fix it) and one per CSV that passes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from polgrad.errors import DataError, PolgradError
from polgrad.results.paths import META, csv_path, experiments, folder, stage_results
from polgrad.results.provenance import DIRTY, TUNING
from polgrad.results.record import FINISHED
from polgrad.results.store import WARM_START, read_rows
from studies.overoptimization import STUDY as OVEROPTIMIZATION

MIN_SEEDS = 10
# CSVs an analysis writes beside a sweep's CSV (python -m studies.overoptimization), some without a
# git_commit column: <sweep><suffix>.csv
ANALYSIS = tuple(s.removesuffix(".csv") for s in OVEROPTIMIZATION.outputs if s.endswith(".csv"))


def _rows(n: int) -> str:
    return f"{n} row{'' if n == 1 else 's'}"


def tag_commit(tag: str, cwd: str | os.PathLike | None = None) -> str | None:
    """The full sha of the commit `tag` names in the repository at cwd, or None."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}"], cwd=cwd, capture_output=True
        )
    except OSError:  # no git
        return None
    return out.stdout.decode().strip() if out.returncode == 0 else None


def _commit_problems(rows: Sequence[dict[str, str]], sha: str) -> list[str]:
    wrong: dict[str, int] = {}
    for r in rows:
        commit = (r.get("git_commit") or "").strip()
        edited = commit.endswith(DIRTY) or bool((r.get("git_diff") or "").strip())
        ours = len(commit) >= 7 and sha.startswith(commit.removesuffix(DIRTY))
        if not ours or edited:
            what = (commit.removesuffix(DIRTY) or "no commit") + (" with uncommitted edits" if edited else "")
            wrong[what] = wrong.get(what, 0) + 1
    return [f"{_rows(n)} from {c}" for c, n in sorted(wrong.items())]


def _cells_problems(rows: Sequence[dict[str, str]], meta: dict) -> list[str]:
    """Every cell the experiment declares has a finished row (ok, or unstable: an outcome)."""
    status = {r.get("cell_id"): r.get("status") for r in rows}
    missing = [c["id"] for c in meta.get("cells", []) if c["id"] not in status]
    failed = [c["id"] for c in meta.get("cells", []) if status.get(c["id"]) not in (None, *FINISHED)]
    out = []
    if missing:
        out.append(f"{len(missing)} declared cells have no row ({_some(missing)})")
    if failed:
        out.append(f"{len(failed)} cells did not finish ({_some(failed)})")
    return out


def _some(ids: Sequence[str]) -> str:
    return ", ".join(ids[:3]) + (" ..." if len(ids) > 3 else "")


def _design_problems(rows: Sequence[dict[str, str]], meta: dict) -> list[str]:
    """≥ MIN_SEEDS declared seeds per configuration; a warm start on every finished row, one per seed."""
    problems = []
    seeds: dict[tuple, set[str]] = {}
    for c in meta.get("cells", []):
        key = (c.get("spec", ""), *(f"{k}={v}" for k, v in sorted((c.get("swept") or {}).items())))
        seeds.setdefault(key, set()).add(str(c.get("seed")))
    for key, got in sorted(seeds.items()):
        if len(got) < MIN_SEEDS:
            problems.append(f"{' · '.join(key)} declares {len(got)} seeds (the protocol: ≥ {MIN_SEEDS})")
    current = {c["id"] for c in meta.get("cells", [])}
    done = [r for r in rows if r.get("cell_id") in current and r.get("status") in FINISHED]
    unknown = [r for r in done if not (r.get(WARM_START) or "").strip()]
    if unknown:
        problems.append(f"{_rows(len(unknown))} record no warm start (the CSV's warm_start column)")
    by_seed: dict[str, set[str]] = {}
    for r in done:
        if (r.get(WARM_START) or "").strip():
            by_seed.setdefault(str(r.get("seed")), set()).add(r[WARM_START])
    mixed = sorted(s for s, w in by_seed.items() if len(w) > 1)
    if mixed:
        problems.append(f"seeds {', '.join(mixed)} started from more than one warm start")
    shared = len({w for ws in by_seed.values() for w in ws})
    if not mixed and len(by_seed) > 1 and shared < len(by_seed):
        problems.append(
            f"{len(by_seed)} seeds share {shared} warm starts (each seed its own is the protocol)"
        )
    return problems


def _csvs(results: Path) -> list[Path]:
    """The CSVs of every experiment folder under `results`: its own, its analyses', its tuning stage's."""
    out = []
    for name in experiments(results):
        out += sorted(folder(name, results).glob(f"{name}*.csv"))
        tuning = csv_path(f"{name}{TUNING}", stage_results(name, results))
        if tuning.is_file():
            out.append(tuning)
    return out


def check(tag: str, results_dir: str | os.PathLike = "results") -> tuple[list[str], list[str]]:
    """(problems, passes): one line per CSV of results_dir that breaks the campaign's rules, one per
    CSV that keeps them. Run in the repository whose history holds `tag`."""
    sha = tag_commit(tag)
    if sha is None:
        raise DataError(f"campaign: {tag}: no such tag or commit in this repository (git fetch --tags)")
    results = Path(results_dir)
    problems, passes = [], []
    failed: set[str] = set()
    paths = _csvs(results)
    # a CSV outside every experiment's folder is not the campaign's layout
    for loose in sorted(results.glob("*.csv")):
        problems.append(
            f"{loose}: a CSV outside any experiment's folder (results/X/X.csv); move the old layout with "
            f"python -m polgrad.results.migrate --results {results}"
        )
    # the CSVs that record their commit first, then the analysis CSVs that rest on their sweep's
    for path in sorted(paths, key=lambda p: p.stem.endswith(ANALYSIS)):
        rows = read_rows(path)
        if not rows:
            problems.append(f"{path}: no rows")
            failed.add(path.stem)
            continue
        found, vouched = [], ""
        if "git_commit" in rows[0]:
            found += _commit_problems(rows, sha)
        else:
            owner = next((path.stem.removesuffix(s) for s in ANALYSIS if path.stem.endswith(s)), None)
            if owner is None or not csv_path(owner, results).is_file():
                found.append("no git_commit column and no sweep CSV beside it to vouch for it")
            elif owner in failed:
                found.append(f"no git_commit column, and its sweep's {owner}.csv fails")
            else:
                vouched = f" (no git_commit column: its sweep's {owner}.csv passes)"
        meta_path = path.parent / META  # a sweep's CSV: its folder's experiment.json (not an analysis CSV's)
        design = []
        if path.stem == path.parent.name and meta_path.is_file():
            meta = json.loads(meta_path.read_text())
            found += _cells_problems(rows, meta)
            if not path.stem.endswith(TUNING):
                design = _design_problems(rows, meta)
        if found or design:
            failed.add(path.stem)
            name = path.stem.removesuffix(TUNING)
            name = next((name.removesuffix(s) for s in ANALYSIS if name.endswith(s)), name)
            module = "studies.overoptimization" if path.stem.endswith(ANALYSIS) else "polgrad.sweep"
            command = f"python -m {module} experiments/{name}.gin"
            fix = f"rerun it from a clean clone of {tag} ({command})"
            if design:
                fix = (
                    f"experiments/{name}.gin breaks the protocol: change it, tag a new campaign commit and "
                    f"rerun it from a clean clone of that ({command})"
                )
            problems.append(f"{path}: " + "; ".join(found + design) + f": {fix}")
        else:
            passes.append(f"{path}: {_rows(len(rows))}" + (vouched or f" from {sha[:7]}"))
    if not paths:
        problems.append(f"{results}: no CSV to check")
    return problems, passes


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m studies.campaign TAG [--results DIR]`: writes nothing; 0 when every CSV of the results
    folder keeps the campaign's rules, 1 with one line per CSV that does not, 2 when TAG names nothing."""
    ap = argparse.ArgumentParser(
        prog="python -m studies.campaign",
        description="Check that every results CSV comes from the commit TAG names, clean, with the "
        "protocol's seeds and warm starts.",
    )
    ap.add_argument("tag", help="the campaign's tag or commit")
    ap.add_argument("--results", default="results", help="results folder (default: results)")
    args = ap.parse_args(argv)
    try:
        problems, passes = check(args.tag, args.results)
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in passes:
        print(f"ok {line}")
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        print(
            f"{len(problems)} of {len(problems) + len(passes)} CSVs break the campaign's rules",
            file=sys.stderr,
        )
        return 1
    print(
        f"all {len(passes)} CSVs of {args.results} from {args.tag}, with the protocol's seeds and warm starts"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
