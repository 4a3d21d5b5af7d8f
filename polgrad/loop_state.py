"""A run's loop state: what the loop carries from step to step, and how a run starts or resumes.

A checkpoint `step<N>` (written and read by polgrad/checkpoints.py) holds DeepSpeed's own checkpoint
of every engine (the policy's; a critic's own engine, `Critic.engines()`), the loop state below under
client_state["polgrad"], every rank's RNG states, and what the sampler needs to resume exactly
(`Sampler.save`: an async run's older weight versions). A resume loads the newest intact one.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import os
from pathlib import Path

import torch

from polgrad import checkpoints, collective, export, hooks, stopping
from polgrad.algorithm import Algorithm
from polgrad.build import Models
from polgrad.config import ConfigRecord, TrainConfig
from polgrad.evaluation import Evaluator
from polgrad.io import atomic_write_text
from polgrad.run_folder import RunFolder


@dataclasses.dataclass(frozen=True)
class LoopState:
    """What the loop carries from step to step and saves in checkpoints."""

    step: int = 0  # steps done
    kl_coef: float = 0.0  # the KL coefficient of the next step
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    # What the run has sampled, cumulative over its steps and ranks (polgrad/stopping.py: the budget).
    sampled_sequences: int = 0
    kept_sequences: int = 0
    generated_tokens: int = 0


def start_or_resume(
    cfg: TrainConfig, algo: Algorithm, m: Models, out_dir: str, evaluate: Evaluator, record: ConfigRecord
) -> LoopState:
    """The loop state at the spec's initial KL coefficient, or the last checkpoint's with `resume`.

    A fresh run evaluates its starting policy (step 0) first; a resumed one keeps the evaluations
    its checkpoint covers. Only the writing rank (rank 0, `evaluate.write`) touches the run's files.
    `record` is the run's gin configuration as the entry point read it: its text (config.gin) and, on
    a resume, its differences from the folder's config.gin."""
    state, writer = LoopState(kl_coef=algo.kl_coef), evaluate.write
    folder = RunFolder(out_dir)
    ckpt, metrics_path = str(folder.checkpoints), str(folder.metrics)
    # The newest checkpoint that is intact (checked first; a damaged newer one is a warning line).
    parts = ("policy", *(name for name, _ in m.critic.engines()))
    tag = checkpoints.resume_tag(ckpt, parts, warn=bool(writer)) if cfg.resume else None
    if tag is not None:
        # Our counters live under one key: DeepSpeed keeps its own (e.g. 'skipped_steps') beside them.
        saved = checkpoints.load_part(m.engine, os.path.join(ckpt, "policy"), tag)["polgrad"]
        for name, engine in m.critic.engines():
            checkpoints.load_part(engine, os.path.join(ckpt, name), tag)
        state = LoopState(**{f.name: saved[f.name] for f in dataclasses.fields(LoopState) if f.name in saved})
        state = _config_changes(cfg, algo, m, out_dir, state, writer, record)
        if writer:
            _truncate_metrics(metrics_path, state.step)
        evaluate.keep_until(state.step)
        m.sampler.resumed(m.engine.module)  # e.g. a vLLM engine gets the loaded weights
    elif writer:
        Path(metrics_path).unlink(missing_ok=True)  # a fresh run never appends to an older run's metrics
    export.save_run_model_files(m, out_dir, algo.name, algo.source)  # what polgrad.export needs
    if state.step == 0:
        if writer:
            folder.write_config(record.bindings)
        evaluate.start()
        with hooks.phase("eval"):
            evaluate(m.engine.module, m.tokenizer, 0)
    stopping.arm()  # the loop starts: ^C / SIGTERM now end the step and checkpoint it (stopping.py)
    return state


def _config_changes(
    cfg: TrainConfig,
    algo: Algorithm,
    m: Models,
    out_dir: str,
    state: LoopState,
    writer: bool,
    record: ConfigRecord,
) -> LoopState:
    """A resume whose bindings differ from the run's config.gin (a grown train.steps, or what
    --allow-config-change let through; polgrad/resume_config.py): what the checkpoint would restore
    takes the new values (the KL coefficient, the optimizer's lr and eps), so the new bindings act
    from this step on, and the folder records it (resume_overrides.jsonl, config.gin rewritten)."""
    override = record.resume_override  # computed by the entry point, where gin is read
    collective.all_max(torch.zeros(()))  # every rank has read config.gin before rank 0 rewrites it
    trained = set(override["overridden"]) if override else set()
    if "Algorithm.kl_coef" in trained:
        state = dataclasses.replace(state, kl_coef=algo.kl_coef)
    if trained & {"train.lr", "train.critic_lr", "train.adam_eps"}:
        _set_optimizer(m.engine, cfg.lr, cfg.critic_lr, cfg.adam_eps)
        for _, engine in m.critic.engines():
            _set_optimizer(engine, cfg.critic_lr, cfg.critic_lr, cfg.adam_eps)
    if override and writer:
        when = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        RunFolder(out_dir).append_resume_override({"time": when, "step": int(state.step), **override})
        RunFolder(out_dir).write_config(record.bindings)
    return state


def _set_optimizer(engine, lr: float, other_lr: float, eps: float) -> None:
    """The first param group trains at `lr`, any further one (a LoRA critic's) at `other_lr` (make_engine)."""
    for i, group in enumerate(engine.optimizer.param_groups):
        group["lr"], group["eps"] = float(lr if i == 0 else other_lr), float(eps)


def _truncate_metrics(path: str, steps: int) -> None:
    """Keep the first `steps` rows (those the checkpoint covers); a resumed run rewrites the rest."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip()][:steps]
    atomic_write_text(path, "".join(rows))
