"""The tuning stage of a sweep (`Sweep.tuning`, polgrad/sweep/tuning.py): declared, checked, run as
`<name>_tuning`, its best value per configuration bound in the evaluation cells and shown in the md.

The sweeps run tests/fake_train.py (conftest's `fake_trainer`): its eval_accuracy is a fixed function
of (lr, kl, seed) (0.5 · crc32(f"{lr}|{kl}") % 1000 / 1000 + 0.02 · seed at the last step), so with
the tuning grid lr ∈ {0.1, 0.3, 0.5} the best lr is 0.5 under @fakekl.k1 (0.874 vs 0.869 and 0.39)
and 0.1 under @fakekl.k2 (0.991 vs 0.524 and 0.872): two configurations, two different choices, one
of them not the first value. The tests read the means from the tuning runs' own summary.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from polgrad import sweep
from polgrad.errors import PolgradError
from polgrad.sweep import prepare, tuning

DATA = Path(__file__).resolve().parents[1] / "data"
REPO = Path(__file__).resolve().parents[2]
LRS = ["0.1", "0.3", "0.5"]


def fake_exp(
    tmp_path: Path, tuning_decl: str, seeds: str = "[0, 1]", name: str = "exp", primary: str = "eval_accuracy"
) -> Path:
    path = tmp_path / f"{name}.gin"
    path.write_text(
        f"include '{DATA / 'base_fake.gin'}'\n"
        f"Sweep.specs = ['{DATA / 'spec_a.gin'}']\n"
        "Sweep.grid = {'fake_train.kl': [@fakekl.k1, @fakekl.k2]}\n"
        f"Sweep.seeds = {seeds}\n"
        "Sweep.seed_binding = 'fake_train.seed'\n"
        f"Sweep.primary_metric = '{primary}'\n"
        f"Sweep.tuning = {tuning_decl}\n" + ("Sweep.higher_is_better = False\n" if primary == "kl" else "")
    )
    return path


# both choices below are at an edge of the grid (0.5 the largest, 0.1 the smallest): the declaration
# says why they may stand, else the evaluation is refused (test_a_choice_at_the_grids_edge_...)
WHY = "the fake trainer's score is a hash of lr: nothing lies beyond the grid"
BARE = "{'seeds': [10, 11], 'grid': {'fake_train.lr': [" + ", ".join(LRS) + "]}"
DECL = BARE + f", 'at_edge': \"{WHY}\"}}"
BARE += "}"


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


def summaries(folder: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in folder.glob("runs/*/summary.json")}


# ------------------------------------------------------------------------------ the declaration
@pytest.mark.usefixtures("fake_trainer")
def test_tuning_seeds_that_are_also_evaluation_seeds_are_refused_in_one_line(tmp_path, capsys):
    path = fake_exp(
        tmp_path, "{'seeds': [1, 2, 10], 'grid': {'fake_train.lr': [0.1, 0.3]}}", seeds="[0, 1, 2]"
    )
    assert sweep.main([str(path), "--dry-run"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {path}: line 7: Sweep.tuning['seeds']: "), err
    assert "seeds 1, 2 also evaluate (Sweep.seeds = [0, 1, 2])" in err, err


@pytest.mark.usefixtures("fake_trainer")
@pytest.mark.parametrize(
    "decl, says",
    [
        ("[10, 11]", "must be a dict with the keys 'seeds', 'grid'"),
        (
            "{'seeds': [10], 'grid': {'fake_train.lr': [0.1]}, 'metrics': 'kl'}",
            "with the keys 'seeds', 'grid' (optional: 'metric', 'higher_is_better', 'at_edge')",
        ),
        (
            "{'seeds': [10], 'grid': {'fake_train.lr': [0.1]}, 'metric': 'eval_acc'}",
            "Sweep.tuning['metric']: unknown metric 'eval_acc'; valid: final_train_reward, eval_accuracy",
        ),
        (
            "{'seeds': [10], 'grid': {'fake_train.lr': [0.1]}, 'higher_is_better': 'yes'}",
            "Sweep.tuning['higher_is_better']: must be True or False",
        ),
        ("{'seeds': [10, 10], 'grid': {'fake_train.lr': [0.1]}}", "must be a list of distinct ints"),
        ("{'seeds': [10], 'grid': {}}", "must be a non-empty dict of axes"),
        (
            "{'seeds': [10], 'grid': {'fake_train.kl': [@fakekl.k3]}}",
            "'fake_train.kl' is also a Sweep.grid axis",
        ),
        ("{'seeds': [10], 'grid': {'fake_train.seed': [1, 2]}}", "is the seed binding"),
        ("{'seeds': [10], 'grid': {'fake_train.lr': [0.1, 'x']}}", "values mix types"),
    ],
)
def test_a_bad_tuning_declaration_is_one_line_naming_the_file(tmp_path, capsys, decl, says):
    path = fake_exp(tmp_path, decl)
    assert sweep.main([str(path), "--dry-run"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {path}: line 7: Sweep.tuning") and says in err, err


# ------------------------------------------------------------------------------ the expansion
def test_beta_is_tuned_only_in_the_configurations_with_a_kl_term(tmp_path, monkeypatch):
    """GRPO binds a KL estimator, RLOO binds `Algorithm.kl = None` (checked here on the spec files):
    GRPO's tuning cells cross 3 lr × 2 β, RLOO's only the 3 lr (its β stays the first, not read)."""
    monkeypatch.chdir(REPO)
    assert "\nAlgorithm.kl = @kl.k3\n" in (REPO / "registry/grpo.gin").read_text()
    assert "\nAlgorithm.kl = None\n" in (REPO / "registry/rloo.gin").read_text()
    path = tmp_path / "tiny.gin"
    path.write_text(
        "include 'experiments/base_tiny.gin'\n"
        "Sweep.specs = ['registry/grpo.gin', 'registry/rloo.gin']\n"
        "Sweep.seeds = [0, 1]\n"
        "Sweep.tuning = {'seeds': [7, 8], "
        "'grid': {'train.lr': [3e-5, 1e-4, 3e-4], 'Algorithm.kl_coef': [0.01, 0.1]}}\n"
    )
    exp, cells = prepare(str(path), "polgrad.train")
    plan = exp.tuning
    by_spec: dict[str, set] = {}
    for c in plan.cells:
        by_spec.setdefault(c.spec_name, set()).add(
            (dict(c.swept)["train.lr"], dict(c.swept)["Algorithm.kl_coef"])
        )
        assert c.seed in (7, 8)
    lrs = ["3e-05", "0.0001", "0.0003"]
    assert by_spec["grpo"] == {(lr, b) for lr in lrs for b in ("0.01", "0.1")}
    assert by_spec["rloo"] == {(lr, "0.01") for lr in lrs}
    assert len(plan.cells) == (6 + 3) * 2
    assert all(c.unread == ("Algorithm.kl_coef",) for c in plan.cells if c.spec_name == "rloo")
    assert all(c.unread == () for c in plan.cells if c.spec_name == "grpo")
    assert [g.tuned for g in plan.groups] == [["train.lr", "Algorithm.kl_coef"], ["train.lr"]]
    # the evaluation cells keep their own seeds and do not list the tuning keys as bound-but-unread
    assert {c.seed for c in cells} == {0, 1}
    assert all("Algorithm.kl_coef" not in dict(c.not_read) for c in cells)
    text = tuning.format_stages(exp, cells)
    assert "stage 1, tuning: tiny_tuning:" in text and "= 18 cells" in text
    assert "The evaluation cells' train.lr, Algorithm.kl_coef come from tuning" in text
    assert "not tuned where not read: Algorithm.kl_coef in rloo" in text


# ------------------------------------------------------------------------------ the choice, end to end
def _means(tuning_dir: Path, metric: str = "eval_accuracy") -> dict[tuple[str, str], float]:
    """Mean `metric` per (kl, lr) over the tuning seeds, from the tuning runs' summary.json."""
    got: dict[tuple[str, str], list[float]] = {}
    for cid, s in summaries(tuning_dir).items():
        cell = json.loads((tuning_dir / "runs" / cid / "cell.json").read_text())["cell"]
        swept = dict(map(tuple, cell["swept"]))
        got.setdefault((swept["fake_train.kl"], swept["fake_train.lr"]), []).append(s[metric])
    assert all(len(v) == 2 for v in got.values()) and len(got) == 6
    return {k: sum(v) / len(v) for k, v in got.items()}


@pytest.fixture
def tuned(tmp_path, fake_trainer):
    path = fake_exp(tmp_path, DECL)
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out)]) == 0
    return path, out


def test_each_configuration_gets_its_best_mean_bound_in_its_evaluation_cells(tuned):
    path, out = tuned
    means = _means(out / "exp" / "exp_tuning")
    best = {kl: max(LRS, key=lambda lr: means[(kl, lr)]) for kl in ("@fakekl.k1", "@fakekl.k2")}
    assert best == {"@fakekl.k1": "0.5", "@fakekl.k2": "0.1"}  # as the docstring works out by hand
    meta = json.loads((out / "exp" / "experiment.json").read_text())
    chosen = {c["config"]["fake_train.kl"]: c["chosen"] for c in meta["tuning"]["configurations"]}
    assert chosen == {kl: {"fake_train.lr": lr} for kl, lr in best.items()}
    for s_id in summaries(out / "exp"):  # each evaluation run trained with its configuration's lr
        cell = json.loads((out / "exp" / "runs" / s_id / "cell.json").read_text())["cell"]
        kl = dict(map(tuple, cell["swept"]))["fake_train.kl"]
        config_gin = (out / "exp" / "runs" / s_id / "config.gin").read_text()
        assert f"fake_train.lr = {best[kl]}\n" in config_gin, config_gin
        assert cell["seed"] in (0, 1)
    assert len(summaries(out / "exp")) == 4 and len(summaries(out / "exp" / "exp_tuning")) == 12


def test_a_kl_primary_experiment_tunes_by_its_declared_metric(tmp_path, fake_trainer, capsys):
    """Primary metric kl, lower is better (as kl_ablation): tuned by it, each configuration would get
    the lr that moves least; with 'metric': 'eval_accuracy' it gets the most accurate one, in the
    direction of accuracy (higher: the default for a metric other than the primary). The dry run, the
    record and the md say which metric and direction chose."""
    decl = DECL[:-1] + ", 'metric': 'eval_accuracy'}"
    path = fake_exp(tmp_path, decl, primary="kl")
    assert sweep.main([str(path), "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert "the value with the highest mean eval_accuracy over the tuning seeds [10, 11]" in dry, dry
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out)]) == 0
    acc, kl = _means(out / "exp" / "exp_tuning"), _means(out / "exp" / "exp_tuning", "kl")
    kls = ("@fakekl.k1", "@fakekl.k2")
    best = {k: max(LRS, key=lambda lr: acc[(k, lr)]) for k in kls}
    least_kl = {k: min(LRS, key=lambda lr: kl[(k, lr)]) for k in kls}
    assert best != least_kl  # the two metrics disagree here, so the test tells them apart
    meta = json.loads((out / "exp" / "experiment.json").read_text())["tuning"]
    assert (meta["metric"], meta["higher_is_better"]) == ("eval_accuracy", True)
    chosen = {c["config"]["fake_train.kl"]: c["chosen"] for c in meta["configurations"]}
    assert chosen == {k: {"fake_train.lr": lr} for k, lr in best.items()}
    md = (out / "exp" / "exp.md").read_text().split("## Tuning\n", 1)[1]
    assert "the value with the highest mean eval_accuracy over those seeds" in md, md
    # without 'metric' the same experiment tunes by its primary metric, the lowest mean kl
    capsys.readouterr()
    assert sweep.main([str(fake_exp(tmp_path, DECL, primary="kl", name="plain")), "--dry-run"]) == 0
    assert "the value with the lowest mean kl over the tuning seeds" in capsys.readouterr().out


def test_the_md_has_the_tuning_section(tuned):
    _, out = tuned
    md = (out / "exp" / "exp.md").read_text()
    assert "\n## Tuning\n" in md, md
    section = md.split("## Tuning\n", 1)[1].split("\n## ", 1)[0]
    assert "on the tuning seeds 10, 11" in section and "`fake_train.lr` ∈ {0.1, 0.3, 0.5}" in section
    means = _means(out / "exp" / "exp_tuning")
    row = next(ln for ln in section.splitlines() if ln.startswith("| spec_a · fake_train.kl=@fakekl.k1 |"))
    assert "| `fake_train.lr = 0.5` (at the grid's edge) |" in row  # the largest of 0.1, 0.3, 0.5
    for lr in LRS:
        assert f"`fake_train.lr = {lr}`: {means[('@fakekl.k1', lr)]:.4g}" in row
    assert (out / "exp" / "exp_tuning" / "exp_tuning.md").exists() and (
        out / "exp" / "exp_tuning" / "exp_tuning.csv"
    ).exists()
    assert "## Tuning" not in (out / "exp" / "exp_tuning" / "exp_tuning.md").read_text()


def test_a_choice_at_the_grids_edge_blocks_the_evaluation_until_the_gin_says_why(
    tmp_path, fake_trainer, capsys
):
    """Both configurations choose an edge value: without Sweep.tuning['at_edge'] the tuning stage runs
    and is kept, no evaluation cell starts, and one line names each edge and the two ways out. With the
    reason written, the same evaluation cells (the reason is not in their ids) run without any tuning
    cell running again, and the md quotes the reason."""
    path = fake_exp(tmp_path, BARE)
    out = tmp_path / "results"
    assert sweep.main([str(path), "--results", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the tuning stage's own report
    assert err == (
        f"error: {path}: line 7: Sweep.tuning: the tuning stage chose a value at an edge of its grid for "
        "2 of 2 configurations: spec_a · fake_train.kl=@fakekl.k1 (fake_train.lr = 0.5, the largest), "
        "spec_a · fake_train.kl=@fakekl.k2 (fake_train.lr = 0.1, the smallest); its best may lie beyond the "
        "grid: extend 'grid' past that edge (the finished tuning cells are kept), or add 'at_edge': "
        "'why the edge may stand' to Sweep.tuning"
    )
    assert not (out / "exp" / "runs").exists() or not any((out / "exp" / "runs").iterdir())
    runs = out / "exp" / "exp_tuning" / "runs"
    starts = {p.name: (p / "invocations.jsonl").read_text() for p in runs.iterdir()}
    assert len(starts) == 12
    _, bare_cells = prepare(str(path))
    path.write_text(path.read_text().replace(BARE, DECL))
    _, cells = prepare(str(path))
    assert [c.id for c in cells] == [c.id for c in bare_cells]
    assert sweep.main([str(path), "--results", str(out)]) == 0
    assert {p.name: (p / "invocations.jsonl").read_text() for p in runs.iterdir()} == starts
    assert sorted(summaries(out / "exp")) == sorted(c.id for c in cells)
    assert json.loads((out / "exp" / "experiment.json").read_text())["tuning"]["at_edge"] == WHY
    assert (
        f"The experiment keeps the edge (Sweep.tuning['at_edge']): {WHY}"
        in (out / "exp" / "exp.md").read_text()
    )


@pytest.mark.parametrize("why", ["''", "'  '", "3"])
def test_an_empty_or_non_text_edge_reason_is_one_line(tmp_path, capsys, why):
    path = fake_exp(tmp_path, BARE[:-1] + f", 'at_edge': {why}}}")
    assert sweep.main([str(path), "--results", str(tmp_path / "r"), "--dry-run"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {path}: line 7: Sweep.tuning['at_edge']: must be a sentence saying why"), (
        err
    )


def test_a_rerun_runs_no_tuning_cell_again_and_keeps_the_choice(tuned):
    path, out = tuned
    before = (out / "exp" / "experiment.json").read_text()
    runs = out / "exp" / "exp_tuning" / "runs"
    starts = {p.name: (p / "invocations.jsonl").read_text() for p in runs.iterdir()}
    assert len(starts) == 12
    assert sweep.main([str(path), "--results", str(out)]) == 0
    assert {p.name: (p / "invocations.jsonl").read_text() for p in runs.iterdir()} == starts
    after = json.loads((out / "exp" / "experiment.json").read_text())
    assert after["tuning"] == json.loads(before)["tuning"]


def test_a_choice_that_changed_under_evaluation_runs_is_refused_until_they_restart(tuned, capsys):
    """A tuning run's result changes (here by hand: lr 0.3 under k2 now scores best): the evaluation
    cells of that configuration ran with lr 0.1, so the sweep stops in one line naming them; with
    --restart they run again with 0.3."""
    path, out = tuned
    for cid in summaries(out / "exp" / "exp_tuning"):
        if "-k2-0.3-" in cid:
            f = out / "exp" / "exp_tuning" / "runs" / cid / "summary.json"
            f.write_text(json.dumps({**json.loads(f.read_text()), "eval_accuracy": 0.999}))
    capsys.readouterr()
    assert sweep.main([str(path), "--results", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the tuning stage's own report
    assert err.startswith(f"error: {path}: the tuning stage now chooses "), err
    k2 = sorted(p.name for p in (out / "exp" / "runs").iterdir() if "-k2-" in p.name)
    assert "chooses fake_train.lr = 0.3 for spec_a · fake_train.kl=@fakekl.k2" in err, err
    assert "--restart " in err and all(cid in err for cid in k2) and len(k2) == 2, err
    assert sweep.main([str(path), "--results", str(out), "--restart", *k2]) == 0
    for cid in k2:
        assert "fake_train.lr = 0.3\n" in (out / "exp" / "runs" / cid / "config.gin").read_text()


# ------------------------------------------------------------------------------ the choice, its rules
@pytest.mark.usefixtures("fake_trainer")
def test_ties_go_to_the_first_value_and_unfinished_values_rank_last(tmp_path):
    exp, _ = prepare(str(fake_exp(tmp_path, DECL)))
    group = exp.tuning.groups[0]  # spec_a · k1: lr 0.1, 0.3, 0.5, two seeds each
    ids = {tuned[0][1]: cids for tuned, cids in group.values}

    def rows(scores: dict[str, list[tuple[str, str]]]) -> dict[str, dict[str, str]]:
        return {
            cid: {"cell_id": cid, "status": st, "eval_accuracy": v}
            for lr, pairs in scores.items()
            for cid, (st, v) in zip(ids[lr], pairs, strict=True)
        }

    def chosen(scores, higher=True):
        import dataclasses

        decl = dataclasses.replace(exp.tuning.declared, higher_is_better=higher)
        e = dataclasses.replace(exp, tuning=dataclasses.replace(exp.tuning, declared=decl))
        return tuning.choose(e, rows(scores))["configurations"][0]

    ok = lambda *vs: [("ok", str(v)) for v in vs]  # noqa: E731
    # a tie between 0.3 and 0.5 (mean 0.5): the first declared wins
    assert chosen({"0.1": ok(0.1, 0.1), "0.3": ok(0.4, 0.6), "0.5": ok(0.5, 0.5)})["chosen"] == {
        "fake_train.lr": "0.3"
    }
    # 0.5 is best on the seed it finished, but its other run is unstable: it ranks last
    got = chosen({"0.1": ok(0.1, 0.1), "0.3": ok(0.2, 0.2), "0.5": [("ok", "0.9"), ("unstable", "0.9")]})
    assert got["chosen"] == {"fake_train.lr": "0.3"}
    assert got["values"][2] == {"values": {"fake_train.lr": "0.5"}, "mean": None, "n_ok": 1, "n": 2}
    # a failed run (no value) and a run with no row at all rank last too
    got = chosen({"0.1": [("failed", ""), ("ok", "0.9")], "0.3": ok(0.2, 0.2), "0.5": ok(0.1, 0.1)})
    assert got["chosen"] == {"fake_train.lr": "0.3"}
    # lower is better: the smallest mean
    assert chosen({"0.1": ok(0.3, 0.3), "0.3": ok(0.1, 0.2), "0.5": ok(0.2, 0.2)}, higher=False)[
        "chosen"
    ] == {"fake_train.lr": "0.3"}
    # nothing finished: the first value, said so
    got = chosen({})
    assert got["chosen"] == {"fake_train.lr": "0.1"} and got["note"]


def test_with_a_budget_the_choice_reads_the_tuning_cells_that_ran(tmp_path):
    """Sweep.budget puts its bindings into each validated cell's id; the tuning groups must name those
    ids, or the choice finds no row of a run that finished ok and binds the first value for every
    configuration (what happened to experiments/ppo_on_add.gin at 76bb1ac: '0 of 3 runs ok' under
    all-ok runs)."""
    path = tmp_path / "exp.gin"
    path.write_text(
        f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\n"
        "Sweep.specs = ['registry/grpo.gin']\nSweep.seeds = [0]\n"
        "Sweep.budget = ('sampled_sequences', 64)\n"
        "Sweep.tuning = {'seeds': [100, 101], 'grid': {'train.lr': [3e-5, 1e-4]}}\n"
    )
    exp, _ = prepare(str(path))
    plan = exp.tuning
    running = {c.id for c in plan.cells}
    named = [i for g in plan.groups for _, ids in g.values for i in ids]
    assert sorted(named) == sorted(running) and len(named) == 4
    rows = {
        i: {"status": "ok", "eval_accuracy": "0.9" if c.swept[-1] == ("train.lr", "0.0001") else "0.1"}
        for c in plan.cells
        for i in [c.id]
    }
    record = tuning.choose(exp, rows)
    assert record["configurations"][0]["chosen"] == {"train.lr": "0.0001"}
    assert record["configurations"][0]["note"] == ""


def test_a_choice_at_an_edge_of_a_numeric_grid_is_marked_and_said():
    """The md's Tuning section marks a chosen value that is the smallest or largest of a numeric axis of
    >= 3 values (its optimum may lie beyond), and only those: not an interior value, not a 2-value axis,
    not a non-numeric one."""
    from polgrad.results.tuning import section

    def config(name, chosen):
        return {"config": {"spec": "grpo", "x": name}, "chosen": chosen, "values": []}

    record = {
        "experiment": "e_tuning",
        "seeds": [100],
        "metric": "eval_accuracy",
        # declared out of numeric order: the edges are the numerically smallest and largest
        "grid": {"train.lr": ["0.0001", "3e-05", "0.0003"], "b": ["0.01", "0.04"], "c": ["@a", "@b", "@c"]},
        "configurations": [
            config("low", {"train.lr": "3e-05"}),
            config("mid", {"train.lr": "0.0001", "b": "0.04", "c": "@c"}),
            config("high", {"train.lr": "0.0003"}),
        ],
    }
    lines = section(record)
    rows = {line.split(" | ")[0]: line for line in lines if line.startswith("| grpo")}
    assert rows["| grpo · x=low"].count("(at the grid's edge)") == 1
    assert rows["| grpo · x=high"].count("(at the grid's edge)") == 1
    assert "edge" not in rows["| grpo · x=mid"]
    assert lines[-1] == (
        "2 of 3 configurations chose a value at an edge of its numeric grid: grpo · x=low (train.lr = 3e-05, "
        "the smallest); grpo · x=high (train.lr = 0.0003, the largest). Their best value may lie beyond the "
        "grid; a grid extended past that edge would say."
    )


def test_the_tuned_note_names_only_bindings_both_configurations_read():
    """β tuned for a spec with a KL term only is no difference of tuned values with a spec without one;
    a configuration without a tuning record gets no note; equal values none either."""
    from polgrad.results.tuning import tuned_note

    tuned = {("grpo",): {"train.lr": "1e-4", "kl": "0.04"}, ("rloo",): {"train.lr": "1e-4"}}
    tuned[("ppo",)] = {"train.lr": "3e-5", "kl": "0.01"}
    assert tuned_note(tuned, ("rloo",), ("grpo",)) == ""
    assert tuned_note(tuned, ("dpo",), ("grpo",)) == ""
    note = tuned_note(tuned, ("ppo",), ("grpo",))
    assert "(train.lr = 3e-5 against 1e-4; kl = 0.01 against 0.04)" in note


def test_a_configuration_whose_tuning_runs_all_failed_is_not_called_an_edge_choice():
    """Without a value that finished, the choice falls back to the first declared value (the smallest
    here) with a note: a failed tuning stage, not a best value beyond the grid. The edge check names only
    the configuration that chose an edge."""
    from types import SimpleNamespace

    decl = tuning.Declared([10], [(("fake_train.lr",), [0.1, 0.3, 0.5])], "eval_accuracy", True)
    configs = [
        {
            "config": {"spec": "a"},
            "chosen": {"fake_train.lr": "0.1"},
            "note": "no value finished ok",
            "values": [],
        },
        {"config": {"spec": "b"}, "chosen": {"fake_train.lr": "0.5"}, "note": "", "values": []},
        {"config": {"spec": "c"}, "chosen": {"fake_train.lr": "0.3"}, "note": "", "values": []},
    ]
    record = {"grid": {"fake_train.lr": ["0.1", "0.3", "0.5"]}, "configurations": configs}
    plan = tuning.Plan(decl, None, [], [], record)
    exp = SimpleNamespace(file="e.gin", lines={}, tuning=plan)
    with pytest.raises(PolgradError) as e:
        tuning.check_edges(exp)
    assert "for 1 of 3 configurations: b (fake_train.lr = 0.5, the largest);" in str(e.value)
    record["configurations"] = [configs[0], configs[2]]
    tuning.check_edges(exp)  # the fallback and an inner choice: nothing to refuse
    from polgrad.results.tuning import edge_count, section

    assert edge_count(record | {"seeds": [10], "metric": "m", "experiment": "x"}) == 0
    lines = section(record | {"seeds": [10], "metric": "m", "experiment": "x"})
    assert not any("at the grid's edge" in ln for ln in lines)


# ------------------------------------------------------------------------------ Sweep.tuned_by
def replication(tmp_path: Path, original: Path, seeds: str = "[2, 3]", extra: str = "") -> Path:
    """A replication of `original` on other seeds that binds the original's tuning choice."""
    path = tmp_path / "rep.gin"
    path.write_text(
        f"include '{original}'\n"
        "Sweep.name = 'rep'\n"
        f"Sweep.seeds = {seeds}\n"
        "Sweep.tuning = None\n"
        "Sweep.tuned_by = 'exp'\n" + extra
    )
    return path


def test_tuned_by_binds_the_originals_choice_and_tunes_nothing(tuned, capsys):
    """The replication runs no tuning cell: each of its runs trains at the lr the original's tuning runs
    scored best for its configuration (worked out here from those runs' own summaries), its
    experiment.json carries the original's record marked chosen_by, and its md says who chose."""
    path, out = tuned
    means = _means(out / "exp" / "exp_tuning")
    best = {kl: max(LRS, key=lambda lr: means[(kl, lr)]) for kl in ("@fakekl.k1", "@fakekl.k2")}
    rep = replication(path.parent, path)
    assert sweep.main([str(rep), "--dry-run"]) == 0
    assert "come from exp's tuning stage, not re-tuned" in capsys.readouterr().out
    assert sweep.main([str(rep), "--results", str(out)]) == 0
    assert not (out / "rep" / "rep_tuning").exists()
    runs = summaries(out / "rep")
    assert len(runs) == 4
    for cid in runs:
        cell = json.loads((out / "rep" / "runs" / cid / "cell.json").read_text())["cell"]
        kl = dict(map(tuple, cell["swept"]))["fake_train.kl"]
        assert cell["seed"] in (2, 3)
        assert f"fake_train.lr = {best[kl]}\n" in (out / "rep" / "runs" / cid / "config.gin").read_text()
    original = json.loads((out / "exp" / "experiment.json").read_text())["tuning"]
    record = json.loads((out / "rep" / "experiment.json").read_text())["tuning"]
    assert record == {**original, "chosen_by": "exp"}
    section = (out / "rep" / "rep.md").read_text().split("## Tuning\n", 1)[1].split("\n## ", 1)[0]
    assert "by exp's tuning stage and not re-tuned here (Sweep.tuned_by)" in section, section
    assert "The tuning runs: ../exp/exp_tuning/exp_tuning.md." in section, section
    assert (out / "rep" / "../exp/exp_tuning/exp_tuning.md").exists()
    row = next(ln for ln in section.splitlines() if ln.startswith("| spec_a · fake_train.kl=@fakekl.k2 |"))
    assert f"| `fake_train.lr = {best['@fakekl.k2']}`" in row, row


def test_tuned_by_is_in_the_cell_ids(tuned):
    path, _ = tuned
    rep = replication(path.parent, path)
    _, cells = prepare(str(rep))
    rep.write_text(rep.read_text().replace("Sweep.tuned_by = 'exp'\n", ""))
    _, plain = prepare(str(rep))
    assert len(cells) == len(plain) == 4
    assert not {c.id for c in cells} & {c.id for c in plain}


@pytest.mark.usefixtures("fake_trainer")
def test_tuned_by_before_the_original_ran_is_one_line(tmp_path, capsys):
    original = fake_exp(tmp_path, DECL)
    rep = replication(tmp_path, original)
    out = tmp_path / "results"
    assert sweep.main([str(rep), "--results", str(out)]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {rep}: line 5: Sweep.tuned_by: {out / 'exp' / 'experiment.json'} "), err
    assert "does not exist: exp's sweep has not chosen its values yet" in err, err
    assert not (out / "rep" / "runs").exists()


@pytest.mark.usefixtures("fake_trainer")
def test_tuned_by_an_experiment_that_tuned_nothing_is_one_line(tmp_path, capsys):
    original = fake_exp(tmp_path, "None")
    out = tmp_path / "results"
    assert sweep.main([str(original), "--results", str(out)]) == 0
    capsys.readouterr()
    assert sweep.main([str(replication(tmp_path, original)), "--results", str(out)]) == 2
    assert "records no tuning choice: exp has no tuning stage (Sweep.tuning)" in one_line_error(capsys)


def test_tuned_by_on_a_tuning_seed_or_another_configuration_is_one_line(tuned, capsys):
    path, out = tuned
    rep = replication(path.parent, path, seeds="[3, 10]")
    assert sweep.main([str(rep), "--results", str(out)]) == 2
    err = one_line_error(capsys)
    assert "exp tuned on seed 10, which this experiment evaluates (Sweep.seeds = [3, 10])" in err, err
    rep = replication(path.parent, path, extra="Sweep.grid = {'fake_train.kl': [@fakekl.k2, @fakekl.k3]}\n")
    assert sweep.main([str(rep), "--results", str(out)]) == 2
    err = one_line_error(capsys)
    assert "exp's tuning stage chose nothing for 1 of this experiment's 2 configurations: " in err, err
    assert "spec_a · fake_train.kl=@fakekl.k3 (it chose for: spec_a · fake_train.kl=@fakekl.k1, " in err, err
    assert not (out / "rep" / "runs").exists()


@pytest.mark.parametrize(
    "extra, says",
    [
        ("", "Sweep.tuned_by: the values come from exp's tuning stage, so this experiment tunes nothing"),
        ("Sweep.tuning = None\nSweep.tuned_by = 'rep'\n", "Sweep.tuned_by: names this experiment (rep)"),
        ("Sweep.tuning = None\nSweep.tuned_by = 3\n", "Sweep.tuned_by: must be an experiment's name"),
    ],
)
@pytest.mark.usefixtures("fake_trainer")
def test_a_bad_tuned_by_is_one_line_naming_the_file(tmp_path, capsys, extra, says):
    path = tmp_path / "rep.gin"
    body = f"include '{fake_exp(tmp_path, DECL)}'\nSweep.name = 'rep'\nSweep.seeds = [2, 3]\n"
    path.write_text(body + (extra or "Sweep.tuned_by = 'exp'\n"))
    assert sweep.main([str(path), "--dry-run"]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {path}: line "), err
    assert says in err, err


def test_tuned_by_a_replication_names_the_experiment_that_tuned(tuned, capsys):
    path, out = tuned
    rep = replication(path.parent, path)
    assert sweep.main([str(rep), "--results", str(out)]) == 0
    again = path.parent / "again.gin"
    again.write_text(f"include '{rep}'\nSweep.name = 'again'\nSweep.seeds = [4]\nSweep.tuned_by = 'rep'\n")
    capsys.readouterr()
    assert sweep.main([str(again), "--results", str(out)]) == 2
    err = one_line_error(capsys)
    assert "Sweep.tuned_by: rep did not tune: its values come from exp; name that one" in err, err


def test_a_borrowed_choice_that_changed_is_refused_until_its_cells_restart_with_it(tuned, capsys):
    """The original's record changes after the replication ran (here by hand: k2's choice becomes
    0.3): the replication's k2 cells trained at another lr, so it stops in one line naming them; with
    --restart they run again with 0.3."""
    path, out = tuned
    rep = replication(path.parent, path)
    assert sweep.main([str(rep), "--results", str(out)]) == 0
    meta_file = out / "exp" / "experiment.json"
    meta = json.loads(meta_file.read_text())
    for c in meta["tuning"]["configurations"]:
        if c["config"]["fake_train.kl"] == "@fakekl.k2":
            c["chosen"] = {"fake_train.lr": "0.3"}
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    assert sweep.main([str(rep), "--results", str(out)]) == 2
    err = one_line_error(capsys)
    assert err.startswith(f"error: {rep}: Sweep.tuned_by: exp's record ({meta_file}) now chooses "), err
    k2 = sorted(p.name for p in (out / "rep" / "runs").iterdir() if "-k2-" in p.name)
    assert len(k2) == 2 and all(cid in err for cid in k2), err
    assert "chooses fake_train.lr = 0.3 for spec_a · fake_train.kl=@fakekl.k2" in err, err
    assert sweep.main([str(rep), "--results", str(out), "--restart", *k2]) == 0
    for cid in k2:
        assert "fake_train.lr = 0.3\n" in (out / "rep" / "runs" / cid / "config.gin").read_text()
    record = json.loads((out / "rep" / "experiment.json").read_text())["tuning"]
    assert {c["config"]["fake_train.kl"]: c["chosen"]["fake_train.lr"] for c in record["configurations"]}[
        "@fakekl.k2"
    ] == "0.3"


def test_tuned_by_where_the_originals_tuning_failed_is_one_line_with_the_command(tuned, capsys):
    """A configuration none of whose tuning values finished on every seed is recorded with a note (the
    original evaluates it at the first value): the replication refuses it, saying how to finish."""
    path, out = tuned
    meta_file = out / "exp" / "experiment.json"
    meta = json.loads(meta_file.read_text())
    meta["tuning"]["configurations"][0]["note"] = "no value finished ok on every tuning seed: the first"
    meta_file.write_text(json.dumps(meta))
    rep = replication(path.parent, path)
    assert sweep.main([str(rep), "--dry-run", "--results", str(out)]) == 0
    dry = capsys.readouterr().out
    assert f"not re-tuned ({meta_file}): not yet: the sweep would refuse: exp's tuning stage made" in dry, dry
    assert sweep.main([str(rep), "--results", str(out)]) == 2
    err = one_line_error(capsys)
    assert "exp's tuning stage made no choice for spec_a · fake_train.kl=@fakekl.k1 (no value finished" in err
    assert f"--results {out} --restart-failed)" in err, err
    meta["tuning"]["configurations"][0].pop("chosen")
    meta_file.write_text(json.dumps(meta))
    assert sweep.main([str(rep), "--results", str(out)]) == 2
    assert "tuning record is malformed (a configuration without 'config' or 'chosen')" in one_line_error(
        capsys
    )


@pytest.mark.usefixtures("fake_trainer")
def test_tuned_by_matches_configurations_whatever_the_order_of_the_axes(tmp_path, capsys):
    """The original sweeps kl then sleep_s, the replication sleep_s then kl: the same four
    configurations, each bound the value the original chose for it (the dry run says which)."""
    grid = "{'fake_train.kl': [@fakekl.k1, @fakekl.k2], 'fake_train.sleep_s': [0.0, 0.001]}"
    original = fake_exp(tmp_path, DECL.replace("[10, 11]", "[10]"))
    original.write_text(
        original.read_text().replace(
            "Sweep.grid = {'fake_train.kl': [@fakekl.k1, @fakekl.k2]}", f"Sweep.grid = {grid}"
        )
    )
    out = tmp_path / "results"
    assert sweep.main([str(original), "--results", str(out)]) == 0
    swapped = "{'fake_train.sleep_s': [0.0, 0.001], 'fake_train.kl': [@fakekl.k1, @fakekl.k2]}"
    rep = replication(tmp_path, original, seeds="[5]", extra=f"Sweep.grid = {swapped}\n")
    capsys.readouterr()
    assert sweep.main([str(rep), "--dry-run", "--results", str(out)]) == 0
    dry = capsys.readouterr().out
    assert "spec_a · fake_train.kl=@fakekl.k2 · fake_train.sleep_s=0.001: fake_train.lr = " in dry, dry
    assert sweep.main([str(rep), "--results", str(out)]) == 0
    chosen = {
        (c["config"]["fake_train.kl"], c["config"]["fake_train.sleep_s"]): c["chosen"]["fake_train.lr"]
        for c in json.loads((out / "exp" / "experiment.json").read_text())["tuning"]["configurations"]
    }
    runs = summaries(out / "rep")
    assert len(runs) == 4
    for cid in runs:
        cell = json.loads((out / "rep" / "runs" / cid / "cell.json").read_text())["cell"]
        swept = dict(map(tuple, cell["swept"]))
        lr = chosen[(swept["fake_train.kl"], swept["fake_train.sleep_s"])]
        assert f"fake_train.lr = {lr}\n" in (out / "rep" / "runs" / cid / "config.gin").read_text()
