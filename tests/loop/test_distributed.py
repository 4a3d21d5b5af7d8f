"""polgrad.distributed: the DeepSpeed engine gives the gradient and the step of plain PyTorch.

The reference everywhere is `torch.optim.AdamW` on the *sum* of the micro-batch losses (polgrad's
aggregators use the whole step's global denominators, so that sum is the step loss), then
`clip_grad_norm_`. Micro-batches are the same row slices on both sides, so every forward is the
same computation and the float differences come only from the order in which gradients are
summed (micro-batches, ranks, ZeRO's flat buffers) and from how the clip norm is computed.
Tolerances, all fp32:
- gradient of the first step (same parameters on both sides): max|g - g_ref| <= 1e-6 * max|g_ref|
  over the whole model. A wrong loss scale (DeepSpeed's 1/grad_accum, or 1/world_size) is off by
  a factor 2 and fails by six orders of magnitude.
- step losses: rtol 1e-6 (later steps see parameters that differ in the last bits).
- parameters after 3 steps of lr 1e-2: atol 2e-6, i.e. 2e-4 of one step. Adam's eps is 1e-4 here
  (dist_worker.EPS): with 1e-8, coordinates whose true gradient is 0 (the key biases) turn
  summation noise into updates of up to lr and the comparison would say nothing; Adam being
  nearly scale-invariant, the gradient check, not this one, is the one that guards the scale.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from polgrad import checkpoints, distributed
from polgrad.errors import ConfigError, DataError, PolgradError

HERE = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("polgrad_test_dist_worker", HERE / "dist_worker.py")
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


GRAD_REL, LOSS_REL, PARAM_ATOL = 1e-6, 1e-6, 2e-6  # see the module docstring


def _assert_grads_close(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    """max over the model of |g - g_ref| <= GRAD_REL * max over the model of |g_ref|."""
    scale = max(g.abs().max().item() for g in ref.values())
    err = {n: (grads[n].reshape(ref[n].shape) - ref[n]).abs().max().item() for n in ref}
    worst = max(err, key=err.get)
    assert err[worst] <= GRAD_REL * scale, f"{worst}: gradient error {err[worst]:.3g}, scale {scale:.3g}"


def _assert_params_close(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    err = {n: (params[n].reshape(ref[n].shape) - ref[n]).abs().max().item() for n in ref}
    worst = max(err, key=err.get)
    assert err[worst] <= PARAM_ATOL, f"{worst}: parameter error {err[worst]:.3g}"


def _reference_step(model, opt, loss: torch.Tensor, grad_clip: float | None) -> dict[str, torch.Tensor]:
    opt.zero_grad()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()
    return grads


def _reference_run(rows: list[slice]):
    """Plain PyTorch on the tiny Qwen2 problem: step losses, first-step gradient, final params."""
    ref = worker.build_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=worker.LR, eps=worker.EPS, weight_decay=worker.WEIGHT_DECAY)
    batch = worker.global_batch()
    n_tokens = float(batch["mask"].sum())
    losses, first_grads = [], None
    for _ in range(worker.STEPS):
        loss = sum(worker.micro_loss(ref, batch, r, n_tokens) for r in rows)
        losses.append(loss.item())
        grads = _reference_step(ref, opt, loss, worker.GRAD_CLIP)
        first_grads = first_grads or grads
    return losses, first_grads, {n: p.detach() for n, p in ref.named_parameters()}


def _full_params(engine) -> dict[str, torch.Tensor]:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):  # no-op below ZeRO-3
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _mlp(seed: int, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 1)
    ).to(torch.float32)


# --- setup and config ---------------------------------------------------------------------------


def test_setup_is_idempotent_and_skips_the_shm_op():
    first = distributed.setup(seed=3)
    a = torch.rand(3)
    second = distributed.setup(seed=3)
    assert first == second
    assert torch.equal(a, torch.rand(3))  # seeded again
    assert (first.rank, first.world_size, first.local_rank) == (0, 1, 0)
    assert first.device == torch.device("cpu") and first.is_main
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    from deepspeed.comm import comm

    assert comm.is_initialized()
    assert comm.cdb.shm_comm_op is None  # not JIT-compiled
    # no launcher variables are invented: a child process must not mistake them for a launcher's
    assert "MASTER_PORT" not in os.environ or "RANK" in os.environ


def test_ds_config_contents():
    cfg = distributed.ds_config(
        zero_stage=2, micro_batch_size=4, grad_accum=3, bf16=True, grad_clip=1.0, world_size=2
    )
    assert cfg["train_batch_size"] == 24
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["gradient_accumulation_steps"] == 3
    assert cfg["zero_optimization"] == {"stage": 2}
    assert cfg["gradient_clipping"] == 1.0
    assert cfg["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert "optimizer" not in cfg and cfg["wall_clock_breakdown"] is False
    assert cfg["steps_per_print"] >= 2**31
    fp32 = distributed.ds_config(
        zero_stage=0,
        micro_batch_size=1,
        grad_accum=1,
        bf16=False,
        grad_clip=None,
        extra={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )
    assert fp32["bf16"] == {"enabled": False} and fp32["gradient_clipping"] == 0.0
    assert fp32["zero_optimization"] == {"stage": 0, "stage3_param_persistence_threshold": 0}
    assert fp32["train_batch_size"] == 1  # world size of this process


_GOOD = dict(zero_stage=0, micro_batch_size=1, grad_accum=1, bf16=False, grad_clip=None)


@pytest.mark.parametrize(
    ("override", "name"),
    [
        ({"zero_stage": 4}, "zero_stage"),
        ({"zero_stage": -1}, "zero_stage"),
        ({"zero_stage": True}, "zero_stage"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"micro_batch_size": 2.0}, "micro_batch_size"),
        ({"grad_accum": 0}, "grad_accum"),
        ({"bf16": 1}, "bf16"),
        ({"grad_clip": 0.0}, "grad_clip"),
        ({"grad_clip": -1.0}, "grad_clip"),
        ({"grad_clip": math.inf}, "grad_clip"),
        ({"world_size": 0}, "world_size"),
    ],
)
def test_ds_config_rejects(override, name):
    with pytest.raises(ConfigError, match=rf"^distributed\.ds_config: {name} must") as err:
        distributed.ds_config(**{**_GOOD, **override})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"lr": 0.0}, "lr"),
        ({"lr": 1e-3, "weight_decay": -0.1}, "weight_decay"),
        ({"lr": 1e-3, "betas": (0.9, 1.0)}, "betas"),
    ],
)
def test_make_engine_rejects(kwargs, name):
    with pytest.raises(ConfigError, match=rf"^distributed\.make_engine: {name} must"):
        distributed.make_engine(_mlp(0), **kwargs, **_GOOD)


def test_peak_memory_mb():
    assert 10 < distributed.peak_memory_mb() < 24 * 1024


# --- world size 1: gradient and step equal plain PyTorch ----------------------------------------


@pytest.mark.cpu_matrix
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_world_size_1_matches_plain_adamw(stage):
    from deepspeed.utils import safe_get_full_grad

    distributed.setup()
    grad_accum = 2
    engine = distributed.make_engine(
        worker.build_model(),
        lr=worker.LR,
        weight_decay=worker.WEIGHT_DECAY,
        eps=worker.EPS,
        zero_stage=stage,
        micro_batch_size=worker.N_SEQ // grad_accum,
        grad_accum=grad_accum,
        bf16=False,
        grad_clip=worker.GRAD_CLIP,
    )
    batch = worker.global_batch()
    n_tokens = float(batch["mask"].sum())
    rows = worker.shares(0, 1, grad_accum)
    named = list(engine.module.named_parameters())
    losses, first_grads = [], None
    for _ in range(worker.STEPS):
        step_loss = 0.0
        for i, r in enumerate(rows):
            loss = worker.micro_loss(engine, batch, r, n_tokens)
            step_loss += loss.item()
            assert distributed.backward(engine, loss)
            if first_grads is None and i == grad_accum - 1:
                assert engine.is_gradient_accumulation_boundary()
                first_grads = {n: safe_get_full_grad(p).detach().clone() for n, p in named}
            assert distributed.step(engine) is (True if i == grad_accum - 1 else None)
        losses.append(step_loss)
    ref_losses, ref_grads, ref_params = _reference_run(rows)
    assert losses == pytest.approx(ref_losses, rel=LOSS_REL)
    _assert_grads_close(first_grads, ref_grads)
    _assert_params_close(_full_params(engine), ref_params)


@pytest.mark.parametrize("bf16", [False, True])
def test_one_rank_at_stage_0_skips_deepspeeds_flat_copy_of_the_gradients(bf16):
    """At one rank DeepSpeed's stage-0 "allreduce" flattened every gradient into one buffer (a second
    copy of all of them, at the backward's peak memory: issue 41's profile), reduced it over that one
    rank and copied it back. polgrad switches it off there: the engine never calls it, and two steps
    give the parameters of an engine that still does, bit for bit (the reduction over one rank and
    the 1/1 average change no bit; bf16 gradients make a round trip through fp32, also exact)."""
    distributed.setup()

    def engine(allreduce: bool):
        torch.manual_seed(0)
        model = worker.build_model()
        # a trainable parameter the loss never reaches: DeepSpeed's reduction gave it a zero gradient,
        # so AdamW's weight decay moved it; without that its value would stay
        model.unused = torch.nn.Parameter(torch.ones(3))
        e = distributed.make_engine(
            model,
            lr=worker.LR,
            weight_decay=worker.WEIGHT_DECAY,
            eps=worker.EPS,
            zero_stage=0,
            micro_batch_size=worker.N_SEQ,
            grad_accum=1,
            bf16=bf16,
            grad_clip=worker.GRAD_CLIP,
        )
        if allreduce:
            e.enable_backward_allreduce = True  # DeepSpeed's own behaviour
        calls = []
        real = e.allreduce_gradients
        e.allreduce_gradients = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
        return e, calls

    (ours, ours_calls), (theirs, their_calls) = engine(False), engine(True)
    assert not ours.enable_backward_allreduce
    batch = worker.global_batch()
    n_tokens = float(batch["mask"].sum())
    for e in (ours, theirs):
        for _ in range(2):
            assert distributed.backward(e, worker.micro_loss(e, batch, slice(0, worker.N_SEQ), n_tokens))
            assert distributed.step(e) is True
    assert ours_calls == [] and len(their_calls) == 2
    if not bf16:  # decayed by 2 x lr x 0.01 = 2e-4: stepped with a zero gradient (bf16 rounds it back to 1)
        assert not torch.equal(theirs.module.unused, torch.ones(3))
    before = dict(worker.build_model().named_parameters())
    before["unused"] = torch.nn.Parameter(torch.ones(3))
    moved = 0
    for (name, p), (_, q) in zip(
        ours.module.named_parameters(), theirs.module.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
        moved += not torch.equal(p.float(), before[name].to(p.dtype).float())
    assert moved > 0


@pytest.mark.cpu_matrix
@pytest.mark.parametrize(("stage", "step_every_micro_batch"), [(0, False), (1, True), (2, False), (3, True)])
def test_variable_micro_batch_count_with_boundary(stage, step_every_micro_batch):
    """backward(boundary=...) lets each optimizer step have its own number of micro-batches."""
    from deepspeed.utils import safe_get_full_grad

    distributed.setup()
    engine = distributed.make_engine(
        _mlp(0),
        lr=1e-2,
        eps=1e-4,
        zero_stage=stage,
        micro_batch_size=2,
        grad_accum=1,
        bf16=False,
        grad_clip=1.0,
    )
    ref = _mlp(0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(7)
    for n_micro in (3, 1, 2):
        micro = [torch.randn(2, 8, generator=g, dtype=torch.float32) for _ in range(n_micro)]
        results = []
        for i, x in enumerate(micro):
            last = i == n_micro - 1
            assert distributed.backward(engine, engine(x).pow(2).sum() / (2.0 * n_micro), boundary=last)
            if last:
                grads = {
                    n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()
                }
            if step_every_micro_batch or last:
                results.append(distributed.step(engine))
        assert results == [None] * (len(results) - 1) + [True]
        ref_grads = _reference_step(ref, opt, sum(ref(x).pow(2).sum() / (2.0 * n_micro) for x in micro), 1.0)
        _assert_grads_close(grads, ref_grads)
    _assert_params_close(_full_params(engine), {n: p.detach() for n, p in ref.named_parameters()})


# --- non-finite loss: the whole step is skipped -------------------------------------------------


@pytest.mark.cpu_matrix
@pytest.mark.parametrize(("stage", "bad"), [(0, math.nan), (1, math.inf), (2, -math.inf), (3, math.nan)])
def test_nonfinite_loss_skips_the_step(stage, bad):
    distributed.setup()
    lr, grad_accum = 1e-2, 2
    engine = distributed.make_engine(
        _mlp(0),
        lr=lr,
        eps=1e-4,
        zero_stage=stage,
        micro_batch_size=4,
        grad_accum=grad_accum,
        bf16=False,
        grad_clip=1.0,
    )
    ref = _mlp(0)
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=1e-4, weight_decay=0.0)
    g = torch.Generator().manual_seed(5)
    data = [
        [torch.randn(4, 8, generator=g, dtype=torch.float32) for _ in range(grad_accum)] for _ in range(3)
    ]
    nonfinite = skipped = 0
    for step_i, micro in enumerate(data):
        if step_i == 1:
            before = _full_params(engine)
        for i, x in enumerate(micro):
            loss = engine(x).pow(2).sum() / 16.0
            if step_i == 1 and i == 0:
                loss = loss * bad  # poisons the whole step 1
            nonfinite += not distributed.backward(engine, loss)
            applied = distributed.step(engine)
            skipped += applied is False
            assert (applied is None) == (i < grad_accum - 1)
        if step_i == 1:
            after = _full_params(engine)
            assert all(torch.equal(before[n], after[n]) for n in before)
        else:  # the reference never sees step 1
            _reference_step(ref, opt, sum(ref(x).pow(2).sum() / 16.0 for x in micro), 1.0)
    assert (nonfinite, skipped, engine.skipped_steps, engine.global_steps) == (1, 1, 1, 3)
    # the optimizer state was untouched too: step 2 matches a reference that never saw step 1
    _assert_params_close(_full_params(engine), {n: p.detach() for n, p in ref.named_parameters()})


@pytest.mark.cpu_matrix
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_nonfinite_loss_skips_the_step_bf16(stage):
    """bf16 goes through other DeepSpeed optimizer wrappers; their overflow check must fire too."""
    distributed.setup(seed=2)
    engine = distributed.make_engine(
        _mlp(0), lr=1e-2, zero_stage=stage, micro_batch_size=4, grad_accum=2, bf16=True, grad_clip=1.0
    )
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    flags, snapshots = [], [_full_params(engine)]
    for step_i in range(2):
        for i in range(2):
            loss = engine(torch.randn(4, 8, dtype=torch.bfloat16)).float().pow(2).sum()
            if step_i == 1 and i == 0:
                loss = loss * math.nan
            flags.append((distributed.backward(engine, loss), distributed.step(engine)))
        snapshots.append(_full_params(engine))
    assert flags == [(True, None), (True, True), (False, None), (True, False)]
    assert not all(torch.equal(snapshots[0][n], snapshots[1][n]) for n in snapshots[0])  # step 0 applied
    assert all(torch.equal(snapshots[1][n], snapshots[2][n]) for n in snapshots[0])  # step 1 skipped


# --- checkpoint: save, load, continue = uninterrupted -------------------------------------------


def _train_steps(engine, n_steps: int) -> list[float]:
    """Draws data from all three global RNGs and uses dropout: resume must restore them all."""
    losses = []
    for _ in range(n_steps):
        for _ in range(2):
            x = torch.randn(4, 8, dtype=torch.float32) * (1.0 + random.random()) + float(np.random.rand())
            loss = engine(x).pow(2).mean() / 2.0
            losses.append(loss.item())
            distributed.backward(engine, loss)
            distributed.step(engine)
    return losses


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_checkpoint_resume_is_bit_identical(stage, tmp_path):
    distributed.setup(seed=11)
    kwargs = dict(lr=1e-2, weight_decay=0.1, zero_stage=stage, micro_batch_size=4, grad_accum=2, bf16=False)
    engine = distributed.make_engine(_mlp(0, dropout=0.3), grad_clip=1.0, **kwargs)
    _train_steps(engine, 2)
    checkpoints.save_engine(engine, tmp_path, "step2", {"step": 2, "note": "x"})
    assert (tmp_path / "latest").read_text().strip() == "step2"
    losses = _train_steps(engine, 2)
    uninterrupted = _full_params(engine)

    distributed.setup(seed=999)  # a different RNG position and a different init
    resumed = distributed.make_engine(_mlp(1, dropout=0.3), grad_clip=1.0, **kwargs)
    client_state = checkpoints.load_engine(resumed, tmp_path)
    assert client_state["step"] == 2 and client_state["note"] == "x"
    assert "polgrad_rng" not in client_state
    assert resumed.global_steps == 2
    assert _train_steps(resumed, 2) == losses
    params = _full_params(resumed)
    assert all(torch.equal(params[n], uninterrupted[n]) for n in uninterrupted)


def test_checkpoint_misuse_raises(tmp_path):
    distributed.setup()
    engine = distributed.make_engine(_mlp(0), lr=1e-3, **{**_GOOD, "grad_accum": 2})
    with pytest.raises(DataError, match="no checkpoint in"):
        checkpoints.load_engine(engine, tmp_path)
    for i in range(2):
        distributed.backward(engine, engine(torch.randn(2, 8, dtype=torch.float32)).sum())
        distributed.step(engine)
        if i == 0:
            with pytest.raises(PolgradError, match="between optimizer steps"):
                checkpoints.save_engine(engine, tmp_path, "mid")
    with pytest.raises(ConfigError, match="reserved"):
        checkpoints.save_engine(engine, tmp_path, "s1", {"polgrad_rng": 1})


# --- world size 2 under torchrun ----------------------------------------------------------------


@pytest.mark.cpu_matrix
@pytest.mark.slow
def test_world_size_2_matches_world_size_1(tmp_path):
    """Stage 0 (allreduce), ZeRO-2 and ZeRO-3 on 2 ranks: the gradient and step of the global batch."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    start = time.monotonic()
    proc = subprocess.run(
        [*torchrun, str(HERE / "dist_worker.py"), str(tmp_path), "0,2,3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"torchrun world size 2, stages 0, 2 and 3: {time.monotonic() - start:.1f} s")

    # reference: plain PyTorch, the same 4 micro-batches (2 ranks x 2) summed
    ref_losses, ref_grads, ref_params = _reference_run([r for k in range(2) for r in worker.shares(k, 2, 2)])
    for stage in (0, 2, 3):
        results = [json.loads((tmp_path / f"stage{stage}_rank{r}.json").read_text()) for r in range(2)]
        for res in results:
            assert res["world_size"] == 2
            assert res["losses"] == pytest.approx(ref_losses, rel=LOSS_REL)
            _assert_grads_close({n: torch.tensor(g) for n, g in res["grads"].items()}, ref_grads)
            _assert_params_close({n: torch.tensor(p) for n, p in res["params"].items()}, ref_params)
        for res, backward_ok in zip(results, ([True, True], [False, True]), strict=True):
            assert res["poisoned"] == {
                "backward": backward_ok,  # the NaN was on rank 1's first micro-batch
                "step": [None, False],  # skipped on both ranks
                "unchanged": True,
                "skipped_steps": 1,
            }
        assert results[0]["params"] == results[1]["params"]  # the ranks agree exactly
        assert results[0]["losses"] == results[1]["losses"]
        if stage == 3:  # each rank holds only its half of every parameter
            for res in results:
                for n, (full, local) in res["numel"].items():
                    assert local == math.ceil(full / 2) < full, n


def _launched_alone(script: str) -> subprocess.CompletedProcess:
    """`python -c script` as the one rank of a launched group (RANK 0, WORLD_SIZE 1, env://); it must
    exit 0."""
    from polgrad.sweep.slots import free_port

    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def test_a_launched_process_group_is_destroyed_before_the_interpreter_exits(tmp_path):
    """Under a launcher (RANK and WORLD_SIZE set) setup registers the group's destruction at exit: a
    gloo group left to interpreter finalization can abort a finished run (SIGABRT). atexit runs its
    handlers last-registered first, so a checker registered before setup runs after it and sees the
    group gone."""
    proc = _launched_alone(
        "import atexit, sys, torch.distributed as tdist\n"
        "from polgrad import distributed\n"
        "atexit.register(lambda: print('up at exit:', tdist.is_initialized(), flush=True))\n"
        "distributed.setup()\n"
        "print('up after setup:', tdist.is_initialized(), flush=True)\n"
    )
    assert proc.stdout.splitlines()[-2:] == ["up after setup: True", "up at exit: False"], proc.stdout


@pytest.mark.cpu_matrix  # two ranks (the marker's rule: what a test runs)
def test_finish_holds_every_rank_until_all_are_done_then_ends_the_group(tmp_path):
    """Rank 1 is done while rank 0 still works for 2 s (rank 0 writes the final model after the last
    collective): rank 1 leaves `finish` only after rank 0 entered it, and both leave without a group.
    A rank that tore its gloo group down alone at exit could abort after a finished run
    (SIGABRT, 'terminate called without an active exception'), and its launcher then killed rank 0
    in the middle of writing."""
    import finish_worker
    import torch.multiprocessing as mp

    from polgrad.sweep.slots import free_port

    mp.spawn(finish_worker.run, args=(2, free_port(), str(tmp_path), 2.0), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"finish{r}.json").read_text()) for r in (0, 1))
    assert r1["entered"] < r0["entered"] - 1.0  # rank 1 came first, by most of rank 0's 2 s
    assert r1["left"] >= r0["entered"] and not r0["up"] and not r1["up"]


_LEAVE_SCRIPT = """
import atexit, sys
from polgrad import distributed
atexit.register(lambda: print("finalized", flush=True))
distributed.setup()
if sys.argv[1] == "finish":
    distributed.finish()
sys.stdout.write("done")
distributed.leave(3)
"""


@pytest.mark.cpu_matrix  # two ranks (the marker's rule: what a test runs)
@pytest.mark.parametrize("ends", ["finish", "no finish"])
def test_a_rank_whose_group_ended_together_leaves_without_interpreter_finalization(tmp_path, ends):
    """`distributed.leave` after `finish` at world size 2: each rank exits with the run's code and
    what it wrote, without finalization (no atexit handler runs), where gloo's worker threads, still
    alive because DeepSpeed holds the groups, could abort a finished run. A rank that did not end
    with its group (an error, a stop) exits normally: its atexit handlers run. The ranks are started
    directly (env://), not by torchrun, which would SIGTERM one rank when the other exits non-zero;
    their stdout is a file, block-buffered (PYTHONUNBUFFERED dropped), so what a rank wrote arrives
    only if `leave` (or DeepSpeed's logging handler on stdout, which it shuts down) flushes it."""
    from polgrad.sweep.slots import free_port

    script = tmp_path / "leave.py"
    script.write_text(_LEAVE_SCRIPT)
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in (*drop, "PYTHONUNBUFFERED")}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks = []
    for rank in (0, 1):
        out = open(tmp_path / f"rank{rank}.out", "w")
        ranks.append(subprocess.Popen(
            [sys.executable, str(script), ends], env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=out, stderr=subprocess.PIPE, text=True,
        ))  # fmt: skip
        out.close()
    for rank, proc in enumerate(ranks):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 3, (rank, proc.returncode, err[-2000:])
        expected = "done" if ends == "finish" else "donefinalized\n"
        assert (tmp_path / f"rank{rank}.out").read_text() == expected, (rank, err[-2000:])


def test_a_launchers_new_group_has_not_ended_together():
    """`setup` under a launcher clears what an earlier group's `finish` set: a process that sets a
    group up again and then fails exits normally (`leave`), with its atexit handlers."""
    proc = _launched_alone(
        "from polgrad import distributed\n"
        "distributed._ended_together = True  # as an earlier group's finish leaves it\n"
        "distributed.setup()\n"
        "print('ended together:', distributed._ended_together)\n"
    )
    assert proc.stdout.splitlines()[-1] == "ended together: False", proc.stdout


def test_leave_flushes_what_the_rank_printed_before_it_skips_finalization(monkeypatch):
    """os._exit drops Python's buffers: `leave` flushes stdout and stderr first (a sweep cell's log is
    a file, block-buffered), and exits with the run's code."""
    import io
    import logging

    from polgrad import distributed

    flushed_at_exit = []

    class Out(io.StringIO):
        def flush(self):
            self.flushed = True

    out, err = Out(), Out()
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # not pytest's own handlers
    monkeypatch.setattr(distributed, "_ended_together", True)
    monkeypatch.setattr(
        distributed.os,
        "_exit",
        lambda code: flushed_at_exit.append((code, hasattr(out, "flushed"), hasattr(err, "flushed"))),
    )
    monkeypatch.setattr(distributed.sys, "stdout", out)
    monkeypatch.setattr(distributed.sys, "stderr", err)
    distributed.leave(3)
    assert flushed_at_exit == [(3, True, True)]


def test_a_finished_run_ends_through_finish(tmp_path, monkeypatch):
    """polgrad.train's main calls distributed.finish after a run that ended well (a no-op at one rank)."""
    from polgrad import distributed
    from polgrad.train import main

    calls = []
    real = distributed.finish
    run = tmp_path / "run"
    # when finish is called, the run has ended: its summary is written
    monkeypatch.setattr(
        distributed, "finish", lambda: (calls.append((run / "summary.json").exists()), real())[1]
    )
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = [os.path.join(repo, "registry", "grpo.gin"), "--out", str(run), "--no-progress"]
    for b in (
        "train.steps = 1",
        "train.prompts_per_step = 2",
        "train.eval_every = 100",
        "train.eval_size = 8",
    ):
        argv += ["--bind", b]
    assert main(argv) == 0 and calls == [True]
