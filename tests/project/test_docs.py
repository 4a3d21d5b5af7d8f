"""The project's front pages stay short, correct and runnable: README.md at most 150 lines with its two
set-up-complete commands first, every file the docs name present, and the README's example
experiment accepted by the sweep's dry run as written (the dry run checks every cell as the trainer
would, so an example that names a missing spec, a binding no cell reads or a wrong Sweep parameter
fails here, not in a newcomer's first hour)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    REPO / "README.md",
    REPO / "CONTRIBUTING.md",
    REPO / "results" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
]


def indented_block_after(text: str, marker: str) -> list[str]:
    """The lines of the 4-space-indented block that follows `marker` (indent removed)."""
    lines = text.split(f"<!-- {marker} -->\n", 1)[1].splitlines()
    block = []
    for line in lines:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return block


def test_the_readme_is_at_most_150_lines_and_opens_with_its_two_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 150, len(text.splitlines())
    first_section = text.split("\n## ", 1)[0]  # both commands come before any section
    main = indented_block_after(first_section, "main-command")
    tests = indented_block_after(first_section, "test-command")
    assert len(main) == 1 and "python -m polgrad.sweep experiments/" in main[0], main
    assert len(tests) == 1 and "-m pytest" in tests[0], tests
    assert main[0].startswith("bash .ci/setup &&") and tests[0].startswith("bash .ci/setup --test &&")


def test_the_main_command_writes_where_git_does_not_look():
    """The main command's sweep writes to a git-ignored folder: the committed results/ stay our
    machine's record and `git status` stays clean after it (the README's promise)."""
    text = (REPO / "README.md").read_text()
    (main,) = indented_block_after(text.split("\n## ", 1)[0], "main-command")
    found = re.search(r"--results (\S+)", main)
    assert found, f"the main command writes into results/, which git tracks: {main}"
    name = re.search(r"experiments/(\w+)\.gin", main).group(1)
    for path in (f"{found.group(1)}/{name}/{name}.md", f"{found.group(1)}/{name}/runs/c0/metrics.jsonl"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path


# a path the docs name: a folder of the project, then path characters; a placeholder (X, <name>, *, {})
# names no one file and is skipped
PATH = re.compile(
    r"(?<![\w./-])((?:polgrad|registry|experiments|results|docs|tests|benchmarks|examples|\.ci)/[\w./-]*\w)(?![\w*<{])"
)
LINK = re.compile(r"\]\(([^)#\s]+)")


def named_paths(page: Path) -> list[tuple[str, Path]]:
    text = page.read_text()
    found = [(m, REPO / m) for m in PATH.findall(text)]
    found += [(m, page.parent / m) for m in LINK.findall(text) if "://" not in m]
    placeholder = re.compile(r"(^|/)(X|Y|N)([._/]|$)|[<>*{}]|/X_|_X\b|my_idea")  # my_idea: the reader's own
    return [(name, path) for name, path in found if not placeholder.search(name)]


def test_every_file_the_front_pages_name_exists():
    missing = [
        f"{page.relative_to(REPO)}: {name}"
        for page in PAGES
        for name, path in named_paths(page)
        if not path.exists()
        and not (REPO / "polgrad" / name.removeprefix("polgrad/")).with_suffix(".py").exists()
    ]
    assert not missing, missing
    # the check sees what it should: README links results/README.md and names registry/grpo.gin
    readme = dict(named_paths(REPO / "README.md"))
    assert "results/README.md" in readme and "registry/grpo.gin" in readme


def test_the_front_pages_catch_a_missing_file():
    """The path check itself: a page naming a file that does not exist is caught."""
    assert PATH.findall("see docs/no_such_page.md and `registry/grpo.gin`") == [
        "docs/no_such_page.md",
        "registry/grpo.gin",
    ]
    assert not (REPO / "docs" / "no_such_page.md").exists()


def test_the_readme_sweep_example_passes_the_dry_run(tmp_path):
    """The README's example experiment, written to a file as a reader would, passes `--dry-run`: 3 specs x
    10 seeds = 30 cells. (An earlier draft swept Algorithm.kl_coef with Dr. GRPO, whose spec has no KL
    term: the dry run refused it, as it should.)"""
    gin = indented_block_after((REPO / "README.md").read_text(), "sweep-example")
    assert gin and gin[0].startswith("include "), gin
    path = tmp_path / "my_idea.gin"
    path.write_text("\n".join(gin) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "polgrad.sweep", str(path), "--dry-run"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    cells = [line for line in proc.stdout.splitlines() if re.match(r"^(grpo|dr_grpo|rloo)-s\d+-", line)]
    assert len(cells) == 30, proc.stdout[-2000:]


def test_the_run_folders_a_newcomer_makes_are_ignored_by_git():
    """The README's one run (`--out runs/...`) and `polgrad.train`'s default folder (results/runs/) are
    ignored: otherwise every later sweep row is recorded '-dirty' with the run's weights in its diff."""
    readme = (REPO / "README.md").read_text()
    out = re.search(r"python -m polgrad\.train \S+ .*--out (\S+)", readme).group(1)
    for path in (
        f"{out}/metrics.jsonl",
        "results/runs/grpo-20260101-000000/final/model.safetensors",
        "results/my_idea/runs/c0/metrics.jsonl",  # a sweep's run folders, a tuning stage's inside it
        "results/my_idea/my_idea_tuning/runs/c0/metrics.jsonl",
        "results/my_idea/my_idea.csv.lock",
    ):
        proc = subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO)
        assert proc.returncode == 0, f"{path} is not ignored by .gitignore"


def test_the_campaign_check_the_pages_give_first_names_a_commit_any_clone_has():
    """A tag does not travel with a branch: the first `studies.campaign` command of results/README.md
    (and docs/experiments.md's) names the commit by its hash, which every clone of main has."""
    for page in (REPO / "results" / "README.md", REPO / "docs" / "experiments.md"):
        text = " ".join(page.read_text().split())
        found = re.findall(r"python -m studies\.campaign ([\w.-]+)", text)
        commits = [f for f in found if f != "COMMIT"]  # docs/experiments.md's placeholder
        assert commits, f"{page.name} gives no studies.campaign command with a commit"
        first = commits[0]
        assert re.fullmatch(r"[0-9a-f]{7,40}", first), f"{page.name}: '{first}' is not a commit hash"
        probe = subprocess.run(
            ["git", "cat-file", "-e", f"{first}^{{commit}}"], cwd=REPO, capture_output=True
        )
        assert probe.returncode == 0, f"{page.name}: {first} is not a commit of this clone"


def test_results_holds_one_folder_per_experiment_and_its_index_names_each():
    """results/ has no loose report files: each experiment's CSV, md, figures and experiment.json sit
    in its folder (polgrad/results/paths.py), and results/README.md links every experiment's md."""
    from polgrad.results.paths import csv_path, experiments, md_path, meta_path

    tracked = subprocess.run(["git", "ls-files", "results"], cwd=REPO, capture_output=True, text=True)
    loose = [p for p in tracked.stdout.split() if p.count("/") == 1 and p != "results/README.md"]
    assert loose == [], f"files at the top of results/, outside any experiment's folder: {loose}"
    root = REPO / "results"
    names = experiments(root)
    assert len(names) >= 10 and "kl_ablation" in names, names
    index = (root / "README.md").read_text()
    for name in names:
        assert (
            csv_path(name, root).is_file()
            and md_path(name, root).is_file()
            and meta_path(name, root).is_file()
        )
        assert f"]({name}/{name}.md)" in index, f"results/README.md does not link {name}/{name}.md"
