"""The checks of a spec's bindings, apart from the spec's math (`Algorithm` calls `validate`).

validate(algo)                     every check of an Algorithm's bindings in order, then `probe`
probe(algo)                        each tensor part called once on a tiny batch, as the loop will
entry_of_kind(binding, fn, kind)   the registry entry of a part bound to `binding`, of `kind`
unbound_hyperparameters(part)      the part's hyperparameters that had no value when it was bound
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from polgrad import registry
from polgrad.components.advantage import last_token
from polgrad.errors import ConfigError, PolgradError

PLACEMENTS = ("reward", "loss")


def needing_baseline(algo: Any) -> str:
    """'binding = @part' of the part that needs a greedy baseline rollout (ReMax)."""
    binding = next(b for b, e in algo.parts.items() if e.meta.get("needs_baseline_rollout"))
    return f"{binding} = @{algo.parts[binding].full_name}"


def entry_of_kind(binding: str, fn: Any, kind: str) -> registry.Entry:
    """The registry entry of a part bound to `binding`, checked to be of `kind`."""
    entry = registry.entry_of(fn)
    if entry is None:
        raise ConfigError(
            f"{binding} must be a registered {kind} part (@{kind}.<name>), got {fn!r}; "
            f"valid {kind} names: {', '.join(registry.names(kind))}"
        )
    if entry.kind != kind:
        raise ConfigError(
            f"{binding} = @{entry.full_name} is a {entry.kind} part, not a {kind} part; "
            f"valid {kind} names: {', '.join(registry.names(kind))}"
        )
    return entry


def unbound_hyperparameters(part: Any) -> list[str]:
    """The part's hyperparameters that had no value when the config layer bound it (`Bound.unbound`):
    a spec parsed alone leaves such a value to a config parsed later (the base config), so the probe
    does not call that part; the real call reports it if it is still unbound then. A plain
    registered function (no binding at all): its required keyword-only hyperparameters."""
    if isinstance(part, registry.Bound):
        return list(part.unbound)
    entry = registry.entry_of(part)
    return [
        p.name
        for p in registry.contract.hyperparameters(entry.kind, entry.fn)
        if p.default is inspect.Parameter.empty
    ]


def validate(algo: Any) -> None:
    """Every check of an `Algorithm`'s bindings, in order, then the probe: one line naming the binding.
    Sets `algo.parts` (binding -> registry entry) first, which the checks and the spec's properties read."""
    if not isinstance(algo.name, str) or not algo.name:
        raise ConfigError("Algorithm.name must be a non-empty string, e.g. Algorithm.name = 'grpo'")
    algo.parts = {}
    if algo.preference is not None:
        algo.parts["Algorithm.preference"] = entry_of_kind(
            "Algorithm.preference", algo.preference, "preference"
        )
        _validate_offline(algo)
    for kind in () if algo.offline else ("advantage", "clip", "aggregate"):
        if getattr(algo, kind) is None:
            valid = ", ".join(f"@{kind}.{n}" for n in registry.names(kind))
            raise ConfigError(
                f"Algorithm.{kind} is required (one of {valid}), unless Algorithm.preference "
                "trains on preference pairs"
            )
        algo.parts[f"Algorithm.{kind}"] = entry_of_kind(f"Algorithm.{kind}", getattr(algo, kind), kind)
    algo.parts["Algorithm.kl_controller"] = entry_of_kind(
        "Algorithm.kl_controller", algo.kl_controller, "kl_controller"
    )
    algo.parts["Algorithm.value_loss"] = entry_of_kind("Algorithm.value_loss", algo.value_loss, "value_loss")
    if algo.kl is not None:
        algo.parts["Algorithm.kl"] = entry_of_kind("Algorithm.kl", algo.kl, "kl")
    if algo.value_init is not None:
        algo.parts["Algorithm.value_init"] = entry_of_kind(
            "Algorithm.value_init", algo.value_init, "value_init"
        )
    for i, fn in enumerate(algo.reward_shaping):
        algo.parts[f"Algorithm.reward_shaping[{i}]"] = entry_of_kind(
            f"Algorithm.reward_shaping[{i}]", fn, "reward_shaping"
        )
    for i, fn in enumerate(algo.filters):
        algo.parts[f"Algorithm.filters[{i}]"] = entry_of_kind(f"Algorithm.filters[{i}]", fn, "filter")

    if algo.kl_placement not in PLACEMENTS:
        raise ConfigError(
            f"Algorithm.kl_placement must be one of {', '.join(map(repr, PLACEMENTS))}, "
            f"got {algo.kl_placement!r}"
        )
    for binding, value, low in (
        ("Algorithm.kl_coef", algo.kl_coef, 0.0),
        ("Algorithm.entropy_coef", algo.entropy_coef, 0.0),
        ("Algorithm.vf_coef", algo.vf_coef, 0.0),
    ):
        if not value >= low:  # also rejects NaN
            raise ConfigError(f"{binding} must be >= {low}, got {value}")
    for binding, value in (
        ("Algorithm.ppo_epochs", algo.ppo_epochs),
        ("Algorithm.minibatches", algo.minibatches),
        ("Algorithm.group_size", algo.group_size),
        ("Algorithm.max_sampling_rounds", algo.max_sampling_rounds),
    ):
        if value < 1:
            raise ConfigError(f"{binding} must be >= 1, got {value}")

    if algo.max_sampling_rounds > 1 and not algo.filters:
        raise ConfigError(
            f"Algorithm.max_sampling_rounds = {algo.max_sampling_rounds} refills what filters drop, but "
            "Algorithm.filters is empty: add a filter (e.g. @filter.zero_variance_groups) or remove it"
        )
    needing_groups = [b for b, e in algo.parts.items() if e.meta.get("needs_groups")]
    if needing_groups and algo.group_size < 2:
        raise ConfigError(
            f"{needing_groups[0]} = @{algo.parts[needing_groups[0]].full_name} compares samples of the "
            f"same prompt: set Algorithm.group_size >= 2 (got {algo.group_size})"
        )
    needing_critic = [b for b, e in algo.parts.items() if e.meta.get("needs_critic")]
    if needing_critic and algo.value_init is None:
        raise ConfigError(
            f"{needing_critic[0]} = @{algo.parts[needing_critic[0]].full_name} needs a critic: set "
            "Algorithm.value_init to one of "
            + ", ".join("@value_init." + n for n in registry.names("value_init"))
        )
    if algo.value_init is not None and not needing_critic:
        raise ConfigError(
            f"Algorithm.value_init = @{algo.parts['Algorithm.value_init'].full_name} is set but no part "
            "uses a critic (e.g. @advantage.gae or @advantage.mc): remove the binding"
        )
    if (
        algo.kl is not None
        and algo.kl_placement == "reward"
        and algo.parts["Algorithm.kl"].meta.get("needs_logits")
    ):
        raise ConfigError(
            f"Algorithm.kl = @{algo.parts['Algorithm.kl'].full_name} needs the full logits, which a "
            "KL in the reward does not have (it uses the sampled tokens' log-probs): pick a "
            "sample-based estimator such as @kl.k1 there, or set Algorithm.kl_placement = 'loss'"
        )
    if algo.needs_baseline_rollout and algo.reward_shaping:
        raise ConfigError(
            f"{needing_baseline(algo)} compares each score with the greedy response's raw score; "
            "reward shaping would change one side only: remove Algorithm.reward_shaping"
        )
    probe(algo)


def _validate_offline(algo: Any) -> None:
    """A preference spec has none of the on-policy parts: each one set is a mistake, named."""
    binding = f"Algorithm.preference = @{algo.parts['Algorithm.preference'].full_name}"
    unused = {
        "advantage": algo.advantage,
        "clip": algo.clip,
        "aggregate": algo.aggregate,
        "kl": algo.kl,
        "value_init": algo.value_init,
        "reward_shaping": algo.reward_shaping or None,
        "filters": algo.filters or None,
    }
    for name, value in unused.items():
        if value is not None:
            raise ConfigError(
                f"{binding} trains on fixed preference pairs against the reference; it has no "
                f"Algorithm.{name}: remove that binding (or Algorithm.preference)"
            )


def probe(algo: Any) -> None:
    """Call each tensor part once on a tiny batch, as the loop will, so that a bad part or
    hyperparameter fails now, naming its binding: `Algorithm.clip = @clip.x: TypeError: ...`.

    Each result is checked against its kind's contract (polgrad/registry/kinds.py): the structure
    ((adv, returns) for an advantage, (loss, metrics) for a clip rule), the shapes ([B,T] where
    the contract says so), zeros where the mask is 0 (an advantage, a KL estimate), and that changing
    the inputs at masked-out positions leaves every valid output unchanged. The probe batch has a
    masked-out position (row 1, token 1), two sequences of one group, and a critic's values and a
    greedy baseline's rewards for the parts that declare them.

    One case is deferred to the real call (`unbound_hyperparameters`): a hyperparameter the
    spec leaves to a config file parsed later (an unbound %MACRO, or a required keyword-only
    hyperparameter no binding sets yet), since a spec is also built on its own (Table 5).
    """
    dt = torch.float64
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=dt)
    logp = torch.tensor([[-1.0, -0.5], [-0.7, 0.0]], dtype=dt)
    group_ids = torch.tensor([0, 0])
    rewards = torch.tensor([1.0, 0.0], dtype=dt)
    hole = mask == 0

    def at_holes(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.where(hole, torch.full_like(x, value), x)

    def clip(lp):
        return algo.clip(lp, lp - 0.1, mask.clone(), mask, rollout_logp=lp - 0.1)

    def kl(lp):
        logits = torch.zeros(2, 2, 3, dtype=dt)
        return algo.kl(lp, lp - 0.1, mask, logits=logits, ref_logits=logits)

    def advantage(tok, values):
        return algo.advantage(
            rewards,
            mask,
            group_ids=group_ids,
            values=values if algo.needs_critic else None,
            token_rewards=tok,
            baseline_rewards=torch.tensor([0.5, 0.5], dtype=dt) if algo.needs_baseline_rollout else None,
        )

    tok, values = last_token(rewards, mask), torch.tensor([[0.2, 0.1], [0.3, 0.0]], dtype=dt)
    # (binding, call, contract check of its result, the call again with other masked-out inputs)
    probes: list[tuple[str, Callable[[], Any], Callable[[Any], str | None], Callable[[], Any] | None]] = [
        (
            "Algorithm.value_loss",
            lambda: algo.value_loss(logp, logp, logp, mask),
            lambda out: _tensor("loss", out, mask.shape),
            None,
        ),
        ("Algorithm.kl_controller", lambda: algo.kl_controller(0.1, 0.1, 1), lambda out: None, None),
    ]
    if algo.offline:
        pair = torch.tensor([0.5, -0.25], dtype=dt)
        probes.append(("Algorithm.preference", lambda: algo.preference(pair, -pair), lambda out: None, None))
    else:
        probes.append(("Algorithm.clip", lambda: clip(logp), lambda out: _clip_result(out, mask), None))
    if algo.kl is not None:
        probes.append(
            (
                "Algorithm.kl",
                lambda: kl(logp),
                lambda out: _tensor("kl", out, mask.shape) or _zero_at("kl", out, hole),
                lambda: kl(at_holes(logp, -3.0)),
            )
        )
    if not algo.offline:
        probes.append(
            (
                "Algorithm.advantage",
                lambda: advantage(tok, values),
                lambda out: _advantage_result(out, mask, hole),
                lambda: advantage(at_holes(tok, 7.0), at_holes(values, 7.0)),
            )
        )
    for binding, call, contract, again in probes:
        if unbound_hyperparameters(algo.part(binding)):
            continue
        head = f"{binding} = @{algo.parts[binding].full_name}"
        try:
            out = call()
            wrong = contract(out)
            if wrong is None and again is not None:
                wrong = _same_where_valid(out, again(), ~hole)
        except Exception as e:  # noqa: BLE001 - every failure is reported, naming the binding
            first = (str(e).strip().splitlines() or [""])[0]  # gin appends "In call to ..." lines
            # polgrad's own errors already say what is wrong; any other gets its type named
            what = first if isinstance(e, PolgradError) else f"{type(e).__name__}: {first}"
            raise ConfigError(f"{head}: {what}") from None
        if wrong:
            kind = binding.removeprefix("Algorithm.")
            raise ConfigError(
                f"{head}: {wrong}; a part of kind {kind} returns {registry.kinds.returns(kind)} "
                "(polgrad/registry/kinds.py)"
            )


def _described(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    return f"a {type(x).__name__}"


def _tensor(name: str, x: Any, shape: torch.Size) -> str | None:
    if not isinstance(x, torch.Tensor) or x.shape != shape:
        return f"on a [B,T] = {list(shape)} batch it returned {_described(x)} as {name}, not [B,T]"
    return None


def _zero_at(name: str, x: torch.Tensor, hole: torch.Tensor) -> str | None:
    if bool((x.detach()[hole] != 0).any()):
        return f"{name} is not zero where the mask is 0 (multiply it by the mask)"
    return None


def _clip_result(out: Any, mask: torch.Tensor) -> str | None:
    if not isinstance(out, tuple) or len(out) != 2 or not isinstance(out[1], dict):
        return f"it returned {_described(out)}, not the pair (loss, metrics dict)"
    return _tensor("loss", out[0], mask.shape)


def _advantage_result(out: Any, mask: torch.Tensor, hole: torch.Tensor) -> str | None:
    if not isinstance(out, tuple) or len(out) != 2:
        return f"it returned {_described(out)}, not the pair (adv, returns)"
    adv, returns = out
    wrong = _tensor("adv", adv, mask.shape) or _zero_at("adv", adv, hole)
    if wrong is None and returns is not None:
        wrong = _tensor("returns", returns, mask.shape)
    return wrong


def _same_where_valid(out: Any, other: Any, valid: torch.Tensor) -> str | None:
    """None when every valid [B,T] output of `out` equals `other`'s (inputs differing only where the
    mask is 0), else what moved."""
    first = out[0] if isinstance(out, tuple) else out
    second = other[0] if isinstance(other, tuple) else other
    if not torch.equal(first.detach()[valid], second.detach()[valid]):
        return "its valid outputs changed when only inputs at masked-out positions changed (it reads them)"
    return None
