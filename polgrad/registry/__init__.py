"""The component registry: one table per kind, one name per part, shared by code, gin and CSVs.

    @register("advantage", "rloo", level="sequence", needs_groups=True)
    def rloo(rewards, mask, *, group_ids, ...): ...

`register` puts the plain function in polgrad's table for its kind and returns it unchanged.
The config layer (polgrad.config_parts) makes every entry a gin configurable with module = kind,
so `advantage.rloo` is the registry name, the gin name (`Algorithm.advantage = @advantage.rloo`,
`advantage.rloo.some_hparam = 1`) and the name that lands in a results CSV; and at build it hands
the run each part as a `Bound`: the plain function with its hyperparameters fixed, which reads no
global configuration when called. A user's module registers its own parts the same way; a gin
file pulls it in with `import my_module`.

The contract of each kind (call signature, metadata keys) lives in `polgrad.registry.kinds` and
is checked by `register`. `python -m polgrad.registry` lists every kind and name with its
module:line, metadata and the first line of its docstring; `--table` prints the chapter's
Table 5 for every spec in registry/.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from polgrad.errors import ConfigError, RegistryError, did_you_mean
from polgrad.registry.contract import check_meta, check_signature, hyperparameters
from polgrad.registry.kinds import META_KEYS, PROTOCOLS, StepCounts, signature_text, where

__all__ = [
    "KINDS",
    "META_KEYS",
    "PROTOCOLS",
    "Bound",
    "Entry",
    "StepCounts",
    "describe",
    "entries",
    "entry_of",
    "get",
    "lookup",
    "names",
    "on_register",
    "register",
    "task_configuration",
]

# The kinds and the one call signature of each, generated from the Protocols in kinds.py.
KINDS: dict[str, str] = {kind: signature_text(kind) for kind in PROTOCOLS}


@dataclass(frozen=True)
class Entry:
    """One registered part: its kind, name, the plain function and its metadata."""

    kind: str
    name: str
    fn: Callable[..., Any]
    meta: dict[str, Any] = field(default_factory=dict)
    where: str = "?"  # module:line of the definition

    @property
    def full_name(self) -> str:
        return f"{self.kind}.{self.name}"

    @property
    def summary(self) -> str:
        doc = inspect.getdoc(self.fn) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""


@dataclass(frozen=True, eq=False)
class Bound:
    """A part with its hyperparameters fixed: what a built run calls (`config.build()` makes them).

    `Bound(entry, hparams)(*args, **kw)` is `entry.fn(*args, **hparams, **kw)`; nothing is looked
    up when it is called, so rebinding or clearing the gin config after the build changes nothing.
    `unbound` names the hyperparameters that had no value when it was made (a spec parsed without
    its base config); calling it then raises one line naming the first.
    """

    entry: Entry
    hparams: Mapping[str, Any] = field(default_factory=dict)
    unbound: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "hparams", MappingProxyType(dict(self.hparams)))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.unbound:
            raise ConfigError(
                f"{self.entry.full_name}.{self.unbound[0]} has no value: bind it in a gin file or with --bind"
            )
        return self.entry.fn(*args, **{**self.hparams, **kwargs})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams.items())
        return f"@{self.entry.full_name}({args})"

    def __reduce__(self) -> tuple[Any, ...]:
        # as its function (by reference: unpickling imports, hence registers, its module) and values
        return (_bound, (self.entry.fn, dict(self.hparams), self.unbound))


def _bound(fn: Callable[..., Any], hparams: dict[str, Any], unbound: tuple[str, ...]) -> Bound:
    return Bound(fn.__polgrad_entry__, hparams, unbound)


_TABLE: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
_HOOKS: list[Callable[[Entry], None]] = []


def on_register(hook: Callable[[Entry], None]) -> None:
    """Call `hook(entry)` for every part registered so far and every one registered later (the
    config layer makes each a gin configurable this way)."""
    _HOOKS.append(hook)
    for table in _TABLE.values():
        for entry in table.values():
            hook(entry)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise RegistryError(
            f"unknown kind '{kind}'; valid kinds: {', '.join(sorted(KINDS))}"
            + did_you_mean(kind, KINDS, cutoff=0.5)
        )


def register(kind: str, name: str, **meta: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: register `fn` as `kind.name` in polgrad's table; `fn` itself is returned unchanged.

    Checked here, each failure a one-line RegistryError naming `kind.name (module:line)`: the
    name is new and an identifier; every `meta` key is declared for the kind (kinds.META_KEYS,
    listed with their meaning by `python -m polgrad.registry`) with an allowed value; and `fn`
    accepts the call of the kind's Protocol (kinds.PROTOCOLS), its other parameters being
    keyword-only or defaulted hyperparameters for gin.
    """
    _check_kind(kind)
    if not name.isidentifier():
        raise RegistryError(f"{kind} name '{name}' is not a Python identifier (gin needs one)")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        at = where(fn)
        check_meta(kind, f"{kind}.{name}", at, meta)
        check_signature(kind, f"{kind}.{name}", at, fn)
        if name in _TABLE[kind]:
            old = _TABLE[kind][name].fn
            raise RegistryError(
                f"{kind}.{name} is already registered (by {getattr(old, '__module__', '?')}."
                f"{getattr(old, '__qualname__', '?')}); pick another name"
            )
        entry = Entry(kind=kind, name=name, fn=fn, meta=dict(meta), where=at)
        fn.__polgrad_entry__ = entry
        _TABLE[kind][name] = entry
        for hook in _HOOKS:
            hook(entry)
        return fn

    return deco


def lookup(kind: str, name: str) -> Entry:
    """The entry `kind.name`; an unknown name raises one line with the valid names and the closest."""
    _check_kind(kind)
    table = _TABLE[kind]
    if name not in table:
        valid = ", ".join(sorted(table)) or "(none registered)"
        hint = did_you_mean(name, table, cutoff=0.5)
        raise RegistryError(f"unknown {kind} '{name}'; valid {kind} names: {valid}{hint}")
    return table[name]


def get(kind: str, name: str) -> Callable[..., Any]:
    """The plain function registered as `kind.name` (its own defaults; no gin binding applies)."""
    return lookup(kind, name).fn


def entry_of(fn: Any) -> Entry | None:
    """The registry entry behind a part: a `Bound`, the plain function, or gin's wrapper of it, or None."""
    if isinstance(fn, Bound):
        return fn.entry
    # gin's wrappers (`@kind.name`, `@scope/kind.name`) use functools.wraps, which copies the attribute.
    return getattr(fn, "__polgrad_entry__", None)


def task_configuration(name: str, given: Mapping[str, Any] | None) -> dict[str, Any]:
    """The full configuration of task `name` called with `given`: its factory's defaults updated by
    `given`, without the parameters the task declares `key_neutral` while at their default. It keys the
    warm-start cache (and so, through the policy's fingerprint, the reward models trained on it), so the
    same task reached with its defaults spelled out or left implicit (`{'digits': 2}` or `{}` for
    task.add) is one cache entry, not two."""
    entry = lookup("task", name)
    config = {
        p.name: p.default
        for p in inspect.signature(entry.fn).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    config.update(given or {})
    for key, default in entry.meta.get("key_neutral", {}).items():  # added later: old keys hold
        if key in config and config[key] == default:
            del config[key]
    return config


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


def _hyperparameters_text(kind: str, fn: Callable[..., Any]) -> str:
    """'eps=1e-06, scale='group'': the part's gin-bindable parameters with their defaults."""
    out = []
    for p in hyperparameters(kind, fn):
        out.append(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}")
    return ", ".join(out)


def describe() -> str:
    """Every kind: its call signature and declared metadata keys; then each name with module:line,
    its metadata (the descriptive keys level, ratio, unbiased, denominator included), docstring
    summary, formula and hyperparameters (gin-bindable, with their defaults)."""
    lines = []
    for kind, signature in KINDS.items():
        lines.append(f"{kind}  {signature}")
        for key, spec in META_KEYS[kind].items():
            lines.append(f"    meta {key}: {spec.meaning}")
        for e in entries(kind):
            meta = ", ".join(f"{k}={v}" for k, v in sorted(e.meta.items()) if k != "formula")
            lines.append(f"  {e.full_name:<32} {e.where}" + (f"  [{meta}]" if meta else ""))
            if e.summary:
                lines.append(f"      {e.summary}")
            if "formula" in e.meta:
                lines.append(f"      formula: {e.meta['formula']}")
            hparams = _hyperparameters_text(kind, e.fn)
            if hparams:
                lines.append(f"      hyperparameters: {hparams}")
        lines.append("")
    return "\n".join(lines)
