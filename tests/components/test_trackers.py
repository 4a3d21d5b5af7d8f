"""Trackers (`train.loggers`): what TensorBoard, MLflow and W&B hold is read back with their own readers.

TensorBoard through tensorboard's EventAccumulator, MLflow through MlflowClient on the local file
store, W&B (offline, no network) from the run's .wandb file: W&B's own protobuf records
(`wandb.proto.wandb_internal_pb2.Record`) in its LevelDB-style log framing, unpacked below (wandb
ships no Python reader for it). A fake metric stream checks each tracker fast; a two-cell sweep of
the real trainer checks the whole path (slow).
"""

from __future__ import annotations

import glob
import json
import struct
import sys
from pathlib import Path

import gin
import pytest
from helpers import require

from polgrad import config, registry, tracking
from polgrad.components import tracker as tracker_parts
from polgrad.errors import ConfigError

require("tensorboard", "mlflow", "wandb")

REPO = Path(__file__).resolve().parents[2]
TRACKERS = ["tensorboard", "mlflow", "wandb"]


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No network, nothing outside tmp_path: W&B offline and silent, MLflow's file store allowed."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for var in ("MLFLOW_TRACKING_URI", tracking.ENV_NAME, tracking.ENV_GROUP, tracking.ENV_PARAMS):
        monkeypatch.delenv(var, raising=False)


# ------------------------------------------------------------------------------------ readers
def read_tensorboard(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    history = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    params = b"".join(e.tensor_proto.string_val[0] for e in acc.Tensors("params/text_summary")).decode()
    return {"history": history, "params_text": params}


def mlflow_client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def read_mlflow(uri: str, experiment: str) -> list[dict]:
    """Every active run of `experiment` in the store at `uri`: name, id, status, params, history."""
    client = mlflow_client(uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r} in {uri}"
    out = []
    for run in client.search_runs([exp.experiment_id]):
        history = {
            key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics
        }
        out.append(
            {
                "name": run.info.run_name,
                "id": run.info.run_id,
                "status": run.info.status,
                "params": run.data.params,
                "history": history,
            }
        )
    return out


def wandb_records(path: str):
    """The protobuf records of a .wandb file: a 7-byte header (':W&B', magic, version), then
    LevelDB-log framed chunks (crc32 u32, length u16, type u8; FULL=1, FIRST=2, MIDDLE=3, LAST=4)
    in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def read_wandb(run_dir: Path) -> list[dict]:
    """Every offline attempt under run_dir/wandb, in order: run id, name, group, config, history."""

    def started(path: str) -> tuple[str, int]:
        # offline-run-<YYYYmmdd_HHMMSS>-<id>[-<n>]: wandb adds -n when an attempt starts in the same second
        _, _, stamp, run_id, *n = Path(path).parent.name.split("-")
        return stamp, int(n[0]) if n else 0

    attempts = []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")), key=started):
        att = {"history": {}, "summary": {}, "exit_code": None}
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                att.update(
                    id=r.run.run_id,
                    name=r.run.display_name,
                    group=r.run.run_group,
                    config={i.key: json.loads(i.value_json) for i in r.run.config.update},
                )
            elif kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in r.history.item}
                for key, value in items.items():
                    if not key.startswith("_"):
                        att["history"].setdefault(key, []).append((r.history.step.num, value))
            elif kind == "summary":
                att["summary"].update({_key(i): json.loads(i.value_json) for i in r.summary.update})
            elif kind == "exit":
                att["exit_code"] = r.exit.exit_code
        attempts.append(att)
    return attempts


# ------------------------------------------------------------------------------------ fake stream
def fake_cfg(loggers):
    """A real TrainConfig (its checks included) choosing `loggers`."""
    return config.TrainConfig(task=registry.get("task", "add"), max_new_tokens=8, loggers=loggers)


ROWS = [
    {"step": 1, "reward_mean": 0.25, "kl": 0.5, "skipped_update": "every sequence was filtered out"},
    {"step": 2, "reward_mean": 0.5, "kl": 0.75, "flag": True},
    {"step": 3, "reward_mean": 0.625, "kl": 1.0, "eval_accuracy": 0.375},
]
SUMMARY = {
    "status": "ok",
    "steps": 3,
    "eval_accuracy": 0.375,
    "final_train_reward": 0.4375,
    "table5": {"a": 1},
}
SWEPT = {"spec": "grpo", "Algorithm.kl": "@kl.k3", "seed": 0}


def run_fake(run_dir: Path, loggers, rows=ROWS, resume_step=0, finish=True, start_accuracy=0.125):
    if start_accuracy is not None and not resume_step:
        (run_dir / "eval.jsonl").write_text(json.dumps({"step": 0, "accuracy": start_accuracy}) + "\n")
    track = tracking.start(fake_cfg(loggers), str(run_dir), "grpo", resume_step, enabled=True)
    for row in rows:
        track.log(row)
    if finish:
        track.finish(SUMMARY)
    else:
        track._abort()  # what the exit hook does when the run dies
    return track


EXPECTED = {  # what every tracker must hold after run_fake(ROWS): the numbers of the stream, by step
    "reward_mean": [(1, 0.25), (2, 0.5), (3, 0.625)],
    "kl": [(1, 0.5), (2, 0.75), (3, 1.0)],
    "eval_accuracy": [(0, 0.125), (3, 0.375)],  # the starting policy's (eval.jsonl) and step 3's
}


def test_tensorboard_holds_each_number_at_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv(tracking.ENV_PARAMS, json.dumps(SWEPT))
    run_fake(tmp_path, ["tensorboard"])
    got = read_tensorboard(tmp_path)
    for key, points in EXPECTED.items():
        assert got["history"][key] == points, key  # dyadic values: exact in float32 too
    assert not {"skipped_update", "flag", "step", "table5"} & set(got["history"])  # numbers only
    assert got["history"]["summary/final_train_reward"] == [(3, 0.4375)]
    assert got["history"]["summary/eval_accuracy"] == [(3, 0.375)]
    assert "| Algorithm.kl | @kl.k3 |" in got["params_text"] and "| train.task | add |" in got["params_text"]


def test_mlflow_holds_one_run_with_params_and_each_number_at_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv(tracking.ENV_NAME, "grpo-k3-s0-abcd1234")
    monkeypatch.setenv(tracking.ENV_GROUP, "kl_ablation")
    monkeypatch.setenv(tracking.ENV_PARAMS, json.dumps(SWEPT))
    run_fake(tmp_path, ["mlflow"])
    (run,) = read_mlflow((tmp_path / "mlruns").as_uri(), "kl_ablation")
    assert run["name"] == "grpo-k3-s0-abcd1234" and run["status"] == "FINISHED"
    assert run["params"]["Algorithm.kl"] == "@kl.k3" and run["params"]["spec"] == "grpo"
    assert run["params"]["seed"] == "0" and run["params"]["train.max_new_tokens"] == "8"
    for key, points in EXPECTED.items():
        assert run["history"][key] == points, key  # dyadic values: exact in float32 too
    assert not {"skipped_update", "flag", "step"} & set(run["history"])
    assert run["history"]["summary/final_train_reward"] == [(3, 0.4375)]


def test_wandb_offline_run_holds_config_and_each_number_at_its_step(tmp_path, monkeypatch):
    monkeypatch.setenv(tracking.ENV_NAME, "grpo-k3-s0-abcd1234")
    monkeypatch.setenv(tracking.ENV_GROUP, "kl_ablation")
    monkeypatch.setenv(tracking.ENV_PARAMS, json.dumps(SWEPT))
    run_fake(tmp_path, ["wandb"])
    (att,) = read_wandb(tmp_path)
    assert att["name"] == "grpo-k3-s0-abcd1234" and att["group"] == "kl_ablation"
    assert att["config"]["Algorithm.kl"] == "@kl.k3" and att["config"]["train.task"] == "add"
    for key, points in EXPECTED.items():
        assert att["history"][key] == points, key  # dyadic values: exact in float32 too
    assert not {"skipped_update", "flag", "step"} & set(att["history"])
    assert att["summary"]["summary/final_train_reward"] == 0.4375
    assert att["exit_code"] == 0


def test_a_run_without_loggers_or_off_rank_0_opens_nothing(tmp_path):
    assert tracking.start(fake_cfg([]), str(tmp_path), "grpo", 0, enabled=True).parts == []
    assert tracking.start(fake_cfg(TRACKERS), str(tmp_path), "grpo", 0, enabled=False).parts == []
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------------------------ resume
FIRST = [{"step": s, "reward_mean": float(s)} for s in (1, 2, 3, 4)]  # crashed after step 4
SECOND = [{"step": s, "reward_mean": 10.0 + s} for s in (3, 4, 5)]  # resumed from the step-2 checkpoint


def test_a_resumed_run_logs_every_step_once_into_the_same_tracker_run(tmp_path):
    run_fake(tmp_path, TRACKERS, rows=FIRST, finish=False, start_accuracy=0.125)
    mlflow_id = json.loads((tmp_path / tracker_parts.STATE_FILE).read_text())["mlflow"]["run_id"]
    run_fake(tmp_path, TRACKERS, rows=SECOND, resume_step=2)

    # TensorBoard: the resumed writer purges what the dead attempt logged after the checkpoint.
    tb = read_tensorboard(tmp_path)["history"]["reward_mean"]
    assert tb == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert read_tensorboard(tmp_path)["history"]["eval_accuracy"][0] == (0, 0.125)

    # MLflow: the same run, reopened; the steps it already holds are not logged again.
    (run,) = read_mlflow((tmp_path / "mlruns").as_uri(), tracking.DEFAULT_GROUP)
    assert run["id"] == mlflow_id and run["status"] == "FINISHED"
    assert run["history"]["reward_mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 15.0)]

    # W&B: a second offline attempt of the same run id, holding only the steps after the first's.
    first, second = read_wandb(tmp_path)
    assert first["id"] == second["id"] and first["exit_code"] == 1 and second["exit_code"] == 0
    assert first["history"]["reward_mean"] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert second["history"]["reward_mean"] == [(5, 15.0)]


def test_a_fresh_start_in_a_dead_attempts_folder_replaces_its_tracker_runs(tmp_path):
    run_fake(tmp_path, ["tensorboard", "mlflow"], rows=FIRST, finish=False)
    run_fake(tmp_path, ["tensorboard", "mlflow"], rows=SECOND[:1])  # no checkpoint: from step 0
    assert read_tensorboard(tmp_path)["history"]["reward_mean"] == [(3, 13.0)]
    (run,) = read_mlflow((tmp_path / "mlruns").as_uri(), tracking.DEFAULT_GROUP)  # the dead one is deleted
    assert run["history"]["reward_mean"] == [(3, 13.0)] and run["status"] == "FINISHED"


# ------------------------------------------------------------------------------------ bad config
def test_unknown_logger_is_one_line_naming_the_binding_the_valid_names_and_the_closest():
    with pytest.raises(ConfigError) as err:
        fake_cfg(["tensorboard", "mlflw"])
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("train.loggers: unknown tracker 'mlflw'")
    assert "valid tracker names: mlflow, tensorboard, wandb" in msg and "did you mean 'mlflow'?" in msg
    with pytest.raises(ConfigError, match=r"train.loggers must be a list of tracker names"):
        fake_cfg("tensorboard")


@pytest.mark.parametrize(
    "name, module", [("tensorboard", "tensorboard"), ("mlflow", "mlflow"), ("wandb", "wandb")]
)
def test_a_missing_library_is_one_line_naming_the_extra_and_the_dry_run_stops_there(
    tmp_path, monkeypatch, capsys, name, module
):
    monkeypatch.setitem(sys.modules, module, None)  # importlib.util.find_spec now says: not installed
    with pytest.raises(ConfigError) as err:
        fake_cfg([name])
    assert str(err.value) == (
        f"train.loggers: tracker '{name}' needs the {module} package, which is not installed: "
        f"pip install 'polgrad[{name}]'"
    )
    from polgrad.sweep import main as sweep_main

    exp = tmp_path / "exp.gin"
    exp.write_text(
        "include 'experiments/base_tiny.gin'\n"
        f"train.loggers = ['{name}']\n"
        "Sweep.specs = ['registry/grpo.gin']\nSweep.grid = {'train.lr': [1e-4]}\nSweep.seeds = [0]\n"
    )
    assert sweep_main([str(exp), "--dry-run", "--results", str(tmp_path / "r")]) == 2
    assert f"pip install 'polgrad[{name}]'" in capsys.readouterr().err


def test_the_dry_run_names_an_unknown_logger(tmp_path, capsys):
    from polgrad.sweep import main as sweep_main

    exp = tmp_path / "exp.gin"
    exp.write_text(
        "include 'experiments/base_tiny.gin'\n"
        "Sweep.specs = ['registry/grpo.gin']\nSweep.grid = {'train.loggers': [['tensorbord']]}\n"
        "Sweep.seeds = [0]\n"
    )
    assert sweep_main([str(exp), "--dry-run", "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "train.loggers: unknown tracker 'tensorbord'" in err and "did you mean 'tensorboard'?" in err
    gin.clear_config()


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_two_cell_sweep_writes_one_tracker_run_per_cell_named_after_it(tmp_path, capsys):
    """The real trainer under `python -m polgrad.sweep`: per cell, TensorBoard events, an MLflow run
    in the experiment named after the sweep (one shared store) and a W&B offline run, each named
    after the cell id, with the swept binding as a param, holding metrics.jsonl's numbers by step."""
    from polgrad import sweep

    store = (tmp_path / "mlruns").as_uri()
    exp = tmp_path / "trk.gin"
    exp.write_text(
        "include 'experiments/base_tiny.gin'\n"
        "train.steps = 2\ntrain.prompts_per_step = 2\ntrain.eval_every = 2\ntrain.eval_size = 8\n"
        "train.checkpoint_every = 100\n"
        "train.loggers = ['tensorboard', 'mlflow', 'wandb']\n"
        f"tracker.mlflow.tracking_uri = '{store}'\n"
        "Sweep.name = 'trk'\nSweep.specs = ['registry/grpo.gin']\n"
        "Sweep.grid = {'clip.ppo.eps_high': [0.2, 0.28]}\nSweep.seeds = [0]\n"
    )
    results = tmp_path / "results"
    assert sweep.main([str(exp), "--results", str(results)]) == 0, capsys.readouterr().err
    _, cells = sweep.prepare(str(exp))
    assert len(cells) == 2
    mlflow_runs = {r["name"]: r for r in read_mlflow(store, "trk")}
    assert set(mlflow_runs) == {c.id for c in cells}  # one run per cell, named after it
    for cell in cells:
        run_dir = results / "trk" / "runs" / cell.id
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        start = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[0])
        assert [r["step"] for r in rows] == [1, 2] and start["step"] == 0
        reward = [(r["step"], r["reward_mean"]) for r in rows]
        accuracy = [(0, start["accuracy"]), (2, rows[-1]["eval_accuracy"])]
        eps = dict(cell.swept)["clip.ppo.eps_high"]  # the swept value as the experiment file writes it

        tb = read_tensorboard(run_dir)
        assert tb["history"]["reward_mean"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in reward]
        assert tb["history"]["eval_accuracy"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in accuracy]
        assert f"| clip.ppo.eps_high | {eps} |" in tb["params_text"] and "| seed | 0 |" in tb["params_text"]

        run = mlflow_runs[cell.id]
        assert run["status"] == "FINISHED" and run["params"]["clip.ppo.eps_high"] == eps
        assert run["history"]["reward_mean"] == reward and run["history"]["eval_accuracy"] == accuracy

        (att,) = read_wandb(run_dir)
        assert att["name"] == cell.id and att["group"] == "trk" and att["config"]["clip.ppo.eps_high"] == eps
        assert att["history"]["reward_mean"] == reward and att["exit_code"] == 0


@pytest.mark.slow
def test_the_trainer_resumes_into_the_same_tracker_runs_without_logging_a_step_twice(tmp_path):
    """The real trainer in-process: 2 steps, then resumed from its step-2 checkpoint to 4 steps."""
    from polgrad.train import run as train

    def run(steps: int, resume: bool) -> None:
        gin.clear_config()
        config.parse_config(
            [str(REPO / "registry" / "grpo.gin")],
            [
                f"train.steps = {steps}",
                "train.prompts_per_step = 2",
                "train.eval_every = 2",
                "train.eval_size = 8",
                "train.checkpoint_every = 2",
                "train.progress = False",
                "train.loggers = ['tensorboard', 'mlflow', 'wandb']",
            ],
        )
        train(str(tmp_path), resume=resume)

    run(2, resume=False)
    mlflow_id = json.loads((tmp_path / tracker_parts.STATE_FILE).read_text())["mlflow"]["run_id"]
    run(4, resume=True)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reward = [(r["step"], r["reward_mean"]) for r in rows]
    assert [s for s, _ in reward] == [1, 2, 3, 4]

    tb = read_tensorboard(tmp_path)["history"]
    assert tb["reward_mean"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in reward]
    assert [s for s, _ in tb["eval_accuracy"]] == [0, 2, 4]
    (run_,) = read_mlflow((tmp_path / "mlruns").as_uri(), tracking.DEFAULT_GROUP)
    assert run_["id"] == mlflow_id and run_["history"]["reward_mean"] == reward
    assert [s for s, _ in run_["history"]["eval_accuracy"]] == [0, 2, 4]
    first, second = read_wandb(tmp_path)
    assert first["id"] == second["id"] and first["name"] == second["name"] == tmp_path.name
    assert first["history"]["reward_mean"] + second["history"]["reward_mean"] == reward


def test_the_docs_say_how_to_read_the_mlflow_store_and_that_it_is_needed(tmp_path):
    """Reading a run's MLflow file store needs MLFLOW_ALLOW_FILE_STORE=true (MLflow 3 refuses it
    otherwise): the docs' Trackers section says so (only a docstring did)."""
    import os
    import subprocess

    run_fake(tmp_path, ["mlflow"])
    read = (
        "from mlflow.tracking import MlflowClient; "
        f"print(len(MlflowClient(tracking_uri={(tmp_path / 'mlruns').as_uri()!r}).search_experiments()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_ALLOW_FILE_STORE"}  # a fresh reader's shell
    refused = subprocess.run(
        [sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0 and "filesystem tracking backend" in refused.stderr, refused.stderr[-500:]
    env["MLFLOW_ALLOW_FILE_STORE"] = "true"
    allowed = subprocess.run(
        [sys.executable, "-c", read], env=env, capture_output=True, text=True, timeout=120
    )
    assert allowed.returncode == 0 and int(allowed.stdout.split()[-1]) >= 1, allowed.stderr[-500:]
    section = (REPO / "docs" / "configuration.md").read_text().split("\n## Trackers\n")[1].split("\n## ")[0]
    assert "MLFLOW_ALLOW_FILE_STORE=true" in section
