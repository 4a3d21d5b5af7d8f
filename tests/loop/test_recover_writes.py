"""A full disk or a read-only folder is one line naming the file, leaves no temp file and loses no
row; what polgrad writes is readable with the user's umask (not mkstemp's private 0600)."""

from __future__ import annotations

import builtins
import csv
import errno
import os
import stat
from pathlib import Path

import pytest

from polgrad import io, results, sweep
from polgrad.errors import WriteError
from polgrad.results import figures

TESTS = Path(__file__).resolve().parents[1]
DATA = TESTS / "data"


@pytest.fixture()
def umask():
    """Set the process umask for a test and restore it."""
    saved = []

    def set_(mask: int) -> None:
        saved.append(os.umask(mask))

    yield set_
    if saved:
        os.umask(saved[0])


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _failing_fsync(code: int):
    def fsync(fd):
        raise OSError(code, os.strerror(code))

    return fsync


# ----------------------------------------------------------------------------- umask
@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_atomic_writes_get_the_mode_of_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    io.atomic_write_text(tmp_path / "a.txt", "x")
    results.upsert_row(tmp_path / "x.csv", {"cell_id": "c", "status": "ok"})
    assert _mode(tmp_path / "a.txt") == mode
    assert _mode(tmp_path / "x.csv") == mode


def test_the_figures_get_the_mode_of_the_umask_and_leave_no_temp_file(tmp_path, umask):
    umask(0o022)
    rows = [
        {
            "cell_id": f"c{i}",
            "spec": "a",
            "x": v,
            "seed": s,
            "status": "ok",
            "eval_accuracy": acc,
        }
        for i, (v, s, acc) in enumerate(
            [("1", "0", "0.1"), ("1", "1", "0.3"), ("2", "0", "0.2"), ("2", "1", "0.5")]
        )
    ]
    figs = figures.plot(tmp_path / "e.png", "e", rows, swept_columns=["x"], results_dir=tmp_path)
    assert [_mode(p) for p in figs.paths] == [0o644, 0o644]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.png", "e_curves.png"]


# ----------------------------------------------------------------------------- one line, no temp
@pytest.mark.parametrize(
    "code, reason",
    [
        (errno.ENOSPC, "no space left on device"),
        (errno.EROFS, "read-only file system"),
        (errno.EACCES, "permission denied"),
    ],
)
def test_a_failed_atomic_write_is_one_line_keeps_the_old_file_and_no_temp(
    tmp_path, monkeypatch, code, reason
):
    target = tmp_path / "x.csv"
    target.write_text("old\n")
    monkeypatch.setattr(io.os, "fsync", _failing_fsync(code))
    with pytest.raises(WriteError) as e:
        io.atomic_write_text(target, "new\n")
    assert str(e.value) == f"{reason} while writing {target}"
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["x.csv"]  # the temp file is gone


def test_a_figure_on_a_full_disk_is_one_line_and_leaves_no_temp_png(tmp_path, monkeypatch):
    import matplotlib.figure

    def savefig(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")  # a partial file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    rows = [{"cell_id": "c", "spec": "a", "seed": "0", "status": "ok", "eval_accuracy": "0.5"}]
    with pytest.raises(WriteError, match=f"^no space left on device while writing {tmp_path / 'e.png'}$"):
        figures.plot(tmp_path / "e.png", "e", rows, swept_columns=[], results_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_folder_is_one_line(tmp_path, monkeypatch):
    """The OS's EACCES on the temporary file, raised by a patched mkstemp (chmod would not block the
    root user CI runs as), is one line naming the file being written."""
    folder = tmp_path / "ro"
    folder.mkdir()
    real = io.tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if Path(dir) == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(folder / ".x.csv.tmp"))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(io.tempfile, "mkstemp", mkstemp)
    with pytest.raises(WriteError, match=f"^permission denied while writing {folder / 'x.csv'}$"):
        results.upsert_row(folder / "x.csv", {"cell_id": "c"})


# ----------------------------------------------------------------------------- the sweep
# (fake_trainer: the fake trainer for sweeps, tests/conftest.py)
def _experiment(tmp_path: Path) -> Path:
    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{DATA / 'base_fake.gin'}'\nSweep.specs = ['{DATA / 'spec_a.gin'}']\n"
        "Sweep.grid = {'fake_train.lr': [0.1, 0.2, 0.3]}\nSweep.seeds = [0]\n"
        "Sweep.seed_binding = 'fake_train.seed'\n"
    )
    return path


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith(("error", "Traceback"))]


def test_disk_full_while_recording_a_cell_is_one_line_and_no_row_is_lost(
    tmp_path, monkeypatch, capsys, fake_trainer
):
    path, out = _experiment(tmp_path), tmp_path / "r"
    csv_file = out / "exp" / "exp.csv"
    real_fsync, seen = io.os.fsync, []

    def fsync(fd):  # the disk fills up while the second cell's row is written
        name = os.readlink(f"/proc/self/fd/{fd}")
        if Path(name).name.startswith(".exp.csv."):
            seen.append(name)
            if len(seen) == 2:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(io.os, "fsync", fsync)
    rc = sweep.main([str(path), "--results", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert _error_lines(err) == [
        f"error: no space left on device while writing {csv_file}; free space (or make the folder "
        "writable) and re-run the same command: finished cells are kept"
    ]
    first = _rows(csv_file)
    assert len(first) == 1 and first[0]["status"] == "ok"
    assert not [p for p in out.iterdir() if p.name.startswith(".exp.csv.")]  # no temp file left

    monkeypatch.setattr(io.os, "fsync", real_fsync)  # space freed: the re-run records every cell
    assert sweep.main([str(path), "--results", str(out)]) == 0
    after = _rows(csv_file)
    assert len(after) == 3 and after[0] == first[0]  # the recorded row is untouched


def test_disk_full_while_writing_the_report_says_how_to_write_it(tmp_path, monkeypatch, capsys, fake_trainer):
    import matplotlib.figure

    def savefig(self, fname, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    path, out = _experiment(tmp_path), tmp_path / "r"
    rc = sweep.main([str(path), "--results", str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    (line,) = _error_lines(err)
    assert line == (
        f"error: no space left on device while writing {out / 'exp' / 'exp.png'}; every cell is recorded in "
        f"{out / 'exp' / 'exp.csv'}: free space, then write the report with python -m polgrad.results exp "
        f"--results {out}"
    )
    assert len(_rows(out / "exp" / "exp.csv")) == 3
    assert not [p.name for p in (out / "exp").iterdir() if ".tmp" in p.name]


def test_a_read_only_results_folder_is_one_line_for_the_sweep(tmp_path, monkeypatch, capsys, fake_trainer):
    path, out = _experiment(tmp_path), tmp_path / "r"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # what a read-only file system answers
        if self == out / "exp":
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    rc = sweep.main([str(path), "--results", str(out)])
    assert rc == 1
    assert _error_lines(capsys.readouterr().err) == [
        f"error: read-only file system while writing {out / 'exp'}; free space (or make the folder "
        "writable) and re-run the same command: finished cells are kept"
    ]


# ----------------------------------------------------------------------------- the trainer
GRPO = str(TESTS.parent / "registry" / "grpo.gin")
FAST = [
    "train.prompts_per_step = 4",
    "train.eval_every = 100",
    "train.eval_size = 16",
    "train.checkpoint_every = 1",
]


def _train_cli(out: Path, steps: int, *extra: str) -> int:
    from polgrad import train as train_cli

    bind = [a for b in [*FAST, f"train.steps = {steps}"] for a in ("--bind", b)]
    return train_cli.main([GRPO, *bind, "--out", str(out), "--no-progress", *extra])


@pytest.mark.slow
def test_disk_full_during_a_checkpoint_is_one_line_and_the_run_resumes(tmp_path, monkeypatch, capfd):
    """torch reports a full disk as 'unexpected pos ...': the trainer names the checkpoint folder,
    removes the partial one, and a resume goes on from the last intact checkpoint."""
    import torch

    real_save, calls = torch.save, []

    def save(obj, f, *args, **kwargs):
        calls.append(str(f))
        if "step2" in str(f):
            Path(f).write_bytes(b"PK\x03\x04 half")
            raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 764416 vs 764304")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    out = tmp_path / "run"
    capfd.readouterr()
    rc = _train_cli(out, 3)
    err = capfd.readouterr().err
    step2 = out / "checkpoints" / "policy" / "step2"
    assert rc == 2
    assert _error_lines(err) == [
        f"error: could not write checkpoint {step2} (RuntimeError: [enforce fail at inline_container.cc:603] "
        ". unexpected pos 764416 vs 764304); free space (or make the folder writable) and re-run with "
        "--resume (a sweep: the same command)"
    ]
    assert not step2.exists() and (out / "checkpoints" / "policy" / "step1").is_dir()

    monkeypatch.setattr(torch, "save", real_save)
    assert _train_cli(out, 3, "--resume") == 0
    assert "warning:" not in capfd.readouterr().err  # the partial folder was removed: nothing to skip
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in open(out / "metrics.jsonl")]
    assert steps == [1, 2, 3]


@pytest.mark.slow
def test_disk_full_for_the_metrics_and_the_summary_is_one_line(tmp_path, monkeypatch, capfd):
    from polgrad import run_folder  # the metrics' one writer (RunFolder.append_metrics)

    class Full:
        def __init__(self, path):
            self.path = path

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    real_open = builtins.open

    def open_(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            return Full(path)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(run_folder, "open", open_, raising=False)
    out = tmp_path / "run"
    capfd.readouterr()
    assert _train_cli(out, 1) == 2
    assert _error_lines(capfd.readouterr().err) == [
        f"error: no space left on device while writing the run folder {out}; free space and re-run with "
        "--resume"
    ]
    monkeypatch.undo()

    real_fsync = io.os.fsync

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").split("/")[-1].startswith(".summary.json."):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(io.os, "fsync", fsync)
    assert _train_cli(tmp_path / "run2", 1) == 2
    assert _error_lines(capfd.readouterr().err) == [
        f"error: no space left on device while writing {tmp_path / 'run2' / 'summary.json'}; free space "
        "and re-run with --resume"
    ]
    assert not [p for p in (tmp_path / "run2").iterdir() if p.name.startswith(".summary.json.")]


def test_a_read_only_folder_is_one_line_already_at_the_csv_lock(tmp_path, monkeypatch):
    """On a read-only file system the CSV's lock file is the first write that fails."""
    from polgrad.results import store

    real_open = builtins.open

    def open_(path, mode="r", *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(store, "open", open_, raising=False)
    with pytest.raises(WriteError, match=f"^read-only file system while writing {tmp_path / 'x.csv'}$"):
        results.upsert_row(tmp_path / "x.csv", {"cell_id": "c"})
