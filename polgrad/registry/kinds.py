"""The contract of every kind, written once: its call signature (a Protocol) and its metadata keys.

The training loop calls every part of a kind exactly as its Protocol's `__call__` says and never
branches on a name. `register()` checks each part against this file when it is registered
(`check_signature`, `check_meta`), `KINDS` (the signature strings shown by
`python -m polgrad.registry`) is generated from it, and CONTRIBUTING.md points here (the checks
themselves: polgrad/registry/contract.py).

Reading a Protocol: parameters before `*` are passed positionally, in that order; parameters
after `*` are passed by keyword; a parameter with a default here is one the loop may omit (so
the part needs a default for it too). Any further parameter of a part is a hyperparameter that
gin binds by the part's full name (`clip.ppo.eps_high = 0.28`): it must be keyword-only (after
`*`) or have a default.

Tensor names are the glossary's (CONTRIBUTING.md): B sequences, T response tokens, V vocabulary.

    logp, old_logp, ref_logp, rollout_logp  [B,T]  log-prob of each sampled response token
    mask        [B,T]  float 0/1, 1 on response tokens that count (holes allowed)
    rewards     [B]    one scalar per sequence (score, after shaping; plus folded KL if placed in reward)
    token_rewards [B,T] per-token rewards (score on the last valid token, minus beta*kl per token)
    group_ids   [B]    int64, sequences sampled from the same prompt share an id
    values, old_values, returns, adv  [B,T]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor, nn

from polgrad.registry.step_counts import StepCounts  # noqa: F401  (kept importable from here)

# --------------------------------------------------------------------------------------------
# The Protocols: one call signature per kind. The first docstring line is the return value.
# --------------------------------------------------------------------------------------------


class AdvantageFn(Protocol):
    def __call__(
        self,
        rewards: Tensor,
        mask: Tensor,
        *,
        group_ids: Tensor,
        values: Tensor | None,
        token_rewards: Tensor,
        baseline_rewards: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """(adv[B,T], returns[B,T]|None)

        adv is zero where mask is 0; returns is None when no critic is trained. values is None
        unless a part declares needs_critic, baseline_rewards None unless needs_baseline_rollout.
        """
        ...


class KLFn(Protocol):
    def __call__(
        self,
        logp: Tensor,
        ref_logp: Tensor,
        mask: Tensor,
        *,
        logits: Tensor | None = None,
        ref_logits: Tensor | None = None,
    ) -> Tensor:
        """kl[B,T]

        Per-token KL estimate, zero where mask is 0. logits/ref_logits are omitted when the KL is
        placed in the reward and passed (possibly None) in the loss; only parts that declare
        needs_logits get them: [B,T,V] tensors, or (the trainer's, at a large vocabulary) LogitRows
        that make the logits a chunk of positions at a time (polgrad/components/logit_rows.py:
        `as_logit_rows` takes either).
        """
        ...


class ClipFn(Protocol):
    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        adv: Tensor,
        mask: Tensor,
        *,
        rollout_logp: Tensor | None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss[B,T], metrics: dict[str, [B,T]])

        The per-token loss to minimise and per-token metric tensors such as 'clip_low',
        'clip_high' (0/1) and 'approx_kl'; the Algorithm averages metrics over the step's tokens.
        rollout_logp is None unless a part declares off_policy.
        """
        ...


class AggregateFn(Protocol):
    def __call__(self, loss: Tensor, mask: Tensor, counts: StepCounts) -> Tensor:
        """scalar

        This micro-batch's share of the step loss; every denominator comes from `counts`.
        """
        ...


class ValueLossFn(Protocol):
    def __call__(self, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
        """loss[B,T]"""
        ...


class ValueInitFn(Protocol):
    def __call__(self, *, policy_path: str, reward_model_path: str | None) -> nn.Module:
        """critic nn.Module: (input_ids, attention_mask) -> [B,S]

        A factory called once per run; reward_model_path is None unless a part declares
        needs_reward_model. A part that declares `lora` is also passed `policy=` (the peft policy).
        """
        ...


class KLControllerFn(Protocol):
    def __call__(self, kl_coef: float, measured_kl: float, n_steps: int) -> float:
        """the KL coefficient for the next step

        measured_kl is the per-sequence KL of the step's rollouts: the mean over the batch's
        sequences (all data-parallel ranks) of the sum over each response's valid tokens of
        log pi(y_t) - log pi_ref(y_t), in nats per sequence, the unit of Ziegler et al.'s target
        (6 nats). n_steps is the number of samples (sequences) since the last update.
        """
        ...


class RewardShapingFn(Protocol):
    def __call__(self, scores: Tensor, mask: Tensor, *, truncated: Tensor) -> Tensor:
        """scores[B]

        truncated [B] bool: no EOS within the generation budget.
        """
        ...


class RewardEnsembleFn(Protocol):
    def __call__(self, member_scores: Tensor) -> Tensor:
        """scores[B]

        member_scores [K,B]: the score of each of the K reward models of an ensemble (train.rm_ensemble)
        for each of the B sequences; the part combines them into the one score the loop trains on.
        """
        ...


class FilterFn(Protocol):
    def __call__(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """keep[B] bool: which sequences enter the update"""
        ...


class PreferenceFn(Protocol):
    def __call__(self, chosen_logratio: Tensor, rejected_logratio: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(loss[P], chosen_reward[P], rejected_reward[P])

        One row per preference pair (prompt, chosen y_w, rejected y_l). chosen_logratio [P] is
        log pi_theta(y_w|x) - log pi_ref(y_w|x), each log-prob summed over the response's tokens;
        rejected_logratio [P] the same for y_l. loss is each pair's loss (the loop averages it over
        the step's pairs); the rewards are the implicit rewards beta * logratio (detached), which
        the loop logs as accuracy (chosen > rejected) and margin. Hyperparameters (beta, ...) are
        keyword-only.
        """
        ...


class TaskFn(Protocol):
    def __call__(self) -> Any:
        """Task (polgrad/tasks/base.py)

        A factory the trainer calls with no arguments: every parameter is a hyperparameter that
        gin binds (`task.add.digits = 3`), so each must be keyword-only or have a default.
        """
        ...


class RewardFn(Protocol):
    def __call__(self, answer: str, response: str) -> float:
        """score in [0, 1]

        A verifier of a response against a task's reference answer (task.file.answer_format names
        one): answer is the reference's final answer (what follows the last '####' of a GSM8K-style
        reference), response the decoded response without EOS. 1.0 = right. Never raises on any
        response text (a response it cannot read scores 0.0).
        """
        ...


class TrackerFn(Protocol):
    def __call__(
        self, run_dir: str, *, name: str, group: str, params: dict[str, str], resume_step: int
    ) -> Any:
        """tracker: .log(metrics, step), .summary(values, step), .close(ok)

        A factory the run calls once, on rank 0, after its loop state is known (polgrad/tracking.py).
        name and group: the run's and its experiment's names (in a sweep the cell id and
        Sweep.name); params: what the run is (spec, train.* and a sweep's swept bindings) as
        strings; resume_step: the steps the resumed checkpoint covers (0: a fresh start). metrics
        and values are numbers only; step is the steps done (0: the starting policy's evaluation).
        """
        ...


# --------------------------------------------------------------------------------------------
# Kinds: Protocol + declared metadata keys
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetaKey:
    """A metadata key a part may declare: what it means, who reads it, and its allowed values."""

    meaning: str
    choices: tuple[Any, ...] | None = None  # allowed values; None: any value of `type`
    type: type = bool

    def check(self, value: Any) -> str | None:
        """Why `value` is not allowed, or None."""
        if self.choices is not None:
            return None if value in self.choices else f"must be one of {', '.join(map(repr, self.choices))}"
        if not isinstance(value, self.type):
            return f"must be a {self.type.__name__}"
        return None


_FORMULA = MetaKey(
    "the term this part contributes to the Table-5 core loss (Algorithm.table_row); also listed", type=str
)
_FORMULA_LISTED = MetaKey("descriptive: the part's formula, shown by `python -m polgrad.registry`", type=str)
_NEEDS_GROUPS = MetaKey("compares samples of the same prompt: Algorithm() requires group_size >= 2")
_NEEDS_TASK = MetaKey(
    "the Task method the run calls for this part, e.g. 'preference_pairs': config.build() (so the sweep's "
    "dry run) refuses a task without it, naming the tasks that have it",
    type=str,
)
META_KEYS: dict[str, dict[str, MetaKey]] = {
    "advantage": {
        "needs_critic": MetaKey(
            "uses `values`: a critic is built (Algorithm.value_init required) and trained"
        ),
        "needs_groups": _NEEDS_GROUPS,
        "needs_baseline_rollout": MetaKey(
            "uses `baseline_rewards`: the loop scores one extra greedy response per prompt"
        ),
        "level": MetaKey(
            "descriptive: 'token' (per-token advantages) or 'sequence' (one per response, broadcast)",
            choices=("token", "sequence"),
        ),
        "formula": _FORMULA,
    },
    "kl": {
        "needs_logits": MetaKey(
            "uses full-vocabulary logits: loaded when the KL is in the loss; refused in the reward"
        ),
        "unbiased": MetaKey("descriptive: the estimate's expectation under the policy is the true KL"),
        "formula": _FORMULA,
    },
    "clip": {
        "off_policy": MetaKey("uses `rollout_logp`, the sampler's own log-probs; marks the spec Off-policy"),
        "ratio": MetaKey(
            "descriptive: 'token' (per-token importance ratio) or 'sequence' (one per response)",
            choices=("token", "sequence"),
        ),
        "formula": _FORMULA,
    },
    "aggregate": {
        "denominator": MetaKey("descriptive: what the step loss is divided by, e.g. 'tokens'", type=str),
        "formula": _FORMULA,
    },
    "value_loss": {"formula": _FORMULA_LISTED},
    "value_init": {
        "needs_reward_model": MetaKey("a reward model is trained (cached) and its path passed in"),
        "needs_task": _NEEDS_TASK,
        "lora": MetaKey(
            "the critic sits on the policy's LoRA backbone (train.lora_r > 0): the part is also passed "
            "`policy=` (the peft policy module) and returns a polgrad.models.lora.LoraCritic"
        ),
    },
    "kl_controller": {
        "constant": MetaKey("never moves the coefficient: with kl_coef = 0 no reference model is loaded"),
        "formula": _FORMULA_LISTED,
    },
    "reward_shaping": {"formula": _FORMULA_LISTED},
    "reward_ensemble": {"formula": _FORMULA_LISTED},
    "filter": {"needs_groups": _NEEDS_GROUPS, "formula": _FORMULA_LISTED},
    "preference": {
        "formula": _FORMULA,
        "needs_task": _NEEDS_TASK,
        "method": MetaKey(
            "the method's name in Table 5 (table5_method), e.g. 'ipo': a preference spec is the method "
            "of its loss, whatever its Algorithm.name (default: the part's name)",
            type=str,
        ),
    },
    "task": {
        "key_neutral": MetaKey(
            "{parameter: default} of parameters added after runs were cached: left out of the task's "
            "configuration (which keys the warm-start and reward-model caches) while at that default",
            type=dict,
        ),
    },
    "reward": {
        "formula": _FORMULA_LISTED,
        "reference": MetaKey(
            "how task.file reads a reference's final answer (default: after its last '####')", type=object
        ),
        "demo": MetaKey(
            "task.file's demonstration of an answer, a format string (default '\\boxed{{{}}}')", type=str
        ),
    },
    "tracker": {
        "requires": MetaKey("the module the tracker imports; build() refuses it when missing", type=str),
        "extra": MetaKey("the pip extra that installs it: pip install 'polgrad[<extra>]'", type=str),
    },
}

PROTOCOLS: dict[str, type] = {
    "advantage": AdvantageFn,
    "kl": KLFn,
    "clip": ClipFn,
    "aggregate": AggregateFn,
    "value_loss": ValueLossFn,
    "value_init": ValueInitFn,
    "kl_controller": KLControllerFn,
    "reward_shaping": RewardShapingFn,
    "reward_ensemble": RewardEnsembleFn,
    "filter": FilterFn,
    "preference": PreferenceFn,
    "task": TaskFn,
    "reward": RewardFn,
    "tracker": TrackerFn,
}

# Kinds whose parts are called by name from inside a built object (a task scores with the reward its
# answer_format names), never handed over bound by the config layer: a hyperparameter of theirs would
# never receive a gin binding, so `register` refuses one.
NO_HYPERPARAMETERS = {"reward": "a task calls it by name (task.file.answer_format) while it scores"}

# Shapes of the glossary's tensor names, used to render the signatures.
SHAPES = {
    "rewards": "[B]",
    "scores": "[B]",
    "member_scores": "[K,B]",
    "group_ids": "[B]",
    "baseline_rewards": "[B]",
    "truncated": "[B]",
    "chosen_logratio": "[P]",
    "rejected_logratio": "[P]",
    "logits": "[B,T,V]",
    "ref_logits": "[B,T,V]",
}


def call_parameters(kind: str) -> list[inspect.Parameter]:
    """The parameters the loop passes to a part of `kind` (its Protocol's __call__ without self)."""
    return list(inspect.signature(PROTOCOLS[kind].__call__).parameters.values())[1:]


def returns(kind: str) -> str:
    """What a part of `kind` returns: the first line of its Protocol's docstring."""
    return (inspect.getdoc(PROTOCOLS[kind].__call__) or "").splitlines()[0]


def _render(p: inspect.Parameter) -> str:
    ann = str(p.annotation).replace(" ", "")
    if ann in ("Tensor", "Tensor|None"):
        text = p.name + SHAPES.get(p.name, "[B,T]") + ("|None" if ann.endswith("|None") else "")
    else:
        text = f"{p.name}: {ann}"
    return text + ("=None" if p.default is None else "")


def signature_text(kind: str) -> str:
    """The kind's call signature on one line, e.g. '(logp[B,T], ...) -> kl[B,T]'.

    Tensor parameters show their glossary shape, others their annotation; `=None` marks one the
    loop may omit."""
    parts, star = [], False
    for p in call_parameters(kind):
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(_render(p))
    params = ", ".join(parts) if parts else "**hparams"
    return f"({params}) -> {returns(kind)}"


def where(fn: Callable[..., Any]) -> str:
    """'module:line' of a function's definition (decorators included), for messages and the listing."""
    fn = inspect.unwrap(fn)
    try:
        line = inspect.getsourcelines(fn)[1]
    except (OSError, TypeError):
        line = getattr(getattr(fn, "__code__", None), "co_firstlineno", "?")
    return f"{getattr(fn, '__module__', '?')}:{line}"
