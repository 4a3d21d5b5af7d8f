"""A run's loop state and its checkpoints: what the loop carries from step to step, how a run starts
or resumes, and how a step is checkpointed.

A checkpoint `step<N>` holds DeepSpeed's own checkpoint of every engine (the policy's; a critic's
own engine, `Critic.engines()`), the loop state below under client_state["polgrad"], every rank's
RNG states, and what the sampler needs to resume exactly (`Sampler.save`: an async run's older
weight versions). Every earlier checkpoint is kept; a resume loads the newest intact one
(polgrad/checkpoints.py).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from polgrad import checkpoints, collective, export, hooks, resume_config, stopping
from polgrad import distributed as dist_lib
from polgrad.algorithm import Algorithm
from polgrad.build import Models
from polgrad.config import ConfigRecord, TrainConfig
from polgrad.errors import DataError, PolgradError, WriteError, is_write_failure, write_error
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
        saved = _load(m.engine, os.path.join(ckpt, "policy"), tag)["polgrad"]
        for name, engine in m.critic.engines():
            _load(engine, os.path.join(ckpt, name), tag)
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
    changes = dict(record.resume_changes)  # computed by the entry point, where gin is read
    collective.all_max(torch.zeros(()))  # every rank has read config.gin before rank 0 rewrites it
    trained = resume_config.training_changes(changes)
    if "Algorithm.kl_coef" in trained:
        state = dataclasses.replace(state, kl_coef=algo.kl_coef)
    if trained.keys() & {"train.lr", "train.critic_lr", "train.adam_eps"}:
        _set_optimizer(m.engine, cfg.lr, cfg.critic_lr, cfg.adam_eps)
        for _, engine in m.critic.engines():
            _set_optimizer(engine, cfg.critic_lr, cfg.critic_lr, cfg.adam_eps)
    if changes and writer:
        resume_config.record(out_dir, state.step, changes)
        RunFolder(out_dir).write_config(record.bindings)
    return state


def _set_optimizer(engine, lr: float, other_lr: float, eps: float) -> None:
    """The first param group trains at `lr`, any further one (a LoRA critic's) at `other_lr` (make_engine)."""
    for i, group in enumerate(engine.optimizer.param_groups):
        group["lr"], group["eps"] = float(lr if i == 0 else other_lr), float(eps)


def _load(engine, part_dir: str, tag: str) -> dict[str, Any]:
    """`distributed.load_checkpoint` of a checked tag; a failure is one line naming the folder."""
    try:
        return dist_lib.load_checkpoint(engine, part_dir, tag=tag)
    except PolgradError:
        raise
    except Exception as e:  # noqa: BLE001 - torch/DeepSpeed errors name neither the file nor the fix
        raise DataError(
            f"cannot load checkpoint {os.path.join(part_dir, tag)}: {type(e).__name__}: {e}; move that "
            "folder aside to resume from the one before it"
        ) from e


def save_checkpoint(m: Models, out_dir: str, state: LoopState) -> None:
    """The engines' checkpoint `step<N>` (every earlier one is kept, to fall back to on resume).

    A write that fails (disk full, read-only folder) is one line naming the tag folder; the partial
    folder is removed, so the run's newest intact checkpoint stays the one a resume loads."""
    client_state = {"polgrad": dataclasses.asdict(state)}
    ckpt, tag = str(RunFolder(out_dir).checkpoints), f"step{state.step}"
    # Async rollouts: the older weights the next steps sample with, first.
    m.sampler.save(os.path.join(ckpt, "sampler"), state.step)
    parts = (("policy", m.engine), *m.critic.engines())
    for part, engine in parts:
        try:
            dist_lib.save_checkpoint(engine, os.path.join(ckpt, part), tag, client_state)
        except (OSError, RuntimeError) as e:
            where = os.path.join(ckpt, part, tag)
            shutil.rmtree(where, ignore_errors=True)
            raise _checkpoint_write_error(e, where) from e
    # Written last, once every part's files of every rank are (save_checkpoint ends with a barrier):
    # a copy of the folder made elsewhere (a Ray node's, polgrad/sweep/ray_sync.py) knows from it
    # which tags are whole and which parts a whole one has.
    if collective.rank() == 0:
        marker = {"step": state.step, "parts": [part for part, _ in parts]}
        atomic_write_text(os.path.join(ckpt, checkpoints.COMPLETE), json.dumps(marker) + "\n")


def _checkpoint_write_error(e: BaseException, where: str) -> PolgradError:
    """torch reports a full disk as "PytorchStreamWriter failed writing file ... unexpected pos": name
    the folder and, from the file system, the reason."""
    fix = "free space (or make the folder writable) and re-run with --resume (a sweep: the same command)"
    if isinstance(e, OSError) and is_write_failure(e):
        return write_error(e, where, fix)
    folder = os.path.dirname(where)
    st = os.statvfs(folder) if os.path.isdir(folder) else None
    if st is not None and st.f_bavail * st.f_frsize < 2**20:
        return write_error(OSError(errno.ENOSPC, ""), where, fix)
    if not os.access(folder, os.W_OK):
        return write_error(OSError(errno.EACCES, ""), where, fix)
    if isinstance(e, OSError) or "PytorchStreamWriter" in str(e) or "unexpected pos" in str(e):
        first = " ".join(str(e).split())[:200]
        return WriteError(f"could not write checkpoint {where} ({type(e).__name__}: {first}); {fix}")
    raise e


def _truncate_metrics(path: str, steps: int) -> None:
    """Keep the first `steps` rows (those the checkpoint covers); a resumed run rewrites the rest."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip()][:steps]
    atomic_write_text(path, "".join(rows))
