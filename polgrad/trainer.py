"""The RL loop, readable top to bottom: sample -> score -> reference/values -> advantages -> update.

One call of `train(cfg, algo, task, out_dir, record=...)` is one run of the chapter's
policy-gradient loop. Its inputs are built by the entry point (`polgrad.config.build()` from the parsed
gin files; `python -m polgrad.train`, `polgrad.train.run`): the immutable `Algorithm` (what to
optimise), the `TrainConfig` (the `train.*` bindings: task, model, budget, optimiser, DeepSpeed), the
task, and the `ConfigRecord` of the gin configuration the run writes down. Nothing here reads gin.
It writes into out_dir:

    config.gin            every binding of the run (written first, so a crash still has it); a resume
                          whose bindings differ rewrites it and appends to resume_overrides.jsonl
    metrics.jsonl         one JSON object per step, flushed every step; its sampled_sequences,
                          kept_sequences and generated_tokens are cumulative (polgrad/stopping.py)
    eval.jsonl            one record per evaluation (step 0 = the starting policy): accuracy and
                          the per-prompt results on the same held-out prompts every time
    summary.json          written atomically at the end; its "table5" is the Algorithm's Table-5 row;
                          status 'ok', or 'unstable' when skipped_frac (skipped optimizer steps /
                          optimizer steps) is above train.unstable_skip_frac; `collapsed` beside it
                          when the held-out accuracy collapsed (polgrad/collapse.py)
    operative_config.gin  the bindings gin actually used
    checkpoints/          DeepSpeed's own checkpoints (+ RNG states and the loop state below), all
                          kept (train.keep_checkpoints = N: the N newest); a resume loads the newest
                          intact one (polgrad/checkpoints.py, which owns them whole), and
                          ^C / SIGTERM writes one of the step it ends (polgrad/stopping.py)
    model/                the policy's config + tokenizer and the spec's name (what polgrad.export needs)
    final/                the result as a model: policy + tokenizer, critic/, README.md (polgrad/export.py);
                          with LoRA the adapter merged in, and adapter/

Loop state: the step, the KL coefficient (a controller may move it; the spec never changes), the
count of skipped optimizer steps and the budget's counters. It is saved in every checkpoint and
restored on resume (polgrad/loop_state.py; the models are built once by polgrad/build.py, the summary
by polgrad/summary.py).

Reproducibility: the warm start and reward model are seeded by `train.init_seed` (default: the RL seed), so
a seed starts from the same policy in every configuration (paired); summary.json's `warm_start` names it.
Every random draw of step s (prompts, sampling, minibatch shuffles) is seeded from (seed, s,
rank), and checkpoints carry optimiser and RNG states, so on CPU the same seed gives the same
metrics file and an interrupted run resumed with `resume=True` ends where an uninterrupted run
ends.

Data parallelism (world size W > 1, under torchrun or the DeepSpeed launcher): each rank samples
its own `prompts_per_step` prompts (its seed includes the rank), so one step trains on W times as
many groups. Groups never straddle ranks, so group statistics (GRPO's mean and std, RLOO's
leave-one-out) are rank-local; every statistic of the whole batch (whitening, batch std, the
aggregators' denominators, the KL the controller reads, every logged metric) is reduced over the
ranks (polgrad.collective), so with one epoch of one minibatch a step at world size W is the
step at world size 1 on the concatenated batch (tests/loop/test_data_parallel.py, ZeRO 0-3; with
several minibatches each rank shuffles its own rows into them, so the minibatches differ).
With filters, every rank keeps the same number of groups (the fewest any rank has), so all
ranks run the same optimizer steps.

Asynchronous rollouts (`train.max_staleness` = k > 0; polgrad/sampling.py): a
producer samples step s's rollout from the weights of step max(s - k, 0) while the trainer updates on
earlier ones. Its log-probs are kept as `rollout_logp` (the behaviour policy), old_logp is recomputed
when the rollout is stale, and the row logs staleness_mean/max, rollout_wait_s and the statistics of
π_old/π_behaviour (is_ratio_*). k = 0 (the default) is the synchronous loop; checkpoints also hold the k
older weight versions the next steps sample with, so resume stays exact.

The step never asks which optional roles the run has: each is a strategy chosen once, when the
models are built (polgrad/build.py) or, for the collector, when the run starts (`collector_for`):
the sampler (HF, vLLM, async; it draws each round's prompts, one stream for the trainer and an async
producer, and says whether π_old is recomputed: polgrad/sampling.py), the
reference (none, frozen, frozen with full logits: polgrad/reference.py), the critic (none, own
engine with its warm-up, in the policy's engine: polgrad/critic.py), the scorer (the task's
verifier, or a reward model with the gold beside it) and the baseline (none, ReMax's greedy one).
tests/project/test_layers.py counts the step's branches on optional roles: there are none.

Phases are announced through `polgrad.hooks` (sample, reward, old_logp, ref, values, advantage,
policy_fwd, loss, backward, optim, sync, eval, checkpoint) so tools can time them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any, NamedTuple

import torch
from torch import Tensor

from polgrad import (
    checkpoints,
    collective,
    config,
    export,
    hooks,
    machine,
    models,
    offline,
    stopping,
    tracking,
)
from polgrad import distributed as dist_lib
from polgrad.algorithm import Algorithm
from polgrad.batch import Batch
from polgrad.build import Models, build_models
from polgrad.errors import PolgradError
from polgrad.evaluation import Evaluator
from polgrad.loop_state import LoopState, start_or_resume
from polgrad.registry import StepCounts
from polgrad.rollout import hf as hf_rollout
from polgrad.run_folder import RunFolder
from polgrad.sampling import round_seed, step_seed
from polgrad.summary import response_lengths, summarize
from polgrad.tasks.base import is_correct
from polgrad.tasks.rewards import RewardGuard


def train(
    cfg: config.TrainConfig, algo: Algorithm, task: Any, out_dir: str, *, record: config.ConfigRecord
) -> dict[str, Any]:
    """Train `algo` on `task` as `cfg` says for `cfg.steps` steps, or until its sampling budget is spent
    (`train.max_sampled_sequences` / `max_generated_tokens`, polgrad/stopping.py); returns the summary.

    `record` is the gin configuration the run writes down (config.gin, operative_config.gin).
    """
    with dist_lib.session(seed=cfg.seed) as info:  # every rank seeded alike: the models start identical
        return _train(cfg, algo, task, out_dir, record, info.rank)


def _train(
    cfg: config.TrainConfig, algo: Algorithm, task: Any, out_dir: str, record: config.ConfigRecord, rank: int
) -> dict[str, Any]:
    t_start = time.time()
    models.threads.apply_run_threads(cfg.threads)  # every thread decision lives in polgrad/models/threads.py
    bf16_slowdown = machine.warn_if_bf16_slow(cfg.bf16)  # one line where bf16 is emulated (AVX2)
    os.makedirs(out_dir, exist_ok=True)
    config.check_world_size(cfg, collective.world_size())  # the sweep's dry run checks it too

    # 1. Build the models: the warm-started policy, and the reference, critic, reward model and sampler
    #    the parts and the settings need (polgrad/build.py), once; the loop never changes them.
    m = build_models(cfg, algo, task, out_dir=out_dir, seed_of=lambda s: step_seed(cfg.seed, s, rank))
    t_start += m.warm_start_s  # the run's time_s and wall_time_s leave out the warm start (warm_start_s)
    guard = RewardGuard(cfg.reward_errors, cfg.task_name, timeout_s=cfg.reward_timeout_s)
    examples = task.eval_examples(cfg.eval_size)
    evaluate = Evaluator(task, examples, cfg.max_new_tokens, out_dir, rank == 0, guard, m.score.proxy)
    # 2. Start (evaluating the starting policy), or resume the loop state from the last checkpoint.
    state = start_or_resume(cfg, algo, m, out_dir, evaluate, record)
    track = tracking.start(cfg, out_dir, algo.name, state.step, enabled=rank == 0)  # train.loggers

    # 3-5 of each step: sample, score, advantages, update (rl_step, below); a preference spec
    # (DPO) instead updates on the task's fixed preference pairs (polgrad/offline.py).
    one_step = (
        offline.pair_step if algo.offline else functools.partial(rl_step, collector=collector_for(algo))
    )
    bar = _progress(range(state.step, cfg.steps), enabled=cfg.progress and rank == 0, desc=algo.name)
    for step in bar:
        if stopping.done(cfg, state):  # the sampling budget is spent (e.g. resumed after its last step)
            break
        hooks.event("step")
        with hooks.clock() as clock:  # the step's phases, summed into its time_* metrics
            row, tokens, state = one_step(cfg, algo, m, task, step_seed(cfg.seed, step, rank), state)
        times = clock.step_times()
        # 6. Evaluate; log; checkpoint (at the last step: train.steps, or the sampling budget spent).
        if (step + 1) % cfg.eval_every == 0 or stopping.done(cfg, state):
            with hooks.phase("eval"):
                row["eval_accuracy"] = evaluate(m.engine.module, m.tokenizer, step + 1)
            row.update(evaluate.fields)  # a reward-model run: the proxy's score of the same responses
        row.update(times, **stopping.counts(state))  # cumulative sampled/kept sequences, generated tokens
        peak = float(collective.all_max(torch.tensor(dist_lib.peak_memory_mb())))
        seconds = max(clock.wall, 1e-9)  # the whole step, phases and what runs between them
        row.update(tokens_per_s=float(tokens) / seconds, peak_mem_mb=peak, time_s=time.time() - t_start)
        if rank == 0:
            RunFolder(out_dir).append_metrics(row)
        track.log(row)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(
                loss=f"{row.get('pg_loss', row.get('pref_loss', 0.0)):.3f}", acc=row.get("eval_accuracy", "")
            )
        stop = stopping.requested()  # ^C / SIGTERM (on any rank): checkpoint this step, then stop
        if stop or (step + 1) % cfg.checkpoint_every == 0 or stopping.done(cfg, state):
            with hooks.phase("checkpoint"):
                checkpoints.save(
                    m,
                    out_dir,
                    state.step,
                    {"polgrad": dataclasses.asdict(state)},
                    keep_last=cfg.keep_checkpoints,
                )
        stopping.stop_if(stop, state.step)

    # 7. Summarise the run (with the Table-5 row of the Algorithm it actually built).
    m.sampler.close()  # an async sampler's thread may still be sampling with the vLLM engine
    summary = summarize(out_dir, time.time() - t_start, unstable_skip_frac=cfg.unstable_skip_frac)
    summary.update(stopping.counts(state), table5=algo.table_row())  # the totals the budget counts
    summary.update(world_size=collective.world_size(), zero_stage=cfg.zero_stage, **m.summary_fields())
    summary.update(
        cpu=machine.cpu_info(), **({} if bf16_slowdown is None else {"bf16_slowdown": bf16_slowdown})
    )
    if rank == 0:
        RunFolder(out_dir).write_summary(summary)
        RunFolder(out_dir).write_operative_config(record.operative)
    track.finish(summary)
    # 8. The result as a model: out_dir/final/ (policy + tokenizer, critic, model card; polgrad/export.py).
    export.write_final(
        m, out_dir, name=algo.name, source=algo.source, config=record.operative, summary=summary
    )
    return summary


def rl_step(
    cfg: config.TrainConfig, algo: Algorithm, m: Models, task, seed: int, state: LoopState, *, collector
) -> tuple[dict[str, Any], float, LoopState]:
    """Steps 3-5 of one RL step, and its metrics row; returns (row, generated tokens, new state).
    `collector` is step 3's, chosen once for the run (`collector_for`)."""
    m.sampler.begin(state.step, m.engine.module)  # async: publish these weights, queue the next rollouts
    # 3. Collect a batch: G responses per prompt, scored, with the reference's and critic's view
    #    (with filters, sampling again until enough groups are kept: DAPO's dynamic sampling).
    got = collector(cfg, algo, m, task, seed)
    # 4. Advantages for the whole batch (reward shaping, filters and a KL in the reward inside).
    with hooks.phase("advantage"):
        batch, prep_metrics = algo.prepare(got.batch, kl_coef=state.kl_coef)
    # 5. Update: ppo_epochs x minibatches optimizer steps on this batch (while the critic warms up, its own).
    update_metrics, n_updates, skipped = update(cfg, algo, m, batch, state.kl_coef, seed, step=state.step)
    if n_updates:  # the sampler gets the new weights (vLLM: loaded into its engine; HF, async: nothing)
        m.sampler.sync(m.engine.module)
    # The row; the KL controller moves the coefficient for the next step.
    state = dataclasses.replace(state, step=state.step + 1, skipped_steps=state.skipped_steps + skipped)
    row = step_row(m, got.sampled, batch, state, {**prep_metrics, **got.info}, update_metrics)
    # The budget's counters: everything sampled (every round, greedy baselines), what was trained on.
    sampled, tokens = collective.all_sum(torch.tensor(got.counts, dtype=torch.float64)).tolist()
    state = stopping.counted(state, sampled, kept=row["update_seqs"], tokens=tokens)
    row.update(m.sampler.metrics(batch))  # async: staleness, the wait, the IS weights π_old/π_behaviour
    row["optimizer_steps"] = n_updates  # the denominator of the summary's skipped_frac
    # the KL controller reads the step's per-sequence KL to the reference (kl_seq), the unit of its target
    state = dataclasses.replace(state, kl_coef=m.reference.next_kl_coef(algo, state.kl_coef, row))
    return row, tokens, state


# --------------------------------------------------------------------------- 3. collect a batch
def collect(cfg: config.TrainConfig, algo: Algorithm, m: Models, task, seed: int) -> Batch:
    """Sample G responses for each of this step's prompts and add what the parts need.

    The batch still holds the groups of faulty rewards (`collect_kept` counts, then drops them)."""
    m.engine.module.eval()
    with hooks.phase("sample"):  # this round's prompts (the sampler's stream) and G responses to each
        rollout = m.sampler.sample(seed)
    # The reward: one scalar per sequence (a greedy baseline gets the same scorer).
    with hooks.phase("reward"):
        scores = m.score(rollout, task)
        gold_scores = m.score.gold(rollout, task)  # a reward model's run: the task verifier's too
        baseline_scores = m.baseline(rollout, task)  # ReMax: the greedy baseline's scores (else None)
    mask = rollout.mask.double()
    # π_old's log-probs: the sampler's own (same weights, same temperature), or recomputed with the
    # trainer's forward for an off-policy correction (e.g. clip.tis) or a stale async rollout.
    old_logp = m.sampler.old_logp(rollout, m.engine.module, cfg.temperature)
    # The reference's log-probs and the exact KL, from one no-grad forward (None without a reference).
    ref = m.reference.collect(m.engine.module, rollout, cfg.temperature)
    values = m.critic.old_values(rollout, mask)  # the critic's values before the update; None without one
    return Batch(
        mask=mask,
        group_ids=rollout.group_ids,
        old_logp=old_logp,
        scores=scores,
        gold_scores=gold_scores,
        truncated=rollout.truncated,
        rollout_logp=rollout.rollout_logp.double(),
        baseline_scores=baseline_scores,
        ref_logp=ref["ref_logp"],
        kl_exact=ref["kl_exact"],
        values=values,
        old_values=values,
        rollout=dataclasses.replace(rollout, policy_logp_all=None),  # [B,T,V]: used, not kept
    )


class Collected(NamedTuple):
    """Step 3's: all sampled (reward metrics), the kept batch, dynamic-sampling metrics, and this
    rank's (sequences, generated tokens) sampled, faulty groups and greedy baselines included."""

    sampled: Batch
    batch: Batch
    info: dict[str, float]
    counts: tuple[float, float] = (0.0, 0.0)


def collector_for(algo: Algorithm):
    """Step 3's collector, chosen once for the run: DAPO's dynamic sampling when the spec has filters
    (`collect_kept`), else one sampling round (`collect_once`)."""
    return collect_kept if algo.filters else collect_once


def collect_once(cfg: config.TrainConfig, algo: Algorithm, m: Models, task, seed: int) -> Collected:
    """One `collect`, without the groups of faulty rewards."""
    raw = collect(cfg, algo, m, task, seed)
    batch = raw.without_faulty_groups()
    return Collected(batch, same_groups_on_every_rank(batch), {}, m.baseline.sampled(raw.rollout))


def collect_kept(cfg: config.TrainConfig, algo: Algorithm, m: Models, task, seed: int) -> Collected:
    """DAPO's dynamic sampling (Yu et al. 2025), for a spec with `Algorithm.filters`: rounds of
    `prompts_per_step` fresh prompts (round r seeded by `round_seed(seed, r)`) until the filters kept
    that many groups on every rank or `max_sampling_rounds` are done; it trains on the first ones
    kept (at world size > 1 as many as the rank with the fewest: the same optimizer steps). Logs
    `sampling_rounds`, `kept_frac` (kept share of the sampled groups, every round and rank) and
    `filtered_frac` (dropped share of the sampled rows: `prepare` sees the kept rows only)."""
    need, pad_id = cfg.prompts_per_step, m.tokenizer.pad_token_id
    sampled, kept, drawn = [], [], (0.0, 0.0)
    for r in range(algo.max_sampling_rounds):
        raw = collect(cfg, algo, m, task, round_seed(seed, r))
        drawn = tuple(a + b for a, b in zip(drawn, m.baseline.sampled(raw.rollout), strict=True))
        part = raw.without_faulty_groups()
        sampled.append(part)
        kept.append(part.select(algo.keep(part)))
        have = sum(b.n_groups for b in kept)
        if float(collective.all_min(torch.tensor(float(have)))) >= need:  # every rank decides alike
            break
    all_sampled, batch = Batch.concat(sampled, pad_id), Batch.concat(kept, pad_id)
    counts = [batch.n_groups, all_sampled.n_groups, batch.size, all_sampled.size]
    n_kept, n_sampled, rows_kept, rows_sampled = collective.all_sum(torch.tensor(counts, dtype=torch.float64))
    batch = batch.first_groups(int(collective.all_min(torch.tensor(float(min(need, batch.n_groups))))))
    size = torch.tensor(float(batch.size))
    if float(collective.all_min(size)) != float(collective.all_max(size)):
        raise PolgradError(
            "the filters kept groups of different sizes on the ranks; at world size > 1 a filter must "
            "keep or drop whole groups (as filter.zero_variance_groups does)"
        )
    info = {
        "sampling_rounds": float(len(sampled)),
        "kept_frac": float(n_kept / n_sampled.clamp_min(1)),
        "filtered_frac": float(1 - rows_kept / rows_sampled.clamp_min(1)),  # prepare sees kept rows only
    }
    return Collected(all_sampled, batch, info, drawn)


def same_groups_on_every_rank(batch: Batch) -> Batch:
    """The first groups of `batch`, as many as the rank with the fewest has (groups dropped for a
    faulty reward), so every rank runs the same optimizer steps; `batch` at world size 1."""
    take = int(collective.all_min(torch.tensor(float(batch.n_groups))))
    return batch if take == batch.n_groups else batch.first_groups(take)


# --------------------------------------------------------------------------- 5. update
def update(
    cfg: config.TrainConfig,
    algo: Algorithm,
    m: Models,
    batch: Batch,
    kl_coef: float,
    seed: int,
    *,
    step: int,
) -> tuple[dict[str, float], int, int]:
    """ppo_epochs x minibatches optimizer steps; returns the mean metrics, the steps taken and skipped.
    Each minibatch is one optimizer step over its micro-batches, whose aggregators share the whole
    step's denominators (StepCounts): micro-batching does not change the gradient. The critic decides
    what loop step `step` trains (polgrad/critic.py: while it warms up, itself alone)."""
    rng = torch.Generator().manual_seed(seed)
    n = batch.size
    totals: dict[str, float] = {}
    n_updates, skipped = 0, 0
    for _epoch in range(algo.ppo_epochs if n else 0):
        for mb_rows in torch.randperm(n, generator=rng).chunk(min(algo.minibatches, n)):
            micro = list(mb_rows.split(cfg.micro_batch_size))
            counts = StepCounts.of_step([batch.mask[rows] for rows in micro])
            m.engine.module.train()
            for i, rows in enumerate(micro):
                last = i == len(micro) - 1
                metrics = micro_step(cfg, algo, m, batch.select(rows), counts, kl_coef, last=last, step=step)
                for k, v in metrics.items():
                    totals[k] = totals.get(k, 0.0) + float(v)
            with hooks.phase("optim"):  # the policy's step (None: a warm-up's), then the critic's own
                applied = m.critic.optimizer_step(m.engine, step)
            skipped += applied is False
            n_updates += 1
    # Each micro-batch metric is a share of its step's mean (denominators of the whole step over
    # every rank): the sum over a step's micro-batches and ranks is the step mean, so the row
    # reports the mean over the n_updates optimizer steps (every rank runs the same steps).
    keys = sorted(totals)
    summed = collective.all_sum(torch.tensor([totals[k] for k in keys], dtype=torch.float64)).tolist()
    return {k: v / max(n_updates, 1) for k, v in zip(keys, summed, strict=True)}, n_updates, skipped


def micro_step(
    cfg: config.TrainConfig,
    algo: Algorithm,
    m: Models,
    mb: Batch,
    counts: StepCounts,
    kl_coef: float,
    last: bool,
    step: int,
) -> dict[str, Tensor]:
    """Forward, loss and backward of one micro-batch (the optimizer steps after the `last` one) of
    loop step `step` (a critic warming up backs up its value loss alone: polgrad/critic.py)."""
    # One forward gives log-probs, entropy (and logits for an exact-KL part). The training forwards
    # go through the engines, not their modules: ZeRO-3 counts micro-batches in the engine's forward
    # and would otherwise overwrite, not add, each micro-batch's gradient (DeepSpeed 0.19).
    with hooks.phase("policy_fwd"):
        out = hf_rollout.response_logprobs(
            m.engine,
            mb.rollout,
            temperature=cfg.temperature,
            with_entropy=True,
            logit_rows=algo.needs_logits,
        )
    fresh: dict[str, Tensor] = {"logp": out.logp.double(), "entropy": out.entropy.double()}
    fresh.update(m.reference.logits(out, mb.rollout, cfg.temperature))  # an exact-KL part's [B,T,V] ({})
    fresh.update(m.critic.fresh(mb.rollout))  # the critic's values with a graph ({} without a critic)
    with hooks.phase("loss"):
        policy_loss, value_loss, metrics = algo.loss(mb.replace(**fresh), counts, kl_coef=kl_coef)
    # A NaN/inf loss never reaches the optimizer: distributed.backward poisons the whole step,
    # which DeepSpeed then skips on every rank (see distributed.py).
    with hooks.phase("backward"):  # policy and value losses as the critic is trained (polgrad/critic.py)
        m.critic.backward(m.engine, policy_loss, value_loss, last=last, step=step)
    return metrics


# --------------------------------------------------------------------------- 6. log
def step_row(m: Models, sampled: Batch, batch: Batch, state: LoopState, prep: dict, update: dict) -> dict:
    """The metrics row of one step: rewards of every sample, update metrics, KL to the reference.

    Every number is over the whole batch of every rank (sums reduced by polgrad.collective)."""
    scores = sampled.scores.double()
    row: dict[str, Any] = {"step": state.step, **prep}
    row.update(m.row_fields)  # e.g. the reward model's held-out pairwise accuracy
    lengths = sampled.rollout.mask.sum(-1).double()
    errors = m.rewards.take()  # faulty rewards (train.reward_errors)
    sums = [len(scores), scores.sum(), is_correct(scores).double().sum(), lengths.sum(), batch.size, errors]
    n, score_sum, correct, length_sum, update_seqs, reward_errors = collective.all_sum(
        torch.tensor([float(x) for x in sums], dtype=torch.float64)
    ).tolist()
    row["reward_errors"] = int(reward_errors)
    n = max(n, 1.0)  # every group dropped for a faulty reward: the means are 0
    mean = score_sum / n
    _, _, score_var = collective.moments(scores, ddof=1)
    if update_seqs == 0:
        row["skipped_update"] = "every sequence was filtered out"
    row.update(
        reward_mean=mean,
        reward_std=math.sqrt(float(score_var)) if n > 1 else 0.0,  # sample std, as torch.std
        train_accuracy=correct / n,
        response_len=length_sum / n,
        update_seqs=update_seqs,
        kl_coef=state.kl_coef,  # the coefficient this step ran with (the controller moves it after)
        skipped_steps=state.skipped_steps,
    )
    row.update(update, **response_lengths(lengths, m.score.verdicts(sampled)))  # right/wrong lengths
    row.update(m.score.row(sampled, n))  # a reward model's run: the gold (task verifier) beside its proxy
    row.update(m.reference.row(batch, update_seqs))  # the KL to the reference, per token and per sequence
    row.update(m.critic.row(batch, update_seqs))  # the critic's explained variance
    return row


def _progress(it, *, enabled: bool, desc: str):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, unit="step", dynamic_ncols=True)
