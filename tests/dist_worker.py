"""Worker for the world-size-2 test of polgrad.distributed, and the tiny problem both sides share.

Run under a launcher, e.g. ``torchrun --standalone --nproc_per_node 2 tests/dist_worker.py OUT 2,3``:
for each ZeRO stage it trains the tiny Qwen2 policy for `STEPS` optimizer steps on the fixed
global batch of `global_batch()`, this rank taking its contiguous share, and writes
``OUT/stage{S}_rank{R}.json`` with the step losses, the reduced gradient of the first step, the
parameters after the last step and, under ZeRO-3, each parameter's full and local sizes. A last
step with a NaN loss on one rank only must then be skipped by all ranks.
tests/loop/test_distributed.py imports the helpers below to compute the plain-PyTorch reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

SEED = 0  # model init
DATA_SEED = 1234  # the global batch
N_SEQ, PROMPT_LEN, SEQ_LEN, VOCAB = 8, 4, 12, 128
LR, WEIGHT_DECAY, GRAD_CLIP = 1e-2, 0.01, 1.0
# Adam's eps: with the default 1e-8, coordinates whose true gradient is ~0 (the key biases: softmax
# is invariant to them) turn float-summation noise into updates of up to lr; 1e-4 keeps the
# comparison with the reference well conditioned (tests/loop/test_distributed.py).
EPS = 1e-4
STEPS = 3
# ZeRO-3 keeps parameters below this many elements whole on every rank (DeepSpeed default 1e5):
# 0 partitions every parameter of the tiny model, so the test can see the partition.
ZERO3_EXTRA = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def build_model() -> torch.nn.Module:
    """A tiny Qwen2 built from scratch (hidden 64, 2 layers, 2 heads of 32), fp32, seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    return Qwen2ForCausalLM(config).to(torch.float32)


def global_batch() -> dict[str, torch.Tensor]:
    """Token ids [N,T], response mask [N,T-1] (float 0/1, ragged lengths) and advantages [N,T-1]."""
    g = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(0, VOCAB, (N_SEQ, SEQ_LEN), generator=g)
    lengths = torch.randint(2, SEQ_LEN - PROMPT_LEN + 1, (N_SEQ,), generator=g)
    pos = torch.arange(SEQ_LEN - 1)
    start = PROMPT_LEN - 1  # logp[:, t] scores token t+1, the first response token is PROMPT_LEN
    mask = ((pos >= start) & (pos < start + lengths[:, None])).to(torch.float32)
    adv = torch.randn(N_SEQ, SEQ_LEN - 1, generator=g, dtype=torch.float32) * mask
    return {"ids": ids, "mask": mask, "adv": adv}


def micro_loss(model, batch: dict[str, torch.Tensor], rows: slice, n_tokens: float) -> torch.Tensor:
    """Policy-gradient token_mean term of `rows`: -sum(logp * adv * mask) / (global token count)."""
    ids = batch["ids"][rows]
    logits = model(input_ids=ids).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * batch["adv"][rows] * batch["mask"][rows]).sum() / n_tokens


def shares(rank: int, world_size: int, grad_accum: int) -> list[slice]:
    """The micro-batches (row slices of the global batch) of `rank`: contiguous, equal sizes."""
    per_rank = N_SEQ // world_size
    micro = per_rank // grad_accum
    start = rank * per_rank
    return [slice(start + i * micro, start + (i + 1) * micro) for i in range(grad_accum)]


def run_stage(stage: int, out: Path) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    from polgrad import distributed

    info = distributed.setup(seed=SEED)
    grad_accum = 2
    model = build_model()
    engine = distributed.make_engine(
        model,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        eps=EPS,
        zero_stage=stage,
        micro_batch_size=N_SEQ // (info.world_size * grad_accum),
        grad_accum=grad_accum,
        bf16=False,
        grad_clip=GRAD_CLIP,
        extra=ZERO3_EXTRA if stage == 3 else None,
    )
    params = list(engine.module.parameters())
    names = [n for n, _ in engine.module.named_parameters()]
    result: dict = {"stage": stage, "rank": info.rank, "world_size": info.world_size, "losses": []}
    if stage == 3:
        result["numel"] = {
            n: [int(p.ds_numel), int(p.ds_tensor.numel())] for n, p in zip(names, params, strict=True)
        }
    batch = global_batch()
    n_tokens = float(batch["mask"].sum())
    for step_i in range(STEPS):
        step_loss = torch.zeros(())
        for rows in shares(info.rank, info.world_size, grad_accum):
            loss = micro_loss(engine, batch, rows, n_tokens)
            step_loss += loss.detach()
            assert distributed.backward(engine, loss)
            if step_i == 0 and engine.is_gradient_accumulation_boundary():
                # the reduced gradient, before the optimizer step (collective under ZeRO 1-3)
                result["grads"] = {
                    n: safe_get_full_grad(p).flatten().tolist() for n, p in zip(names, params, strict=True)
                }
            applied = distributed.step(engine)
            assert applied is (True if engine.micro_steps % grad_accum == 0 else None)
        dist.all_reduce(step_loss)  # the step loss is the sum over micro-batches and ranks
        result["losses"].append(float(step_loss))

    # One more step, poisoned on the last rank only: every rank must skip it, so the parameters
    # gathered below are still those after STEPS steps.
    local = [(p.ds_tensor if stage == 3 else p).detach().clone() for p in params]
    poisoned = {"backward": [], "step": []}
    for i, rows in enumerate(shares(info.rank, info.world_size, grad_accum)):
        loss = micro_loss(engine, batch, rows, n_tokens)
        if i == 0 and info.rank == info.world_size - 1:
            loss = loss * float("nan")
        poisoned["backward"].append(distributed.backward(engine, loss))
        poisoned["step"].append(distributed.step(engine))
    poisoned["unchanged"] = all(
        torch.equal((p.ds_tensor if stage == 3 else p).detach(), q)
        for p, q in zip(params, local, strict=True)
    )
    poisoned["skipped_steps"] = engine.skipped_steps
    result["poisoned"] = poisoned

    with deepspeed.zero.GatheredParameters(params):  # no-op below ZeRO-3
        result["params"] = {n: p.detach().flatten().tolist() for n, p in zip(names, params, strict=True)}
    result["peak_memory_mb"] = distributed.peak_memory_mb()
    (out / f"stage{stage}_rank{info.rank}.json").write_text(json.dumps(result))


def main(argv: list[str]) -> None:
    out = Path(argv[1])
    for stage in (int(s) for s in argv[2].split(",")):
        run_stage(stage, out)


if __name__ == "__main__":
    main(sys.argv)
