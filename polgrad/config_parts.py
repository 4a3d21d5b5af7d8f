"""The config layer's side of the registry: every part a gin configurable, and a `Bound` at build.

    bind(fn)        a part as gin handed it over (`@kl.k3`, `@scope/kl.k3`) -> registry.Bound
    part(kind, name)  the registered part `kind.name` bound from gin's config now
    algorithm()     the `Algorithm` of the parsed gin config, each part bound (gin's `Algorithm`)
    part_blocks()   the bound parts' values as gin text, for the run's operative config

The registry holds plain functions. Importing this module makes each of them (and each one
registered later, e.g. by a gin `import my_module`) a gin configurable named `kind.name`, so gin
files bind and reference them as before. At build every part is read once from gin into a
`registry.Bound`: its hyperparameters are gin's values at that moment (a macro evaluated, a
default filled in), and the run calls that object, never gin. With polgrad.config,
polgrad.train_config, polgrad.resume_config, the entry points and the sweep's planner, this is the
configuration layer: the only code under polgrad/ that imports gin (tests/project/test_layers.py).
Importing polgrad.config imports this module; `import polgrad` alone does not make the parts gin
configurables.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterable
from typing import Any

import gin

from polgrad import registry
from polgrad.algorithm import Algorithm
from polgrad.registry.contract import hyperparameters

__all__ = ["algorithm", "bind", "part", "part_blocks", "refuse_unbound"]


def _configure(entry: registry.Entry) -> None:
    gin.external_configurable(entry.fn, entry.name, module=entry.kind)


registry.on_register(_configure)


def _scopes(fn: Any, entry: registry.Entry) -> list[str] | None:
    """The gin scope of a scoped reference `@a/b/kind.name` (['a', 'b']), None for anything else.

    gin hands a scoped reference over as a closure over its scope components (gin.config's
    `_decorate_with_scope`); there is no public accessor. The part's own function (a registered
    closure may hold a list of strings too) and gin's unscoped wrapper have no scope."""
    if fn is entry.fn or fn is gin.get_configurable(entry.full_name):
        return None
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            return list(value)
    return None


def bind(fn: Any) -> Any:
    """A part as gin handed it over -> `registry.Bound` with gin's values now; anything else as is.

    Each hyperparameter takes its binding (`kind.name.p = ...`) or else its default, read in the
    scope gin would call the part in: the reference's own (`@s/kind.name`), else the current one.
    A reference among them is evaluated there and, if it names a part, bound in turn (in that
    scope). One with neither, or bound to %gin.REQUIRED or to a macro without a value, is listed in
    `Bound.unbound` (a spec parsed alone leaves such values to the base config)."""
    if isinstance(fn, list | tuple):
        return type(fn)(bind(f) for f in fn)
    entry = registry.entry_of(fn)
    if entry is None or isinstance(fn, registry.Bound):
        return fn
    scopes = _scopes(fn, entry)
    with gin.config_scope(scopes) if scopes else contextlib.nullcontext():
        raw = gin.get_bindings(entry.full_name, resolve_references=False)
        values: dict[str, Any] = {}
        unbound: list[str] = []
        for p in hyperparameters(entry.kind, entry.fn):
            if p.name in raw:
                if _without_value(raw[p.name]):
                    unbound.append(p.name)
                    continue
                value = copy.deepcopy(raw[p.name])  # gin's own evaluation of references and macros
            elif p.default is inspect.Parameter.empty:
                unbound.append(p.name)
                continue
            else:
                value = p.default
            if value is gin.REQUIRED:
                unbound.append(p.name)
            else:
                values[p.name] = bind(value)
    return registry.Bound(entry, values, tuple(unbound))


def _without_value(raw: Any) -> bool:
    """A bound value that is %gin.REQUIRED or a macro with no value yet (other errors are not hidden)."""
    text = str(raw) if isinstance(raw, gin.config.ConfigurableReference) else ""
    if not text.startswith("%"):
        return False
    if text == "%gin.REQUIRED":
        return True
    try:
        gin.query_parameter(text)
    except ValueError:
        return True
    return False


def refuse_unbound(parts: Iterable[Any]) -> None:
    """One line for the first bound part with a hyperparameter that has no value: at the build (the
    dry run), not at the part's first call after the warm start."""
    for part in parts:
        if isinstance(part, registry.Bound) and part.unbound:
            raise registry.ConfigError(
                f"{part.entry.full_name}.{part.unbound[0]} has no value: bind it in a gin file or with --bind"
            )


def part(kind: str, name: str) -> registry.Bound:
    """The part `kind.name` with gin's values now, as a build would hand it to the run."""
    return bind(registry.get(kind, name))


def _make_algorithm(**kwargs: Any) -> Algorithm:
    """gin's `Algorithm`: the bindings as given, each part (and each default part) bound."""
    for param, (kind, name) in Algorithm.DEFAULT_PARTS.items():
        if kwargs.get(param) is None:
            kwargs[param] = registry.get(kind, name)
    return Algorithm(**{k: bind(v) for k, v in kwargs.items()})


_make_algorithm.__signature__ = inspect.signature(Algorithm)  # gin checks binding names against it
_ALGORITHM = gin.external_configurable(_make_algorithm, "Algorithm")


def algorithm() -> Algorithm:
    """The `Algorithm` of the parsed gin config, every part a `registry.Bound`."""
    return _ALGORITHM()


def _gin_value(value: Any) -> str:
    if isinstance(value, registry.Bound):
        return f"@{value.entry.full_name}"
    if isinstance(value, list | tuple):
        inner = ", ".join(_gin_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    return repr(value)


def part_blocks(parts: Iterable[Any]) -> str:
    """The bound parts' hyperparameters as gin text, one block per part (gin's operative-config
    layout): what the run used, since its parts no longer pass through gin when called."""
    blocks, seen, todo = [], set(), list(parts)
    while todo:
        part = todo.pop(0)
        if not isinstance(part, registry.Bound) or part.entry.full_name in seen or not part.hparams:
            continue
        for v in part.hparams.values():  # a part bound to a hyperparameter gets its block too
            todo.extend(v if isinstance(v, list | tuple) else [v])
        seen.add(part.entry.full_name)
        lines = [f"# Parameters for {part.entry.full_name}:", "# " + "=" * 78]
        lines += [f"{part.entry.full_name}.{k} = {_gin_value(v)}" for k, v in sorted(part.hparams.items())]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
