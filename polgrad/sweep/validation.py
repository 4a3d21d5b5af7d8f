"""The dry run's check of every cell: parse it with gin as the trainer will, before anything trains.

One public entry, `validate(exp, cells, train_module)`: imports polgrad and the trainer module (so
every configurable is registered), runs the experiment's import statements, checks component
names against the registry, then parses every binding on top of each spec (to name the culprit)
and every cell whole with `gin.finalize()`. The first problem is raised as one ConfigError line
(`explain_gin_error` turns gin's multi-line messages into that line).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Sequence
from typing import Any

from polgrad.errors import PolgradError
from polgrad.sweep.experiment import DEFAULT_TRAIN_MODULE, TRAIN_MODULE_ENV, Experiment, _closest, _fail
from polgrad.sweep.grid import Cell
from polgrad.sweep.values import GinRef, gin_text

__all__ = ["validate"]


def _gin_selectors() -> list[str]:
    try:
        import gin.config as gc

        complete = [s for s, _ in gc._REGISTRY.items()]
        return sorted({*complete, *(gc._REGISTRY.minimal_selector(s) for s in complete)})
    except Exception:  # gin internals moved: no suggestions, the message still names the binding
        return []


def _gin_parameters(selector: str) -> list[str] | None:
    try:
        import gin.config as gc

        configurable = gc._REGISTRY.get_match(selector)
        fn = configurable.wrapped
        if inspect.isclass(fn):
            fn = fn.__init__
        params = inspect.signature(fn).parameters.values()
        return [
            p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
        ]
    except Exception:
        return None


def _unknown_reference(selector: str) -> str:
    """One line for an unknown `@selector`: polgrad's registry message for a registered kind."""
    from polgrad import registry

    kind, _, name = selector.partition(".")
    if name and "." not in name and kind in registry.KINDS:
        try:
            registry.lookup(kind, name)
        except PolgradError as e:
            return str(e)
    return f"unknown configurable '@{selector}'{_closest(selector, _gin_selectors())}"


def explain_gin_error(exc: BaseException) -> str:
    """gin's multi-line error as one line, with the valid names and the closest match where we can."""
    msg = str(exc)
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    m = re.search(r"No configurable matching reference '@([^']+?)(?:\(\))?'", msg)
    if m:
        return _unknown_reference(m.group(1).rsplit("/", 1)[-1])
    m = re.search(r"No configurable matching '([^']+)'", msg)
    if m:
        return f"unknown configurable '{m.group(1)}'{_closest(m.group(1), _gin_selectors())}"
    m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", msg)
    if m:
        params = _gin_parameters(m.group(1))
        valid = f"; valid parameters: {', '.join(params)}{_closest(m.group(2), params)}" if params else ""
        return f"'{m.group(1)}' has no parameter '{m.group(2)}'{valid}"
    loc = re.search(r'In file "([^"]+)", line (\d+)', msg)
    return first + (f" ({loc.group(1)}, line {loc.group(2)})" if loc else "")


def _refs(value: Any):
    if isinstance(value, GinRef):
        yield value
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _refs(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _refs(k)
            yield from _refs(v)


def import_train_module(train_module: str) -> None:
    """Import polgrad and the trainer module so that every configurable a cell binds is registered."""
    import polgrad  # noqa: F401  (registers the built-in parts)

    modules = [train_module]
    if train_module == DEFAULT_TRAIN_MODULE:
        modules.append("polgrad.trainer")  # registers `train`; polgrad.train imports it lazily
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as e:
        raise PolgradError(
            f"cannot import the trainer module '{train_module}' ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); set {TRAIN_MODULE_ENV} or install polgrad"
        ) from None


def validate(exp: Experiment, cells: Sequence[Cell], train_module: str) -> None:
    """Parse every cell's config as the trainer will; raise one ConfigError line on the first problem."""
    import gin

    import_train_module(train_module)
    f = exp.file
    for stmt in exp.imports:  # a user's module: its parts must register before we check names
        try:
            gin.parse_config(stmt)  # gin's own import, exactly as the trainer will run it
        except Exception as e:
            raise _fail(f, f"'{stmt}'", f"cannot import ({' '.join(str(e).split())})") from None

    # Component names first: the registry's message is the most useful one.
    named: list[tuple[str, Any]] = [(f"line {b.line}: {b.key}", b.value) for b in exp.fixed]
    for keys, values in exp.axes:
        label = f"line {exp.lines.get('grid', 0)}: Sweep.grid['{keys[0] if len(keys) == 1 else keys}']"
        named.extend((label, v) for v in values)
    for where, value in named:
        for ref in _refs(value):
            if not gin.config._REGISTRY.matching_selectors(ref.selector):
                raise _fail(f, f"{where} = {ref!r}", _unknown_reference(ref.selector))

    # Then gin, one binding at a time on top of each spec (to name the culprit), and every cell whole.
    try:
        for spec, spec_path in zip(exp.specs, exp.spec_paths, strict=True):
            gin.clear_config()
            for path in (*exp.include_paths, spec_path):
                try:
                    gin.parse_config_file(path)
                except Exception as e:
                    raise _fail(
                        f, f"while reading {path} (for spec '{spec}')", explain_gin_error(e)
                    ) from None
            checks = [(f"'{s}'", s) for s in exp.imports]
            checks += [(f"line {b.line}: binding '{b.text}'", b.text) for b in exp.fixed]
            for keys, values in exp.axes:
                for value in values:
                    parts = value if len(keys) > 1 else (value,)
                    for k, v in zip(keys, parts, strict=True):
                        checks.append((f"Sweep.grid binding '{k} = {gin_text(v)}'", f"{k} = {gin_text(v)}"))
            seed_text = f"{exp.seed_binding} = {exp.seeds[0]}"
            checks.append((f"Sweep.seed_binding '{seed_text}'", seed_text))
            for where, text in checks:
                try:
                    gin.parse_config(text)
                except Exception as e:
                    raise _fail(f, where, explain_gin_error(e)) from None
        for cell in cells:
            gin.clear_config()
            try:
                gin.parse_config_files_and_bindings(
                    list(cell.config_files), list(cell.bindings), finalize_config=True
                )
            except Exception as e:
                raise _fail(
                    f, f"cell {cell.id} ({cell.spec}; {cell.describe()})", explain_gin_error(e)
                ) from None
    finally:
        gin.clear_config()
