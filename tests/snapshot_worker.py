"""Two gloo ranks take the producer's snapshot of a module (tests/loop/test_async_ranks.py): with the same
weights, or with rank 1's moved by `shift` (ranks that diverged). Writes out/rank<r>.txt: 'ok' or the
error's text."""

from __future__ import annotations

import torch


def run(rank: int, world: int, store: str, out: str, shift: float) -> None:
    import torch.distributed as dist

    from polgrad.errors import PolgradError
    from polgrad.producer import _snapshot

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        if rank == 1:
            with torch.no_grad():
                module[1].bias[0] += shift
        try:
            weights = _snapshot(module, 7)
            text = "ok" if torch.equal(weights["1.bias"], module[1].bias) else "not a copy"
        except PolgradError as e:
            text = str(e)
        with open(f"{out}/rank{rank}.txt", "w") as fh:
            fh.write(text)
    finally:
        dist.destroy_process_group()


def run_zero3(rank: int, world: int, port: int, out: str) -> None:
    """ZeRO-3 with every parameter partitioned (persistence threshold 0, so no rank holds a whole
    weight): the producer's snapshot must gather them, and its sampling copy must compute what the
    unpartitioned model computes. Writes out/zero3_rank<r>.txt: 'ok' or what differs."""
    import os

    os.environ.update(
        {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
         "MASTER_PORT": str(port)}
    )  # fmt: skip
    import polgrad
    from polgrad import distributed
    from polgrad.models import build_tiny
    from polgrad.producer import _partitioned, _sampling_copy, _snapshot

    torch.set_num_threads(1)
    task = polgrad.get("task", "add")()
    model, _ = build_tiny(task, seed=3)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    engine = distributed.make_engine(
        model, lr=1e-3, zero_stage=3, micro_batch_size=1, grad_accum=1, bf16=False, grad_clip=None,
        extra={"zero_optimization": {"stage3_param_persistence_threshold": 0}},
    )  # fmt: skip
    problems = []
    try:
        module = engine.module
        if not _partitioned(module) or all(p.numel() for p in module.parameters()):
            problems.append("the module's weights are not partitioned: the test would not test the gather")
        weights = _snapshot(module, 0)
        problems += [k for k in full if not torch.equal(weights[k], full[k])]
        copy = _sampling_copy(module)
        copy.load_state_dict(weights)
        with torch.no_grad():
            if not torch.equal(copy(input_ids=ids).logits, expected):
                problems.append("the sampling copy's logits differ from the model's")
    except Exception as e:  # noqa: BLE001 - reported to the test
        problems.append(f"{type(e).__name__}: {e}")
    with open(f"{out}/zero3_rank{rank}.txt", "w") as fh:
        fh.write("; ".join(problems) or "ok")
    import torch.distributed as dist

    dist.barrier()
