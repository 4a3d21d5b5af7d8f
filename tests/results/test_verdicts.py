"""`python -m polgrad.results X --compare-verdicts OTHER.md`: an md's verdicts beside another md's."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from polgrad.results import __main__ as results_cli
from polgrad.results import verdicts

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"


def _section_rows(md: Path, title: str) -> list[list[str]]:
    """The table rows of the md's section `title` (cells stripped), header and rule excluded."""
    lines = md.read_text().splitlines()
    start = lines.index(f"## {title}")
    table = []
    for ln in lines[start + 1 :]:
        if ln.startswith("## "):
            break
        if ln.startswith("|---"):
            continue
        if ln.startswith("|"):
            table.append([c.strip() for c in ln.strip().strip("|").split(" | ")])
        elif table:
            break
    return table[1:]


def test_the_committed_replication_table_is_what_comparing_the_two_mds_gives(capsys):
    """kl_ablation.md's Replication section is computed by the replication study from both CSVs; the
    compare command reads only the two mds. Same claims, same Δ and verdict texts, same agreement."""
    study = {r[0]: r for r in _section_rows(RESULTS / "kl_ablation" / "kl_ablation.md", "Replication")}
    assert len(study) == 4
    rc = results_cli.main(
        [
            "kl_ablation",
            "--results",
            str(RESULTS),
            "--compare-verdicts",
            str(RESULTS / "kl_ablation_replication" / "kl_ablation_replication.md"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    got = {}
    for ln in out.splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split(" | ")]
        if ln.startswith("|") and cells[0] in study:
            got[cells[0]] = cells
    assert got == study  # prediction, metric, Δ A, verdict A, Δ B, verdict B, agrees/replicates
    assert "Of 4 predictions, 4 agree." in out
    # read from each md's machine line (after the README's main command on another CPU, the first md
    # is that machine's)
    a, b = (verdicts.read_md(RESULTS / n / f"{n}.md") for n in ("kl_ablation", "kl_ablation_replication"))
    assert b.cpu.startswith("AMD EPYC") and ("Both ran on the same CPU type" in out) == (a.cpu == b.cpu)


def _md(path: Path, cpu: str, rows: list[tuple[str, str, str, str]]) -> Path:
    """An md with a machine line and a Predictions table of (claim, configuration, expected, verdict)."""
    path.write_text(
        "\n".join(
            [
                "# exp",
                "",
                f"Machine: box (2 CPUs: {cpu}) · python 3.11 · torch 2 · commit abc1234 · cells finished "
                "2026-01-01 10:00 UTC to 2026-01-01 11:00 UTC · report 2026-01-02 10:00 UTC · command: `x`",
                "",
                "| prediction | configuration | metric | expected | Δ [95% CI] | p (Holm) | verdict |",
                "|---|---|---|---|---|---|---|",
                *(f"| {c} | {cfg} | acc | {e} | +0.1 [0, 0.2] | 0.01 | {v} |" for c, cfg, e, v in rows),
                "",
                "## Next",
            ]
        )
    )
    return path


def test_verdicts_agree_only_when_both_decide_the_same_way(tmp_path, capsys):
    mine = [
        ("same", "a", "higher", "confirmed"),
        ("opposite", "a", "higher", "confirmed"),
        ("one decides", "a", "higher", "not confirmed"),
        ("both open", "a", "no difference", "undecided"),
        ("moved", "a", "higher", "confirmed"),
        ("mine only", "a", "higher", "confirmed"),
        ("both refuted", "a", "lower", "refuted"),
        ("inside the margin", "a", "no difference", "confirmed (equivalent within ±0.1) and different"),
    ]
    theirs = [
        ("same", "a", "higher", "confirmed"),
        ("opposite", "a", "higher", "refuted"),
        ("one decides", "a", "higher", "confirmed"),
        ("both open", "a", "no difference", "undecided"),
        ("moved", "b", "higher", "confirmed"),
        ("both refuted", "a", "lower", "refuted"),
        ("inside the margin", "a", "no difference", "confirmed (equivalent within ±0.1)"),
    ]
    a = verdicts.read_md(_md(tmp_path / "a.md", "Intel Xeon · AMX", mine))
    b = verdicts.read_md(_md(tmp_path / "b.md", "AMD EPYC · AVX512", theirs))
    assert (a.cpu, a.commit, a.cells_finished) == (
        "Intel Xeon · AMX",
        "abc1234",
        "2026-01-01 10:00 UTC to 2026-01-01 11:00 UTC",
    )
    out = verdicts.compare(a, b)
    words = {
        ln.split(" | ")[0][2:]: ln.rstrip(" |").rsplit("| ", 1)[1]
        for ln in out.lines
        if ln.startswith("| ") and "---" not in ln
    }
    assert words == {
        "prediction": "agrees",
        "same": "yes",
        "opposite": "no",
        "one decides": "no",
        "both open": "neither decides",
        "moved": "declared differently",
        "mine only": "declared in one only",
        "both refuted": "yes",
        "inside the margin": "yes",
    }
    assert (out.agree, out.disagree, out.compared) == (3, 2, 8)
    assert not any("same CPU type" in ln for ln in out.lines)
    assert (
        verdicts.main(str(tmp_path / "a.md"), str(tmp_path / "b.md")) == 1
    )  # a prediction decided differently
    assert verdicts.main(str(tmp_path / "b.md"), str(tmp_path / "b.md")) == 0
    capsys.readouterr()


def test_record_appends_which_cpu_the_verdicts_held_on(tmp_path, capsys):
    rows = [("p", "a", "higher", "confirmed")]
    _md(tmp_path / "a.md", "Intel Xeon · AMX", rows)
    _md(tmp_path / "b.md", "AMD EPYC · AVX512", rows)
    log = tmp_path / "replications.csv"
    for _ in range(2):
        assert verdicts.main(str(tmp_path / "a.md"), str(tmp_path / "b.md"), str(log)) == 0
    got = list(csv.DictReader(open(log)))
    assert len(got) == 2 and tuple(got[0]) == verdicts.RECORD_COLUMNS
    assert got[0]["cpu"] == "Intel Xeon · AMX" and (got[0]["agree"], got[0]["predictions"]) == ("1", "1")
    assert got[0]["against"].endswith("b.md (AMD EPYC · AVX512, abc1234)")
    other = tmp_path / "other.csv"
    other.write_text("x,y\n1,2\n")
    a, b = verdicts.read_md(tmp_path / "a.md"), verdicts.read_md(tmp_path / "b.md")
    with pytest.raises(verdicts.DataError, match="other.csv: its header is not experiment,cpu"):
        verdicts.record(other, a, b, verdicts.compare(a, b))
    assert other.read_text() == "x,y\n1,2\n"  # nothing written to a file of another kind
    capsys.readouterr()


def test_an_md_without_predictions_or_missing_is_one_line(tmp_path, capsys):
    (tmp_path / "kl_ablation").mkdir()
    shutil.copy(RESULTS / "kl_ablation" / "kl_ablation.md", tmp_path / "kl_ablation" / "kl_ablation.md")
    (tmp_path / "plain.md").write_text("# kl_ablation\n\nno table here\n")
    for other, text in (
        (tmp_path / "plain.md", "plain.md: no Predictions table"),
        (tmp_path / "missing.md", "missing.md: no such md"),
    ):
        rc = results_cli.main(["kl_ablation", "--results", str(tmp_path), "--compare-verdicts", str(other)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and text in err[0], err
    with pytest.raises(SystemExit):
        results_cli.main(["kl_ablation", "--record", str(tmp_path / "r.csv")])
    assert "--record goes with --compare-verdicts" in capsys.readouterr().err


def test_git_head_compares_the_rerun_with_the_committed_md(tmp_path, capsys):
    """The README's main command overwrites the committed md in the working tree: `git:HEAD` reads the
    committed one back."""
    import subprocess

    results = tmp_path / "results"
    (results / "exp").mkdir(parents=True)
    md = _md(results / "exp" / "exp.md", "AMD EPYC · AVX512", [("p", "a", "higher", "confirmed")])
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "findings"], check=True)
    _md(md, "Intel Xeon · AMX", [("p", "a", "higher", "not confirmed")])  # the rerun
    rc = results_cli.main(["exp", "--results", str(results), "--compare-verdicts", "git:HEAD"])
    out = capsys.readouterr().out
    assert rc == 1 and "B: HEAD:results/exp/exp.md (AMD EPYC · AVX512, abc1234" in out
    assert "| p | acc | +0.1 [0, 0.2] | not confirmed | +0.1 [0, 0.2] | confirmed | no |" in out
    rc = results_cli.main(["exp", "--results", str(results), "--compare-verdicts", "git:nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "git cannot show nope:results/exp/exp.md" in err[0]


def test_git_rev_reads_an_older_commits_md_at_its_flat_path(tmp_path, capsys):
    """A commit from before one folder per experiment has results/exp.md, not results/exp/exp.md:
    `git:REV` reads that one (the campaign's commits are such)."""
    import subprocess

    results = tmp_path / "results"
    results.mkdir()
    _md(results / "exp.md", "AMD EPYC · AVX512", [("p", "a", "higher", "confirmed")])
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "flat findings"], check=True)
    (results / "exp.md").unlink()
    (results / "exp").mkdir()
    _md(results / "exp" / "exp.md", "Intel Xeon · AMX", [("p", "a", "higher", "confirmed")])
    rc = results_cli.main(["exp", "--results", str(results), "--compare-verdicts", "git:HEAD"])
    out = capsys.readouterr().out
    assert rc == 0 and "B: HEAD:results/exp.md (AMD EPYC · AVX512" in out, out


def test_an_intel_model_name_is_read_whole(tmp_path):
    """Linux names Intel CPUs 'Intel(R) Xeon(R) ...': the CPU is everything up to the machine line's
    ') · python', not the first ')' (which made any two Intel machines 'the same CPU type')."""
    rows = [("p", "a", "higher", "confirmed")]
    a = verdicts.read_md(_md(tmp_path / "a.md", "Intel(R) Xeon(R) Platinum 8480+ · AMX · amx_bf16", rows))
    b = verdicts.read_md(_md(tmp_path / "b.md", "Intel(R) Xeon(R) Gold 6338 · AVX512 · avx512f", rows))
    assert a.cpu == "Intel(R) Xeon(R) Platinum 8480+ · AMX · amx_bf16"
    assert not any("same CPU type" in ln for ln in verdicts.compare(a, b).lines)
    (tmp_path / "c.md").write_text(
        (tmp_path / "a.md")
        .read_text()
        .replace("(2 CPUs: ", "(2 CPUs")
        .replace("Intel(R) Xeon(R) Platinum 8480+ · AMX · amx_bf16", "")
    )
    c = verdicts.read_md(tmp_path / "c.md")
    assert c.cpu == verdicts.UNKNOWN_CPU
    assert not any("same CPU type" in ln for ln in verdicts.compare(c, c).lines)  # unknown is not the same


def test_record_into_a_missing_folder_is_one_line(tmp_path):
    rows = [("p", "a", "higher", "confirmed")]
    a = verdicts.read_md(_md(tmp_path / "a.md", "AMD EPYC", rows))
    with pytest.raises(verdicts.DataError, match="its folder .* does not exist"):
        verdicts.record(tmp_path / "no" / "r.csv", a, a, verdicts.compare(a, a))
