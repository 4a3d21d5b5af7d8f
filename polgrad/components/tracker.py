"""Built-in tracker parts: a run's metrics in TensorBoard, MLflow or W&B, through their own libraries.

Call signature: `polgrad.registry.kinds.TrackerFn`. Each part is a factory the run calls once, on
rank 0, after its loop state is known (polgrad/tracking.py); it returns an object with
`log(metrics, step)` (numbers only, `step` = steps done, 0 = the starting policy's evaluation),
`summary(values, step)` (the run's summary.json numbers, logged as `summary/<key>`) and
`close(ok)`. A run picks them with `train.loggers = ['tensorboard', 'mlflow', 'wandb']`; its
metrics.jsonl is written either way. Each library is an optional extra (`pip install
'polgrad[tensorboard]'`, `[mlflow]`, `[wandb]`, or `[trackers]` for all three), imported only
inside its part; `check_loggers` (called by `polgrad.config.build()`, hence by the sweep's dry run)
refuses an unknown name or a missing library in one line.

Where each writes, and what a resumed run (`--resume`: the checkpoint covers `resume_step` steps,
while the crashed attempt may have logged a few steps more) does:

    tensorboard  <run_dir>/tensorboard/ (torch.utils.tensorboard.SummaryWriter): one event file per
                 attempt in the same logdir, steps continue; the new writer's `purge_step` makes
                 TensorBoard drop what an earlier attempt logged from step resume_step + 1 on (from
                 step 0 on a fresh start), so every step shows once, with the newest attempt's value.
    mlflow       a file store at <run_dir>/mlruns (MLflow's file backend, allowed by setting
                 MLFLOW_ALLOW_FILE_STORE=true), or `tracker.mlflow.tracking_uri` / $MLFLOW_TRACKING_URI
                 (e.g. one 'file:results/X/mlruns' for a whole sweep, or a server). MLflow experiment =
                 the run's group, run name = its name, params = its params. The run id is kept in
                 <run_dir>/trackers.json: a resume reopens that run and skips the steps it already
                 logged (MLflow cannot delete a metric point; on CPU the re-computed steps are the
                 same); a fresh start in the same folder deletes the dead attempt's run first.
    wandb        offline by default (`tracker.wandb.mode`; no network, no login): files under
                 <run_dir>/wandb/, uploaded later with `wandb sync <run_dir>/wandb/offline-run-*`.
                 project `tracker.wandb.project`, group = the run's group, name = its name, config =
                 its params. A resume reuses the run id from trackers.json (resume='allow'; offline,
                 each attempt is a folder of its own that `wandb sync` appends to the same run) and
                 skips the steps already logged, as W&B itself drops steps below a run's last one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

from polgrad.checks import is_real
from polgrad.errors import ConfigError, did_you_mean
from polgrad.io import atomic_write_text
from polgrad.registry import lookup, names, register

STATE_FILE = "trackers.json"  # per run: each tracker's run id and last logged step


def check_loggers(loggers: Any) -> None:
    """`train.loggers` names registered trackers whose library is installed; else one ConfigError line."""
    if isinstance(loggers, str) or not isinstance(loggers, (list, tuple)):
        raise ConfigError(
            f"train.loggers must be a list of tracker names such as ['tensorboard'], got {loggers!r}"
        )
    valid = names("tracker")
    for name in loggers:
        if name not in valid:
            raise ConfigError(
                f"train.loggers: unknown tracker {name!r}; valid tracker names: {', '.join(valid)}"
                + did_you_mean(str(name), valid)
            )
        meta = lookup("tracker", name).meta
        if meta.get("requires") and importlib.util.find_spec(meta["requires"]) is None:
            package = f"polgrad[{meta['extra']}]" if meta.get("extra") else meta["requires"]
            raise ConfigError(
                f"train.loggers: tracker {name!r} needs the {meta['requires']} package, which is not "
                f"installed: pip install '{package}'"
            )


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The entries of a metrics row or summary a tracker takes: real numbers (no bools, strings, dicts)."""
    return {k: float(v) for k, v in values.items() if is_real(v)}


class _State:
    """One tracker's entry in <run_dir>/trackers.json (run id, last logged step), written atomically."""

    def __init__(self, run_dir: str, key: str):
        self.path, self.key = Path(run_dir) / STATE_FILE, key

    def get(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.path.read_text()).get(self.key, {}))
        except (OSError, ValueError, AttributeError):
            return {}

    def set(self, **values: Any) -> None:
        try:
            whole = json.loads(self.path.read_text())
        except (OSError, ValueError):
            whole = {}
        whole[self.key] = {**whole.get(self.key, {}), **values}
        atomic_write_text(self.path, json.dumps(whole, indent=1, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------- TensorBoard
class TensorBoardTracker:
    def __init__(self, logdir: str, params: dict[str, str], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(logdir, purge_step=resume_step + 1 if resume_step else 0)
        if not resume_step:
            table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
            self.writer.add_text("params", "| binding | value |\n|---|---|\n" + table, 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a crash keeps every step logged so far

    def summary(self, values: dict[str, float], step: int) -> None:
        self.log({f"summary/{k}": v for k, v in values.items()}, step)

    def close(self, ok: bool) -> None:
        self.writer.close()


@register("tracker", "tensorboard", requires="tensorboard", extra="tensorboard")
def tensorboard(run_dir: str, *, name: str, group: str, params: dict[str, str], resume_step: int):
    """TensorBoard event files in <run_dir>/tensorboard, one scalar per metrics.jsonl key.

    `tensorboard --logdir results/X/runs` shows every cell of a sweep as a run named after its
    folder (the cell id). The params go in as a text table, the summary as `summary/<key>`.
    Needs the `tensorboard` extra."""
    return TensorBoardTracker(os.path.join(run_dir, "tensorboard"), params, resume_step)


# --------------------------------------------------------------------------------- MLflow
class MLflowTracker:
    def __init__(self, client: Any, run_id: str, state: _State, skip_until: int):
        self.client, self.run_id, self.state, self.skip_until = client, run_id, state, skip_until

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step <= self.skip_until:  # logged by the attempt this run resumes
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch, synchronous=True)
        self.state.set(last_step=step)

    def summary(self, values: dict[str, float], step: int) -> None:
        self.skip_until = -1  # the summary is the newest attempt's
        self.log({f"summary/{k}": v for k, v in values.items()}, step)

    def close(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def _mlflow_experiment(client: Any, name: str) -> str:
    """The id of the MLflow experiment `name`, created if new (cells of a sweep may race to create it)."""
    from mlflow.exceptions import MlflowException

    for _ in range(3):
        found = client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return client.create_experiment(name)
        except MlflowException:
            time.sleep(0.2)  # another cell created it first
    raise ConfigError(f"tracker.mlflow: cannot create or find the MLflow experiment {name!r}")


@register("tracker", "mlflow", requires="mlflow", extra="mlflow")
def mlflow(
    run_dir: str,
    *,
    name: str,
    group: str,
    params: dict[str, str],
    resume_step: int,
    tracking_uri: str | None = None,
):
    """An MLflow run per polgrad run: experiment = its group, run name = its name, params = its params.

    The store is `tracking_uri`, else $MLFLOW_TRACKING_URI, else a file store at <run_dir>/mlruns.
    Metrics are logged with their step, the summary as `summary/<key>`; the run ends FINISHED or
    FAILED. Needs the `mlflow` extra (mlflow-skinny)."""
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or Path(run_dir, "mlruns").resolve().as_uri()
    if uri.startswith("file:") or "://" not in uri:  # MLflow 3 refuses its file store unless asked
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client, state = MlflowClient(tracking_uri=uri), _State(run_dir, "mlflow")
    old = state.get()
    same_store = old.get("tracking_uri") == uri and bool(old.get("run_id"))
    if resume_step and same_store:
        try:
            client.update_run(old["run_id"], status="RUNNING")
            return MLflowTracker(client, old["run_id"], state, int(old.get("last_step", -1)))
        except MlflowException:
            pass  # the run is gone: start a new one
    if same_store:  # a fresh start replaces a dead attempt's run
        try:
            client.delete_run(old["run_id"])
        except MlflowException:
            pass
    run = client.create_run(_mlflow_experiment(client, group), run_name=name)
    client.log_batch(run.info.run_id, params=[Param(k, v[:6000]) for k, v in sorted(params.items())])
    state.set(tracking_uri=uri, run_id=run.info.run_id, last_step=-1)
    return MLflowTracker(client, run.info.run_id, state, -1)


# --------------------------------------------------------------------------------- Weights & Biases
class WandbTracker:
    def __init__(self, run: Any, state: _State, skip_until: int):
        self.run, self.state, self.skip_until = run, state, skip_until

    def log(self, metrics: dict[str, float], step: int) -> None:
        if step <= self.skip_until:  # logged by the attempt this run resumes
            return
        self.run.log(metrics, step=step)
        self.state.set(last_step=step)

    def summary(self, values: dict[str, float], step: int) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in values.items()})

    def close(self, ok: bool) -> None:
        import wandb as wandb_lib

        self.run.finish(exit_code=0 if ok else 1)
        # finish() can return before W&B's service has written the run's file; its teardown waits.
        wandb_lib.teardown()


@register("tracker", "wandb", requires="wandb", extra="wandb")
def wandb(
    run_dir: str,
    *,
    name: str,
    group: str,
    params: dict[str, str],
    resume_step: int,
    project: str = "polgrad",
    entity: str | None = None,
    mode: str | None = "offline",
):
    """A Weights & Biases run under <run_dir>/wandb: group, name and config = the run's group, name, params.

    `mode` 'offline' (the default: no network, no login), 'online' (needs `wandb login`) or None
    (W&B's own $WANDB_MODE); `project` and `entity` as in wandb.init. Needs the `wandb` extra."""
    import wandb as wandb_lib

    state = _State(run_dir, "wandb")
    old = state.get()
    resuming = bool(resume_step and old.get("id"))
    run_id = old["id"] if resuming else uuid.uuid4().hex[:8]
    settings = wandb_lib.Settings(silent=True, console="off", save_code=False, x_save_requirements=False)
    run = wandb_lib.init(
        project=project,
        entity=entity,
        group=group,
        name=name,
        id=run_id,
        dir=run_dir,
        config=dict(params),
        mode=mode,
        resume="allow" if resuming else None,
        reinit="create_new",
        settings=settings,
    )
    if not resuming:
        state.set(id=run_id, last_step=-1)
    return WandbTracker(run, state, int(old.get("last_step", -1)) if resuming else -1)
