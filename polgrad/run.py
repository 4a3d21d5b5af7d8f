"""What a run holds around the RL step: its models, its loop state and checkpoints, its summary.

`polgrad.trainer.train` uses these; the step itself (collect, advantages, update, log) is in
polgrad/trainer.py, readable top to bottom.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import gin
import torch
from torch import Tensor

from polgrad import checkpoints, collective, config, export, hooks, models, pretrain, resume_config, stopping
from polgrad import distributed as dist_lib
from polgrad.algorithm import Algorithm
from polgrad.errors import DataError, PolgradError, WriteError, is_write_failure, write_error
from polgrad.evaluation import Evaluator, read_evals
from polgrad.io import atomic_write_text
from polgrad.rollout import hf as hf_rollout
from polgrad.tasks.rewards import RewardGuard

SUMMARY_LAST_K = 5  # final_train_reward: mean over the last k steps


# --------------------------------------------------------------------------- 1. models
@dataclasses.dataclass
class Models:
    """The run's models: the policy's DeepSpeed engine and whatever else the parts need (else None)."""

    engine: Any
    tokenizer: Any
    reference: torch.nn.Module | None = None
    critic: Any = None  # the critic's DeepSpeed engine
    reward_model: torch.nn.Module | None = None
    rm_accuracy: float | None = None  # the reward model's held-out pairwise accuracy
    vllm: Any = None  # a vLLM sampler: the policy's weights after every step (async: the producer's)
    rewards: RewardGuard = dataclasses.field(default_factory=RewardGuard)  # train.reward_errors
    warm_start_s: float = 0.0  # seconds spent in polgrad.pretrain (SFT warm start, reward model)
    warm_start: str = ""  # which policy the run started from (`warm_start_id`)
    producer: Any = None  # async rollouts (train.async_rollouts): polgrad.producer.Producer

    def summary_fields(self) -> dict[str, Any]:
        """What summary.json records of the warm start: its seconds and its identity (`warm_start_id`)."""
        return {"warm_start_s": self.warm_start_s, "warm_start": self.warm_start}

    @property
    def critic_engine(self) -> Any:
        """The critic's own DeepSpeed engine, or None: no critic, or a LoRA critic, whose head (and
        adapter) the policy's engine trains (`critic.in_policy_engine`, polgrad/models/lora.py)."""
        return None if getattr(self.critic, "in_policy_engine", False) else self.critic

    def sample(self, examples, **kwargs) -> hf_rollout.Rollout:
        if self.producer is not None:
            return self.producer.sample(examples, **kwargs)
        if self.vllm is not None:
            return self.vllm.generate(examples, **kwargs)
        return hf_rollout.generate(self.engine.module, self.tokenizer, examples, **kwargs)

    def score(self, rollout: hf_rollout.Rollout, task) -> Tensor:
        """One scalar per sequence [B] float64: the reward model's, else the task's verifier's.

        Each is checked by `self.rewards` (train.reward_errors): a reward that raises or is not a
        finite number stops the run in one line, is scored 0, or is NaN ('skip_group': the loop
        drops its group)."""
        if self.reward_model is not None:
            scores = hf_rollout.rollout_scores(self.reward_model, rollout)
            return self.rewards.checked(scores, rollout.examples, rollout.texts)
        return self.rewards.task_scores(task, rollout.examples, rollout.texts)


# The files of a checkpoint polgrad did not make that its `warm_start_id` hashes: what the model is.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
EDGE_BYTES = 1 << 20  # a large file is hashed by its size, first and last MiB


def warm_start_id(policy_path: str) -> str:
    """The identity of a starting policy, as summary.json's `warm_start` and the CSV's column record it:
    the first 16 hex characters of its polgrad.json cache key (an SFT warm start's: the suffix of its
    cache folder .cache/polgrad/sft/<task>-<key>, which the task, model, SFT settings and seed fix), or
    for a checkpoint polgrad did not make, 'path-' and 16 hex characters of a hash of its content:
    config.json and the weights files (`WEIGHT_SUFFIXES`), each by name, size and the sha256 of its
    bytes (of its first and last MiB when larger than 2 MiB), so two such checkpoints are told apart
    and the same one, wherever it lies, is one warm start."""
    key = models.read_info(policy_path).get("key") if os.path.isdir(policy_path) else None
    if key:
        return str(key)[:16]
    h = hashlib.sha256()
    folder = Path(policy_path)
    files = sorted(folder.iterdir()) if folder.is_dir() else []
    for f in files:
        if f.is_file() and (f.name == "config.json" or f.name.endswith(WEIGHT_SUFFIXES)):
            size = f.stat().st_size
            with open(f, "rb") as fh:
                if size <= 2 * EDGE_BYTES:
                    content = hashlib.sha256(fh.read()).hexdigest()
                else:
                    head = fh.read(EDGE_BYTES)
                    fh.seek(-EDGE_BYTES, os.SEEK_END)
                    content = hashlib.sha256(head + fh.read(EDGE_BYTES)).hexdigest()
            h.update(f"{f.name}\0{size}\0{content}\n".encode())
    return "path-" + h.hexdigest()[:16]


def warm_start(cfg: config.TrainConfig) -> str:
    """The run's starting policy: train.policy_path, else the cached SFT warm start of the task's tiny
    model seeded by `cfg.warm_start_seed` (train.init_seed, else train.seed)."""
    if cfg.policy_path is not None:
        return cfg.policy_path
    sft = {} if cfg.sft_steps is None else {"sft_steps": cfg.sft_steps}
    return pretrain.warm_start(
        cfg.task_name,
        cfg.task_kwargs(),
        cfg.model_kwargs,
        seed=cfg.warm_start_seed,
        progress=cfg.progress,
        reward_errors=cfg.reward_errors,
        reward_timeout_s=cfg.reward_timeout_s,
        **sft,
    )


def build_models(cfg: config.TrainConfig, algo: Algorithm, task) -> Models:
    """Policy (built and warm-started by cached SFT unless train.policy_path), then what the parts need.

    The inputs are checked against the policy before anything trains (`models.check_inputs`: the
    task's prompts fit the model's positions and survive its tokenizer). `Models.warm_start_s` is
    the time spent in polgrad.pretrain (SFT, reward model; ~0 when cached), `Models.warm_start` the
    starting policy's `warm_start_id`."""
    t_pretrain = time.perf_counter()
    policy_path = warm_start(cfg)
    warm_start_s = time.perf_counter() - t_pretrain
    policy, tokenizer = models.load_policy(policy_path), models.load_tokenizer(policy_path)
    models.check_inputs(
        task, tokenizer, policy.config, cfg.max_new_tokens, path=policy_path, name=cfg.task_name
    )
    if cfg.lora_r:  # the backbone is frozen; the actor trains its adapter (polgrad/models/lora.py)
        lora_cfg = models.lora.lora_config(
            r=cfg.lora_r,
            alpha=cfg.lora_alpha,
            target_modules=cfg.lora_target_modules,
            dropout=cfg.lora_dropout,
        )
        policy = models.lora.add_policy_adapter(policy, lora_cfg)
    # A reward model is trained (cached) when it scores the responses or initialises the critic.
    # With LoRA it is an adapter + head on the policy's backbone, unless a part (value_init.reward_model)
    # reads the reward model's own checkpoint: then it is the full model, as without LoRA.
    rm_path, rm_accuracy, reward_model = None, None, None
    lora_rm = bool(cfg.lora_r) and not algo.needs_reward_model
    if cfg.reward_source == "reward_model" or algo.needs_reward_model:
        rm, t_pretrain = {} if cfg.rm_steps is None else {"steps": cfg.rm_steps}, time.perf_counter()
        if lora_rm:
            rm["lora"] = dict(
                r=cfg.lora_r,
                alpha=cfg.lora_alpha,
                target_modules=list(cfg.lora_target_modules),
                dropout=cfg.lora_dropout,
            )
        rm_path, rm_accuracy = pretrain.train_reward_model(
            policy_path, task, seed=cfg.warm_start_seed, progress=cfg.progress, **rm
        )
        warm_start_s += time.perf_counter() - t_pretrain
    if cfg.reward_source == "reward_model":
        reward_model = (
            models.lora.add_reward_model(policy, rm_path) if lora_rm else models.load_reward_model(rm_path)
        )
    reference = None
    if algo.needs_reference or cfg.measure_kl:
        # With LoRA the reference is the policy's own module with its adapter disabled: no second copy.
        reference = models.lora.AdapterDisabled(policy) if cfg.lora_r else models.load_reference(policy_path)
    if reference is not None and cfg.bf16 and not cfg.lora_r:
        # The policy's engine module at step 0, exactly (KL 0, as in fp32): DeepSpeed's bf16 casts
        # the parameters only (buffers such as RoPE's inv_freq stay fp32, as in a bf16 HF load).
        for p in reference.parameters():
            p.data = p.data.to(torch.bfloat16)
    critic, lr_groups = None, ()
    if algo.needs_critic:
        lora_critic = algo.parts["Algorithm.value_init"].meta.get("lora", False)
        on_policy = {"policy": policy} if lora_critic else {}  # a `lora` part builds on the peft policy
        critic = algo.value_init(policy_path=policy_path, reward_model_path=rm_path, **on_policy)
        if lora_critic:  # its head (and own adapter) train in the policy's engine, at the critic's lr
            lr_groups = ((models.lora.critic_parameters(policy), cfg.critic_lr),)

    ds = dict(
        zero_stage=cfg.zero_stage,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=1,
        bf16=cfg.bf16,
        grad_clip=cfg.grad_clip,
    )
    engine = dist_lib.make_engine(policy, lr=cfg.lr, eps=cfg.adam_eps, lr_groups=lr_groups, **ds)
    critic_engine = critic
    if critic is not None and not getattr(critic, "in_policy_engine", False):
        critic_engine = dist_lib.make_engine(critic, lr=cfg.critic_lr, eps=cfg.adam_eps, **ds)
    vllm = None
    if cfg.rollout_backend == "vllm":
        from polgrad.rollout.vllm import VLLMRollout  # optional extra: imported only when chosen

        vllm = VLLMRollout(policy_path, seed=cfg.seed)
    rewards = RewardGuard(
        cfg.reward_errors, cfg.task_name, f"the reward model {rm_path}", timeout_s=cfg.reward_timeout_s
    )
    return Models(
        engine,
        tokenizer,
        reference,
        critic_engine,
        reward_model,
        rm_accuracy,
        vllm,
        rewards,
        warm_start_s,
        warm_start_id(policy_path),
    )


# --------------------------------------------------------------------------- 2. loop state
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
    cfg: config.TrainConfig, algo: Algorithm, m: Models, out_dir: str, evaluate: Evaluator
) -> LoopState:
    """The loop state at the spec's initial KL coefficient, or the last checkpoint's with `resume`.

    A fresh run evaluates its starting policy (step 0) first; a resumed one keeps the evaluations
    its checkpoint covers. Only the writing rank (rank 0, `evaluate.write`) touches the run's files."""
    state, writer = LoopState(kl_coef=algo.kl_coef), evaluate.write
    ckpt = os.path.join(out_dir, "checkpoints")
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    # The newest checkpoint that is intact (checked first; a damaged newer one is a warning line).
    parts = ("policy", "critic") if m.critic_engine is not None else ("policy",)
    tag = checkpoints.resume_tag(ckpt, parts, warn=bool(writer)) if cfg.resume else None
    if tag is not None:
        # Our counters live under one key: DeepSpeed keeps its own (e.g. 'skipped_steps') beside them.
        saved = _load(m.engine, os.path.join(ckpt, "policy"), tag)["polgrad"]
        if m.critic_engine is not None:
            _load(m.critic_engine, os.path.join(ckpt, "critic"), tag)
        state = LoopState(**{f.name: saved[f.name] for f in dataclasses.fields(LoopState) if f.name in saved})
        state = _config_changes(cfg, algo, m, out_dir, state, writer)
        if writer:
            _truncate_metrics(metrics_path, state.step)
        evaluate.keep_until(state.step)
        if m.vllm is not None:
            m.vllm.sync_weights(m.engine.module)
    elif writer:
        Path(metrics_path).unlink(missing_ok=True)  # a fresh run never appends to an older run's metrics
    export.save_run_model_files(m, out_dir, algo.name, algo.source)  # what polgrad.export needs
    if state.step == 0:
        if writer:
            with open(os.path.join(out_dir, "config.gin"), "w") as f:
                f.write(gin.config_str())
        evaluate.start()
        with hooks.phase("eval"):
            evaluate(m.engine.module, m.tokenizer, 0)
    stopping.arm()  # the loop starts: ^C / SIGTERM now end the step and checkpoint it (stopping.py)
    return state


def _config_changes(
    cfg: config.TrainConfig, algo: Algorithm, m: Models, out_dir: str, state: LoopState, writer: bool
) -> LoopState:
    """A resume whose bindings differ from the run's config.gin (a grown train.steps, or what
    --allow-config-change let through; polgrad/resume_config.py): what the checkpoint would restore
    takes the new values (the KL coefficient, the optimizer's lr and eps), so the new bindings act
    from this step on, and the folder records it (resume_overrides.jsonl, config.gin rewritten)."""
    old = resume_config.saved_config(out_dir)
    changes = {} if old is None else resume_config.diff(old, gin.config_str())
    collective.all_max(torch.zeros(()))  # every rank has read config.gin before rank 0 rewrites it
    trained = resume_config.training_changes(changes)
    if "Algorithm.kl_coef" in trained:
        state = dataclasses.replace(state, kl_coef=algo.kl_coef)
    if trained.keys() & {"train.lr", "train.critic_lr", "train.adam_eps"}:
        _set_optimizer(m.engine, cfg.lr, cfg.critic_lr, cfg.adam_eps)
        if m.critic_engine is not None:
            _set_optimizer(m.critic_engine, cfg.critic_lr, cfg.critic_lr, cfg.adam_eps)
    if changes and writer:
        resume_config.record(out_dir, state.step, changes)
        atomic_write_text(os.path.join(out_dir, resume_config.CONFIG_FILE), gin.config_str())
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
    ckpt, tag = os.path.join(out_dir, "checkpoints"), f"step{state.step}"
    if m.producer is not None:  # async rollouts: the older weights the next steps sample with, first
        m.producer.save(os.path.join(ckpt, "sampler"), state.step)
    for part, engine in (("policy", m.engine), ("critic", m.critic_engine)):
        if engine is None:
            continue
        try:
            dist_lib.save_checkpoint(engine, os.path.join(ckpt, part), tag, client_state)
        except (OSError, RuntimeError) as e:
            where = os.path.join(ckpt, part, tag)
            shutil.rmtree(where, ignore_errors=True)
            raise _checkpoint_write_error(e, where) from e


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


def summarize(out_dir: str, wall_time_s: float, unstable_skip_frac: float = 1.0) -> dict[str, Any]:
    """The run's summary: means over the last steps, the last and the starting eval accuracy.

    `status` is 'unstable' when more than `unstable_skip_frac` of the run's optimizer steps were
    skipped for a non-finite loss or gradient (`skipped_frac`; `unstable` says so in words), else 'ok'.
    `wall_time_s` is the RL run's (the trainer leaves the warm start out: its `warm_start_s`);
    `reward_errors` counts the faulty rewards of every step (train.reward_errors)."""
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics_path)] if os.path.exists(metrics_path) else []
    init = [e["accuracy"] for e in read_evals(out_dir) if e["step"] == 0]
    last = rows[-SUMMARY_LAST_K:]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in last if key in r]
        return float(sum(vals) / len(vals)) if vals else None

    evals = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    skipped = rows[-1].get("skipped_steps", 0) if rows else 0
    updates = sum(r.get("optimizer_steps", 1) for r in rows)  # rows of older runs: one per step
    stability = _stability(skipped, updates, unstable_skip_frac)
    return {
        **stability,
        "steps": len(rows),
        "final_train_reward": mean("reward_mean"),
        "eval_accuracy": evals[-1] if evals else None,
        "eval_accuracy_init": init[0] if init else None,
        "kl": mean("kl"),
        "kl_exact": mean("kl_exact"),
        "entropy": mean("entropy"),
        "tokens_per_s": mean("tokens_per_s"),
        "wall_time_s": wall_time_s,
        "peak_mem_mb": max((r.get("peak_mem_mb", 0.0) for r in rows), default=None),
        "skipped_steps": skipped,
        "reward_errors": sum(int(r.get("reward_errors", 0)) for r in rows),
    }


def _stability(skipped: int, updates: int, threshold: float) -> dict[str, Any]:
    """status 'ok' or 'unstable' (skipped / optimizer steps above `threshold`), and the numbers."""
    frac = skipped / updates if updates else 0.0
    out: dict[str, Any] = {"status": "unstable" if frac > threshold else "ok", "skipped_frac": frac}
    if frac > threshold:
        out["unstable"] = (
            f"unstable: {skipped} of {updates} optimizer steps skipped for a non-finite loss or gradient "
            f"({frac:.0%} > train.unstable_skip_frac = {threshold:g}); try a lower train.lr"
        )
    return out


def _truncate_metrics(path: str, steps: int) -> None:
    """Keep the first `steps` rows (those the checkpoint covers); a resumed run rewrites the rest."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [line for line in f if line.strip()][:steps]
    atomic_write_text(path, "".join(rows))


def _progress(it, *, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, unit="step", dynamic_ncols=True)
