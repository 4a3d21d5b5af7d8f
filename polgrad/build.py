"""A run's models, built once and complete, one builder per role: policy, reward model, reference,
critic, engines, sampler.

`build_models` returns the `Models` bundle the loop reads and never patches: the policy's DeepSpeed
engine and tokenizer, the `Reference` strategy (polgrad/reference.py), the `Critic` strategy
(polgrad/critic.py), the scorer of the responses (the task's verifier or a reward model), the
`Sampler` strategy (polgrad/sampling.py), and what summary.json records of the warm start.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from polgrad import collective, config, models, pretrain, sampling, stopping
from polgrad import distributed as dist_lib
from polgrad.algorithm import Algorithm
from polgrad.critic import Critic, NoCritic, OwnEngineCritic, PolicyEngineCritic
from polgrad.errors import ConfigError
from polgrad.layout import FullCopies, Layout, layout_for
from polgrad.reference import FrozenReference, LogitsReference, NoReference, Reference
from polgrad.rollout import hf as hf_rollout
from polgrad.tasks.base import is_correct
from polgrad.tasks.rewards import RewardGuard


# --------------------------------------------------------------------------- the bundle
class TaskScorer:
    """Scores with the task's own verifier, each reward checked by `rewards` (train.reward_errors).

    The reward trained on is the gold one: `gold` has nothing more to measure (None), and no proxy
    scores the held-out responses (`proxy` None)."""

    proxy = None

    def __init__(self, rewards: RewardGuard):
        self.rewards = rewards

    def __call__(self, rollout: hf_rollout.Rollout, task: Any) -> Tensor:
        return self.rewards.task_scores(task, rollout.examples, rollout.texts)

    def gold(self, rollout: hf_rollout.Rollout, task: Any) -> Tensor | None:
        return None

    def verdicts(self, sampled: Any) -> Tensor:
        """[B]: the scores that say right or wrong (`tasks.base.is_correct`): the verifier's own."""
        return sampled.scores

    def row(self, sampled: Any, n: float) -> dict[str, float]:
        return {}  # the reward trained on is the gold one: nothing more to log


class RewardModelScorer:
    """Scores with a learned reward model (train.reward_source = 'reward_model'), checked by `rewards`.

    The reward model is a proxy of the task's gold reward (its verifier): `gold` scores the same
    samples with the verifier (checked by `gold_rewards`; a measurement, never trained on), and
    `proxy` scores any rollout with the reward model (the evaluator's held-out responses), so a run
    logs the proxy beside the gold as the policy moves (Gao et al. 2023, "Scaling Laws for Reward
    Model Overoptimization").

    `model` is one reward model, or a list of K (an ensemble, train.rm_ensemble): each scores every
    response, member_scores [K,B], and `combine` (a reward_ensemble part, train.rm_combine) makes the
    one score [B] trained on and logged as the proxy. One model is scored as before, without `combine`."""

    def __init__(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        rewards: RewardGuard,
        gold_rewards: RewardGuard | None = None,
        combine: Callable[[Tensor], Tensor] | None = None,
    ):
        self.members = list(model) if isinstance(model, (list, tuple)) else [model]
        self.model = self.members[0]
        self.rewards, self.combine = rewards, combine
        self.gold_rewards = gold_rewards or RewardGuard("zero")
        if len(self.members) > 1 and combine is None:
            raise ValueError("RewardModelScorer: an ensemble of reward models needs `combine`")

    def _scores(self, rollout: hf_rollout.Rollout) -> Tensor:
        if len(self.members) == 1:
            return hf_rollout.rollout_scores(self.model, rollout)
        member_scores = torch.stack([hf_rollout.rollout_scores(m, rollout).double() for m in self.members])
        return self.combine(member_scores)

    def __call__(self, rollout: hf_rollout.Rollout, task: Any) -> Tensor:
        return self.rewards.checked(self._scores(rollout), rollout.examples, rollout.texts)

    def gold(self, rollout: hf_rollout.Rollout, task: Any) -> Tensor | None:
        """[B] float64: the task verifier's score of the same samples."""
        return self.gold_rewards.task_scores(task, rollout.examples, rollout.texts)

    def proxy(self, rollout: hf_rollout.Rollout) -> Tensor:
        """[B] float64: the reward model's score (unchecked: a measurement of held-out responses)."""
        return self._scores(rollout).double()

    def verdicts(self, sampled: Any) -> Tensor:
        """[B]: the scores that say right or wrong: the gold ones (a proxy's score is no verdict)."""
        return sampled.gold_scores

    def row(self, sampled: Any, n: float) -> dict[str, float]:
        """The gold (task verifier) beside the proxy: its mean and accuracy over the `n` samples of
        every rank."""
        gold = sampled.gold_scores.double()
        g_sum, g_ok = collective.all_sum(torch.stack([gold.sum(), is_correct(gold).double().sum()])).tolist()
        return {"gold_reward_mean": g_sum / n, "gold_accuracy": g_ok / n}


class NoBaseline:
    """A spec without a baseline rollout: no baseline scores; a sampling call drew its rows alone."""

    def __call__(self, rollout: hf_rollout.Rollout, task: Any) -> Tensor | None:
        return None

    def sampled(self, rollout: hf_rollout.Rollout) -> tuple[float, float]:
        """(sequences, generated tokens) one sampling call drew on this rank (the budget's counters)."""
        return stopping.sampled(rollout)


class GreedyBaseline:
    """ReMax's greedy baseline (a part with meta needs_baseline_rollout): the sampler adds one greedy
    response per prompt (`rollout.baseline`), scored by the run's scorer as the samples are: [P]."""

    def __init__(self, score: Callable[[hf_rollout.Rollout, Any], Tensor]):
        self.score = score

    def __call__(self, rollout: hf_rollout.Rollout, task: Any) -> Tensor | None:
        return self.score(rollout.baseline, task)

    def sampled(self, rollout: hf_rollout.Rollout) -> tuple[float, float]:
        """(sequences, generated tokens) one sampling call drew on this rank: its rows and its greedy
        responses."""
        rows, tokens = stopping.sampled(rollout)
        greedy, greedy_tokens = stopping.greedy_sampled(rollout.baseline)
        return rows + greedy, tokens + greedy_tokens


@dataclasses.dataclass(frozen=True)
class Models:
    """The run's models, complete when built (`build_models`); the loop reads them and never sets them.

    `score(rollout, task)` is one scalar per sequence [B] float64: the reward model's, else the task's
    verifier's, each checked by `rewards` (train.reward_errors: a reward that raises or is not a finite
    number stops the run in one line, is scored 0, or is NaN ('skip_group': the loop drops its group)).
    `baseline(rollout, task)` scores a greedy baseline rollout [P] (ReMax), or is None (`NoBaseline`).
    `row_fields` go into every metrics row (a reward model's held-out pairwise accuracy)."""

    engine: Any  # the policy's DeepSpeed engine
    tokenizer: Any
    sampler: sampling.Sampler
    critic: Critic = dataclasses.field(default_factory=NoCritic)
    reference: Reference = dataclasses.field(default_factory=NoReference)  # polgrad/reference.py
    rewards: RewardGuard = dataclasses.field(default_factory=RewardGuard)
    score: Callable[[hf_rollout.Rollout, Any], Tensor] | None = None  # default: TaskScorer(rewards)
    baseline: Callable[[hf_rollout.Rollout, Any], Tensor | None] = dataclasses.field(
        default_factory=NoBaseline
    )
    row_fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    layout: Layout = dataclasses.field(default_factory=FullCopies)  # polgrad/layout.py
    warm_start_s: float = 0.0  # seconds spent in polgrad.pretrain (SFT warm start, reward model)
    warm_start: str = ""  # which policy the run started from (`warm_start_id`)

    def __post_init__(self) -> None:
        if self.score is None:
            object.__setattr__(self, "score", TaskScorer(self.rewards))

    def summary_fields(self) -> dict[str, Any]:
        """What summary.json records of the warm start: its seconds and its identity (`warm_start_id`)."""
        return {"warm_start_s": self.warm_start_s, "warm_start": self.warm_start}


# --------------------------------------------------------------------------- the builders
def build_models(
    cfg: config.TrainConfig, algo: Algorithm, task: Any, *, out_dir: str, seed_of: Callable[[int], int]
) -> Models:
    """Policy (built and warm-started by cached SFT unless train.policy_path), then what the parts need.

    The inputs are checked against the policy before anything trains (`models.check_inputs`: the
    task's prompts fit the model's positions and survive its tokenizer). `Models.warm_start_s` is
    the time spent in polgrad.pretrain (SFT, reward model; ~0 when cached), `Models.warm_start` the
    starting policy's `warm_start_id`. `seed_of(step)` is the seed of a step's first sampling round
    (the async sampler draws the coming steps' prompts with it); `out_dir` holds the checkpoints a
    resumed async sampler reads. The roles are built in a fixed order (policy, reward model,
    reference, critic, engines, sampler): each draws its random initialisation from the RNG
    `distributed.setup` seeded, so the order is part of the run's reproducibility."""
    check_tiny_positions(cfg, task)  # before the warm start's SFT trains on prompts it cannot hold
    t_pretrain = time.perf_counter()
    with collective.rank_zero_first():  # rank 0 fills the cache, the others read it
        policy_path = warm_start(cfg)
    warm_start_s = time.perf_counter() - t_pretrain
    layout = layout_for(cfg, algo)  # full copies, or one LoRA backbone: chosen here, once
    policy, tokenizer = _policy(cfg, task, policy_path, layout)
    t_pretrain = time.perf_counter()
    with collective.rank_zero_first():
        rm_path, rm_accuracy, reward_model = reward_models(cfg, algo, task, policy, policy_path, layout)
    warm_start_s += time.perf_counter() - t_pretrain if rm_path is not None else 0.0
    reference = _reference(cfg, algo, policy, policy_path, layout)
    critic, in_policy_engine, lr_groups = _critic(cfg, algo, policy, policy_path, rm_path, layout)
    if cfg.gradient_checkpointing:  # the trained models recompute their layers in the backward
        if in_policy_engine:  # a LoRA critic on the policy's backbone switches adapters around its
            # forward; the backward would recompute its layers with the policy's adapter active
            raise ConfigError(
                "train.gradient_checkpointing = True with a critic on the policy's LoRA backbone "
                "(value_init.lora, value_init.shared_lora) is not supported: the backward would recompute "
                "the critic's layers under the policy's adapter; bind train.gradient_checkpointing = False "
                "or give the critic its own model (e.g. Algorithm.value_init = @value_init.policy)"
            )
        models.checkpoint_activations(policy, "policy")
        if critic is not None and not in_policy_engine:
            models.checkpoint_activations(critic, "critic")
    ds = dict(
        zero_stage=cfg.zero_stage,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum=1,
        bf16=cfg.bf16,
        grad_clip=cfg.grad_clip,
    )
    engine = dist_lib.make_engine(policy, lr=cfg.lr, eps=cfg.adam_eps, lr_groups=lr_groups, **ds)
    critic_engine = None
    if critic is not None and not in_policy_engine:
        critic_engine = dist_lib.make_engine(critic, lr=cfg.critic_lr, eps=cfg.adam_eps, **ds)
    if cfg.compile:  # train.compile: the forwards (and with them the backward and decode) compiled in place
        models.compiled.compile_models(
            engine.module, reference, None if critic_engine is None else critic_engine.module
        )
    if critic is None:
        strategy: Critic = NoCritic()
    elif in_policy_engine:  # a LoRA critic: the policy's engine trains it
        strategy = PolicyEngineCritic(critic)
    else:
        strategy = OwnEngineCritic(critic_engine, warmup_steps=cfg.critic_warmup_steps)
    sampler = sampling.make_sampler(
        cfg,
        algo,
        task,
        out_dir,
        engine.module,
        tokenizer,
        policy_path,
        seed_of,
        layout,
        keep_distribution=reference is not None,
    )
    rewards = RewardGuard(
        cfg.reward_errors, cfg.task_name, f"the reward model {rm_path}", timeout_s=cfg.reward_timeout_s
    )
    # The gold reward of a reward-model run is measured, never trained on: a faulty one counts 0 (warned).
    gold = RewardGuard("zero", cfg.task_name, timeout_s=cfg.reward_timeout_s)
    score = (
        TaskScorer(rewards)
        if reward_model is None
        else RewardModelScorer(reward_model, rewards, gold, combine=cfg.ensemble_combine)
    )
    return Models(
        engine=engine,
        tokenizer=tokenizer,
        sampler=sampler,
        critic=strategy,
        reference=_reference_role(algo, reference),
        rewards=rewards,
        score=score,
        baseline=GreedyBaseline(score) if algo.needs_baseline_rollout else NoBaseline(),
        row_fields={} if rm_accuracy is None else {"rm_heldout_accuracy": rm_accuracy},
        layout=layout,
        warm_start_s=warm_start_s,
        warm_start=warm_start_id(policy_path),
    )


def _policy(
    cfg: config.TrainConfig, task: Any, policy_path: str, layout: Layout
) -> tuple[torch.nn.Module, Any]:
    """The warm-started policy and its tokenizer, checked against the task, as the layout trains it
    (with LoRA the backbone is frozen and the actor trains its adapter)."""
    # a config.json that is no model's: one line here, not a traceback from the tokenizer's loader
    models.load_config(models.check_dir(policy_path, "policy"), "policy")
    tokenizer = models.load_tokenizer(policy_path, chat_template=cfg.chat_template)  # before the weights
    policy = models.load_policy(policy_path)
    models.check_inputs(
        task, tokenizer, policy.config, cfg.max_new_tokens, path=policy_path, name=cfg.task_name
    )
    return layout.policy(policy), tokenizer


def reward_models(
    cfg: config.TrainConfig,
    algo: Algorithm,
    task: Any,
    policy: torch.nn.Module,
    policy_path: str,
    layout: Layout,
) -> tuple[str | None, float | None, list[torch.nn.Module] | None]:
    """(checkpoint, held-out pairwise accuracy, scoring models). A reward model is trained (cached) when
    it scores the responses or initialises the critic; it scores them with train.reward_source =
    'reward_model'. The layout trains and loads it: with LoRA an adapter + head on the policy's
    backbone, unless a part (value_init.reward_model) reads the reward model's own checkpoint: then
    the full model.
    With train.rm_ensemble = K the K members (member 0 first: the single reward model, whose checkpoint
    a value_init part reads) all score; the accuracy is then the members' mean."""
    if not (cfg.reward_source == "reward_model" or algo.needs_reward_model):
        return None, None, None
    rm: dict[str, Any] = {"form": layout.reward_model_form()}
    if cfg.rm_steps is not None:
        rm["steps"] = cfg.rm_steps
    if cfg.rm_pairs is not None:
        rm["pairs"] = cfg.rm_pairs
    if cfg.chat_template is not None:
        rm["chat_template"] = cfg.chat_template
    trained = [
        pretrain.train_reward_model(
            policy_path, task, seed=cfg.warm_start_seed, progress=cfg.progress, member=k, **rm
        )
        for k in range(cfg.rm_ensemble if cfg.reward_source == "reward_model" else 1)
    ]
    rm_path = trained[0][0]
    rm_accuracy = sum(acc for _, acc in trained) / len(trained)
    reward_models = None
    if cfg.reward_source == "reward_model":
        reward_models = [layout.reward_model(policy, path, k) for k, (path, _) in enumerate(trained)]
    return rm_path, rm_accuracy, reward_models


def _reference(
    cfg: config.TrainConfig, algo: Algorithm, policy: torch.nn.Module, policy_path: str, layout: Layout
) -> torch.nn.Module | None:
    """The frozen reference when a part reads it or the run measures KL (train.measure_kl), as the
    layout keeps it (with LoRA the policy's own module with its adapter disabled: no second copy)."""
    if not (algo.needs_reference or cfg.measure_kl):
        return None
    return layout.reference(policy, policy_path, bf16=cfg.bf16)


def _reference_role(algo: Algorithm, module: torch.nn.Module | None) -> Reference:
    """The reference strategy (polgrad/reference.py) for the frozen module `_reference` built, if any."""
    if module is None:
        return NoReference()
    return LogitsReference(module) if algo.needs_logits else FrozenReference(module)


def _critic(
    cfg: config.TrainConfig,
    algo: Algorithm,
    policy: torch.nn.Module,
    policy_path: str,
    rm_path: str | None,
    layout: Layout,
) -> tuple[Any, bool, tuple]:
    """The critic module the spec's value_init part builds (None without one), whether the policy's
    engine trains it, and the extra param groups of that engine, as the layout places it (a `lora`
    part on a LoRA backbone: its head and own adapter train in the policy's engine at the critic's
    lr)."""
    if not algo.needs_critic:
        return None, False, ()
    return layout.critic(algo, policy, policy_path, rm_path, cfg.critic_lr)


# --------------------------------------------------------------------------- the warm start
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


def check_tiny_positions(cfg: config.TrainConfig, task: Any) -> None:
    """Without train.policy_path, the task's prompts + train.max_new_tokens against the positions the
    tiny default will have (`models.tiny_positions`, capped), before its SFT warm start: the length check
    `_policy` makes on the loaded model, made early (one line naming the prompt, no training)."""
    if cfg.policy_path is not None:
        return
    from polgrad.models.subword import tokens_per_char

    # counted in characters (the character tokenizer) against positions for the most tokens a character
    # can take under the run's tokenizer: a prompt that fits this fits
    tokenizer = models.build_tokenizer(task.alphabet)
    per_char = tokens_per_char(task, models.resolved_model_kwargs(cfg.model_kwargs)["subword_vocab"])
    positions = types.SimpleNamespace(max_position_embeddings=models.tiny_positions(task, per_char))
    prompts, _ = models.inputs.sample_texts(task)
    models.inputs.check_positions(
        prompts, tokenizer, positions, cfg.max_new_tokens, path=None, name=cfg.task_name
    )


def warm_start(cfg: config.TrainConfig) -> str:
    """The run's starting policy: train.policy_path, else the cached SFT warm start of the task's tiny
    model seeded by `cfg.warm_start_seed` (train.init_seed, else train.seed)."""
    if cfg.policy_path is not None:
        return cfg.policy_path
    sft: dict = {} if cfg.sft_steps is None else {"sft_steps": cfg.sft_steps}
    if not cfg.sft_stop_at_target:
        sft["target_accuracy"] = None
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
