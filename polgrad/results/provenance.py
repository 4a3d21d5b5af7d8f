"""Where a results row ran: the git commit (and the diff when the tree differs from it), package
versions, hostname, CPU count (no heavy imports).

A row is clean when `git diff HEAD` over the tracked files, and the untracked files that .gitignore does
not ignore (a new module under polgrad/ changes results too), is empty once the experiment's own outputs
are left out (`outputs`: the experiment's folder results/X/, which holds its CSV, report, figures and
tuning stage): the sweep rewrites those itself while it runs, so a run from
a clean checkout stays clean from its first cell to its last. Otherwise its git_commit is
`<sha>-dirty` and its git_diff the first 12 hex digits of the sha256 of that diff, which the sweep saves
as diff.patch in the cell's run folder (`cell_environment`, taken when the cell starts), untracked
files as new files in it. Run folders and the model cache are ignored by the project's .gitignore
(results/**/runs/, /.cache/), so they never count. `check` tells whether every row of a CSV comes
from a clean commit in the history of this repository's HEAD (`python -m polgrad.results X
--check-provenance`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from polgrad.io import atomic_path
from polgrad.machine import cpu_label
from polgrad.results import paths

DIRTY = "-dirty"
# The row column of the modules an experiment's gin imports, by content (module_digests)
USER_MODULES = "user_modules"
TUNING = paths.TUNING  # X_tuning: the tuning stage of experiment X (its folder: results/X/X_tuning/)
# `git diff HEAD` in one format whatever the user's git configuration says. A binary file's content is
# never in it ("Binary files ... differ"), only its blob hashes (--full-index: 40 hex digits), which
# the git_diff column's hash covers: a changed binary changes the hash, not the patch's size.
DIFF = (
    *("-c", "core.quotePath=true", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false"),
    *("diff", "HEAD", "--no-ext-diff", "--no-textconv", "--no-color", "--full-index", "--no-renames"),
    *("--no-relative", "--src-prefix=a/", "--dst-prefix=b/"),
)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(
    args: Sequence[str], cwd: str | os.PathLike | None, env: dict[str, str] | None = None, stdin: bytes = b""
) -> subprocess.CompletedProcess | None:
    """`git args` in `cwd` (bytes out; `env` added to the environment), or None when git cannot be run."""
    try:
        return subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            timeout=30,
            input=stdin,
            env={**os.environ, **env} if env else None,
        )
    except (OSError, subprocess.SubprocessError):
        return None


def _untracked(root: Path, specs: Sequence[str]) -> list[bytes] | None:
    """The untracked files under `specs` that .gitignore (and .git/info/exclude) does not ignore,
    relative to `root`; None when git fails."""
    out = _git(["ls-files", "--others", "--exclude-standard", "--full-name", "-z", "--", *specs], root)
    if out is None or out.returncode != 0:
        return None
    return [f for f in out.stdout.split(b"\0") if f]


def repo_root(cwd: str | os.PathLike | None = None) -> Path | None:
    """The top folder of the git work tree holding `cwd` (default: the working directory), or None."""
    out = _git(["rev-parse", "--show-toplevel"], cwd)
    if out is None or out.returncode != 0 or not out.stdout.strip():
        return None
    return Path(os.fsdecode(out.stdout.strip())).resolve()


def repo_relative(path: str | os.PathLike, root: str | os.PathLike | None = None) -> str:
    """`path` relative to `root` (default: the working directory), in '/' form, when it lies inside;
    else as given. What a tracked file records, so that it reads the same from any checkout path."""
    base = Path(root if root is not None else os.getcwd()).resolve()
    try:
        return Path(path).resolve().relative_to(base).as_posix()
    except ValueError:
        return str(path)


def portable_command(argv: Sequence[str], root: str | os.PathLike | None = None) -> str:
    """A command line as a tracked file records it: each absolute path inside `root` made relative to
    it, one outside shown as `<dir>/` + its last part (no machine's folders in a committed file), also
    in `--flag=/path` form; shell-quoted otherwise."""

    def show(arg: str) -> str:
        flag, eq, value = arg.partition("=") if arg.startswith("--") else ("", "", arg)
        if value.startswith("<dir>/"):  # shown so already
            return arg
        if not os.path.isabs(value):
            return shlex.quote(arg)
        rel = repo_relative(value, root)
        if os.path.isabs(rel):
            return (shlex.quote(flag + eq) if flag else "") + f"<dir>/{shlex.quote(Path(value).name)}"
        return shlex.quote(flag + eq + rel)

    return " ".join(map(show, argv))


def outputs(experiment: str, results_dir: str | os.PathLike) -> list[Path]:
    """What a sweep of `experiment` writes under `results_dir`, which the provenance check ignores: its
    folder (polgrad/results/paths.py), with its CSV, report, figures, experiment.json, run folders, its
    studies' files and its tuning stage's folder. For a tuning stage (X_tuning in results/X/) it is the
    evaluation's whole folder, which holds the stage's: the sweep writes results/X/experiment.json too."""
    results_dir = Path(results_dir)
    if experiment.endswith(TUNING) and results_dir.name == experiment.removesuffix(TUNING):
        return [results_dir]
    return [paths.folder(experiment, results_dir)]


def git_state(
    cwd: str | os.PathLike | None = None, ignore: Iterable[str | os.PathLike] = ()
) -> tuple[str, bytes]:
    """(short sha of HEAD, with `-dirty` if a file outside `ignore` differs from it; that diff).

    ('unknown', b'') outside git. The diff is `git diff HEAD` (staged and unstaged changes; a binary
    file by its blob hashes, not its bytes) in a fixed format, whatever the user's git configuration
    says, and every untracked file .gitignore does not ignore as a new file (marked intent-to-add in
    a temporary copy of the index: the user's index is not touched)."""
    sha = _git(["rev-parse", "--short", "HEAD"], cwd)
    root = repo_root(cwd)
    if sha is None or sha.returncode != 0 or not sha.stdout.strip() or root is None:
        return "unknown", b""
    specs = [":(top)"]
    for p in ignore:
        rel = repo_relative(Path(cwd or os.getcwd()) / p, root)
        if not Path(rel).is_absolute():
            specs.append(f":(top,exclude,literal){rel}")
            # ... and its atomic writes in flight (polgrad.io: `.<name>.<random><suffix>` beside a
            # file, `<name>.tmp-*` / `<name>.old-*` beside a folder): another cell recording its row
            # while this one starts must not make it dirty (nor 'unknown' when the temp file goes
            # between the listing and the diff)
            parent, name = _glob_escape(str(Path(rel).parent)), _glob_escape(Path(rel).name)
            prefix = "" if parent == "." else f"{parent}/"
            specs.append(f":(top,exclude,glob){prefix}.{name}.*")
            specs += [f":(top,exclude,glob){prefix}{name}.{kind}-*/**" for kind in ("tmp", "old")]
    for _attempt in range(3):  # an untracked file that vanishes before `git add` sees it: list again
        state = _diff_state(root, cwd, specs)
        if state is not None:
            return os.fsdecode(sha.stdout.strip()) + (DIRTY if state else ""), state
    return "unknown", b""


def _glob_escape(text: str) -> str:
    """`text` matched literally inside a glob pathspec."""
    return "".join(f"[{c}]" if c in "*?[]\\" else c for c in text)


def _diff_state(root: Path, cwd: str | os.PathLike | None, specs: list[str]) -> bytes | None:
    """`git diff HEAD` over `specs`, untracked files included as new ones; None when git fails."""
    untracked = _untracked(root, specs)
    if untracked is None:
        return None
    with tempfile.TemporaryDirectory(prefix="polgrad-index-") as tmp:
        env = None
        if untracked:  # in a copy of the index, marked intent-to-add: `git diff HEAD` shows them as new
            index = _git(["rev-parse", "--git-path", "index"], root)
            if index is None or index.returncode != 0:
                return None
            real = root / os.fsdecode(index.stdout.strip())
            env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
            if real.exists():
                shutil.copyfile(real, env["GIT_INDEX_FILE"])
            added = _git(
                ["add", "--intent-to-add", "--pathspec-from-file=-", "--pathspec-file-nul"],
                root,
                {**env, "GIT_LITERAL_PATHSPECS": "1"},
                b"\0".join(untracked),
            )
            if added is None or added.returncode != 0:
                return None
        diff = _git([*DIFF, "--", *specs], cwd, env)
    if diff is None or diff.returncode != 0:
        return None
    return diff.stdout


def git_commit(cwd: str | os.PathLike | None = None, ignore: Iterable[str | os.PathLike] = ()) -> str:
    """Short sha of HEAD (`-dirty` if a tracked file outside `ignore` changed), 'unknown' outside git."""
    return git_state(cwd, ignore)[0]


def diff_hash(diff: bytes) -> str:
    """The git_diff column: the first 12 hex digits of the diff's sha256 ('' for no diff)."""
    return hashlib.sha256(diff).hexdigest()[:12] if diff else ""


def cpu_count() -> int:
    """CPUs this process may use (the affinity mask where there is one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def machine() -> dict[str, Any]:
    """python/torch/transformers/deepspeed versions, hostname, cpu count and the CPU (model, torch's
    CPU capability, bf16-relevant ISA flags: polgrad/machine.py): fixed for a process."""
    return {
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "deepspeed": _version("deepspeed"),
        "hostname": socket.gethostname(),
        "cpu_count": cpu_count(),
        "cpu": cpu_label(),
    }


def environment(
    ignore: Iterable[str | os.PathLike] = (),
    diff_to: str | os.PathLike | None = None,
    cwd: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """git_commit and git_diff now (never cached: a commit may land between two cells), then `machine()`.

    With `diff_to`, the diff is written there when the tree is dirty, and a stale file there is
    removed when it is clean (a resumed cell's folder keeps no patch of its earlier start)."""
    commit, diff = git_state(cwd, ignore)
    if diff_to is not None:
        if diff:
            with atomic_path(diff_to) as tmp:
                tmp.write_bytes(diff)
        else:
            Path(diff_to).unlink(missing_ok=True)
    return {"git_commit": commit, "git_diff": diff_hash(diff), **machine()}


def cell_environment(run_dir: str | os.PathLike, experiment: str) -> dict[str, Any]:
    """`environment` at the start of a sweep cell whose run folder is
    <results>/<experiment>/runs/<cell>: the experiment's outputs ignored, the diff saved as
    run_dir/diff.patch, and the modules its experiment.json says the experiment imports recorded by
    content (`user_modules`, module_digests). A folder laid out otherwise ignores nothing."""
    run_dir = Path(run_dir)
    exp_dir = run_dir.parent.parent
    ours = run_dir.parent.name == "runs" and exp_dir.name == experiment
    meta_path = exp_dir / paths.META
    meta = _recorded(meta_path) if ours else {}
    ignore = outputs(experiment, exp_dir.parent) if ours else []
    env = environment(ignore, diff_to=run_dir / "diff.patch")
    if meta.get("imports"):  # the user modules the experiment imports, by content (USER_MODULES)
        env[USER_MODULES] = module_digests(meta["imports"])
    return env


def _recorded(meta_path: Path) -> dict[str, Any]:
    """The sweep's experiment.json ({} when there is none yet, or it is not the sweep's)."""
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def module_names(imports: Iterable[str]) -> list[str]:
    """The modules of gin import statements ('import a.b', 'from a import b' -> 'a.b'), gin's own
    `from __gin__ import ...` left out."""
    names = []
    for statement in imports:
        words = statement.split()
        if len(words) == 2 and words[0] == "import":
            names.append(words[1])
        elif len(words) == 4 and words[0] == "from" and words[2] == "import" and words[1] != "__gin__":
            names.append(f"{words[1]}.{words[3]}")
    return names


def module_digests(names: Iterable[str]) -> str:
    """'name@<sha256 of its source, 12 hex digits>' for each module an experiment imports, found as
    the trainer will find it (the working directory, then sys.path); a package's digest covers every
    .py file under it; 'name@missing' when it does not resolve. ', '-joined. A module outside the
    repository (on PYTHONPATH) is code the commit does not name: this is its record in every row."""
    import importlib.util

    out = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = Path(spec.origin) if spec is not None and spec.origin else None
        if origin is None or not origin.is_file():
            out.append(f"{name}@missing")
            continue
        files = sorted(origin.parent.rglob("*.py")) if spec.submodule_search_locations else [origin]
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.relative_to(origin.parent).as_posix().encode() + b"\0" + f.read_bytes())
        out.append(f"{name}@{digest.hexdigest()[:12]}")
    return ", ".join(out)


def check(
    rows: Sequence[dict[str, str]],
    cwd: str | os.PathLike | None = None,
    results_dir: str | os.PathLike = "results",
) -> tuple[list[str], list[str]]:
    """(one line per row not from a clean commit in the history of HEAD: cell id, commit, why; the
    clean commits the other rows name). Run in the repository the rows belong to; `results_dir` is
    where the rows' run_dir lie (for the path of a dirty row's diff.patch)."""
    known: dict[str, str | None] = {}

    def why_not(sha: str) -> str | None:
        if sha not in known:
            found = _git(["cat-file", "-e", f"{sha}^{{commit}}"], cwd)
            if found is None or found.returncode != 0:
                known[sha] = "not a commit of this repository"
            else:
                anc = _git(["merge-base", "--is-ancestor", sha, "HEAD"], cwd)
                known[sha] = None if anc is not None and anc.returncode == 0 else "not in the history of HEAD"
        return known[sha]

    bad, clean = [], []
    for n, r in enumerate(rows, 1):
        cid = r.get("cell_id") or f"row {n}"
        commit = (r.get("git_commit") or "").strip()
        if not commit:
            why = "no git_commit recorded"
        elif commit == "unknown":
            why = "ran outside a git repository"
        elif commit.endswith(DIRTY):
            digest = (r.get("git_diff") or "").strip()
            run_dir = r.get("run_dir")
            where = (
                (Path(results_dir) / run_dir / "diff.patch").as_posix()
                if run_dir
                else "diff.patch in its run folder"
            )
            why = (
                f"the tree differed from the commit (diff {digest}, saved as {where})"
                if digest
                else "the tree differed from the commit (no diff recorded)"
            )
        else:
            why = why_not(commit)
        if why:
            bad.append(f"{cid}: {commit or '-'}: {why}")
        elif commit not in clean:
            clean.append(commit)
    return bad, clean
