"""Supervised warm start: SFT of the tiny model on a task's demonstrations -> a cached checkpoint dir.

    warm_start(...)      SFT on task.demonstrations -> cached HF checkpoint dir (the policy and reference)
    accuracy(...)        mean task reward of one (greedy or sampled) response per example

The cache (key, atomic entries, per-key lock) is polgrad.models.cache.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
from torch import nn

from polgrad.errors import ConfigError
from polgrad.models.cache import MODEL_CODE_VERSION, cache_entry, cache_root, digest, write_info
from polgrad.models.loading import save_model_dir
from polgrad.models.subword import task_subword_tokenizer, tokens_per_char
from polgrad.models.threads import default_num_threads, torch_threads
from polgrad.models.tiny import build_tiny, key_kwargs, resolved_model_kwargs
from polgrad.models.tokenizer import encode_sequences
from polgrad.registry import get, task_configuration
from polgrad.rollout.hf import generate
from polgrad.tasks.rewards import RewardGuard

# The default SFT budget, tuned on task.add (digits=2): SFT stops as soon as greedy accuracy on a probe
# of train-split prompts reaches SFT_TARGET_ACCURACY, so RL starts from a policy that is sometimes right
# (held-out greedy accuracy ~0.3). Fixed-step SFT is a poor way to hit that window: the accuracy of
# this model jumps from ~10% to ~80% within ~200 steps, and where the jump happens moves by ~150 steps
# with the seed (measured: seed 0 is at 16% after 400 steps, seed 1 at 59%). SFT_STEPS is the cap.
SFT_STEPS = 1000
SFT_BATCH_SIZE = 64
SFT_LR = 2e-3
SFT_TARGET_ACCURACY = 0.3
SFT_WARMUP_STEPS = 20
SFT_PROBE_EVERY = 10
SFT_PROBE_EXAMPLES = 128
SFT_EVAL_EXAMPLES = 256
SFT_LOG_EVERY = 50  # without a progress bar: one line on stdout every this many SFT steps


def warmup_then(steps: int, warmup: int, decay: bool):
    """LR multiplier: linear warm-up over `warmup` steps, then constant or cosine decay to 1/10."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if not decay:
            return 1.0
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def make_task(task_name: str, task_kwargs: dict[str, Any] | None):
    """The registered task `task_name` built with `task_kwargs`."""
    return get("task", task_name)(**(task_kwargs or {}))


def heldout_accuracy(
    model,
    tokenizer,
    task,
    *,
    n: int,
    seed: int,
    temperature: float = 0.0,
    split: str = "eval",
    rewards: RewardGuard | None = None,
    per_char: int = 1,
) -> float:
    """Mean task reward of one response per prompt of `split` (default: held-out); temperature 0 = greedy."""
    examples = task.examples(split, n, seed)
    kw = {"temperature": temperature, "rewards": rewards, "per_char": per_char}
    return accuracy(model, tokenizer, task, examples, seed=seed, **kw)


def accuracy(
    model,
    tokenizer,
    task,
    examples,
    *,
    seed: int,
    temperature: float = 0.0,
    rewards: RewardGuard | None = None,
    per_char: int = 1,
) -> float:
    """Mean task reward of one response per example (temperature 0 = greedy, `seed` seeds sampling), of
    at most `per_char` (subword.tokens_per_char) x the task's longest response + 1 tokens.

    `rewards` checks each reward (default: a faulty one raises a one-line error); a faulty reward
    it lets through (train.reward_errors 'zero' or 'skip_group') counts as 0."""
    out = generate(
        model,
        tokenizer,
        examples,
        group_size=1,
        temperature=temperature,
        max_new_tokens=per_char * int(task.max_response_chars) + 1,
        generator_seed=seed,
    )
    scores = (rewards or RewardGuard()).task_scores(task, out.examples, out.texts)
    return sum(scores.nan_to_num(0.0).tolist()) / len(scores)  # the arithmetic of the cached stats


def warm_start(
    task_name: str,
    task_kwargs: dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    *,
    sft_steps: int = SFT_STEPS,
    batch_size: int = SFT_BATCH_SIZE,
    lr: float = SFT_LR,
    target_accuracy: float | None = SFT_TARGET_ACCURACY,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    threads: int | None = None,
    reward_errors: str = "raise",
    reward_timeout_s: float | None = None,
) -> str:
    """Supervised warm start of the tiny model on `task.demonstrations`; returns the checkpoint dir.

    Model: `build_tiny(task, **model_kwargs, seed=seed)`. Loss: token-mean cross-entropy on the
    response tokens and the EOS only (BOS and prompt masked). AdamW (betas 0.9/0.95, no weight
    decay, grad-norm clip 1), each step a fresh batch of `batch_size` demonstrations.

    Budget: with `target_accuracy` set (the default), every 10 steps the greedy accuracy on 128
    train-split prompts is probed and SFT stops as soon as it reaches `target_accuracy` (or after
    `sft_steps` steps); the learning rate is constant after a 20-step warm-up, since the run is meant
    to stop mid-learning. With `target_accuracy=None`, exactly `sft_steps` steps with cosine decay to
    lr/10 after the warm-up.

    The directory holds `save_pretrained` of the model and tokenizer and a `polgrad.json` with the
    config and the SFT stats: steps taken, final loss (mean of the last 10 steps), the probe history,
    held-out greedy and sampled (temperature 1) accuracy on 256 eval-split prompts, seconds.

    Cached (polgrad.models.cache): a second call with the same arguments returns the same path at once.
    `progress`: a tqdm bar (on a terminal) or, when False, a line on stdout (flushed, so a sweep
    cell's stdout.log shows it) at the start, every `SFT_LOG_EVERY` steps and at the end.
    `reward_errors` (train.reward_errors): how a faulty task reward in the probe and the held-out
    accuracy is handled ('raise': a one-line error; else it counts as 0); `reward_timeout_s`
    (train.reward_timeout_s) the limit of one reward call. They, `progress` and `threads` (torch
    threads while training, default `default_num_threads()`) are not part of the key.
    """
    if sft_steps < 0 or batch_size < 1 or not lr > 0:
        raise ConfigError(
            f"warm_start: need sft_steps >= 0, batch_size >= 1, lr > 0; got {sft_steps}, {batch_size}, {lr}"
        )
    if target_accuracy is not None and not 0 < target_accuracy <= 1:
        raise ConfigError(f"warm_start: target_accuracy must be in (0, 1] or None, got {target_accuracy}")
    task = make_task(task_name, task_kwargs)
    mkw = {**resolved_model_kwargs(model_kwargs), "seed": seed}
    probe = task.examples("train", SFT_PROBE_EXAMPLES, seed + 1) if target_accuracy is not None else []
    key_fields = {
        "kind": "sft",
        "version": MODEL_CODE_VERSION,
        "task": task_name,
        "task_kwargs": task_configuration(task_name, task_kwargs),
        "model_kwargs": key_kwargs(mkw),
        "sft": {"steps": sft_steps, "batch_size": batch_size, "lr": lr, "target_accuracy": target_accuracy},
        "seed": seed,
        # a subword tokenizer as built (its vocabulary, merges and rules), so a change of how it is made
        # (the texts it learns from, the tokenizers library) is a new warm start, never a stale one
        **({"tokenizer": _tokenizer_digest(task, mkw["subword_vocab"])} if mkw["subword_vocab"] else {}),
        "data": digest(
            [
                task.alphabet,
                task.max_prompt_chars,
                task.max_response_chars,
                # a sample of the data, so that a task setting missing from task_kwargs (a gin
                # binding) still changes the key; the full demonstrations are drawn only on a miss
                task.demonstrations(64, seed),
                [(e.prompt, e.answer) for e in probe + task.examples("eval", 8, seed)],
            ]
        ),
    }
    key = digest(key_fields)
    name = f"{task_name}-{key[:16]}"
    with cache_entry(cache_root(cache_dir) / "sft", name) as (final, tmp):
        if tmp is None:
            return str(final)
        demos = task.demonstrations(sft_steps * batch_size, seed) if sft_steps else []
        with torch_threads(threads or default_num_threads()):
            rewards = RewardGuard(reward_errors, task_name, timeout_s=reward_timeout_s)
            stats, model, tokenizer = _sft(
                task, mkw, demos, probe, batch_size, lr, target_accuracy, seed, progress, rewards
            )
        save_model_dir(model, tmp)  # from any rank (transformers saves from rank 0 only)
        tokenizer.save_pretrained(tmp)
        n_params = sum(p.numel() for p in model.parameters())
        write_info(tmp, {**key_fields, "key": key, "n_params": n_params, "stats": stats})
    return str(final)


def _tokenizer_digest(task, subword_vocab: int) -> str:
    """The digest of the subword tokenizer `build_tiny` gives the task (its whole serialised form)."""
    return digest(task_subword_tokenizer(task, subword_vocab).backend_tokenizer.to_str())


def _log(text: str) -> None:
    print(text, flush=True)  # stdout: a sweep cell's stdout.log


def _sft(
    task, mkw, demos, probe, batch_size, lr, target, seed, progress, rewards
) -> tuple[dict[str, Any], Any, Any]:
    """The SFT run behind `warm_start`: -> (stats, trained model, tokenizer)."""
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    max_steps = len(demos) // batch_size
    model, tokenizer = build_tiny(task, **mkw)
    per_char = tokens_per_char(task, mkw["subword_vocab"])
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = min(SFT_WARMUP_STEPS, max(1, max_steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then(max_steps, warmup, decay=target is None))
    losses: list[float] = []
    history: list[tuple[int, float]] = []
    bar = tqdm(total=max_steps, desc=f"sft {task.name}", disable=not progress, mininterval=1.0)
    if not progress:
        _log(
            f"warm start: SFT of task.{rewards.task_name or task.name}, up to {max_steps} steps "
            "(cached once done)"
        )
    step, acc = 0, None
    while step < max_steps:
        batch = demos[step * batch_size : (step + 1) * batch_size]
        ids, attn, resp = encode_sequences(tokenizer, [p for p, _ in batch], [r for _, r in batch])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        weight = resp[:, 1:].float()
        loss = (nll * weight).sum() / weight.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if target is not None and (step % SFT_PROBE_EVERY == 0 or step == max_steps):
            acc = accuracy(model, tokenizer, task, probe, seed=seed, rewards=rewards, per_char=per_char)
            history.append((step, acc))
            bar.set_postfix(loss=f"{losses[-1]:.3f}", probe=f"{acc:.2f}", refresh=False)
            if acc >= target:
                break
        if not progress and step % SFT_LOG_EVERY == 0:
            probed = "" if acc is None else f", probe accuracy {acc:.2f}"
            _log(
                f"warm start: step {step}/{max_steps}, loss {losses[-1]:.3f}{probed}, "
                f"{time.perf_counter() - t0:.0f} s"
            )
    bar.close()
    train_seconds = time.perf_counter() - t0
    model.eval()
    tail = losses[-10:]
    stats = {
        "steps": step,
        "max_steps": max_steps,
        "stopped_at_target": bool(history) and history[-1][1] >= target,
        "final_loss": sum(tail) / len(tail) if tail else None,
        "probe_history": history,
        "heldout_greedy_accuracy": heldout_accuracy(
            model, tokenizer, task, n=SFT_EVAL_EXAMPLES, seed=seed, rewards=rewards, per_char=per_char
        ),
        "heldout_sampled_accuracy": heldout_accuracy(
            model,
            tokenizer,
            task,
            n=SFT_EVAL_EXAMPLES,
            seed=seed,
            temperature=1.0,
            rewards=rewards,
            per_char=per_char,
        ),
        "heldout_examples": SFT_EVAL_EXAMPLES,
        "train_seconds": round(train_seconds, 2),
        "total_seconds": round(time.perf_counter() - t0, 2),
    }
    if not progress:
        _log(
            f"warm start: done, {step} steps in {stats['total_seconds']:.0f} s, held-out greedy "
            f"accuracy {stats['heldout_greedy_accuracy']:.2f}"
        )
    return stats, model, tokenizer
