"""Reward-model training: Bradley-Terry on a task's preference pairs -> a cached ScalarHeadModel dir.

    train_reward_model   Bradley-Terry on task.preference_pairs -> cached ScalarHeadModel dir
    pairwise_accuracy    fraction of (prompt, chosen, rejected) pairs ranked correctly

Load the result with polgrad.models.load_reward_model; the cache is polgrad.models.cache.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence

import torch
from torch import nn

from polgrad.checks import is_int
from polgrad.errors import ConfigError, DataError
from polgrad.models.cache import (
    MODEL_CODE_VERSION,
    cache_entry,
    cache_root,
    checkpoint_fingerprint,
    digest,
    read_info,
    write_info,
)
from polgrad.models.heads import FullRewardModel, ScalarHeadModel, sequence_scores
from polgrad.models.loading import check_dir
from polgrad.models.lora import LoraRewardModel
from polgrad.models.threads import default_num_threads, torch_threads
from polgrad.models.tokenizer import encode_sequences, load_tokenizer
from polgrad.pretrain.sft import make_task, warmup_then

# The default reward-model budget: ~20 s on this CPU. Measured held-out pairwise accuracy (seed 0,
# SFT warm starts with the defaults): task.sort 0.94, task.reverse 0.50-0.65, task.add (digits=2)
# 0.53-0.54 (seeds 0-2). The add pairs are hard negatives (off by one, a dropped carry, one digit
# wrong): telling them apart means re-doing the addition at the EOS, and a 4-layer model does not
# learn that from one bit per pair within minutes. Tried without success (all <= 0.60): 2000 steps,
# lr 3e-4..3e-3, batch 128, a head-only probe, training only the last layer, two extra layers, a
# random head, mean-pooled or pre-EOS readout, an 87%-accurate SFT backbone. The SFT policy's own
# log-likelihood ranks 81% of the same pairs correctly, so the information is there, just not
# reachable by a scalar head at the EOS on this budget.
RM_PAIRS = 4096
RM_STEPS = 300
RM_BATCH_SIZE = 32
RM_LR = 1e-3
RM_HELDOUT_PAIRS = 512


def _pair_scores(
    model, tokenizer, batch: Sequence[tuple[str, str, str]]
) -> tuple[torch.Tensor, torch.Tensor]:
    prompts = [p for p, _, _ in batch]
    ids, attn, _ = encode_sequences(
        tokenizer, prompts + prompts, [c for _, c, _ in batch] + [r for _, _, r in batch]
    )
    scores = sequence_scores(model, ids, attn)
    return scores[: len(batch)], scores[len(batch) :]


@torch.no_grad()
def pairwise_accuracy(
    model, tokenizer, pairs: Sequence[tuple[str, str, str]], *, batch_size: int = 256
) -> float:
    """Fraction of (prompt, chosen, rejected) pairs with score(chosen) > score(rejected)."""
    was = model.training
    model.eval()
    wins = 0
    for i in range(0, len(pairs), batch_size):
        c, r = _pair_scores(model, tokenizer, pairs[i : i + batch_size])
        wins += int((c > r).sum())
    model.train(was)
    return wins / max(1, len(pairs))


def train_reward_model(
    policy_path: str | os.PathLike,
    task,
    *,
    pairs: int = RM_PAIRS,
    steps: int = RM_STEPS,
    lr: float = RM_LR,
    seed: int = 0,
    batch_size: int = RM_BATCH_SIZE,
    heldout_pairs: int = RM_HELDOUT_PAIRS,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    threads: int | None = None,
    form: FullRewardModel | LoraRewardModel | None = None,
    member: int = 0,
    chat_template: bool | None = None,
) -> tuple[str, float]:
    """Bradley-Terry reward model on `task.preference_pairs`; returns (checkpoint dir, held-out accuracy).

    Model: `ScalarHeadModel` with the SFT policy's backbone and a zero head. Loss (Ouyang et al. 2022,
    eq. 1): mean over pairs of -log sigmoid(r(x, y_chosen) - r(x, y_rejected)), the score read at the
    EOS token of prompt + response + EOS. `pairs` training pairs (seed `seed`) are cycled through in
    batches of `batch_size` for `steps` AdamW steps (warm-up 5%, cosine to lr/10). Held-out accuracy:
    the fraction of `heldout_pairs` fresh pairs (another seed, prompts disjoint from the training
    pairs) ranked correctly, or of the task's own held-out pairs where it has them
    (`heldout_preference_pairs`: task.file with a preference file). `task` is a Task or a registered
    task name. Cached like `warm_start`; the directory also holds the tokenizer and a polgrad.json with
    the stats (including the training-pair accuracy). `progress` and `threads` as in `warm_start`.

    Measured accuracies with the defaults are next to RM_STEPS: 0.94 on task.sort, but near chance
    on task.add, whose preference pairs need the sum itself to be told apart.

    `form`: how the model trains and is saved, chosen by the run's model layout (polgrad/layout.py):
    `FullRewardModel()` (None: the default) trains every weight; `LoraRewardModel(spec)` trains a LoRA
    adapter 'reward' on the frozen backbone + the head instead: the directory then holds the adapter
    (`lora.REWARD_FILE`), the head and the config, no backbone weights, and loads onto a LoRA policy
    with `lora.add_reward_model` (one backbone in the run).

    `member` k > 0 is member k of an ensemble (train.rm_ensemble; Coste et al. 2024): the same
    training and held-out pairs, another initialisation seed: its head starts from N(0, 1/H) (H the
    hidden size; member 0, the single reward model, keeps the zero head), its LoRA adapter (if any)
    from that seed too, and the pairs are visited in that seed's order. Cached under its own key.

    `chat_template` (train.chat_template): False feeds prompts raw to a policy whose tokenizer has a
    chat template (polgrad.models.prompt_ids); the template in effect (if any) is part of the key.
    """
    if isinstance(task, str):
        task = make_task(task, None)
    form = FullRewardModel() if form is None else form
    if not is_int(member) or member < 0:
        raise ConfigError(f"train_reward_model: member must be an integer >= 0, got {member!r}")
    if pairs < 1 or steps < 0 or batch_size < 1 or not lr > 0:
        raise ConfigError(
            f"train_reward_model: need pairs >= 1, steps >= 0, batch_size >= 1, lr > 0; got "
            f"{pairs}, {steps}, {batch_size}, {lr}"
        )
    policy = check_dir(policy_path, "policy")
    train = task.preference_pairs(pairs, seed)
    seen = {p for p, _, _ in train}
    own = getattr(task, "heldout_preference_pairs", None)  # a task with a held-out set of its own pairs
    heldout = own(heldout_pairs) if own is not None else None
    if heldout is None:
        fresh = task.preference_pairs(2 * heldout_pairs, seed + 7919)
        heldout = [t for t in fresh if t[0] not in seen][:heldout_pairs]
    if not heldout:
        raise DataError(f"task.{task.name}: no held-out preference pairs with prompts unseen in training")
    template = getattr(load_tokenizer(policy, chat_template=chat_template), "chat_template", None)
    key_fields = {
        "kind": "reward_model",
        "version": MODEL_CODE_VERSION,
        "task": task.name,
        "policy": checkpoint_fingerprint(policy),
        "rm": {
            "pairs": pairs,
            "steps": steps,
            "lr": lr,
            "batch_size": batch_size,
            "heldout_pairs": heldout_pairs,
            **form.key(),  # {} for the full form (the keys of before LoRA), {'lora': settings}
            **({"member": member} if member else {}),  # absent for the single reward model, likewise
            # the chat template in effect (absent without one: the keys of before; a template's text
            # changes every prompt's tokens, so a reward model trained without it is not reused)
            **({"chat_template": digest(template)} if template else {}),
        },
        "seed": seed,
        "data": digest([train, heldout]),
    }
    key = digest(key_fields)
    name = f"{task.name}-{key[:16]}"
    with cache_entry(cache_root(cache_dir) / "rm", name) as (final, tmp):
        if tmp is None:
            return str(final), float(read_info(final)["stats"]["heldout_pairwise_accuracy"])
        with torch_threads(threads or default_num_threads()):
            options = dict(
                steps=steps, batch_size=batch_size, lr=lr, seed=seed, form=form, member=member,
                chat_template=chat_template,
            )  # fmt: skip
            acc = _train_rm(task, policy, train, heldout, options, progress, key_fields, key, tmp)
    return str(final), acc


def _member_seed(seed: int, member: int) -> int:
    """The initialisation seed of ensemble member `member` (> 0) of the reward model of seed `seed`."""
    return (seed * 1_000_003 + member) % 2**31


def _train_rm(task, policy, train, heldout, options: dict, progress, key_fields, key, tmp) -> float:
    """The Bradley-Terry run behind `train_reward_model`: train, evaluate, write into `tmp`. `options`:
    its steps, batch_size, lr, seed, form, member and chat_template, as `train_reward_model` was
    given them."""
    from tqdm.auto import tqdm

    steps, batch_size, lr, seed = options["steps"], options["batch_size"], options["lr"], options["seed"]
    form, member = options["form"], options["member"]

    t0 = time.perf_counter()
    tokenizer = load_tokenizer(policy, chat_template=options["chat_template"])
    model = ScalarHeadModel.from_backbone(policy)
    with torch.random.fork_rng(devices=[], enabled=member > 0):
        if member:  # an ensemble member: its own random head (and adapter) from its own seed
            torch.manual_seed(_member_seed(seed, member))
            with torch.no_grad():
                model.head.weight.normal_(0.0, model.head.weight.shape[-1] ** -0.5)
        form.prepare(model)  # the LoRA form: the backbone frozen, adapter 'reward' + the head trained
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_then(steps, max(1, steps // 20), decay=True))
    order = list(range(len(train)))
    rng = random.Random(_member_seed(seed, member) if member else seed)
    rng.shuffle(order)
    losses: list[float] = []
    cursor = 0
    bar = tqdm(range(steps), desc=f"reward model {task.name}", disable=not progress, mininterval=1.0)
    for _ in bar:
        idx = []
        while len(idx) < batch_size:
            if cursor == len(order):
                rng.shuffle(order)
                cursor = 0
            take = order[cursor : cursor + batch_size - len(idx)]
            idx += take
            cursor += len(take)
        chosen, rejected = _pair_scores(model, tokenizer, [train[i] for i in idx])
        loss = -nn.functional.logsigmoid(chosen - rejected).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()
    acc = pairwise_accuracy(model, tokenizer, heldout)
    form.save(model, tmp)
    tokenizer.save_pretrained(tmp)
    tail = losses[-10:]
    write_info(
        tmp,
        {
            **key_fields,
            "key": key,
            "policy_path": str(policy),
            "stats": {
                "steps": steps,
                "final_loss": sum(tail) / len(tail) if tail else None,
                "train_pairwise_accuracy": pairwise_accuracy(model, tokenizer, train[: len(heldout)]),
                "heldout_pairwise_accuracy": acc,
                "heldout_pairs": len(heldout),
                "seconds": round(time.perf_counter() - t0, 2),
            },
        },
    )
    return acc
