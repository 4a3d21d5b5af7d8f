"""A grid axis that a cell never reads is refused in the dry run; labels show only what acts.

The dry run builds every cell (polgrad/sweep/validation.py) and asks which bindings the built cell
reads (polgrad/sweep/reads.py). A swept binding a cell does not read, whose values would give
otherwise identical cells, stops the sweep with one line naming the axis, the cells and what they
build instead. Base-file bindings a cell does not read are listed, not refused. The CSV records per
cell the swept bindings it does not read (`not_read`), and the md's and plots' labels leave them out.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polgrad import results
from polgrad.errors import ConfigError
from polgrad.sweep import folder, prepare
from polgrad.sweep.grid import format_cells
from polgrad.sweep.launch import FINISHED

REPO = Path(__file__).resolve().parents[2]


def exp_file(tmp_path: Path, grid: str, spec: str = "grpo", fixed: str = "", seeds: str = "[0]") -> str:
    path = tmp_path / "axes.gin"
    path.write_text(
        "include 'experiments/base_tiny.gin'\n"
        f"{fixed}\n"
        "Sweep.name = 'axes'\n"
        f"Sweep.specs = ['registry/{spec}.gin']\n"
        f"Sweep.grid = {grid}\n"
        f"Sweep.seeds = {seeds}\n"
    )
    return str(path)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # the experiment files include experiments/base_tiny.gin


# ------------------------------------------------------------------------------ the refusal
@pytest.mark.parametrize(
    "grid, axis, builds",
    [
        # GRPO's clip rule is clip.ppo: clip.tis is never called
        ("{'clip.tis.cap': [1.0, 2.0]}", "clip.tis.cap", "Algorithm.clip = @clip.ppo"),
        # the base config's task is task.add: task.sort is never built
        ("{'task.sort.length': [3, 5]}", "task.sort.length", "train.task = @task.add"),
        # GRPO has no critic: the value loss's weight is never used
        ("{'Algorithm.vf_coef': [0.5, 1.0]}", "Algorithm.vf_coef", "builds no critic"),
        # crossed with the clip rule, eps_high acts under clip.ppo only: the clip.none cells repeat
        (
            "{'Algorithm.clip': [@clip.ppo, @clip.none], 'clip.ppo.eps_high': [0.2, 0.28]}",
            "clip.ppo.eps_high",
            "Algorithm.clip = @clip.none",
        ),
    ],
    ids=["tis_cap_under_ppo", "sort_length_under_add", "vf_coef_without_critic", "crossed_with_clip"],
)
def test_an_axis_the_cells_do_not_read_is_refused_naming_it(tmp_path, grid, axis, builds):
    with pytest.raises(ConfigError) as err:
        prepare(exp_file(tmp_path, grid))
    msg = str(err.value)
    assert f"Sweep.grid axis '{axis}' not read by cells " in msg, msg
    assert builds in msg, msg
    assert "identical runs" in msg and "\n" not in msg


def test_the_kl_coefficient_without_a_kl_term_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"axis 'Algorithm.kl_coef' not read .*builds Algorithm.kl = None"):
        prepare(exp_file(tmp_path, "{'Algorithm.kl_coef': [0.0, 0.1]}", spec="dapo"))


def test_the_refusal_names_every_cell_that_repeats(tmp_path):
    with pytest.raises(ConfigError) as err:
        prepare(exp_file(tmp_path, "{'clip.tis.cap': [1.0, 2.0, 4.0]}", seeds="[0, 1]"))
    cells = str(err.value).split(" not read by cells ")[1].split(" (")[0].split(", ")
    assert len(cells) == 3 and all(
        c.startswith("grpo-") and c.endswith(tuple("0123456789abcdef")) for c in cells
    )


def test_an_axis_every_cell_reads_is_accepted(tmp_path):
    _, cells = prepare(exp_file(tmp_path, "{'clip.ppo.eps_low': [0.1, 0.2]}"))
    assert len(cells) == 2
    assert all(c.unread == () for c in cells)


def test_a_zipped_axis_passes_and_records_where_it_is_not_read():
    _, cells = prepare(str(REPO / "experiments" / "clip_rules.gin"))
    by_clip = {dict(c.swept)["Algorithm.clip"]: c.unread for c in cells}
    assert by_clip["@clip.ppo"] == ()
    for rule in ("@clip.none", "@clip.dual_clip", "@clip.gspo", "@clip.cispo"):
        assert by_clip[rule] == ("clip.ppo.eps_high",), rule


def test_the_dry_run_lists_base_bindings_a_cell_does_not_read(tmp_path):
    exp, cells = prepare(exp_file(tmp_path, "{'clip.ppo.eps_low': [0.1, 0.2]}"))
    text = format_cells(exp, cells)
    listed = text.split("Bound but not read by these cells (allowed: not swept):\n")[1]
    assert (
        "  aggregate.seq_mean_token_sum_norm.max_len: all 2 cells: the cell builds "
        "Algorithm.aggregate = @aggregate.seq_mean_token_mean" in listed
    )
    assert "reward_shaping.overlong.max_len: all 2 cells" in listed
    assert "clip.ppo.eps_low" not in listed
    # Dr. GRPO reads it: not listed there
    exp, cells = prepare(exp_file(tmp_path, "{'clip.ppo.eps_low': [0.1, 0.2]}", spec="dr_grpo"))
    assert "aggregate.seq_mean_token_sum_norm.max_len" not in format_cells(exp, cells)


@pytest.mark.parametrize(
    "path",
    sorted(p for p in glob.glob(str(REPO / "experiments" / "*.gin")) if not p.endswith("base_tiny.gin")),
    ids=os.path.basename,
)
def test_every_experiment_passes_its_dry_run(path):
    _, cells = prepare(path)
    assert cells


def test_the_command_line_stops_in_the_dry_run_with_one_line(tmp_path):
    path = exp_file(tmp_path, "{'clip.tis.cap': [1.0, 2.0]}")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    for extra in (["--dry-run"], []):  # the real sweep runs the same dry run first
        out = subprocess.run(
            [sys.executable, "-m", "polgrad.sweep", path, "--results", str(tmp_path / "r"), *extra],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {path}: Sweep.grid axis 'clip.tis.cap'"), (
            lines
        )
    assert not (tmp_path / "r" / "axes" / "runs").exists()  # nothing started


# ------------------------------------------------------------------------------ the labels
def _rows(not_read_none: str) -> list[dict[str, str]]:
    rows = []
    for clip, accs, unread in (
        ("@clip.ppo", [0.50, 0.55, 0.60], ""),
        ("@clip.none", [0.40, 0.42, 0.47], not_read_none),
    ):
        for seed, acc in enumerate(accs):
            rows.append(
                {
                    "experiment": "clip_rules",
                    "cell_id": f"{clip}-{seed}",
                    "spec": "grpo",
                    "Algorithm.clip": clip,
                    "clip.ppo.eps_high": "0.2",
                    "seed": str(seed),
                    "not_read": unread,
                    "eval_accuracy": str(acc),
                    "status": "ok",
                }
            )
    return rows


def test_labels_leave_out_a_binding_the_cell_does_not_read(tmp_path):
    swept = ["Algorithm.clip", "clip.ppo.eps_high"]
    base = {"Algorithm.clip": "@clip.ppo", "clip.ppo.eps_high": "0.2"}
    md = results.markdown(
        "clip_rules",
        _rows("clip.ppo.eps_high"),
        swept_columns=swept,
        primary_metric="eval_accuracy",
        baseline=base,
    )
    assert "grpo · Algorithm.clip=@clip.none" in md
    assert "Algorithm.clip=@clip.none · clip.ppo.eps_high" not in md
    assert "grpo · Algorithm.clip=@clip.ppo · clip.ppo.eps_high=0.2" in md  # read there: kept
    row = next(ln for ln in md.splitlines() if ln.startswith("|") and "`@clip.none`" in ln)
    assert "| `@clip.none` | not read |" in row
    figs = results.plot(
        tmp_path / "c.png",
        "clip_rules",
        _rows("clip.ppo.eps_high"),
        swept_columns=swept,
        results_dir=tmp_path,
        baseline=base,
    )
    assert figs.reference == "clip=@clip.ppo · clip.ppo.eps_high=0.2"
    assert figs.order == ["clip=@clip.none"]
    # a CSV without the column (written before it existed) labels every swept binding, as before
    md = results.markdown("clip_rules", _rows(""), swept_columns=swept, primary_metric="eval_accuracy")
    assert "grpo · Algorithm.clip=@clip.none · clip.ppo.eps_high=0.2" in md


def test_the_csv_row_records_the_bindings_a_cell_does_not_read(tmp_path):
    exp, cells = prepare(str(REPO / "experiments" / "clip_rules.gin"))
    outcome = {"status": sorted(FINISHED)[0], "summary": {}}
    rows = {dict(c.swept)["Algorithm.clip"]: folder.row(exp, c, tmp_path, tmp_path, outcome) for c in cells}
    assert rows["@clip.none"]["not_read"] == "clip.ppo.eps_high"
    assert rows["@clip.ppo"]["not_read"] == ""
    results.upsert_row(tmp_path / "x.csv", rows["@clip.none"])
    assert results.read_rows(tmp_path / "x.csv")[0]["not_read"] == "clip.ppo.eps_high"
