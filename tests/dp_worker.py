"""Worker of tests/loop/test_data_parallel.py: one trainer step at world size 2, and its world-size-1 twin.

    torchrun --standalone --nproc_per_node 2 tests/dp_worker.py OUT CASES   # the ranks
    python tests/dp_worker.py OUT CASES --reference                         # world size 1

CASES is `SPEC=STAGES;SPEC=STAGES...`, e.g. "grpo=0,1,2,3;ppo=0,3": every case runs in one launch
(a launch costs the two ranks' imports and the process group's start, ~10 s each time).
Under the launcher, for each SPEC and each ZeRO stage in its STAGES each rank builds the run of
`SPEC` (registry/<SPEC>.gin on the tiny base config) with `polgrad.trainer`'s own functions,
collects its batch (its own prompts: the step seed includes the rank), computes advantages and
runs `trainer.update` (one optimizer step), and writes OUT/<SPEC>_stage<S>_rank<R>.pt: the
collected batch, the prompts, the advantages, the update metrics, the reduced gradient of the step
and the parameters after it.

With --reference (one process, ZeRO stage 0), for each stage S it loads the batches rank 0 and
rank 1 collected at stage S, concatenates them (`Batch.concat`: rank 1's groups after rank 0's)
and runs the same `prepare` and `update` on the concatenated batch, writing
OUT/<SPEC>_stage<S>_reference.pt. Every spec runs one epoch of one minibatch here, i.e. exactly one
optimizer step (with several, the minibatches of the two sides would hold different rows).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

# Adam's eps 1e-4 instead of 1e-8: on the first step Adam moves each weight by ~lr * g / (|g| + eps),
# so with 1e-8 the weights whose true gradient is ~0 would turn float-summation noise into moves of
# up to lr and the weight comparison would say nothing (same reasoning as tests/dist_worker.py).
BINDINGS = [
    "train.steps = 1",
    "train.prompts_per_step = 4",
    "train.eval_size = 4",
    "train.micro_batch_size = 12",  # 32 rows per rank -> 12+12+8; 64 at world size 1 -> 12*5+4
    "train.adam_eps = 1e-4",
    "train.lr = 1e-3",
    "train.progress = False",
    "Algorithm.ppo_epochs = 1",
    "Algorithm.minibatches = 1",
]


# A case is a spec name, or "<spec>+<variant>" with the variant's extra bindings.
VARIANTS = {
    "rwhiten": ["Algorithm.reward_shaping = [@reward_shaping.whiten]"],
    "own": ["Algorithm.value_init = @value_init.lora"],  # ppo_lora with the critic's own adapter
}


def build(case: str, stage: int):
    import gin

    from polgrad import config, distributed
    from polgrad.build import build_models
    from polgrad.sampling import step_seed

    spec, _, variant = case.partition("+")
    extra = VARIANTS[variant] if variant else []
    gin.clear_config()
    config.parse_config(
        [str(REPO / "registry" / f"{spec}.gin")], [*BINDINGS, *extra, f"train.zero_stage = {stage}"]
    )
    cfg, algo, task = config.build()
    info = distributed.setup(seed=cfg.seed)
    m = build_models(cfg, algo, task, out_dir=str(REPO), seed_of=lambda s: step_seed(cfg.seed, s, info.rank))
    return cfg, algo, task, info, m


def step(cfg, algo, m, collected, sampled, seed: int) -> dict:
    """prepare + update on `collected`, with the reduced gradient caught at the step's boundary,
    and the step's metrics row (`trainer.step_row`, with `sampled` for the reward metrics)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from polgrad import hooks
    from polgrad.loop_state import LoopState
    from polgrad.trainer import step_row, update

    batch, prep = algo.prepare(collected, kl_coef=algo.kl_coef)
    params = [(n, p) for n, p in m.engine.module.named_parameters() if p.requires_grad]  # LoRA: adapter, head
    grads: dict = {}

    def on_phase(path: str, _dt: float) -> None:
        # the backward of the step's last micro-batch has reduced the gradient over the ranks
        if path.endswith("backward") and m.engine.is_gradient_accumulation_boundary():
            grads.update({n: safe_get_full_grad(p).detach().clone() for n, p in params})

    with hooks.listen(on_phase=on_phase):
        metrics, n_updates, skipped = update(cfg, algo, m, batch, algo.kl_coef, seed, step=0)
    with deepspeed.zero.GatheredParameters([p for _, p in params]):  # no-op below ZeRO-3
        after = {n: p.detach().clone() for n, p in params}
    row = step_row(m, sampled, batch, LoopState(step=1, kl_coef=algo.kl_coef), prep, metrics)
    return {
        "row": row,
        "adv": batch.adv,
        "group_ids": batch.group_ids,
        "prep": prep,
        "metrics": metrics,
        "n_updates": n_updates,
        "skipped": skipped,
        "grads": grads,
        "params": after,
    }


def ranks(out: Path, spec: str, stages: list[int]) -> None:
    from polgrad.trainer import collector_for, step_seed

    for stage in stages:
        cfg, algo, task, info, m = build(spec, stage)
        seed = step_seed(cfg.seed, 0, info.rank)
        got = collector_for(algo)(cfg, algo, m, task, seed)
        result = step(cfg, algo, m, got.batch, got.sampled, seed)
        result.update(
            collected=got.batch,
            sampled=got.sampled,
            prompts=[ex.prompt for ex in got.batch.rollout.examples],
            world_size=info.world_size,
        )
        torch.save(result, out / f"{spec}_stage{stage}_rank{info.rank}.pt")


def reference(out: Path, spec: str, stages: list[int]) -> None:
    from polgrad.batch import Batch

    for stage in stages:  # each stage's own batches: ZeRO-3 samples through another decode path
        cfg, algo, task, info, m = build(spec, 0)
        assert info.world_size == 1
        files = [out / f"{spec}_stage{stage}_rank{r}.pt" for r in (0, 1)]
        saved = [torch.load(f, weights_only=False) for f in files]
        pad = m.tokenizer.pad_token_id
        collected = Batch.concat([r["collected"] for r in saved], pad)
        result = step(cfg, algo, m, collected, Batch.concat([r["sampled"] for r in saved], pad), seed=0)
        torch.save(result, out / f"{spec}_stage{stage}_reference.pt")


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    run = reference if sys.argv[3:] == ["--reference"] else ranks
    for case in sys.argv[2].split(";"):
        spec_name, _, stages = case.partition("=")
        run(out_dir, spec_name, [int(s) for s in stages.split(",")])
