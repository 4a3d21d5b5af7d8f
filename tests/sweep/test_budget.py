"""The budget every comparison declares (`Sweep.budget`, polgrad/sweep/budget.py) and the trainer's
counters and stop that enforce it (polgrad/stopping.py).

The sweep's side runs the dry run (every cell built, nothing trained); the expected prompts per step
are worked out by hand from the specs' group sizes (registry/*.gin). The trainer's side runs the
tiny default for a few steps (a ReMax run of 4 prompts: 4 sampled + 4 greedy sequences per step).
"""

from __future__ import annotations

import csv
import glob
import json
import os
import types
from pathlib import Path

import gin
import pytest
import torch

from polgrad import config, stopping
from polgrad.results.report import write_report
from polgrad.rollout.rollout import Rollout
from polgrad.sweep import budget, expand, load_experiment, main, prepare, run
from polgrad.sweep.grid import with_budget
from polgrad.tasks.base import Example
from polgrad.train import run as train

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


def _experiment(tmp_path: Path, body: str, name: str = "exp") -> str:
    path = tmp_path / f"{name}.gin"
    path.write_text(f"include '{REPO / 'experiments' / 'base_tiny.gin'}'\nSweep.seeds = [0]\n{body}\n")
    return str(path)


def _dry_run_error(capsys, path: str) -> str:
    capsys.readouterr()
    assert main([path, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"error: {path}: "), err  # one line naming the file
    return err


def _bound(cell, key: str) -> str | None:
    values = [b.split(" = ", 1)[1] for b in cell.bindings if b.split(" = ", 1)[0] == key]
    return values[-1] if values else None


# --------------------------------------------------------------------------- the sweep sets and refuses
def test_algorithm_comparison_samples_64_sequences_per_step_in_every_cell():
    """64 prompts x 1 (REINFORCE, PPO, REINFORCE++), 16 x 4 (RLOO), 8 x 8 (the group methods),
    32 x (1 + 1 greedy) (ReMax), 32 pairs (DPO: 2 sequences each, not sampled); 64 x 60 steps."""
    exp, cells = prepare(str(REPO / "experiments" / "algorithm_comparison.gin"))
    expected = {
        "reinforce": 64,
        "ppo": 64,
        "reinforce_pp": 64,
        "rloo": 16,
        "grpo": 8,
        "dr_grpo": 8,
        "reinforce_pp_baseline": 8,
        "dapo": 8,
        "gspo": 8,
        "cispo": 8,
        "remax": 32,
        "dpo": 32,
    }
    assert {c.spec_name for c in cells} == set(expected)
    for c in cells:
        assert _bound(c, "train.prompts_per_step") == str(expected[c.spec_name]), c.id
        assert _bound(c, "train.max_sampled_sequences") == str(64 * 60), c.id
        assert c.budget.prompts_per_step == expected[c.spec_name]
    assert len({c.id for c in cells}) == len(cells)
    notes = {c.spec_name: c.budget.note for c in cells}
    assert notes["dpo"].startswith("not sampled: 32 preference pairs per step")
    # DPO learns from gold answers against corrupted ones, not from a sampled reward: the md says so
    assert "a correct answer and a corrupted one, offline data" in notes["dpo"]
    assert notes["remax"] == "32 prompts × (1 + 1 greedy) = 64 sequences"
    text = budget.record(exp.budget, cells)["text"]
    assert text.startswith("equal sampled sequences, 64 per step × 60 steps = 3840 per cell")


# Prompts per step each committed experiment's header states, per spec: GRPO-like specs of G = 8 keep
# base_tiny.gin's 8 prompts at 64 sequences per step; PPO (G = 1) samples 64 prompts at the same
# budget in the designs that compare it at 64 sequences (issue 24: value_init's first design gave it 8).
DESIGNS = {
    "clip_rules": {"*": 8},
    "kl_ablation": {"*": 8},
    "kl_ablation_replication": {"*": 8},
    "loss_aggregation": {"*": 8},
    "off_policy": {"*": 8},
    "overoptimization": {"ppo": 64, "grpo": 8},
    "overoptimization_pilot": {"ppo": 64, "grpo": 8},
    "ppo_on_add": {"ppo": 64, "grpo": 8},
    "reasoning_gym": {"grpo": 8, "dr_grpo": 8, "rloo": 16},
    "reasoning_gym_pilot": {"grpo": 8, "dr_grpo": 8, "rloo": 16},
    "length_bias": {"grpo": 8, "dr_grpo": 8},
    "length_bias_pilot": {"grpo": 8, "dr_grpo": 8},
    "length_bias_checks": {"grpo": 8, "dr_grpo": 8},
    "length_bias_checks_pilot": {"grpo": 8, "dr_grpo": 8},
    "length_bias_checks_replication": {"grpo": 8, "dr_grpo": 8},
    "overoptimization_scaling": {"grpo": 8},
    "overoptimization_scaling_pilot": {"grpo": 8},
    "value_init": {"ppo": 64},
    "value_init_pilot": {"ppo": 64},
}


def test_every_committed_experiment_declares_a_budget_that_keeps_its_design():
    """Every experiment declares a budget, and the prompts per step it makes of each spec are the ones
    its header states (algorithm_comparison: tests above)."""
    files = [f for f in sorted(glob.glob(str(REPO / "experiments" / "*.gin"))) if "base_" not in f]
    assert {Path(f).stem for f in files} == {*DESIGNS, "algorithm_comparison"}
    for f in files:
        exp, cells = prepare(f)
        assert exp.budget is not None, f
        design = DESIGNS.get(Path(f).stem)
        if design is None:
            continue
        for c in cells:
            want = design.get(c.spec_name, design.get("*"))
            assert c.budget.prompts_per_step == want and _bound(c, "train.prompts_per_step") == str(want), (
                f,
                c.id,
            )


def test_a_grid_the_budget_cannot_equalise_is_refused(tmp_path, capsys):
    """G = 3 and G = 8 at 64 sequences per step: 64 / 3 prompts is no whole number. Every cell can
    meet the multiples of lcm(3, 8) = 24."""
    path = _experiment(
        tmp_path,
        "Sweep.specs = ['registry/grpo.gin']\n"
        "Sweep.grid = {'Algorithm.group_size': [8, 3]}\n"
        "Sweep.budget = ('sampled_sequences', 64)",
    )
    err = _dry_run_error(capsys, path)
    assert "Sweep.budget" in err and "registry/grpo.gin" in err
    assert "costs 3 sequences per prompt (Algorithm.group_size = 3)" in err
    assert "multiples of 24 (e.g. 48, 72)" in err


def test_a_per_step_value_one_spec_cannot_meet_names_it_and_the_values_that_work(tmp_path, capsys):
    """60 per step: REINFORCE meets it (60 x 1), RLOO too (15 x 4), GRPO (G = 8) does not;
    lcm(1, 4, 8) = 8."""
    path = _experiment(
        tmp_path,
        "Sweep.specs = ['registry/reinforce.gin', 'registry/rloo.gin', 'registry/grpo.gin']\n"
        "Sweep.budget = ('sampled_sequences', 60)",
    )
    err = _dry_run_error(capsys, path)
    assert "(registry/grpo.gin;" in err and "Algorithm.group_size = 8" in err
    assert "60 per step is not a whole number of prompts" in err and "multiples of 8 (e.g. 56, 64)" in err


def test_remax_counts_its_greedy_sequence_in_the_prompts_per_step(tmp_path, capsys):
    """ReMax: 1 sampled + 1 greedy per prompt, so 63 per step is refused and 64 is 32 prompts."""
    path = _experiment(
        tmp_path, "Sweep.specs = ['registry/remax.gin']\nSweep.budget = ('sampled_sequences', 63)"
    )
    err = _dry_run_error(capsys, path)
    assert "costs 2 sequences per prompt (Algorithm.group_size = 1 + 1 greedy baseline" in err
    assert "Algorithm.advantage = @advantage.remax" in err
    path = _experiment(
        tmp_path, "Sweep.specs = ['registry/remax.gin']\nSweep.budget = ('sampled_sequences', 64)"
    )
    _, cells = prepare(path)
    assert [_bound(c, "train.prompts_per_step") for c in cells] == ["32"]


@pytest.mark.parametrize(
    "body, says",
    [
        (
            "train.prompts_per_step = 16\nSweep.budget = ('sampled_sequences', 64)",
            "binding 'train.prompts_per_step = 16': Sweep.budget = ('sampled_sequences', 64) sets each",
        ),
        (
            "train.max_sampled_sequences = 100\nSweep.budget = ('sampled_sequences', 64)",
            "binding 'train.max_sampled_sequences = 100'",
        ),
        (
            "Sweep.grid = {'train.prompts_per_step': [4, 8]}\nSweep.budget = ('sampled_sequences', 64)",
            "Sweep.grid['train.prompts_per_step']: Sweep.budget = ('sampled_sequences', 64) sets each cell's",
        ),
        (
            "Sweep.grid = {'train.steps': [30, 60]}\nSweep.budget = ('sampled_sequences', 64)",
            "Sweep.grid['train.steps']: Sweep.budget = ('sampled_sequences', 64) compares cells at equal",
        ),
        (
            "Sweep.budget = ('sampled_sequence', 64)",
            "unknown unit 'sampled_sequence'; did you mean 'sampled_sequences'?",
        ),
        ("Sweep.budget = ('sampled_sequences', 0)", "the value must be a positive int, got 0"),
        ("Sweep.budget = 64", "must be (unit, value per step)"),
        ("Sweep.budget = ('optimizer_steps', 30)", "runs train.steps = 60, not the 30 of"),
    ],
)
def test_what_the_budget_cannot_leave_to_the_file_is_one_line(tmp_path, capsys, body, says):
    path = _experiment(tmp_path, f"Sweep.specs = ['registry/grpo.gin']\n{body}")
    assert says in _dry_run_error(capsys, path)


def test_cells_of_different_steps_are_refused(tmp_path, capsys):
    """A spec of its own that binds train.steps: the totals (per step x steps) would differ."""
    short = tmp_path / "grpo_short.gin"
    short.write_text(f"include '{REPO / 'registry' / 'grpo.gin'}'\ntrain.steps = 30\n")
    path = _experiment(
        tmp_path,
        f"Sweep.specs = ['registry/rloo.gin', '{short}']\nSweep.budget = ('sampled_sequences', 64)",
    )
    err = _dry_run_error(capsys, path)
    assert "needs the same train.steps in every cell" in err and "runs 60" in err and "grpo_short" in err


def test_generated_tokens_and_ranks_divide_the_per_step_value(tmp_path):
    """Tokens: 8 prompts x G 8 x max_new_tokens 8 = 512 per step; on 2 ranks each rank draws half the
    prompts (4 x 8 x 2 = 64 sequences per step over the ranks). Steps only: nothing is set."""
    path = _experiment(
        tmp_path, "Sweep.specs = ['registry/grpo.gin']\nSweep.budget = ('generated_tokens', 512)", "tok"
    )
    exp, cells = prepare(path)
    assert _bound(cells[0], "train.prompts_per_step") == "8"
    assert _bound(cells[0], "train.max_generated_tokens") == str(512 * 60)
    path = _experiment(
        tmp_path,
        "Sweep.specs = ['registry/grpo.gin']\nSweep.processes_per_cell = 2\n"
        "Sweep.budget = ('sampled_sequences', 64)",
        "ranks",
    )
    _, cells = prepare(path)
    assert _bound(cells[0], "train.prompts_per_step") == "4"
    assert cells[0].budget.note == "4 prompts × 8 × 2 ranks = 64 sequences"
    path = _experiment(
        tmp_path, "Sweep.specs = ['registry/rloo.gin']\nSweep.budget = ('optimizer_steps', 60)", "steps"
    )
    exp, cells = prepare(path)
    assert _bound(cells[0], "train.prompts_per_step") is None  # base_tiny.gin's 8 stands
    assert cells[0].budget.note == "8 prompts × 4 = 32 sequences"
    assert budget.record(exp.budget, cells)["text"].startswith("equal optimizer steps, train.steps = 60")


def test_the_budget_changes_the_cell_ids(tmp_path):
    """A cell the budget configures differently is another cell (its run folder is not reused)."""
    ids = []
    for per_step in (64, 128):
        path = _experiment(
            tmp_path, f"Sweep.specs = ['registry/grpo.gin']\nSweep.budget = ('sampled_sequences', {per_step})"
        )
        ids.append(prepare(path)[1][0].id)
    assert ids[0] != ids[1]


@pytest.mark.usefixtures("fake_trainer")
def test_experiment_json_the_csv_and_the_md_record_the_budget(tmp_path):
    """What the dry run made of each cell, handed to the sweep by hand (the fake trainer builds no
    Algorithm): experiment.json keeps the budget and each cell's prompts per step, the CSV its
    note, the md states the budget in one line."""
    path = tmp_path / "fake.gin"
    data = TESTS / "data"
    path.write_text(
        f"include '{data / 'base_fake.gin'}'\n"
        f"Sweep.specs = ['{data / 'spec_a.gin'}', '{data / 'spec_b.gin'}']\n"
        "Sweep.seeds = [0]\nSweep.seed_binding = 'fake_train.seed'\n"
    )
    exp = load_experiment(str(path))
    exp.budget = budget.Budget("sampled_sequences", 64)
    planned = {
        "spec_a": budget.CellBudget(("fake_train.steps = 3",), 8, "8 prompts × 8 = 64 sequences", 4),
        "spec_b": budget.CellBudget(
            ("fake_train.steps = 3",), 32, "not sampled: 32 preference pairs per step", 4
        ),
    }
    cells = [with_budget(exp, c, planned[c.spec_name]) for c in expand(exp)]
    out = tmp_path / "results"
    assert run(exp, cells, results_dir=out, train_module="fake_train") == 0
    meta = json.loads((out / exp.name / "experiment.json").read_text())
    assert meta["budget"]["unit"] == "sampled_sequences" and meta["budget"]["total"] == 64 * 4
    assert {c["spec"]: c["prompts_per_step"] for c in meta["cells"]} == {"spec_a": 8, "spec_b": 32}
    with open(out / exp.name / f"{exp.name}.csv", newline="") as fh:
        rows = {r["spec"]: r for r in csv.DictReader(fh)}
    assert rows["spec_b"]["budget_note"] == "not sampled: 32 preference pairs per step"
    assert rows["spec_a"]["prompts_per_step"] == "8"
    md = (out / exp.name / f"{exp.name}.md").read_text()
    budget_lines = [line for line in md.splitlines() if line.startswith("**Budget.**")]
    assert budget_lines == [
        "**Budget.** equal sampled sequences, 64 per step × 4 steps = 256 per cell (a run stops once it has "
        "sampled them, every refill round and greedy baseline counted: train.max_sampled_sequences; "
        "train.steps is the cap). Per step: spec_a 8 prompts × 8 = 64 sequences; spec_b not sampled: 32 "
        "preference pairs per step."
    ]

    # the same sweep without Sweep.budget (e.g. the committed results from before it): the md says none
    # was declared, so its comparisons may be of sample budgets (issue 22: algorithm_comparison's were)
    meta.pop("budget")
    (out / exp.name / "experiment.json").write_text(json.dumps(meta))
    write_report(exp.name, out)
    budget_lines = [
        ln
        for ln in (out / exp.name / f"{exp.name}.md").read_text().splitlines()
        if ln.startswith("**Budget.**")
    ]
    assert budget_lines == [
        "**Budget.** none declared (Sweep.budget) when these cells ran: nothing made the configurations "
        "sample the same number of sequences per step, so a difference between them may be one of sample "
        "budget, not method."
    ]


# --------------------------------------------------------------------------- the trainer counts and stops
def _rollout(lengths: list[int], groups: list[int], baseline: Rollout | None = None) -> Rollout:
    b, t = len(lengths), max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths])
    return Rollout(
        prompt_ids=torch.zeros(b, 2, dtype=torch.long),
        prompt_mask=torch.ones(b, 2, dtype=torch.long),
        response_ids=torch.zeros(b, t, dtype=torch.long),
        mask=mask,
        rollout_logp=torch.zeros(b, t),
        group_ids=torch.tensor(groups),
        truncated=torch.zeros(b, dtype=torch.bool),
        response_lengths=torch.tensor(lengths),
        texts=[""] * b,
        examples=[Example(prompt=f"p{g}", answer="") for g in groups],
        baseline=baseline,
    )


def test_a_greedy_baseline_counts_once_per_prompt():
    """2 prompts x G = 2 sampled rows of 3, 2, 4 and 1 tokens (10), and one greedy response per
    prompt, of 2 and 5 tokens, repeated on each row of its group: 4 + 2 = 6 sequences, 17 tokens."""
    from polgrad.build import GreedyBaseline, NoBaseline

    greedy = _rollout([2, 2, 5, 5], [0, 0, 1, 1])
    with_greedy = _rollout([3, 2, 4, 1], [0, 0, 1, 1], baseline=greedy)
    assert GreedyBaseline(score=None).sampled(with_greedy) == (6.0, 17.0)  # ReMax's baseline role
    assert NoBaseline().sampled(_rollout([3, 2, 4, 1], [0, 0, 1, 1])) == (4.0, 10.0)


def test_done_at_the_step_cap_or_a_spent_budget():
    cfg = types.SimpleNamespace(steps=10, max_sampled_sequences=None, max_generated_tokens=100)
    state = types.SimpleNamespace(step=3, sampled_sequences=10**6, generated_tokens=99)
    assert not stopping.done(cfg, state)  # no limit on sequences; 99 of 100 tokens
    assert stopping.done(cfg, types.SimpleNamespace(step=3, sampled_sequences=0, generated_tokens=100))
    assert stopping.done(cfg, types.SimpleNamespace(step=10, sampled_sequences=0, generated_tokens=0))
    cfg = types.SimpleNamespace(steps=10, max_sampled_sequences=24, max_generated_tokens=None)
    assert stopping.done(cfg, types.SimpleNamespace(step=3, sampled_sequences=24, generated_tokens=0))
    assert not stopping.done(cfg, types.SimpleNamespace(step=3, sampled_sequences=23, generated_tokens=0))


TINY = [
    "train.prompts_per_step = 4",
    "train.eval_every = 100",
    "train.eval_size = 16",
    "train.checkpoint_every = 100",
    "train.progress = False",
]


def _train(out: Path, spec: str, bindings: list[str], **kwargs) -> tuple[list[dict], dict]:
    gin.clear_config()
    config.parse_config(
        [str(REPO / "experiments" / "base_tiny.gin"), str(REPO / "registry" / spec)], bindings
    )
    try:
        train(str(out), **kwargs)
    finally:
        gin.clear_config()
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return rows, json.loads((out / "summary.json").read_text())


def test_remax_stops_when_its_sampled_sequences_reach_the_budget_and_counts_its_greedy_ones(tmp_path):
    """4 prompts x (1 sampled + 1 greedy) = 8 sequences per step: a budget of 20 is reached at step
    3 (24), before train.steps = 5; that step is evaluated and checkpointed, and a resume of the
    finished run takes no further step."""
    bindings = [*TINY, "train.steps = 5", "train.max_sampled_sequences = 20"]
    rows, summary = _train(tmp_path / "run", "remax.gin", bindings)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["sampled_sequences"] for r in rows] == [8, 16, 24]
    assert [r["kept_sequences"] for r in rows] == [4, 8, 12]  # the greedy ones are not trained on
    previous = 0
    for r in rows:  # every step generates its 4 sampled responses and 4 greedy ones (>= 1 token: EOS)
        step_tokens = r["generated_tokens"] - previous
        assert step_tokens >= r["response_len"] * 4 + 4, r
        previous = r["generated_tokens"]
    assert "eval_accuracy" in rows[-1] and all("eval_accuracy" not in r for r in rows[:-1])
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "policy" / "step3")
    assert summary["steps"] == 3 and summary["sampled_sequences"] == 24 and summary["kept_sequences"] == 12
    assert summary["generated_tokens"] == rows[-1]["generated_tokens"]
    (tmp_path / "run" / "summary.json").unlink()  # as if killed after the last checkpoint
    rows, summary = _train(tmp_path / "run", "remax.gin", bindings, resume=True)
    assert [r["step"] for r in rows] == [1, 2, 3] and summary["sampled_sequences"] == 24


@pytest.mark.slow
def test_dapo_stops_after_fewer_steps_when_its_refill_samples_more(tmp_path):
    """DAPO samples 4 prompts x G 8 = 32 sequences per round and refills (up to 10 rounds) until 4
    groups are kept: each step counts 32 x its rounds, and the run ends at the first step whose
    cumulative count reaches 4 x 32 = 128 (train.steps = 6 is the cap)."""
    rows, summary = _train(
        tmp_path / "dapo", "dapo.gin", [*TINY, "train.steps = 6", "train.max_sampled_sequences = 128"]
    )
    counts = [r["sampled_sequences"] for r in rows]
    assert [b - a for a, b in zip([0, *counts], counts, strict=False)] == [
        32 * r["sampling_rounds"] for r in rows
    ]
    assert all(c < 128 for c in counts[:-1]) and (counts[-1] >= 128 or len(rows) == 6)
    kept = [r["kept_sequences"] for r in rows]  # what each step trained on: at most 4 kept groups of 8
    assert [b - a for a, b in zip([0, *kept], kept, strict=False)] == [r["update_seqs"] for r in rows]
    assert all(r["update_seqs"] <= 32 for r in rows)
    assert summary["sampled_sequences"] == counts[-1]


@pytest.mark.slow
def test_dpo_counts_the_two_sequences_of_each_pair_it_trains_on(tmp_path):
    """DPO samples nothing: 4 pairs per step are 8 sequences, so a budget of 16 ends it after 2 steps."""
    rows, summary = _train(
        tmp_path / "dpo", "dpo.gin", [*TINY, "train.steps = 4", "train.max_sampled_sequences = 16"]
    )
    assert [r["sampled_sequences"] for r in rows] == [8, 16]
    assert [r["kept_sequences"] for r in rows] == [8, 16]
    assert summary["steps"] == 2


@pytest.mark.slow
def test_a_generated_tokens_budget_stops_the_run(tmp_path):
    """GRPO, 4 prompts x 8 sampled responses of at most 8 tokens: at most 256 tokens per step, so a
    budget of 300 tokens takes at least 2 steps and stops at the first step that reaches it."""
    rows, summary = _train(
        tmp_path / "tok", "grpo.gin", [*TINY, "train.steps = 20", "train.max_generated_tokens = 300"]
    )
    tokens = [r["generated_tokens"] for r in rows]
    assert len(rows) >= 2 and all(t < 300 for t in tokens[:-1]) and tokens[-1] >= 300
    assert [r["sampled_sequences"] for r in rows] == [32 * (i + 1) for i in range(len(rows))]
