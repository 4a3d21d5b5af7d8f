"""Warm starts per seed, still paired: train.init_seed follows train.seed unless bound, the run records
which warm start it started from (summary.json `warm_start`, polgrad/build.py), and the cache shares one
warm start per seed between configurations and experiments.

The SFT itself is replaced by an untrained tiny model (`_sft` patched) in a temporary cache: what is
checked here is which cache key each cell asks for, not the training (tests/models/test_models.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gin
import pytest

from polgrad import build, config, models
from polgrad.errors import ConfigError
from polgrad.pretrain import sft as sft_module
from polgrad.sweep.experiment import load_experiment
from polgrad.sweep.grid import expand

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_sft(tmp_path, monkeypatch):
    """An empty warm-start cache under tmp_path whose misses save an untrained tiny model at once;
    returns the list of seeds it was asked to train."""
    trained: list[int] = []

    def untrained(task, mkw, demos, probe, batch_size, lr, target, seed, progress, rewards):
        trained.append(seed)
        model, tokenizer = models.build_tiny(task, **mkw)
        return {"heldout_greedy_accuracy": 0.0, "total_seconds": 0.0}, model, tokenizer

    monkeypatch.setattr(sft_module, "_sft", untrained)
    monkeypatch.setenv("POLGRAD_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(REPO)
    return trained


def cell_config(experiment: str, config_index: int, seed: int, extra: tuple[str, ...] = ()):
    """The TrainConfig the trainer builds for configuration `config_index` of experiments/<experiment>.gin
    at `seed` (the cell's own bindings, its seed binding replaced), as the sweep launches it. gin keeps
    the cell's config (the task's settings are read from it) until the next call or the test's end."""
    exp = load_experiment(str(REPO / "experiments" / f"{experiment}.gin"))
    cells = expand(exp)
    first_seed = cells[0].seed
    cell = [c for c in cells if c.seed == first_seed][config_index]
    seed_line = f"train.seed = {first_seed}"
    assert cell.bindings.count(seed_line) == 1, cell.bindings  # the sweep's seed binding
    bindings = [f"train.seed = {seed}" if b == seed_line else b for b in cell.bindings]
    gin.clear_config()
    config.parse_config(list(cell.config_files), [*bindings, *extra])
    cfg, _, _ = config.build()
    return cfg


def warm_start_of(experiment: str, config_index: int, seed: int, extra: tuple[str, ...] = ()) -> str:
    return build.warm_start_id(build.warm_start(cell_config(experiment, config_index, seed, extra)))


def test_each_seed_has_its_own_warm_start_shared_by_every_configuration_and_experiment(fake_sft, tmp_path):
    one = warm_start_of("kl_ablation", 0, seed=1)
    # Another configuration of the same experiment, and other experiments on the same task and model
    # (GRPO's clip rules, PPO in the algorithm comparison, asynchronous rollouts): the same warm start.
    assert warm_start_of("kl_ablation", 4, seed=1) == one
    assert warm_start_of("clip_rules", 3, seed=1) == one
    assert warm_start_of("algorithm_comparison", 1, seed=1) == one
    assert warm_start_of("off_policy", 2, seed=1) == one
    two = warm_start_of("kl_ablation", 0, seed=2)
    assert two != one and warm_start_of("algorithm_comparison", 1, seed=2) == two
    # One SFT per seed, seeded by the RL seed; the id is its cache folder's key.
    assert fake_sft == [1, 2]
    folders = sorted(p.name for p in (tmp_path / "cache" / "sft").iterdir() if not p.name.startswith("."))
    assert folders == sorted([f"add-{one}", f"add-{two}"])
    assert json.loads((tmp_path / "cache" / "sft" / f"add-{one}" / "polgrad.json").read_text())["seed"] == 1
    # A task setting that changes the demonstrations (3-digit add) is another warm start.
    assert warm_start_of("loss_aggregation", 0, seed=1) not in (one, two)


def test_a_bound_init_seed_pins_one_warm_start_for_every_seed(fake_sft):
    pinned = ("train.init_seed = 0",)
    ids = {warm_start_of("kl_ablation", i, seed=s, extra=pinned) for i in (0, 4) for s in (1, 2)}
    assert ids == {warm_start_of("kl_ablation", 0, seed=0)} and fake_sft == [0]
    cfg = cell_config("kl_ablation", 0, seed=3, extra=pinned)
    assert (cfg.seed, cfg.init_seed, cfg.warm_start_seed) == (3, 0, 0)


def test_warm_start_id_of_a_policy_path(tmp_path, fake_sft):
    made = build.warm_start(cell_config("kl_ablation", 0, seed=5))
    key = models.read_info(made)["key"]
    assert build.warm_start_id(made) == key[:16] and made.endswith(f"-{key[:16]}")
    # train.policy_path is the run's policy as given: a checkpoint polgrad made keeps its key...
    cfg = cell_config("kl_ablation", 0, seed=6, extra=(f"train.policy_path = '{made}'",))
    assert build.warm_start(cfg) == made and fake_sft == [5]
    # ...one made elsewhere (no polgrad.json key) is known by its content: config.json and weights
    ids = {}
    for seed in (0, 1):
        model, tokenizer = models.build_tiny(sft_module.make_task("add", {}), seed=seed)
        model.save_pretrained(tmp_path / f"hf{seed}")
        tokenizer.save_pretrained(tmp_path / f"hf{seed}")
        assert not (tmp_path / f"hf{seed}" / "polgrad.json").exists()
        ids[seed] = build.warm_start_id(str(tmp_path / f"hf{seed}"))
    assert ids[0] != ids[1]  # two different checkpoints, two warm starts
    assert all(re.fullmatch(r"path-[0-9a-f]{16}", i) for i in ids.values()), ids
    assert build.warm_start_id(str(tmp_path / "hf0")) == ids[0]  # the same folder twice
    shutil.copytree(tmp_path / "hf0", tmp_path / "elsewhere" / "hf0")  # the same checkpoint elsewhere
    (tmp_path / "elsewhere" / "hf0" / "README.md").write_text("a note, not the model\n")
    assert build.warm_start_id(str(tmp_path / "elsewhere" / "hf0")) == ids[0]
    conf = json.loads((tmp_path / "hf0" / "config.json").read_text())
    (tmp_path / "hf0" / "config.json").write_text(json.dumps({**conf, "rope_theta": 1234.0}))
    assert (
        build.warm_start_id(str(tmp_path / "hf0")) not in ids.values()
    )  # its config.json is its identity too


def test_warm_start_id_of_a_large_weights_file_reads_its_ends(tmp_path):
    """A weights file over 2 MiB is hashed by its size and its first and last MiB: a change at
    either end (here the last byte) or in the size is another warm start."""
    big = tmp_path / "big"
    big.mkdir()
    data = bytearray(b"w" * (3 << 20))
    (big / "model.safetensors").write_bytes(bytes(data))
    first = build.warm_start_id(str(big))
    data[-1:] = b"x"
    (big / "model.safetensors").write_bytes(bytes(data))
    second = build.warm_start_id(str(big))
    (big / "model.safetensors").write_bytes(bytes(data) + b"w")
    assert len({first, second, build.warm_start_id(str(big))}) == 3


@pytest.mark.parametrize("value", ["'0'", "1.5", "True"])
def test_init_seed_must_be_an_integer_or_none(value):
    gin.clear_config()
    config.parse_config([str(REPO / "registry" / "grpo.gin")], [f"train.init_seed = {value}"])
    with pytest.raises(ConfigError, match=r"train.init_seed must be an integer or None .*got") as e:
        config.build()
    assert "\n" not in str(e.value)


FAST = [
    "train.steps = 1",
    "train.prompts_per_step = 2",
    "train.eval_every = 1",
    "train.eval_size = 4",
    "train.checkpoint_every = 100",
    "train.progress = False",
]


def test_summary_records_the_warm_start_each_run_started_from(fake_sft, tmp_path):
    """The trainer writes summary.json's `warm_start`: the seed's, whatever the spec."""
    from polgrad.train import run as train

    got = {}
    for spec, seed in (("grpo", 1), ("reinforce", 1), ("grpo", 2)):
        gin.clear_config()
        config.parse_config([str(REPO / "registry" / f"{spec}.gin")], [*FAST, f"train.seed = {seed}"])
        summary = train(str(tmp_path / f"{spec}{seed}"))
        assert json.loads((tmp_path / f"{spec}{seed}" / "summary.json").read_text()) == summary
        got[spec, seed] = summary["warm_start"]
    assert got["grpo", 1] == got["reinforce", 1] != got["grpo", 2]
    assert {got["grpo", 1], got["grpo", 2]} == {
        p.name.removeprefix("add-") for p in (tmp_path / "cache" / "sft").glob("add-*")
    }


# ------------------------------------------------------------------------ the CSV column and the md
def fake_sweep(tmp_path: Path, warm_start: str | None) -> tuple[list[str], list[dict[str, str]], str]:
    """A fake-trainer sweep (tests/fake_train.py) of 2 learning rates x seeds 0, 1 whose runs record
    `warm_start` (formatted with the cell's seed and lr): the CSV's header and rows and the md."""
    import csv

    from polgrad import sweep

    data = REPO / "tests" / "data"
    exp = tmp_path / "exp.gin"
    exp.write_text(
        f"include '{data / 'base_fake.gin'}'\nSweep.specs = ['{data / 'spec_a.gin'}']\n"
        "Sweep.grid = {'fake_train.lr': [0.1, 0.2]}\nSweep.seeds = [0, 1]\n"
        "Sweep.seed_binding = 'fake_train.seed'\nSweep.primary_metric = 'eval_accuracy'\n"
        + ("" if warm_start is None else f"fake_train.warm_start = '{warm_start}'\n")
    )
    out = tmp_path / "results"
    assert sweep.main([str(exp), "--results", str(out)]) == 0
    with open(out / "exp" / "exp.csv", newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    return list(reader.fieldnames or []), rows, (out / "exp" / "exp.md").read_text()


def paragraph(md: str) -> str:
    """The md's first paragraph after its header (title, question, machine line)."""
    blocks = [b for b in md.split("\n\n") if not b.startswith(("# ", "**Question.**", "Machine: "))]
    return blocks[0]


@pytest.mark.usefixtures("fake_trainer")
def test_the_csv_records_each_runs_warm_start_and_the_md_says_each_seed_has_its_own(tmp_path):
    header, rows, md = fake_sweep(tmp_path, "ws{seed}")
    assert header[header.index("seed") + 1] == "warm_start"
    assert sorted((r["seed"], r["fake_train.lr"], r["warm_start"]) for r in rows) == [
        ("0", "0.1", "ws0"),
        ("0", "0.2", "ws0"),
        ("1", "0.1", "ws1"),
        ("1", "0.2", "ws1"),
    ]
    assert paragraph(md).startswith(
        "**Warm start.** Each seed has its own warm start (same seed → same warm start in every "
        "configuration)"
    )
    assert "Pairing broken" not in md


@pytest.mark.usefixtures("fake_trainer")
def test_one_warm_start_for_every_seed_is_said_first(tmp_path):
    _, rows, md = fake_sweep(tmp_path, "sft0")
    assert {r["warm_start"] for r in rows} == {"sft0"} and {r["seed"] for r in rows} == {"0", "1"}
    assert paragraph(md) == (
        "**Warm start.** One warm start for every seed: the conclusions hold for this one SFT policy "
        "(`sft0`); the spread over seeds leaves out the warm start's own variance."
    )


@pytest.mark.usefixtures("fake_trainer")
def test_a_seed_with_two_warm_starts_is_named_as_broken_pairing(tmp_path):
    _, rows, md = fake_sweep(tmp_path, "ws{seed}-{lr}")  # the warm start changes with the grid's lr
    assert len({r["warm_start"] for r in rows}) == 4
    assert (
        "**Pairing broken:** 2 of 2 seeds started from different warm starts in different configurations "
        "(seed 0: `ws0-0.1` (1 runs), `ws0-0.2` (1 runs); seed 1: `ws1-0.1` (1 runs), `ws1-0.2` (1 runs))"
    ) in md
    assert paragraph(md) == "**Warm start.** 4 warm starts for 2 seeds."


@pytest.mark.usefixtures("fake_trainer")
def test_runs_that_did_not_record_a_warm_start_are_said_so(tmp_path):
    header, rows, md = fake_sweep(tmp_path, None)
    assert all(r["warm_start"] == "" for r in rows)
    assert paragraph(md).startswith("**Warm start.** Warm start not recorded")
    # an older CSV: no warm_start column at all
    from polgrad.results.report import markdown

    old = [{k: v for k, v in r.items() if k != "warm_start"} for r in rows]
    md = markdown("exp", old, swept_columns=["fake_train.lr"], primary_metric="eval_accuracy")
    assert paragraph(md).startswith("**Warm start.** Warm start not recorded")
    # some rows with, some without: the design of those that have it, and how many lack it
    some = [dict(r, warm_start="sft0") for r in rows[:3]] + rows[3:]
    md = markdown("exp", some, swept_columns=["fake_train.lr"], primary_metric="eval_accuracy")
    assert paragraph(md).startswith("**Warm start.** One warm start for every seed")
    assert paragraph(md).endswith("(Warm start not recorded for 1 of 4 runs.)")


def test_an_old_csv_shows_its_warm_starts_by_their_step_0_accuracy():
    """Rows without the warm_start column: one eval_accuracy_init in every row of several seeds is what
    one shared warm start gives (the committed CSVs from before the column: 0.3442 in all 50 kl_ablation
    rows), one value per seed is what one warm start per seed gives, two values within a seed break
    pairing. Row values are made here, not read from the code."""
    from polgrad.results.warm_starts import warm_start_paragraph

    def rows(init):  # 2 configurations x 2 seeds; init(seed, config) -> eval_accuracy_init text
        return [
            {"status": "ok", "seed": str(s), "spec": c, "eval_accuracy_init": init(s, c)}
            for s in (0, 1)
            for c in ("a", "b")
        ]

    one = warm_start_paragraph(rows(lambda s, c: "0.3442"))[0]
    assert one.startswith("**Warm start.** Warm start not recorded: ")
    assert (
        "every run of all 2 seeds starts at the same held-out accuracy (eval_accuracy_init = 0.3442)" in one
    )
    assert "most likely hold for that one SFT policy" in one
    per_seed = warm_start_paragraph(rows(lambda s, c: ["0.3", "0.5"][s]))[0]
    assert "as one warm start per seed gives" in per_seed and "2 values for 2 seeds" in per_seed
    broken = warm_start_paragraph(rows(lambda s, c: {"a": "0.3", "b": "0.4"}[c]))[0]
    assert "the pairing by seed may be broken" in broken
    no_init = warm_start_paragraph(rows(lambda s, c: ""))[0]
    assert no_init.endswith("cannot say whether every seed started from one SFT policy or each from its own.")


def test_the_committed_length_bias_pilots_warm_starts_are_the_ones_this_code_asks_for(fake_sft):
    """task.running_sum's `checks` came after the length_bias pilot ran: the warm starts its committed
    CSV records, one per seed, are still those its cells ask for (the setting is key-neutral at its
    default), so the committed pilot reproduces at this commit."""
    import csv

    rows = list(csv.DictReader(open(REPO / "results/pilots/length_bias_pilot/length_bias_pilot.csv")))
    seeds = sorted({int(r["seed"]) for r in rows})
    assert seeds == [0, 1, 2]
    for seed in seeds:
        recorded = {r["warm_start"] for r in rows if int(r["seed"]) == seed}
        assert recorded == {warm_start_of("length_bias_pilot", 0, seed)}, seed


def test_the_committed_length_bias_checks_pilots_warm_starts_are_the_ones_this_code_asks_for(fake_sft):
    """The warm starts the committed length_bias_checks pilot records (its tuning seed 100 and its
    evaluation seeds 3-5, one each) are those its cells ask for at this commit, so the pilot, whose
    gate decides whether length_bias_checks runs, reproduces here."""
    import csv

    folder = REPO / "results/pilots/length_bias_checks_pilot"
    for path, seeds in (
        (folder / "length_bias_checks_pilot_tuning/length_bias_checks_pilot_tuning.csv", [100]),
        (folder / "length_bias_checks_pilot.csv", [3, 4, 5]),
    ):
        rows = list(csv.DictReader(open(path)))
        assert sorted({int(r["seed"]) for r in rows}) == seeds, path
        for seed in seeds:
            recorded = {r["warm_start"] for r in rows if int(r["seed"]) == seed}
            assert recorded == {warm_start_of("length_bias_checks_pilot", 0, seed)}, (path.name, seed)
