"""How a Ray cell's run folder travels between its node and the driver (polgrad/sweep/ray_cells.py),
without Ray: what a change sends, under which names a rank's files arrive, what an attempt reports.
The cluster itself: tests/test_ray_cluster.py."""

from __future__ import annotations

import os

import pytest

from polgrad.errors import PolgradError
from polgrad.sweep.grid import Cell
from polgrad.sweep.ray_cells import Mirror, _Attempt, rank_name, rank_snapshot, read_tree, write_tree


def test_a_mirror_sends_what_changed_and_what_was_deleted_but_not_a_vanished_folder(tmp_path):
    root = tmp_path / "run"
    write_tree(root, {"metrics.jsonl": b"1\n", "checkpoints/policy/step1/m.pt": b"w1", ".lock": b"pid"})
    m = Mirror(root)
    files, deleted = m.delta()
    assert files == {"metrics.jsonl": b"1\n", "checkpoints/policy/step1/m.pt": b"w1"} and deleted == []
    assert m.delta() == ({}, [])  # nothing changed
    (root / "metrics.jsonl").write_bytes(b"1\n2\n")
    (root / "checkpoints/policy/step1/m.pt").unlink()
    assert m.delta() == ({"metrics.jsonl": b"1\n2\n"}, ["checkpoints/policy/step1/m.pt"])
    # a file rewritten with other bytes of the same size is sent again (its mtime moved)
    os.utime(root / "metrics.jsonl", ns=(1, 1))
    assert m.delta() == ({"metrics.jsonl": b"1\n2\n"}, [])
    # the folder itself gone (a wiped disk): no deletion of everything on the driver
    import shutil

    shutil.rmtree(root)
    assert m.delta() == ({}, [])


def test_files_the_driver_sent_are_not_sent_back(tmp_path):
    snapshot = {"stdout.log": b"old\n", "checkpoints/policy/latest": b"step2"}
    write_tree(tmp_path / "run", snapshot)
    m = Mirror(tmp_path / "run", snapshot)
    assert m.delta() == ({}, [])


def test_write_tree_refuses_a_path_out_of_the_run_folder(tmp_path):
    with pytest.raises(PolgradError, match="leaves the run folder"):
        write_tree(tmp_path / "run", {"../escaped": b"x"})
    assert not (tmp_path / "escaped").exists()


def test_a_rank_above_0_sends_its_shards_and_its_log_under_its_own_names(tmp_path):
    name = rank_name(1)
    assert name("checkpoints/policy/step2/zero_pp_rank_1_mp_rank_00_optim_states.pt") == (
        "checkpoints/policy/step2/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    assert (name("stdout.log"), name("cell.json")) == ("stdout.rank1.log", "cell.rank1.json")
    assert name("metrics.jsonl") is None and name("summary.json") is None  # rank 0's to write
    driver = {
        "stdout.log": b"rank 0",
        "cell.json": b"{0}",
        "stdout.rank1.log": b"rank 1",
        "cell.rank1.json": b"{1}",
        "stdout.rank2.log": b"rank 2",
        "checkpoints/policy/latest": b"step2",
    }
    assert rank_snapshot(driver, 1) == {
        "stdout.log": b"rank 1",
        "cell.json": b"{1}",
        "checkpoints/policy/latest": b"step2",
    }
    assert rank_snapshot(driver, 0) == {
        "stdout.log": b"rank 0",
        "cell.json": b"{0}",
        "checkpoints/policy/latest": b"step2",
    }
    # the round trip: rank 1's folder, started from the snapshot, sends back under the driver's names
    local = tmp_path / "rank1"
    mine = rank_snapshot(driver, 1)
    write_tree(local, mine)
    m = Mirror(local, mine, name)
    (local / "stdout.log").write_bytes(b"rank 1, more")
    (local / "metrics.jsonl").write_bytes(b"not rank 1's to send")
    assert m.delta() == ({"stdout.rank1.log": b"rank 1, more"}, [])
    assert read_tree(tmp_path / "missing") == {}


def _outcome(status: str, error: str = "") -> dict:
    return {
        "cell_id": "c",
        "status": status,
        "error": error,
        "summary": {"steps": 4} if status == "ok" else None,
    }


def test_an_attempt_reports_rank_0_or_the_first_rank_that_failed():
    cell = Cell("c", 0, "g.gin", "g", "g.gin", config_files=(), swept=(), seed=0, bindings=())
    att = _Attempt(cell, 1, 2)
    att.outcomes = {0: _outcome("ok"), 1: _outcome("ok")}
    assert att.outcome() == _outcome("ok")
    att.outcomes = {0: _outcome("ok"), 1: _outcome("failed", "boom")}
    got = att.outcome()
    assert (got["status"], got["error"]) == ("failed", "rank 1: boom")
    att.outcomes = {1: _outcome("failed", "boom")}  # rank 0 cancelled when rank 1 failed
    assert att.outcome()["error"] == "rank 1: boom"
    att.outcomes = {0: _outcome("ok")}
    assert att.outcome()["error"] == "rank 1: did not end"
    att.outcomes = {0: _outcome("failed", "bad loss"), 1: _outcome("failed", "closed")}
    assert att.outcome()["error"] == "rank 0: bad loss"
