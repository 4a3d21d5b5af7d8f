"""The component registry: one table per kind, one name per part, shared by code, gin and CSVs.

    @register("advantage", "rloo", level="sequence", needs_groups=True)
    def rloo(rewards, mask, *, group_ids, ...): ...

`register` puts the function in polgrad's table for its kind and makes it a gin configurable
with module = kind, so `advantage.rloo` is the registry name, the gin name
(`Algorithm.advantage = @advantage.rloo`, `advantage.rloo.some_hparam = 1`) and the name that
lands in a results CSV. A user's module registers its own parts the same way; a gin file pulls
it in with `import my_module`.

`python -m polgrad.registry` lists every kind and name with its metadata and the first line of
its docstring; `--table` prints the chapter's Table 5 for every spec in registry/.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gin

from polgrad.errors import RegistryError

# The kinds and the one call signature of each (the Protocols in polgrad/components/protocols.py
# are the typed form of the same contract; CONTRIBUTING.md explains them).
KINDS: dict[str, str] = {
    "advantage": "(rewards[B], mask[B,T], *, group_ids[B], values[B,T]|None, token_rewards[B,T]|None, "
    "baseline_rewards[B]|None) -> (adv[B,T], returns[B,T]|None)",
    "kl": "(logp[B,T], ref_logp[B,T], mask[B,T], *, logits[B,T,V]|None, ref_logits[B,T,V]|None) -> kl[B,T]",
    "clip": "(logp[B,T], old_logp[B,T], adv[B,T], mask[B,T], *, rollout_logp[B,T]|None) "
    "-> (loss[B,T], metrics: dict[str, [B,T]])",
    "aggregate": "(loss[B,T], mask[B,T], counts: StepCounts) -> scalar",
    "value_loss": "(values[B,T], old_values[B,T], returns[B,T], mask[B,T]) -> loss[B,T]",
    "value_init": "(*, policy_path, reward_model_path, ...) -> critic nn.Module: "
    "(input_ids, attention_mask) -> [B,S]",
    "kl_controller": "(coef, measured_kl, n_steps) -> new coef",
    "reward_shaping": "(scores[B], mask[B,T], *, truncated[B]) -> scores[B]",
    "filter": "(rewards[B], group_ids[B]) -> keep[B] bool",
    "task": "(**hparams) -> Task (prompts, reward, eval split, SFT demos, preference pairs)",
}


@dataclass(frozen=True)
class Entry:
    """One registered part: its kind, name, the gin-wrapped callable and its metadata."""

    kind: str
    name: str
    fn: Callable[..., Any]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def full_name(self) -> str:
        return f"{self.kind}.{self.name}"

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.fn) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


_TABLE: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}


def _closest(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise RegistryError(
            f"unknown kind '{kind}'; valid kinds: {', '.join(sorted(KINDS))}{_closest(kind, KINDS)}"
        )


def register(kind: str, name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register `fn` as `kind.name` in polgrad's table and in gin (module = kind).

    Duplicate names raise. `meta` is free-form but the keys below are read by polgrad:
    `needs_critic`, `needs_reference`, `needs_groups`, `needs_logits`, `needs_baseline_rollout`,
    `level` ('token' | 'sequence'), `off_policy`, `formula` (the term used in the Table-5 core loss),
    `constant` (a KL controller that never moves the coefficient).
    """
    _check_kind(kind)
    if not name.isidentifier():
        raise RegistryError(f"{kind} name '{name}' is not a Python identifier (gin needs one)")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _TABLE[kind]:
            old = _TABLE[kind][name].fn
            raise RegistryError(
                f"{kind}.{name} is already registered (by {getattr(old, '__module__', '?')}."
                f"{getattr(old, '__qualname__', '?')}); pick another name"
            )
        wrapped = gin.configurable(name, module=kind)(fn)
        entry = Entry(kind=kind, name=name, fn=wrapped, meta=dict(meta))
        wrapped.__polgrad_entry__ = entry
        _TABLE[kind][name] = entry
        return wrapped

    return deco


def lookup(kind: str, name: str) -> Entry:
    """The entry `kind.name`; an unknown name raises one line with the valid names and the closest."""
    _check_kind(kind)
    table = _TABLE[kind]
    if name not in table:
        valid = ", ".join(sorted(table)) or "(none registered)"
        raise RegistryError(f"unknown {kind} '{name}'; valid {kind} names: {valid}{_closest(name, table)}")
    return table[name]


def get(kind: str, name: str) -> Callable[..., Any]:
    """The gin-wrapped callable registered as `kind.name` (bindings such as `kind.name.eps` apply)."""
    return lookup(kind, name).fn


def entry_of(fn: Any) -> Entry | None:
    """The registry entry behind a callable handed over by gin (`@advantage.rloo`), or None."""
    # gin's scoped references (`@scope/kind.name`) wrap with functools.wraps, which copies the attribute.
    return getattr(fn, "__polgrad_entry__", None)


def names(kind: str) -> list[str]:
    _check_kind(kind)
    return sorted(_TABLE[kind])


def entries(kind: str | None = None) -> list[Entry]:
    kinds = [kind] if kind else list(KINDS)
    out: list[Entry] = []
    for k in kinds:
        _check_kind(k)
        out.extend(_TABLE[k][n] for n in sorted(_TABLE[k]))
    return out


def describe() -> str:
    """Every kind, its call signature, and each name with metadata and docstring summary."""
    lines = []
    for kind, signature in KINDS.items():
        lines.append(f"{kind}  {signature}")
        for e in entries(kind):
            meta = ", ".join(f"{k}={v}" for k, v in sorted(e.meta.items()) if k != "formula")
            lines.append(f"  {e.full_name:<36} {e.summary}" + (f"  [{meta}]" if meta else ""))
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import polgrad  # noqa: F401  (registers the built-in parts)

    ap = argparse.ArgumentParser(prog="python -m polgrad.registry", description=__doc__.splitlines()[0])
    ap.add_argument("--table", action="store_true", help="print the chapter's Table 5 for every spec")
    ap.add_argument("--specs", default=None, help="folder of spec gin files (default: registry/)")
    args = ap.parse_args(argv)
    if args.table:
        from polgrad.config import comparison_table

        print(comparison_table(args.specs))
    else:
        print(describe())
    return 0
