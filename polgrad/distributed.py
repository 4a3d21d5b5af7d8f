"""The thin layer through which polgrad trains with a DeepSpeed engine: CPU here, GPU unchanged.

The training loop uses it like this (one optimizer step = `grad_accum` micro-batches per rank)::

    info = distributed.setup(seed=cfg.seed)          # once, before building models
    engine = distributed.make_engine(policy, lr=1e-5, zero_stage=2, micro_batch_size=4,
                                     grad_accum=8, bf16=False, grad_clip=1.0)
    for micro_batch in micro_batches:                # exactly grad_accum of them, on every rank
        loss = aggregate(...)                        # global denominators: see below
        distributed.backward(engine, loss)           # never engine.backward / loss.backward
        applied = distributed.step(engine)           # None between boundaries; True/False at one

Loss scaling, exactly. polgrad's aggregators divide by the counts of the whole optimizer step
(tokens, sequences, max length over all micro-batches of all data-parallel ranks), so the step loss
is the plain sum L = sum_r sum_m L[r, m] of the micro-batch losses that the ranks compute, and the
gradient the optimizer must see is dL/dθ. DeepSpeed 0.19 by default divides twice:

1. `engine.backward(loss)` divides the loss by `gradient_accumulation_steps` (`scale_wrt_gas=True`).
   `backward` here passes `scale_wrt_gas=False`: micro-batch gradients are summed, not averaged.
2. The data-parallel reduction (allreduce at stage 0, reduce-scatter at ZeRO 1-3) averages over the
   data-parallel ranks (`gradient_allreduce_op: "mean"`; "sum" is rejected under ZeRO-3 in 0.19).
   `backward` multiplies the loss by the data-parallel world size W, so the mean over ranks of
   W * g_r is sum_r g_r. For W a power of two the multiplication and DeepSpeed's division are exact.

So at the optimizer step every rank's gradient is dL/dθ up to float summation order, and gradient
clipping (`gradient_clipping`) clips the norm of that true gradient. tests/loop/test_distributed.py
checks both against a plain-PyTorch AdamW step on the summed loss (world size 1 at stages 0-3,
world size 2 under torchrun at stages 0, 2 and 3).
Do not call `loss.backward()` on a loss computed from engine outputs: DeepSpeed 0.19 hooks the
module outputs and would divide by `gradient_accumulation_steps` there.

Micro-batch count. By default DeepSpeed applies the optimizer step on every `grad_accum`-th call
of `engine.step()`, counting calls, not samples: call `backward` + `step` exactly `grad_accum`
times per optimizer step. When the count varies from step to step (filtered groups, ragged last
minibatch), pass `boundary=` to `backward` (True on the step's last micro-batch, False before) and
call `step` once after the last one (calling it after every micro-batch is also fine); the
`grad_accum` of the config then only feeds DeepSpeed's sample counter, and nothing is rescaled by it
either way. Every rank must run the same number of micro-batches per step, forward included under
ZeRO-3 (it all-gathers parameters); polgrad's loop ensures it by giving every rank the same
number of sequences (with filters, the fewest kept groups of any rank). Another loop could run a
padded micro-batch whose mask is all zero (loss 0, gradient 0) on a rank with fewer sequences.
Micro-batch sizes may differ.

Non-finite losses. A non-finite micro-batch loss poisons the whole optimizer step: it is skipped on
every rank, parameters and optimizer state unchanged. Skipping just that micro-batch's backward or
step is not safe under DeepSpeed: the `engine.step()` counter would shift the accumulation boundary,
ZeRO reduces gradients inside backward (a rank that skips it leaves its peers waiting in a
collective), and the finite micro-batches' partial gradients would still be applied with the wrong
denominators. Instead `backward` backpropagates `loss * nan`, which makes the step's gradient
non-finite on every rank after the reduction; DeepSpeed's own overflow check then discards the
gradients and skips the step (ZeRO 1-3; the bf16 wrappers with `check_grad_overflow`, which
`ds_config` sets), and at stage 0 in fp32, where DeepSpeed calls the torch optimizer with no check,
`make_engine` passes an AdamW that does the same check (`_AdamWSkippingNonFinite`). `backward`
returns False for such a micro-batch and `step` returns False for the skipped step (and
`engine.skipped_steps` counts it): the loop logs both and otherwise goes on as usual, calling
`backward` and `step` for the remaining micro-batches of the step.

Mixed precision (`bf16=True`, `train.bf16`). DeepSpeed's `bf16` config as GPU users run it:
`deepspeed.initialize` casts the module to bf16, so every forward and backward matmul runs in bf16
(AMX/AVX-512-BF16 on CPUs that have it), and the optimizer keeps fp32 master weights and fp32
AdamW state, copying the updated masters back into the bf16 module after each step. Which wrapper
does it depends on the stage (DeepSpeed 0.19, measured on CPU): stage 0 `FP16_UnfusedOptimizer`
with bf16 as its low-precision type (fp32 copies of every parameter, static loss scale 1), stages
1-2 `DeepSpeedZeroOptimizer` and stage 3 `DeepSpeedZeroOptimizer_Stage3` (fp32 partitions).
Gradients are bf16 in the module and accumulate over micro-batches in bf16 (DeepSpeed's default
`grad_accum_dtype`); they are cast to fp32 before clipping and the AdamW step. polgrad casts
logits to fp32 before every log-softmax and computes ratios, KL and losses in float64
(polgrad/rollout/hf.py, polgrad/trainer.py); tests/models/test_bf16.py checks the dtypes, the loss
against fp32 and that a bf16 run learns.

The shared-memory comm op. `deepspeed.init_distributed` JIT-compiles `deepspeed_shm_comm` on CPU (a
fast path used only by inference all-reduce, never by training): measured here 35 s cold on 2 idle
cores (~55 s loaded), 0.13 s from the torch-extensions cache, 0.01 s skipped. `setup` skips it by
marking the op incompatible in DeepSpeed's own compatibility table (`deepspeed.ops.__compatible_ops__`,
which `build_shm_op` consults) while `deepspeed.init_distributed` runs, and restoring the entry after
it, so nothing is compiled, nothing is cached outside the repo and nothing of DeepSpeed stays patched.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from polgrad import collective
from polgrad.checks import is_int, is_real
from polgrad.errors import ConfigError
from polgrad.machine import peak_rss_mib

if TYPE_CHECKING:  # deepspeed is imported lazily: DS_ACCELERATOR must be set before its import
    from deepspeed import DeepSpeedEngine

__all__ = [
    "DistInfo", "session", "backward", "ds_config", "import_deepspeed", "make_engine", "peak_memory_mb",
    "setup", "step",
]  # fmt: skip

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE")
_SHM_OP = "deepspeed_shm_comm"  # DeepSpeed's shared-memory comm op (module docstring)
_MISSING = object()  # set by torchrun and the deepspeed launcher


def import_deepspeed() -> Any:
    """deepspeed, imported with mlflow hidden unless something imported it already: the optional
    `import mlflow` of deepspeed.autotuning (an autotuner polgrad never runs) was 3.7 of deepspeed's
    4.7 s of import in every rank; a None entry in sys.modules makes that import fail, then goes."""
    if "deepspeed" not in sys.modules:
        sys.modules.setdefault("mlflow", None)  # type: ignore[arg-type]  (an imported mlflow stays)
        try:
            import deepspeed  # noqa: F401
        finally:
            if sys.modules.get("mlflow", _MISSING) is None:
                del sys.modules["mlflow"]
    return sys.modules["deepspeed"]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on its node, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that writes logs and results."""
        return self.rank == 0


def setup(seed: int | None = None) -> DistInfo:
    """Initialise the process group once (idempotent) and return this process's `DistInfo`.

    Under a launcher (torchrun, `deepspeed`) RANK/WORLD_SIZE/MASTER_* come from the environment.
    Without one this is a single process: the group is built on an in-process store, so no port is
    picked (no race with other jobs) and no RANK/MASTER_PORT leaks into child processes, which
    would otherwise take them for a launcher's; only LOCAL_RANK=0 is set, which DeepSpeed requires.
    DS_ACCELERATOR defaults to "cpu" when CUDA is unavailable (a user's setting is kept). The
    backend is gloo on CPU, nccl on GPU. `seed`, when given, seeds python, numpy and torch with the
    same value on every rank, so that models built afterwards start identical on all ranks; seed
    per-rank sampling yourself (e.g. `seed + info.rank`).
    """
    global _ended_together
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", "0")
    local_rank = int(os.environ["LOCAL_RANK"])
    launched = all(name in os.environ for name in _LAUNCHER_ENV)
    if cuda:
        torch.cuda.set_device(local_rank)

    import torch.distributed as tdist

    if not tdist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if launched:
            tdist.init_process_group(backend)  # env:// from the launcher
            # Destroyed before the interpreter tears down, for a process that did not end through
            # `finish` and `leave` (an error, a stop). This frees the group only where nothing else
            # holds it: DeepSpeed's engine keeps its groups to the end, and their gloo threads can
            # still abort the process at finalization (SIGABRT; pytorch/pytorch#190489); `leave`
            # skips finalization for a run that ended well.
            atexit.register(_destroy_group)
            _ended_together = False  # a new group: `leave` exits normally until `finish` ends it
        else:
            tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1)

    import_deepspeed()
    import deepspeed.comm  # binds `deepspeed` too, found imported
    from deepspeed.accelerator import get_accelerator

    if not deepspeed.comm.is_initialized():
        # Skip the shm comm op's JIT build (see the module docstring): training never uses it. The
        # entry is DeepSpeed's own table, so it is marked only while init_distributed builds its ops.
        cpu = get_accelerator().device_name() == "cpu"
        table = deepspeed.ops.__compatible_ops__ if cpu else {}
        before = table.get(_SHM_OP, _MISSING)
        if cpu:
            table[_SHM_OP] = False
        try:
            # torch.distributed is up, so DeepSpeed only wraps it: no MPI discovery, no second group.
            deepspeed.init_distributed(dist_backend=tdist.get_backend(), verbose=False)
        finally:
            if before is _MISSING:
                table.pop(_SHM_OP, None)
            else:
                table[_SHM_OP] = before

    if seed is not None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # also seeds every CUDA device
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistInfo(tdist.get_rank(), tdist.get_world_size(), local_rank, device)


def _destroy_group() -> None:
    """At exit: destroy the launcher's process group if it is still up (idempotent)."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def finish() -> None:
    """End a launched run together: every rank waits at a barrier until all are done (rank 0 writes
    the final model and summary after the others' last collective), then the group is destroyed.
    A rank that left the others working and tore its gloo group down at exit could abort ("terminate
    called without an active exception", SIGABRT) after a finished run, and its launcher then SIGTERMs
    the rank still writing: a run whose files were all written failed its sweep cell. No-op without a
    group of more than one rank. The wait is the group's own timeout (torch's default: 30 min for
    gloo, 10 min for NCCL): rank 0's last writes must end within it. A rank that failed never gets
    here; its launcher stops the others (with gloo, a peer's exit also ends the barrier with an error)."""
    import torch.distributed as tdist

    global _ended_together
    if tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1:
        if tdist.get_backend() == "nccl":
            tdist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            tdist.barrier()
        tdist.destroy_process_group()
        _ended_together = True


_ended_together = False  # `finish` ended a group of more than one rank in this process


def leave(code: int) -> NoReturn:
    """Exit a trainer process with `code` (its `__main__`). A rank whose group `finish` ended leaves
    without interpreter finalization (`os._exit`; logging, Python's and C's stdio flushed first): its
    run is over and written, and finalization is where it could still abort. `destroy_process_group`
    does not free gloo's groups while DeepSpeed holds them (the engine, ZeRO-3's parameters and
    deepspeed.utils.groups keep references to the end: after `finish` a 2-rank ZeRO-3 run still
    has its 4 pt_gloo_runloop and 2 gloo_tcp_loop threads at exit), and a gloo worker thread that
    releases a collective's tensors needs the GIL; taken while the interpreter tears down, the
    thread is ended with a forced unwind through C++ code that may not throw, and the process aborts
    ("terminate called without an active exception", SIGABRT; pytorch/pytorch#190489): its launcher
    (torchrun, deepspeed) then SIGTERMs the other ranks, or under Ray the rank's exit code fails the
    attempt, and a finished run fails its sweep cell.

    Contract: after `finish`, no atexit handler and no weakref finalizer runs, so whatever a run
    writes is closed before it (polgrad.train: the trackers end in `Trackers.finish`, which
    unregisters their atexit abort; the sampler closes vLLM and its adapter folder; files are
    written in `with` blocks; the run lock is released before `leave`). Every other process (one
    rank, an error, a stop) exits normally, with its atexit handlers."""
    if not _ended_together:
        raise SystemExit(code)
    import ctypes
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    try:
        ctypes.CDLL(None).fflush(None)  # C's stdio buffers (what C++ code printed), as exit() would
    except (OSError, AttributeError):  # no C library to ask (not Linux/macOS)
        pass
    os._exit(code)


@contextlib.contextmanager
def session(seed: int | None = None) -> Iterator[DistInfo]:
    """`setup(seed)` for the duration of a run, leaving the process's environment as it found it: the
    variables setup writes (LOCAL_RANK, DS_ACCELERATOR) are restored on exit. The process group stays
    up (setup is idempotent; a second run in the same process joins it) until `finish`, which
    polgrad.train's main calls at the end of a launched run."""
    env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "DS_ACCELERATOR")}
    try:
        yield setup(seed=seed)
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ds_config(
    *,
    zero_stage: int,
    micro_batch_size: int,
    grad_accum: int,
    bf16: bool,
    grad_clip: float | None,
    world_size: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The DeepSpeed JSON config for one data-parallel training job.

    train_batch_size = micro_batch_size * grad_accum * world_size (world_size defaults to the
    process group's, else $WORLD_SIZE, else 1). There is no "optimizer" key: `make_engine` passes a
    torch AdamW, because a config optimizer makes DeepSpeed JIT-compile FusedAdam (~70 s on CPU).
    bf16=False trains in fp32. `grad_clip` is the max global L2 norm of the gradient (None: off).
    `extra` is deep-merged last, for settings this function does not name (e.g. ZeRO offload,
    `stage3_param_persistence_threshold`).
    """
    where = "distributed.ds_config"
    if not is_int(zero_stage) or not 0 <= zero_stage <= 3:
        raise ConfigError(f"{where}: zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not is_int(micro_batch_size) or micro_batch_size < 1:
        raise ConfigError(f"{where}: micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
    if not is_int(grad_accum) or grad_accum < 1:
        raise ConfigError(f"{where}: grad_accum must be an integer >= 1, got {grad_accum!r}")
    if not isinstance(bf16, bool):
        raise ConfigError(f"{where}: bf16 must be True or False, got {bf16!r}")
    if grad_clip is not None and (not is_real(grad_clip) or not math.isfinite(grad_clip) or grad_clip <= 0):
        raise ConfigError(f"{where}: grad_clip must be a finite number > 0 or None (off), got {grad_clip!r}")
    world = collective.world_size() if world_size is None else world_size
    if not is_int(world) or world < 1:
        raise ConfigError(f"{where}: world_size must be an integer >= 1, got {world!r}")
    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * grad_accum * world,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
        "zero_optimization": {"stage": zero_stage},
        "gradient_clipping": float(grad_clip) if grad_clip is not None else 0.0,
        # check_grad_overflow: skip a step whose gradient norm is not finite (see module docstring).
        "bf16": {"enabled": True, "check_grad_overflow": True} if bf16 else {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 2**62,  # polgrad logs its own metrics
        "wall_clock_breakdown": False,
    }
    if extra is not None:
        _deep_merge(config, extra)
    return config


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def make_engine(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    lr_groups: Sequence[tuple[Sequence[torch.nn.Parameter], float]] = (),
    **ds_kwargs: Any,
) -> DeepSpeedEngine:
    """Wrap `model` in a DeepSpeed engine with a `torch.optim.AdamW` over its trainable parameters.

    `ds_kwargs` are `ds_config`'s keywords (zero_stage, micro_batch_size, grad_accum, bf16,
    grad_clip, and optionally world_size, extra). Calls `setup()` if it has not run. Train with
    `backward(engine, loss)` and `step(engine)` for every micro-batch (module docstring); the engine's
    forward is `engine(...)`, its module `engine.module`. Under ZeRO-3 each rank holds a partition
    of each parameter (`p.ds_tensor`); gather with `deepspeed.zero.GatheredParameters` to read them.
    `lr_groups` gives some trainable parameters their own learning rate, as (parameters, lr) pairs
    (an AdamW parameter group each; e.g. a LoRA critic's head in the policy's engine at the critic's
    lr); the others train at `lr`, in the first group.
    """
    where = "distributed.make_engine"
    if not is_real(lr) or not lr > 0 or not math.isfinite(lr):
        raise ConfigError(f"{where}: lr must be a finite number > 0, got {lr!r}")
    if not is_real(weight_decay) or not weight_decay >= 0:
        raise ConfigError(f"{where}: weight_decay must be a number >= 0, got {weight_decay!r}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"{where}: betas must be two numbers in [0, 1), got {betas!r}")
    if not is_real(eps) or not eps > 0:
        raise ConfigError(f"{where}: eps must be a number > 0, got {eps!r}")
    setup()
    config = ds_config(**ds_kwargs)
    deepspeed = import_deepspeed()

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError(f"{where}: the model has no trainable parameters")
    # ZeRO accepts only its listed optimizer types (a subclass is "untested"); at stage 0 DeepSpeed
    # calls the optimizer as is, so the overflow check comes with it (see _AdamWSkippingNonFinite).
    adamw = _AdamWSkippingNonFinite if config["zero_optimization"]["stage"] == 0 else torch.optim.AdamW
    # The fused AdamW kernel (CPU and CUDA, fp32/bf16/fp16) is one pass over each tensor instead of
    # ~10 elementwise ops per parameter: 0.5 vs 2.3 ms per step on the tiny model (results/bench).
    fused = all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    groups: list[Any] = params
    if lr_groups:
        own = {id(p) for ps, _ in lr_groups for p in ps}
        groups = [{"params": [p for p in params if id(p) not in own]}]
        groups += [
            {"params": [p for p in ps if p.requires_grad], "lr": float(g_lr)} for ps, g_lr in lr_groups
        ]
    optimizer = adamw(groups, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, fused=fused)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config, dist_init_required=False
    )
    if config["zero_optimization"]["stage"] == 0 and engine.dp_world_size == 1:
        # DeepSpeed's stage-0 gradient "allreduce" flattens every gradient into buckets of up to 5e8
        # elements (a second copy of all of them: 1.9 GB fp32 at Qwen2.5-0.5B), reduces over the one
        # rank, scales by 1/1 and copies back: the same numbers, and a transient copy at the
        # backward's peak memory (issue 41's profile). Nothing to reduce at one rank: off; `step`
        # keeps the one other thing it did (a zero gradient for a parameter that got none).
        engine.enable_backward_allreduce = False
    return engine


def backward(engine: DeepSpeedEngine, loss: torch.Tensor, *, boundary: bool | None = None) -> bool:
    """Backpropagate one micro-batch's share of the step loss; False if `loss` was not finite.

    `loss` is this rank's micro-batch term of the step loss (global denominators), a scalar. Its
    gradient is added as is: DeepSpeed's 1/grad_accum is switched off and its 1/world_size average
    is compensated (module docstring). A non-finite loss is backpropagated as `loss * nan`, which
    makes the whole optimizer step skip on every rank; the caller counts the False. `boundary`
    (True on the last micro-batch of the step) lets the number of micro-batches vary per step;
    leave it None to let DeepSpeed count `grad_accum` micro-batches.
    """
    if loss.dim() != 0:
        raise ValueError(f"backward: loss must be a scalar, got shape {tuple(loss.shape)}")
    if boundary is not None:
        engine.set_gradient_accumulation_boundary(bool(boundary))
    finite = bool(torch.isfinite(loss.detach()).item())
    scaled = loss * float(engine.dp_world_size)
    if not finite:
        scaled = scaled * float("nan")
    engine.backward(scaled, scale_wrt_gas=False)
    return finite


def step(engine: DeepSpeedEngine) -> bool | None:
    """`engine.step()` for every micro-batch; None between boundaries, else whether the step applied.

    At the accumulation boundary the optimizer step is applied unless the reduced gradient is not
    finite (a non-finite loss reached `backward`, or the gradient overflowed); then the gradients
    are discarded, parameters and optimizer state stay as they were, `engine.skipped_steps` grows
    by one, and this returns False.
    """
    boundary = engine.is_gradient_accumulation_boundary()
    if boundary and not engine.enable_backward_allreduce:
        # DeepSpeed's reduction (off at one rank, make_engine) also gave every trainable parameter
        # without a gradient a zero one, which AdamW then steps (its moments decay, weight decay
        # acts, its step count grows); kept, so that one rank trains as before, bit for bit
        for p in engine.module.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    engine.step()
    return engine.was_step_applied() if boundary else None


class _AdamWSkippingNonFinite(torch.optim.AdamW):
    """AdamW that skips a step whose gradient is not finite and says so in `overflow`.

    DeepSpeed's ZeRO and bf16/fp16 wrappers check the gradient norm and skip such a step; at
    stage 0 in fp32 it calls the client optimizer directly, with no check. With this attribute the
    engine treats a skip here as its own overflow (`skipped_steps`, `was_step_applied`). The
    gradients are already all-reduced when it runs, so every rank decides the same.
    """

    overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        # One multi-tensor norm per step: a NaN/inf anywhere makes its tensor's norm NaN/inf.
        self.overflow = bool(grads) and not bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())
        if self.overflow:
            return None
        return super().step(closure)


def peak_memory_mb() -> float:
    """Peak memory of this process in MiB: CUDA allocator peak on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mib()
