"""One-line explanations of a gin mistake, from the files' own statements (`explain_file`,
`explain_text`), and the include cycle gin would recurse on (`check_include_cycle`); used by
`polgrad.config.parse_config`. Each statement is checked against what is registered through gin's public
parser (`gin.config_parser`) and `gin.get_configurable`, never by reading gin's error text: an unknown
name gets the valid names and the closest match, a parameter a part does not take its hyperparameters,
a removed binding what replaced it.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import gin
from gin import config_parser

from polgrad import registry
from polgrad.errors import ConfigError, PolgradError, did_you_mean

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Bindings that existed once: a file that still binds one is told what replaced it.
REMOVED = {
    "train.async_rollouts": "asynchronous rollouts are one setting, train.max_staleness = k (0, the "
    "default, is the synchronous loop; k > 0 samples step s from the weights of step s - k)",
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


class _Recorder(config_parser.ParserDelegate):
    """Collects the references and macros a statement's value names (gin's public parser delegate)."""

    def __init__(self) -> None:
        self.refs: list[str] = []
        self.macros: list[str] = []

    def configurable_reference(self, scoped_configurable_name, evaluate):
        self.refs.append(scoped_configurable_name)
        return scoped_configurable_name

    def macro(self, macro_name):
        self.macros.append(macro_name)
        return macro_name


def _known_selectors() -> list[str]:
    names = [e.full_name for e in registry.entries()]
    return sorted({*names, "Algorithm", "train", "Sweep"})


class _Ambiguous(str):
    """gin's own one-line message for a selector that matches several configurables."""


def _configurable(selector: str) -> Any:
    """The configurable `selector` names; None if unknown; an _Ambiguous message if it names several."""
    try:
        return gin.get_configurable(selector)
    except ValueError:
        return None
    except KeyError as e:  # several configurables end with this name
        return _Ambiguous(f"{_first_line(e).strip(chr(34) + chr(39))}: write the full name")


def unknown_selector(selector: str) -> str:
    """One line for a name gin does not know: the registry's message for a registered kind."""
    name = selector.rsplit("/", 1)[-1]
    kind, _, part = name.partition(".")
    if part and "." not in part and kind in registry.KINDS:
        try:
            registry.lookup(kind, part)
        except PolgradError as e:
            return str(e)
    return f"unknown configurable '{name}'{did_you_mean(name, _known_selectors())}"


def _parameters(fn: Any) -> tuple[list[str], bool]:
    """The parameters a binding may set: for a registered part only its hyperparameters (the loop
    passes the others), for any other configurable every named parameter."""
    entry = registry.entry_of(fn)
    if entry is not None:
        params = registry.contract.hyperparameters(entry.kind, entry.fn)
    else:
        params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def check_statement(stmt: Any, recorder: _Recorder) -> str | None:
    """What is wrong with one parsed statement, or None."""
    if isinstance(stmt, config_parser.ImportStatement):
        try:
            importlib.import_module(stmt.module)
        except Exception as e:  # noqa: BLE001 - reported in one line
            return (
                f"cannot import '{stmt.module}' ({type(e).__name__}: {_first_line(e)}); "
                "a user module must be importable from the working directory: run from the folder "
                "that holds it or add that folder to PYTHONPATH"
            )
        return None
    if isinstance(stmt, config_parser.BindingStatement) and stmt.selector and stmt.arg_name:
        fn = _configurable(stmt.selector)
        if fn is None or isinstance(fn, _Ambiguous):
            return fn or unknown_selector(stmt.selector)
        params, var_kw = _parameters(fn)
        removed = REMOVED.get(f"{stmt.selector}.{stmt.arg_name}")
        if removed:
            return f"{stmt.selector}.{stmt.arg_name} no longer exists: {removed}"
        if stmt.arg_name not in params and not var_kw:
            return (
                f"'{stmt.selector}' has no parameter '{stmt.arg_name}'; valid parameters: "
                f"{', '.join(params) or '(none)'}{did_you_mean(stmt.arg_name, params)}"
            )
    for ref in recorder.refs:
        fn = _configurable(ref.rsplit("/", 1)[-1])
        if fn is None or isinstance(fn, _Ambiguous):
            return fn or unknown_selector(ref)
    return None


def _statements(text: str) -> list[tuple[Any, _Recorder]]:
    """gin's own parse of `text`, statement by statement, with what each value references.

    The parser is a lazy iterator, so the references recorded while producing one statement are
    that statement's.
    """
    out = []
    recorder = _Recorder()
    for stmt in config_parser.ConfigParser(text, recorder):
        mine = _Recorder()
        mine.refs, mine.macros = list(recorder.refs), list(recorder.macros)
        recorder.refs.clear()
        recorder.macros.clear()
        out.append((stmt, mine))
    return out


def _explain_statements(text: str, where: Callable[[Any], str], base_dir: str | None) -> str | None:
    try:
        parsed = _statements(text)
    except Exception as e:  # noqa: BLE001 - a syntax error: gin's first line carries the position
        return f"syntax error: {_first_line(e)}"
    for stmt, rec in parsed:
        if isinstance(stmt, config_parser.IncludeStatement):
            path = _find_include(stmt.filename, base_dir)
            if path is None:
                return (
                    f"{where(stmt)}include '{stmt.filename}' not found (looked in the working "
                    f"directory and {REPO_ROOT})"
                )
            problem = _explain_file_text(path)
            if problem:
                return f"{where(stmt)}in {path}: {problem}"
            continue
        problem = check_statement(stmt, rec)
        if problem:
            return where(stmt) + problem
    return None


def check_include_cycle(path: str) -> None:
    """A ConfigError naming the files of an include cycle reachable from the gin file `path` (a file
    that includes itself, or a -> b -> a), which gin follows until Python's recursion limit. Each file
    is read once; a file that does not parse is left to gin and `explain_file`."""
    done: set[str] = set()

    def visit(file: str, chain: list[tuple[str, str]], line: int) -> None:
        real, seen = os.path.realpath(file), [r for r, _ in chain]
        if real in seen:
            names = [name for _, name in chain[seen.index(real) :]] + [file]
            raise ConfigError(
                f"{path}: include cycle {' -> '.join(names)} (line {line} of {chain[-1][1]} includes "
                f"{file} again); remove that include"
            )
        if real in done:
            return
        try:
            with open(file) as f:
                statements = [stmt for stmt, _ in _statements(f.read())]
        except Exception:  # noqa: BLE001 - unreadable or a syntax error: gin's parse says which
            statements = []
        for stmt in statements:
            found = isinstance(stmt, config_parser.IncludeStatement) and _find_include(
                stmt.filename, os.path.dirname(file)
            )
            if found:
                visit(found, [*chain, (real, file)], stmt.location.line_num)
        done.add(real)

    visit(path, [], 0)


def _find_include(name: str, base_dir: str | None) -> str | None:
    for cand in (name, os.path.join(base_dir or "", name), os.path.join(REPO_ROOT, name)):
        if cand and os.path.isfile(cand):
            return cand
    return None


def _explain_file_text(path: str) -> str | None:
    with open(path) as f:
        text = f.read()

    def where(stmt: Any) -> str:
        return f"line {stmt.location.line_num}: " if getattr(stmt, "location", None) else ""

    return _explain_statements(text, where, os.path.dirname(path))


def explain_file(path: str, error: BaseException) -> str:
    """One line for a gin error while parsing the file `path`."""
    try:
        found = _explain_file_text(path)
    except Exception:  # noqa: BLE001 - fall back to gin's own first line
        found = None
    return found or _first_line(error)


def explain_text(text: str, error: BaseException) -> str:
    """One line for a gin error while parsing the binding(s) `text`."""
    try:
        found = _explain_statements(text, lambda stmt: "", None)
    except Exception:  # noqa: BLE001
        found = None
    return found or _first_line(error)


# ---------------------------------------------------------------------------------- specs
