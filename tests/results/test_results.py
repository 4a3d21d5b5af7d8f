"""Leaderboards: t-based confidence intervals, atomic CSV upserts, grouping, markdown, load()."""

from __future__ import annotations

import csv
import json
import math
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from polgrad import results
from polgrad.errors import DataError

# ---------------------------------------------------------------------------------------------
# Confidence intervals: known values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "df, expected",
    # Two-sided 95% critical values of Student's t (any statistics table).
    [
        (1, 12.7062),
        (2, 4.3027),
        (3, 3.1824),
        (4, 2.7764),
        (5, 2.5706),
        (10, 2.2281),
        (30, 2.0423),
        (100, 1.9840),
    ],
)
def test_t_quantile_matches_the_table(df, expected):
    assert results.t_ppf(0.975, df) == pytest.approx(expected, abs=5e-5)


def test_t_cdf_is_symmetric_and_inverts_ppf():
    assert results.t_cdf(0.0, 7) == pytest.approx(0.5, abs=1e-12)
    for df in (1, 3, 12):
        for q in (0.6, 0.9, 0.995):
            t = results.t_ppf(q, df)
            assert results.t_cdf(t, df) == pytest.approx(q, abs=1e-9)
            assert results.t_ppf(1 - q, df) == pytest.approx(-t, abs=1e-9)


def test_mean_ci_known_values():
    mean, half, n = results.mean_ci([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3)
    # s = 1, t_{0.975, 2} = 4.302653: half-width = 4.302653 · 1 / sqrt(3) = 2.484138
    assert half == pytest.approx(4.302653 / math.sqrt(3), abs=1e-6)
    assert half == pytest.approx(2.484, abs=1e-3)
    assert results.mean_ci([5.0]) == (5.0, None, 1)  # one seed: no interval
    mean, half, n = results.mean_ci([])
    assert math.isnan(mean) and half is None and n == 0
    assert results.mean_ci([1.0, float("nan"), 3.0])[2] == 2  # non-finite values are dropped
    assert results.mean_ci([4.0, 4.0])[1] == 0.0


@given(st.lists(st.floats(-1e6, 1e6), min_size=2, max_size=40), st.sampled_from([0.9, 0.95, 0.99]))
def test_mean_ci_is_scipys_interval_to_the_bit(xs, confidence):
    """mean_ci computes the standard error as scipy.stats.sem does (np.std, ddof 1, over sqrt(n))
    without its per-call cost, and caches the t quantile: the committed reports' intervals stay the
    same numbers, bit for bit."""
    from scipy import stats as sp

    _, half, n = results.mean_ci(xs, confidence)
    assert n == len(xs)
    assert half == float(sp.t.ppf(0.5 + confidence / 2.0, n - 1)) * float(sp.sem(xs))


# ---------------------------------------------------------------------------------------------
# The CSV
# ---------------------------------------------------------------------------------------------


def _row(cid, **kw):
    base = {
        "experiment": "e",
        "cell_id": cid,
        "spec": "grpo",
        "spec_file": "registry/grpo.gin",
        "seed": 0,
        "status": "ok",
        "eval_accuracy": 0.5,
    }
    return {**base, **kw}


def test_upsert_replaces_by_cell_id_keeps_order_and_unions_columns(tmp_path):
    path = tmp_path / "e.csv"
    order = ["c0", "c1", "c2"]
    results.upsert_row(path, _row("c2", **{"Algorithm.kl": "@kl.k3"}), order=order)
    results.upsert_row(path, _row("c0", **{"Algorithm.kl": "@kl.k1"}), order=order)
    results.upsert_row(path, _row("c0", status="failed", error="boom", eval_accuracy=None), order=order)
    results.upsert_row(path, _row("c1", **{"Algorithm.kl_coef": 0.01}), order=order)
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
        header = reader.fieldnames
    assert [r["cell_id"] for r in rows] == ["c0", "c1", "c2"]  # one row per cell, expansion order
    assert rows[0]["status"] == "failed" and rows[0]["error"] == "boom" and rows[0]["eval_accuracy"] == ""
    # Swept columns sit between the identity and the metrics, in first-seen order.
    assert header == [
        "experiment",
        "cell_id",
        "spec",
        "spec_file",
        "Algorithm.kl",
        "Algorithm.kl_coef",
        "seed",
        "eval_accuracy",
        "status",
        "error",
    ]
    assert not list(tmp_path.glob(".e.csv.*"))  # no temp files left behind


def test_concurrent_upserts_lose_nothing(tmp_path):
    path = tmp_path / "e.csv"

    def writer(k):
        for i in range(6):
            results.upsert_row(path, _row(f"w{k}-{i}", eval_accuracy=k + i / 10))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rows = results.read_rows(path)
    assert sorted(r["cell_id"] for r in rows) == sorted(f"w{k}-{i}" for k in range(6) for i in range(6))


def test_load_returns_the_dataframe_and_a_one_line_error_when_missing(tmp_path):
    results.upsert_row(tmp_path / "kl_ablation" / "kl_ablation.csv", _row("c0"))
    df = results.load("kl_ablation", results_dir=tmp_path)
    assert list(df["cell_id"]) == ["c0"] and df["eval_accuracy"].iloc[0] == 0.5
    with pytest.raises(DataError) as err:
        results.load("nope", results_dir=tmp_path)
    msg = str(err.value)
    assert (
        "\n" not in msg
        and "nope" in msg
        and str(tmp_path / "nope" / "nope.csv") in msg
        and "kl_ablation" in msg
    )


def test_environment_reports_versions_without_importing_them():
    env = results.environment()
    assert set(env) == {
        "git_commit",
        "git_diff",
        "python",
        "torch",
        "transformers",
        "deepspeed",
        "hostname",
        "cpu_count",
        "cpu",  # model · torch's CPU capability · bf16 ISA flags (polgrad/machine.py)
    }
    assert env["cpu_count"] >= 1 and env["python"].count(".") == 2
    assert results.git_commit("/") == "unknown"  # not a repository


# ---------------------------------------------------------------------------------------------
# Grouping, markdown, curves
# ---------------------------------------------------------------------------------------------


def _rows():
    rows = []
    for kl, accs in (("@kl.k1", [0.2, 0.4]), ("@kl.k3", [0.6, 0.8, 0.7]), ("@kl.abs", [0.9])):
        for seed, acc in enumerate(accs):
            rows.append(
                _row(
                    f"{kl}-{seed}",
                    **{"Algorithm.kl": kl, "seed": seed, "eval_accuracy": acc, "kl": 0.1 * seed},
                )
            )
    rows.append(
        _row(
            "k2-0", **{"Algorithm.kl": "@kl.k2", "status": "failed", "error": "nan loss", "eval_accuracy": ""}
        )
    )
    rows.append(
        _row("k3-failed", **{"Algorithm.kl": "@kl.k3", "seed": 3, "status": "failed", "error": "oom"})
    )
    return [{k: str(v) for k, v in r.items()} for r in rows]


def test_leaderboard_groups_over_seeds_and_sorts_by_the_primary_metric():
    board = results.leaderboard(_rows(), ["spec", "Algorithm.kl"], "eval_accuracy")
    assert [e["group"]["Algorithm.kl"] for e in board] == ["@kl.abs", "@kl.k3", "@kl.k1", "@kl.k2"]
    k3 = board[1]
    assert (k3["n"], k3["n_failed"]) == (3, 1)
    mean, half, n = k3["eval_accuracy"]
    assert mean == pytest.approx(0.7) and n == 3
    assert half == pytest.approx(results.t_ppf(0.975, 2) * 0.1 / math.sqrt(3))
    assert board[0]["eval_accuracy"][1] is None  # one seed
    assert board[-1]["n"] == 0  # all seeds failed: last
    low = results.leaderboard(_rows(), ["spec", "Algorithm.kl"], "eval_accuracy", higher_is_better=False)
    assert [e["group"]["Algorithm.kl"] for e in low][:3] == ["@kl.k1", "@kl.k3", "@kl.abs"]


TABLE5_ROW = {
    "table5_method": "GRPO",
    "table5_type": "on-policy",
    "table5_reward_model": "rule",
    "table5_value_function": "none",
    "table5_reference_policy": "yes",
    "table5_core_loss": "clip",
}


def test_markdown_ranks_the_groups_and_says_when_there_is_no_ci():
    md = results.markdown(
        "kl",
        [{**r, **TABLE5_ROW} for r in _rows()],
        swept_columns=["Algorithm.kl"],
        primary_metric="eval_accuracy",
        command="python -m polgrad.sweep x.gin",
    )
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert table[0].split(" | ")[:5] == ["| rank", "spec", "Algorithm.kl", "seeds ok", "eval_accuracy"]
    # ranked by the mean, but one seed supports no claim: the leader gets no ★ (tests/results/test_compare.py)
    assert table[1].startswith("| 1 | grpo | `@kl.abs` | 1 | 0.9 (n=1) |")
    assert not any("★" in ln for ln in table[1:5])
    assert table[2].startswith("| 2 | grpo | `@kl.k3` | 3 (1 failed) | 0.7 ± 0.25 |")
    assert "| – |" in table[4]  # the group with no finished seed
    assert "GRPO | on-policy | rule | none | yes | clip |" in table[1]
    assert "`(n=1)` means a single seed, so no interval" in md
    assert "`python -m polgrad.sweep x.gin`" in md
    assert "- `k2-0`: nan loss" in md and "- `k3-failed`: oom" in md


def test_markdown_without_table5_says_why():
    md = results.markdown(
        "kl",
        _rows(),
        swept_columns=["Algorithm.kl"],
        primary_metric="eval_accuracy",
    )
    assert "Table-5 columns unavailable" in md and "| n/a |" in md


def test_read_metrics_skips_a_torn_line_and_keeps_the_last_row_of_a_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 0, "reward_mean": 0.1},
        {"step": 1, "reward_mean": 0.2},
        {"step": 1, "reward_mean": 0.25},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "rew')
    assert results.read_metrics(path) == [{"step": 0, "reward_mean": 0.1}, {"step": 1, "reward_mean": 0.25}]
    assert results.read_metrics(tmp_path / "missing.jsonl") == []


def test_plot_writes_a_valid_png_even_without_metrics(tmp_path):
    import matplotlib.image

    results.plot(tmp_path / "p.png", "kl", _rows(), swept_columns=["Algorithm.kl"], results_dir=tmp_path)
    img = matplotlib.image.imread(tmp_path / "p.png")
    assert img.ndim == 3 and img.shape[2] in (3, 4)


def test_markdown_table5_comes_from_the_csv_columns_and_the_method_is_the_spec(tmp_path):
    t5 = {k: v for k, v in TABLE5_ROW.items() if k != "table5_method"}
    rows = [{**r, **t5} if r["Algorithm.kl"] != "@kl.k1" else r for r in _rows()]
    md = results.markdown("kl", rows, swept_columns=["Algorithm.kl"], primary_metric="eval_accuracy")
    table = [ln for ln in md.splitlines() if ln.startswith("| ")]
    labels = "| method | type | reward model | value function | reference policy | core loss |"
    assert table[0].endswith(labels)
    assert table[1].endswith("| grpo | on-policy | rule | none | yes | clip |")
    k1 = next(ln for ln in table if "`@kl.k1`" in ln)
    assert k1.endswith("| n/a | n/a | n/a | n/a | n/a | n/a |")
    assert "Table-5 columns unavailable for 1 of 4 groups" in md and "grpo · Algorithm.kl=@kl.k1" in md
    # in the CSV the table5_* columns sit after the metrics, not among the swept bindings
    path = tmp_path / "e.csv"
    results.upsert_row(path, _row("c0", **{"Algorithm.kl": "@kl.k3", "steps": 3, **t5}))
    with open(path, newline="") as fh:
        header = csv.DictReader(fh).fieldnames
    assert header.index("Algorithm.kl") < header.index("seed") < header.index("table5_type")
    assert header.index("steps") < header.index("table5_type") < header.index("status")


def test_results_import_neither_the_algorithm_nor_the_trainer():
    import subprocess
    import sys

    code = (
        "import sys, polgrad.results; "
        "sys.exit(any(m in sys.modules for m in ('polgrad.algorithm', 'polgrad.trainer', 'polgrad.sweep')))"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_cli_reports_a_missing_experiment_without_a_runpy_warning(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "polgrad.results", "nope", "--results", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "RuntimeWarning" not in out.stderr
    assert results.main is not None


def test_world_size_and_zero_stage_columns_and_a_csv_from_before_them(tmp_path):
    """A CSV written before world_size / zero_stage existed still loads; a new row adds the columns
    (blank in the old rows), and the md shows each group's values, "n/a" where no row has one."""
    path = tmp_path / "e" / "e.csv"
    path.parent.mkdir()
    old = _row("old", **{"Algorithm.kl": "@kl.k1", "steps": 2})
    with open(path, "w", newline="") as fh:  # the header an older sweep wrote: no such columns
        writer = csv.DictWriter(fh, fieldnames=list(old))
        writer.writeheader()
        writer.writerow(old)
    assert "world_size" not in results.load("e", tmp_path).columns
    new = [
        _row(f"new{s}", **{"Algorithm.kl": "@kl.k3", "seed": s, "world_size": 2, "zero_stage": 3})
        for s in (0, 1)
    ]
    for r in new:
        results.upsert_row(path, r)
    header = next(csv.reader(open(path)))
    assert header.index("steps") + 1 == header.index("world_size") == header.index("zero_stage") - 1
    rows = results.read_rows(path)
    assert [(r["world_size"], r["zero_stage"]) for r in rows] == [("", ""), ("2", "3"), ("2", "3")]
    assert results.load("e", tmp_path)["world_size"].tolist()[1:] == [2, 2]
    md = results.markdown("e", rows, swept_columns=["Algorithm.kl"], primary_metric="eval_accuracy")
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| rank"))
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    table = [ln.split(" | ") for ln in lines[start:end] if ln.startswith("| ")]  # the leaderboard
    col = table[0].index("world size")
    assert table[0][col + 1] == "ZeRO stage"
    by_kl = {ln[2]: ln[col : col + 2] for ln in table[1:]}
    assert by_kl == {"`@kl.k3`": ["2", "3"], "`@kl.k1`": ["n/a", "n/a"]}
    # Groups whose rows differ list every value.
    mixed = rows[1:] + [{**rows[2], "cell_id": "new2", "seed": "2", "world_size": "1", "zero_stage": "0"}]
    md = results.markdown("e", mixed, swept_columns=["Algorithm.kl"], primary_metric="eval_accuracy")
    line = next(ln.split(" | ") for ln in md.splitlines() if ln.startswith("| 1 "))
    assert line[col : col + 2] == ["1, 2", "0, 3"]


def test_the_md_quotes_the_answer_of_the_experiments_own_analysis(tmp_path):
    """An analysis md beside the sweep's (e.g. overoptimization_gao.md) with an Answer: the sweep's md keeps
    its own Answer as its last line and quotes the analysis's after it; a tuning stage's, a replication's,
    a pilot's, another experiment's whose name starts with this one's and an md without an Answer are not
    analyses of these runs."""
    from polgrad.results.report import companions

    kl = tmp_path / "kl"  # the experiment's folder (polgrad/results/paths.py)
    kl.mkdir()
    (kl / "kl_gao.md").write_text("# gao\n\n**Answer.** The gold peaks at d = 1.\n\n![x](x.png)\n")
    (kl / "kl_tuning.md").write_text("- **Answer.** lr 1e-4.\n")
    (kl / "kl_replication.md").write_text("- **Answer.** As a replication of kl: holds.\n")
    (kl / "kl_notes.md").write_text("no answer here\n")
    (tmp_path / "kl_gao.md").write_text("**Answer.** outside the experiment's folder.\n")
    (tmp_path / "kl_ablation").mkdir()
    for folder, other in (
        (kl, "kl_pilot_gao"),
        (kl, "kl_replication_gao"),
        (tmp_path / "kl_ablation", "kl_ablation_gao"),
        (kl, "kl_pilot"),
    ):  # other runs' analyses
        (folder / f"{other}.md").write_text("**Answer.** not these runs.\n")
    gao = ("_gao",)  # the analyses a study declares (studies/overoptimization: Study.answers)
    assert companions("kl_ablation", tmp_path, gao) == [("kl_ablation_gao.md", "not these runs.")]
    assert companions("kl", tmp_path) == []  # no study names an analysis: nothing is quoted
    found = companions("kl", tmp_path, gao)
    assert found == [("kl_gao.md", "The gold peaks at d = 1.")]
    md = results.markdown(
        "kl", _rows(), swept_columns=["Algorithm.kl"], primary_metric="eval_accuracy", companions=found
    )
    (last,) = (ln for ln in md.splitlines() if ln.startswith("- **Answer.** "))  # the findings' last line
    assert last.endswith(
        " By its own declared method, [kl_gao.md](kl_gao.md) answers: The gold peaks at d = 1."
    )
    plain = results.markdown("kl", _rows(), swept_columns=["Algorithm.kl"], primary_metric="eval_accuracy")
    (own,) = (ln for ln in plain.splitlines() if ln.startswith("- **Answer.** "))
    assert last.startswith(own) and last != own  # its own answer first, unchanged
