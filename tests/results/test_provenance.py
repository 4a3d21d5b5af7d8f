"""Clean provenance (polgrad/results/provenance.py): a run records the commit it ran at, `-dirty` plus
the diff's hash (and the diff as diff.patch) only when a tracked file other than the experiment's own
outputs differs from it, or an untracked file .gitignore does not ignore is there; experiment.json
reads the same from any checkout path; `python -m polgrad.results X --check-provenance` flags every
row not from a clean commit in the history of HEAD.

Each test makes a git repository in tmp_path holding a tiny experiment (experiments/exp.gin, the fake
spec and base config of tests/data, a source file, the project's own .gitignore) and runs the sweep
in it with the fake trainer (tests/fake_train.py); git reads no user or system configuration.
"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from polgrad import results, sweep
from polgrad.results import provenance

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
DATA = TESTS / "data"
EXPERIMENT = (
    "include 'experiments/base_fake.gin'\n"
    "Sweep.name = 'exp'\n"
    "Sweep.specs = ['registry/spec_a.gin']\n"
    "Sweep.seeds = [0, 1]\n"
    "Sweep.seed_binding = 'fake_train.seed'\n"
)
# What a sweep of `exp` may rewrite in its results folder (the files the provenance check ignores;
# experiment.json records the command, here with its --restart).
OUTPUTS = {
    "results/exp/exp.csv",
    "results/exp/exp.md",
    "results/exp/exp.png",
    "results/exp/exp_curves.png",
    "results/exp/experiment.json",
}

pytestmark = pytest.mark.usefixtures("fake_trainer")  # tests/conftest.py


@pytest.fixture(autouse=True)
def plain_git(monkeypatch):
    """git without the user's or the system's configuration (a signing key, a diff driver)."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "test")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "test@example.com")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def make_repo(path: Path) -> Path:
    """A committed checkout with an experiment, its spec and base config, and a source file."""
    (path / "experiments").mkdir(parents=True)
    (path / "registry").mkdir()
    (path / "src").mkdir()
    (path / "experiments" / "exp.gin").write_text(EXPERIMENT)
    shutil.copy(DATA / "base_fake.gin", path / "experiments" / "base_fake.gin")
    shutil.copy(DATA / "spec_a.gin", path / "registry" / "spec_a.gin")
    shutil.copy(REPO / ".gitignore", path / ".gitignore")  # the project's own: run folders untracked
    (path / "src" / "code.py").write_text("x = 1\n")
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "experiment")
    return path


def rows(repo: Path) -> list[dict[str, str]]:
    with open(repo / "results" / "exp" / "exp.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def run_and_commit(repo: Path, monkeypatch) -> str:
    """Run the sweep in `repo`, commit its results as the project does; the results commit's sha."""
    monkeypatch.chdir(repo)
    assert sweep.main(["experiments/exp.gin"]) == 0
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "results")
    return git(repo, "rev-parse", "--short", "HEAD")


def test_a_run_from_a_clean_checkout_is_clean_although_the_sweep_rewrites_its_csv(tmp_path, monkeypatch):
    """The restart rewrites the tracked results/exp/exp.csv before its cell starts (and the sweep process
    has run cells before): the cell still records the commit it runs at, clean, and nothing tracked
    but the experiment's own outputs was rewritten."""
    repo = make_repo(tmp_path / "a")
    head = run_and_commit(repo, monkeypatch)
    cid = rows(repo)[0]["cell_id"]
    assert sweep.main(["experiments/exp.gin", "--restart", cid]) == 0
    changed = set(git(repo, "diff", "--name-only", "HEAD").split())
    assert "results/exp/exp.csv" in changed and changed <= OUTPUTS, changed
    row = {r["cell_id"]: r for r in rows(repo)}[cid]
    assert row["git_commit"] == head
    assert row["git_diff"] == ""
    assert not (repo / "results" / row["run_dir"] / "diff.patch").exists()


def test_an_edited_source_file_is_dirty_with_the_diffs_hash_and_the_diff_saved(tmp_path, monkeypatch):
    repo = make_repo(tmp_path / "a")
    head = run_and_commit(repo, monkeypatch)
    (repo / "src" / "code.py").write_text("x = 2\n")
    cid = rows(repo)[1]["cell_id"]
    assert sweep.main(["experiments/exp.gin", "--restart", cid]) == 0
    row = {r["cell_id"]: r for r in rows(repo)}[cid]
    patch = (repo / "results" / row["run_dir"] / "diff.patch").read_bytes()
    # the source edit only: the rewritten CSV and md are the run's own outputs, not in the diff
    assert (
        patch
        == subprocess.run(
            ["git", "diff", "HEAD", "--full-index", "--", "src/code.py"],
            cwd=repo,
            capture_output=True,
            check=True,
        ).stdout
    )
    assert b"+x = 2" in patch
    assert row["git_commit"] == f"{head}-dirty"
    assert row["git_diff"] == hashlib.sha256(patch).hexdigest()[:12]
    git(repo, "apply", "--check", "-R", str(repo / "results" / row["run_dir"] / "diff.patch"))


def test_an_untracked_module_is_dirty_and_in_the_patch_an_ignored_file_is_not(tmp_path, monkeypatch):
    """A new, uncommitted module can change results as much as an edit: it makes the row dirty and
    goes into diff.patch as a new file (the patch recreates it on a clone of the commit). What the
    project's .gitignore ignores (bytecode, the model cache, run folders) and the experiment's own
    not yet committed outputs do not count, and the user's index is left as it was."""
    repo = make_repo(tmp_path / "a")
    head = git(repo, "rev-parse", "--short", "HEAD")
    for f in ("src/__pycache__/code.cpython-311.pyc", ".cache/polgrad/weights.bin", "results/other/runs/x"):
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_bytes(b"\x00ignored\n")
    monkeypatch.chdir(repo)
    assert sweep.main(["experiments/exp.gin"]) == 0  # results/exp/ (exp.csv, exp.md, ...) untracked
    assert [(r["git_commit"], r["git_diff"]) for r in rows(repo)] == [(head, "")] * 2
    assert "?? results/exp/exp.csv" in git(repo, "status", "--porcelain", "-uall")

    (repo / "src" / "new_module.py").write_text("def reward(x):\n    return 2 * x\n")
    index = git(repo, "rev-parse", "--git-path", "index")
    index_before = (repo / index).read_bytes()
    cid = rows(repo)[0]["cell_id"]
    assert sweep.main(["experiments/exp.gin", "--restart", cid]) == 0
    row = {r["cell_id"]: r for r in rows(repo)}[cid]
    assert row["git_commit"] == f"{head}-dirty"
    patch_file = repo / "results" / row["run_dir"] / "diff.patch"
    patch = patch_file.read_bytes()
    assert row["git_diff"] == hashlib.sha256(patch).hexdigest()[:12]
    assert patch.count(b"diff --git") == 1, patch
    assert b"diff --git a/src/new_module.py b/src/new_module.py\nnew file mode 100644\n" in patch, patch
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    git(clone, "checkout", "-q", head)
    git(clone, "apply", str(patch_file))
    assert (clone / "src" / "new_module.py").read_text() == "def reward(x):\n    return 2 * x\n"
    assert (repo / index).read_bytes() == index_before
    assert "?? src/new_module.py" in git(repo, "status", "--porcelain", "-uall").splitlines()


def test_experiment_json_is_the_same_bytes_from_another_checkout_path(tmp_path, monkeypatch):
    """A clone elsewhere reruns every cell (run folders are not committed) and rewrites
    experiment.json: the tracked file must not change. The clone is given the experiment's absolute
    path, the first checkout a relative one: the recorded command and file are the same."""
    a = make_repo(tmp_path / "a")
    run_and_commit(a, monkeypatch)
    b = tmp_path / "elsewhere" / "b"
    git(tmp_path, "clone", "-q", str(a), str(b))
    monkeypatch.chdir(b)
    assert sweep.main([str(b / "experiments" / "exp.gin")]) == 0
    assert git(b, "status", "--porcelain", "--", "results/exp/experiment.json").strip() == ""
    text = (b / "results" / "exp" / "experiment.json").read_text()
    assert str(tmp_path) not in text
    meta = json.loads(text)
    assert meta["file"] == "experiments/exp.gin"
    assert meta["command"] == "python -m polgrad.sweep experiments/exp.gin"
    assert {c["spec_path"] for c in meta["cells"]} == {"registry/spec_a.gin"}


def test_only_the_experiments_own_outputs_are_ignored(tmp_path, monkeypatch):
    """cell_environment at a cell's start: every file of `exp`'s folder (its tuning stage's too) may
    differ; another experiment's file, even one whose name starts with `exp`, makes the tree dirty; a
    resumed cell's stale diff.patch goes when the tree is clean again."""
    repo = make_repo(tmp_path / "a")
    tracked = [
        *sorted(OUTPUTS),
        "results/exp/exp_tuning/exp_tuning.csv",
        "results/exp/exp_tuning/experiment.json",
        "results/expx/expx.csv",
    ]
    for f in tracked:
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text("committed\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "results")
    head = git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.chdir(repo)
    run_dir = repo / "results" / "exp" / "runs" / "c0"
    run_dir.mkdir(parents=True)
    for f in tracked[:-1]:
        (repo / f).write_text("rewritten by the run\n")
    (run_dir / "diff.patch").write_text("stale\n")
    env = results.cell_environment(run_dir, "exp")
    assert (env["git_commit"], env["git_diff"]) == (head, "")
    assert not (run_dir / "diff.patch").exists()

    (repo / "results" / "expx" / "expx.csv").write_text("another experiment's\n")
    env = results.cell_environment(run_dir, "exp")
    assert env["git_commit"] == f"{head}-dirty"
    patch = (run_dir / "diff.patch").read_text()
    assert patch.count("diff --git") == 1 and "results/expx/expx.csv" in patch
    assert env["git_diff"] == hashlib.sha256(patch.encode()).hexdigest()[:12]


def test_a_tuning_cell_counts_the_whole_experiment_folder_as_its_own(tmp_path, monkeypatch):
    """A tuning stage's folder sits inside its experiment's (results/exp/exp_tuning/): at a tuning
    cell's start the evaluation's files beside it (experiment.json, written before the stage runs; the
    CSV and md of an earlier sweep; a study's files) may differ too; another experiment's may not."""
    repo = make_repo(tmp_path / "a")
    tracked = [*sorted(OUTPUTS), "results/exp/exp_gao.md", "results/exp/exp_tuning/exp_tuning.csv"]
    for f in [*tracked, "results/expx/expx.csv"]:
        (repo / f).parent.mkdir(parents=True, exist_ok=True)
        (repo / f).write_text("committed\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "results")
    head = git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.chdir(repo)
    run_dir = repo / "results" / "exp" / "exp_tuning" / "runs" / "c0"
    run_dir.mkdir(parents=True)
    for f in tracked:
        (repo / f).write_text("rewritten by the sweep\n")
    env = results.cell_environment(run_dir, "exp_tuning")
    assert (env["git_commit"], env["git_diff"]) == (head, "")
    (repo / "results" / "expx" / "expx.csv").write_text("another experiment's\n")
    env = results.cell_environment(run_dir, "exp_tuning")
    assert env["git_commit"] == f"{head}-dirty"
    patch = (run_dir / "diff.patch").read_text()
    assert patch.count("diff --git") == 1 and "results/expx/expx.csv" in patch


def test_the_experiments_own_atomic_writes_in_flight_are_not_a_dirty_tree(tmp_path, monkeypatch):
    """With --parallel, a cell starts while another records its row: the CSV's (and md's, png's)
    atomic temp file sits untracked beside it for a moment. That is the experiment's own output in
    flight, not a change of the code: the new cell is clean. (Measured: a kl_ablation --parallel 2
    from a fresh clone recorded rows '-dirty' with the temp CSV as their diff, and 'unknown'.) Another
    experiment's temp file still makes the tree dirty."""
    repo = make_repo(tmp_path / "a")
    head = git(repo, "rev-parse", "--short", "HEAD")
    monkeypatch.chdir(repo)
    run_dir = repo / "results" / "exp" / "runs" / "c0"
    run_dir.mkdir(parents=True)
    results_dir = repo / "results"
    for name in (".exp.csv.k2j4x9.tmp", ".exp.md.a8b.tmp", ".exp_curves.png.z1.png"):
        (results_dir / "exp" / name).write_text("a write in flight\n")
    (results_dir / ".exp.q1w2").write_text("the folder's own swap in flight\n")
    (results_dir / "exp.tmp-123-abc").mkdir()
    (results_dir / "exp.tmp-123-abc" / "x.txt").write_text("a folder swap in flight\n")
    env = results.cell_environment(run_dir, "exp")
    assert (env["git_commit"], env["git_diff"]) == (head, "")
    (results_dir / "expx").mkdir()
    (results_dir / "expx" / ".expx.csv.k2j4x9.tmp").write_text("another experiment's\n")
    env = results.cell_environment(run_dir, "exp")
    assert env["git_commit"] == f"{head}-dirty"
    assert "results/expx/.expx.csv.k2j4x9.tmp" in (run_dir / "diff.patch").read_text()


def test_an_untracked_file_that_vanishes_mid_check_is_listed_again_not_unknown(tmp_path, monkeypatch):
    """git add --intent-to-add fails on a listed file gone since the listing: the state is taken again
    (the row's commit was 'unknown' before)."""
    from polgrad.results import provenance

    repo = make_repo(tmp_path / "a")
    head = git(repo, "rev-parse", "--short", "HEAD")
    real, calls = provenance._untracked, []

    def flaky(root, specs):
        calls.append(1)
        return [b"results/gone.tmp"] if len(calls) == 1 else real(root, specs)

    monkeypatch.setattr(provenance, "_untracked", flaky)
    assert provenance.git_state(repo) == (head, b"") and len(calls) == 2


def test_the_check_command_passes_clean_rows_and_flags_dirty_and_foreign_commits(
    tmp_path, monkeypatch, capsys
):
    repo = make_repo(tmp_path / "a")
    run_and_commit(repo, monkeypatch)
    ran_at = git(repo, "rev-parse", "--short", "HEAD~1")  # the cells ran before their results' commit
    before = (repo / "results" / "exp" / "exp.csv").read_text()
    assert results.main(["exp", "--check-provenance"]) == 0
    assert capsys.readouterr().out == f"all 2 rows from clean commits: {ran_at}\n"
    assert (repo / "results" / "exp" / "exp.csv").read_text() == before  # the check writes nothing

    git(repo, "checkout", "-q", "-b", "side")  # a commit on another branch, not in main's history
    (repo / "src" / "code.py").write_text("x = 3\n")
    git(repo, "commit", "-q", "-am", "side")
    side = git(repo, "rev-parse", "--short", "HEAD")
    git(repo, "checkout", "-q", "main")
    r0, r1 = rows(repo)
    fields = list(r0)
    r0.update(git_commit=f"{ran_at}-dirty", git_diff="0123456789ab")
    r1.update(git_commit=side)
    ghost = {**r1, "cell_id": "ghost", "git_commit": "deadbeef"}
    lost = {**r1, "cell_id": "lost", "git_commit": "", "git_diff": ""}
    with open(repo / "results" / "exp" / "exp.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows([r0, r1, ghost, lost])
    assert results.main(["exp", "--check-provenance"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        f"{r0['cell_id']}: {ran_at}-dirty: the tree differed from the commit (diff 0123456789ab, "
        f"saved as results/{r0['run_dir']}/diff.patch)",
        f"{r1['cell_id']}: {side}: not in the history of HEAD",
        "ghost: deadbeef: not a commit of this repository",
        "lost: -: no git_commit recorded",
    ]
    assert err.startswith("error: 4 of 4 rows of results/exp/exp.csv do not come from a clean commit")
    assert err.count("\n") == 1


def test_the_check_command_outside_git_or_without_a_csv_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert results.main(["exp", "--check-provenance"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --check-provenance: the working directory is not in a git repository")
    assert err.count("\n") == 1
    repo = make_repo(tmp_path / "a")
    monkeypatch.chdir(repo)
    assert results.main(["exp", "--check-provenance"]) == 2
    err = capsys.readouterr().err
    missing = "results/exp/exp.csv does not exist (run the sweep, or give --results DIR)"
    assert err == f"error: --check-provenance: {missing}\n"


def test_a_user_module_the_experiment_imports_is_recorded_by_its_content(tmp_path, monkeypatch):
    """A module on PYTHONPATH (outside the repository: the commit does not name it) that the experiment's
    gin imports: every row records its digest, which changes with its source, so two sweeps whose only
    difference is that module differ in their rows (before, both were recorded clean and identical)."""
    from polgrad.results.provenance import module_digests

    lib = tmp_path / "lib"
    (lib / "my_pkg").mkdir(parents=True)
    (lib / "my_mod.py").write_text("X = 1\n")
    (lib / "my_pkg" / "__init__.py").write_text("")
    (lib / "my_pkg" / "part.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(lib))
    first = module_digests(["my_mod", "my_pkg", "no_such_module_here"])
    mod, pkg, missing = first.split(", ")
    assert mod.startswith("my_mod@") and len(mod) == len("my_mod@") + 12
    assert missing == "no_such_module_here@missing"
    (lib / "my_mod.py").write_text("X = 2\n")
    (lib / "my_pkg" / "part.py").write_text("Y = 2\n")  # a file inside the package, not its __init__
    second = module_digests(["my_mod", "my_pkg"]).split(", ")
    assert second[0] != mod and second[1] != pkg

    repo = make_repo(tmp_path / "a")
    monkeypatch.chdir(repo)
    run_dir = repo / "results" / "exp" / "runs" / "c0"
    run_dir.mkdir(parents=True)
    meta = repo / "results" / "exp" / "experiment.json"
    meta.write_text(json.dumps({"imports": ["my_mod"]}))
    env = results.cell_environment(run_dir, "exp")
    assert env["user_modules"] == module_digests(["my_mod"]) and env["user_modules"].startswith("my_mod@")
    meta.write_text(json.dumps({}))
    assert "user_modules" not in results.cell_environment(run_dir, "exp")  # none imported: no column


def test_the_sweep_records_the_modules_its_file_imports_and_the_md_names_them(tmp_path):
    from polgrad.results import markdown
    from polgrad.sweep import load_experiment
    from polgrad.sweep.folder import write_experiment_json
    from polgrad.sweep.grid import expand

    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\nimport polgrad.components.kl\n"
        "Sweep.name = 'exp'\nSweep.specs = ['registry/grpo.gin']\nSweep.seeds = [0]\n"
    )
    exp = load_experiment(str(path))
    meta = write_experiment_json(exp, expand(exp), tmp_path / "results", "python -m polgrad.sweep x")
    assert meta["imports"] == ["polgrad.components.kl"]
    rows = [
        {"cell_id": "a", "spec": "grpo", "seed": "0", "status": "ok", "eval_accuracy": "0.5",
         "user_modules": "my_mod@0123456789ab"},
    ]  # fmt: skip
    md = markdown("exp", rows, swept_columns=[], primary_metric="eval_accuracy")
    machine = next(line for line in md.splitlines() if line.startswith("Machine: "))
    assert " · user modules my_mod@0123456789ab · " in machine
    plain = markdown("exp", [{k: v for k, v in rows[0].items() if k != "user_modules"}], swept_columns=[],
                     primary_metric="eval_accuracy")  # fmt: skip
    assert "user modules" not in plain


def test_a_binary_file_is_in_the_diff_by_its_hash_not_its_bytes(tmp_path, monkeypatch):
    """A tracked binary file changed (weights left by a one-off run, say): the patch names it with its
    new blob hash (what `git hash-object` gives) and holds none of its 1 MB, and another change to it
    gives another git_diff (before, the patch carried the whole file, base85-encoded)."""
    repo = make_repo(tmp_path / "a")
    blob = repo / "src" / "weights.bin"
    blob.write_bytes(bytes(range(256)) * 4096)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "weights")
    head = git(repo, "rev-parse", "--short", "HEAD")
    hashes = []
    for fill in (1, 2):
        blob.write_bytes(bytes([fill]) * (1 << 20))
        commit, diff = provenance.git_state(repo)
        assert commit == f"{head}-dirty"
        assert len(diff) < 1000 and b"Binary files a/src/weights.bin and b/src/weights.bin differ" in diff
        assert git(repo, "hash-object", str(blob)).encode() in diff  # its content, by hash
        hashes.append(provenance.diff_hash(diff))
    assert hashes[0] != hashes[1]


def test_the_machine_line_says_when_the_cells_finished_and_when_the_report_was_written():
    """A regenerated md moves its own date; when the cells ran comes from their finished_at (issue 43:
    the line said only when the report was written)."""
    from polgrad.results import markdown

    rows = [
        {"cell_id": c, "spec": "grpo", "seed": s, "status": "ok", "eval_accuracy": "0.5", "finished_at": t}
        for c, s, t in (
            ("a", "0", "2026-11-26T20:20:25+00:00"),
            ("b", "1", "2026-11-26T21:12:13+01:00"),
            ("c", "2", ""),
        )  # fmt: skip
    ]
    md = markdown("exp", rows, swept_columns=[], primary_metric="eval_accuracy")
    machine = next(line for line in md.splitlines() if line.startswith("Machine: "))
    # b finished at 21:12 in UTC+1, 20:12 UTC: the first; a row without the time is left out
    assert " · cells finished 2026-11-26 20:12 UTC to 2026-11-26 20:20 UTC · report 20" in machine
    one = markdown("exp", rows[:1], swept_columns=[], primary_metric="eval_accuracy")
    assert " · cells finished 2026-11-26 20:20 UTC · report " in one
    none = markdown("exp", rows[2:], swept_columns=[], primary_metric="eval_accuracy")
    assert "cells finished" not in none and " · report 20" in none
