"""The results CSV is checked against the run folders, never trusted (polgrad/results/record.py).

Sweeps run tests/fake_train.py (POLGRAD_TRAIN_MODULE=fake_train): 3 specs-by-lr cells x 2 seeds = 6
cells, each with a run folder whose summary.json holds the metrics the CSV copies.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest

from polgrad import results, sweep

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"
PRIMARY = "eval_accuracy"


pytestmark = pytest.mark.usefixtures("fake_trainer")  # tests/conftest.py


def _rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _write(path: Path, header: list[str], rows: list[dict[str, str]]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=header, lineterminator="\n", extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _drop(path: Path, column: str, row_index: int) -> None:
    """The issue's hand edit: the primary metric's column removed, one row deleted."""
    header, rows = _rows(path)
    del rows[row_index]
    _write(path, [c for c in header if c != column], rows)


def _sweep(tmp_path: Path, lrs: str, seeds: str) -> tuple[Path, Path]:
    """Run a fake-trainer sweep of spec_a over `lrs` x `seeds`: (experiment file, results folder)."""
    exp = tmp_path / "exp.gin"
    exp.write_text(
        f"include '{DATA / 'base_fake.gin'}'\nSweep.specs = ['{DATA / 'spec_a.gin'}']\n"
        f"Sweep.grid = {{'fake_train.lr': [{lrs}]}}\nSweep.seeds = [{seeds}]\n"
        f"Sweep.seed_binding = 'fake_train.seed'\nSweep.primary_metric = '{PRIMARY}'\n"
    )
    out = tmp_path / "results"
    assert sweep.main([str(exp), "--results", str(out)]) == 0
    return exp, out


@pytest.fixture
def swept(tmp_path):
    exp, out = _sweep(tmp_path, "0.1, 0.2, 0.3", "0, 1")
    return exp, out, out / "exp" / "exp.csv"


def _summaries(out: Path) -> dict[str, dict]:
    runs = out / "exp" / "runs"
    return {p.name: json.loads((p / "summary.json").read_text()) for p in runs.iterdir()}


def test_a_rerun_rebuilds_a_hand_edited_csv_whole_from_the_run_folders(swept, capsys):
    exp, out, csv_file = swept
    header, original = _rows(csv_file)
    assert len(original) == 6 and PRIMARY in header
    _drop(csv_file, PRIMARY, 2)
    edited_header, edited = _rows(csv_file)
    edited[0]["finished_at"] = original[0]["finished_at"] = "2020-01-01T00:00:00+00:00"  # when it was written
    _write(csv_file, edited_header, edited)
    capsys.readouterr()
    assert sweep.main([str(exp), "--results", str(out)]) == 0
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "disagreed with the run folders" in ln]
    assert len(line) == 1 and f"column {PRIMARY} missing" in line[0] and str(csv_file) in line[0]
    new_header, rebuilt = _rows(csv_file)
    assert new_header == header and rebuilt == original  # every value back, a row's finished_at kept
    summaries = _summaries(out)
    assert all(float(r[PRIMARY]) == summaries[r["cell_id"]][PRIMARY] for r in rebuilt)  # from the folders
    assert not list(out.glob(".exp.csv.*"))  # written atomically: no temp file left


def test_a_hand_edited_value_is_restored_and_an_agreeing_csv_is_left_alone(swept, capsys):
    exp, out, csv_file = swept
    before = csv_file.read_text()
    header, rows = _rows(csv_file)
    assert results.main(["exp", "--results", str(out)]) == 0
    assert "disagreed" not in capsys.readouterr().err and csv_file.read_text() == before
    rows[4]["final_train_reward"] = "0.999"
    _write(csv_file, header, rows)
    assert results.main(["exp", "--results", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"cell {rows[4]['cell_id']}'s final_train_reward differs" in err
    assert csv_file.read_text() == before


def test_the_results_command_rebuilds_the_issues_csv_before_the_md(swept, capsys):
    _, out, csv_file = swept
    _, original = _rows(csv_file)
    _drop(csv_file, PRIMARY, 5)
    assert results.main(["exp", "--results", str(out)]) == 0
    err = capsys.readouterr().err
    assert (
        "disagreed with the run folders" in err and f"the row of cell {original[5]['cell_id']} missing" in err
    )
    assert _rows(csv_file)[1] == original


def test_without_run_folders_an_incomplete_csv_is_refused_in_one_line(swept, capsys):
    _, out, csv_file = swept
    shutil.rmtree(out / "exp" / "runs")  # a fresh clone: the CSV is the only record
    header, rows = _rows(csv_file)
    md_before = (out / "exp" / "exp.md").read_text()
    _write(csv_file, [c for c in header if c != PRIMARY], rows)
    assert results.main(["exp", "--results", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"{csv_file}: column '{PRIMARY}' (the primary metric) is missing" in err
    assert f"git checkout {csv_file}" in err

    rows[1][PRIMARY] = ""
    _write(csv_file, header, rows)
    assert results.main(["exp", "--results", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"the ok row of cell {rows[1]['cell_id']} has no {PRIMARY}" in err
    assert (out / "exp" / "exp.md").read_text() == md_before  # nothing written from a half-filled CSV

    rows[1][PRIMARY] = "0.5"  # complete in itself: the md is written from it
    _write(csv_file, header, rows)
    assert results.main(["exp", "--results", str(out)]) == 0


def test_a_commit_landing_while_a_cell_runs_is_no_disagreement(tmp_path, monkeypatch, capsys):
    """The row records the environment the cell started with (cell.json's copy, which the rebuild
    reads), so a commit that lands while the cell trains neither rewrites the row's git_commit nor
    makes the next sweep report that the CSV disagreed with its run folders."""
    from polgrad import results as results_pkg

    calls = iter(range(10_000))
    real = results_pkg.cell_environment

    def drifting(*args, **kwargs):  # every call sees a new commit, as if one landed while the cells ran
        return {**real(*args, **kwargs), "git_commit": f"c{next(calls):04d}"}

    monkeypatch.setattr(results_pkg, "cell_environment", drifting)
    exp, out = _sweep(tmp_path, "0.1, 0.2", "0")
    _, rows = _rows(out / "exp" / "exp.csv")
    for r in rows:
        started = json.loads((out / r["run_dir"] / "cell.json").read_text())["environment"]
        assert r["git_commit"] == started["git_commit"], (r["git_commit"], started["git_commit"])
    capsys.readouterr()
    assert sweep.main([str(exp), "--results", str(out)]) == 0
    assert "disagreed" not in capsys.readouterr().err


def test_a_row_written_while_the_results_command_reconciles_is_kept(swept, capsys):
    """`python -m polgrad.results X` during a sweep: the read, the comparison and the rewrite are one
    step under the CSV's lock, so a failed cell's row (which no run folder can restore) that the
    sweep writes meanwhile survives the rebuild. Here the "sweep" holds the lock while the command
    starts, writes the row, then lets go."""
    import threading
    import time

    from polgrad.results import store

    _, out, csv_file = swept
    header, rows = _rows(csv_file)
    _write(csv_file, header, rows[:-1])  # a row missing: the command will rebuild the CSV
    failed = {**rows[0], "cell_id": "failed-cell", "status": "failed", "error": "boom", PRIMARY: ""}
    codes = []
    with store.locked(csv_file):
        worker = threading.Thread(target=lambda: codes.append(results.main(["exp", "--results", str(out)])))
        worker.start()
        time.sleep(1.0)  # the command has started and waits for the lock (it used to read at once)
        store.rewrite_rows(csv_file, [*rows[:-1], failed], header, lock=False)
    worker.join(60)
    assert codes == [0]
    ids = [r["cell_id"] for r in _rows(csv_file)[1]]
    assert "failed-cell" in ids and sorted(ids) == sorted([r["cell_id"] for r in rows] + ["failed-cell"])


def test_without_run_folders_a_header_only_csv_is_refused(swept, capsys):
    """A header-only CSV, no run folder: the md was rewritten as '0 cells ... Answer. None'. Refused in
    one line; the md and the CSV stay as they were."""
    _, out, csv_file = swept
    shutil.rmtree(out / "exp" / "runs")
    header, rows = _rows(csv_file)
    _write(csv_file, header, [])
    csv_before, md_before = csv_file.read_text(), (out / "exp" / "exp.md").read_text()
    assert results.main(["exp", "--results", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert f"{csv_file}: 6 of 6 current cells (e.g. {rows[0]['cell_id']}) have no row" in err
    assert "re-run the sweep" in err and f"git checkout {csv_file}" in err
    assert (out / "exp" / "exp.md").read_text() == md_before and csv_file.read_text() == csv_before


def test_without_run_folders_a_csv_missing_rows_gives_an_md_that_says_so(swept):
    """2 of the 6 cells' rows gone, no run folder (or a report made while the sweep still runs): the md
    was rewritten as '4 cells (4 ok, 0 failed)' as if the experiment were whole. Now it is written and its
    header names the 2 cells it lacks; the CSV is not touched."""
    _, out, csv_file = swept
    shutil.rmtree(out / "exp" / "runs")
    header, rows = _rows(csv_file)
    _write(csv_file, header, rows[:4])
    csv_before = csv_file.read_text()
    assert results.main(["exp", "--results", str(out)]) == 0
    md = (out / "exp" / "exp.md").read_text()
    assert "**Incomplete.** 2 of the experiment's 6 cells have no row in the CSV" in md
    assert "4 cells (4 " in md and csv_file.read_text() == csv_before


def test_a_finished_rows_time_is_its_summarys_so_a_rebuilt_row_agrees(tmp_path):
    """The sweep's row and a row rebuilt from the folder both say the run finished when it wrote its
    summary.json (the CI once failed on a rebuilt row a second later than the recorded one); a failed
    run without a finished summary gets the clock."""
    import os

    from polgrad.results import record

    run_dir = tmp_path / "exp" / "runs" / "c"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": "ok", "steps": 1}))
    os.utime(run_dir / "summary.json", (1577836800, 1577836800))  # 2020-01-01T00:00:00Z
    cell = {"id": "c", "spec": "s", "spec_file": "s.gin", "swept": {}, "seed": 0}
    env = {"git_commit": "x"}
    row = record.cell_row("exp", cell, run_dir, tmp_path, {"status": "ok", "summary": {}, "environment": env})
    assert row["finished_at"] == "2020-01-01T00:00:00+00:00"
    assert record.finished_outcome(run_dir)["finished_at"] == row["finished_at"]
    failed = record.cell_row("exp", cell, run_dir, tmp_path, {"status": "failed", "environment": env})
    assert failed["finished_at"] > "2025"  # the clock, not the stale summary's time
