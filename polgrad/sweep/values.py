"""Gin values as an experiment file writes them: references, macros, bindings, and their gin text.

The experiment is read with gin's own parser and a delegate that keeps `@kl.k3` and `%LR` as
written (nothing is bound, nothing needs to be registered); `gin_text` gives a value back as gin
text, which is what a cell passes to the trainer with --bind.
"""

from __future__ import annotations

import dataclasses
from typing import Any


class GinRef:
    """A configurable reference as written (`@kl.k3`, `@scope/name()`); repr is its gin text."""

    def __init__(self, scoped_selector: str, evaluate: bool):
        self.scoped_selector, self.evaluate = scoped_selector, evaluate

    @property
    def selector(self) -> str:
        return self.scoped_selector.rsplit("/", 1)[-1]

    def __repr__(self) -> str:
        return f"@{self.scoped_selector}{'()' if self.evaluate else ''}"

    def __eq__(self, other):
        return type(other) is type(self) and repr(other) == repr(self)

    def __hash__(self):
        return hash(repr(self))


class GinMacro:
    """A macro as written (`%LR`); repr is its gin text."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name}"

    def __eq__(self, other):
        return type(other) is type(self) and other.name == self.name

    def __hash__(self):
        return hash(repr(self))


def _delegate():
    from gin import config_parser

    class _Delegate(config_parser.ParserDelegate):
        def configurable_reference(self, scoped_name, evaluate):
            return GinRef(scoped_name, evaluate)

        def macro(self, name):
            return GinMacro(name)

    return _Delegate()


def gin_text(value: Any) -> str:
    """The gin text of a parsed value (Python literal syntax; references and macros as written)."""
    return repr(value)


@dataclasses.dataclass(frozen=True)
class Binding:
    """One `key = value` line, as text, with where it came from."""

    key: str  # 'Algorithm.kl', 'scope/advantage.grpo.eps', or a macro name 'LR'
    value: Any
    line: int = 0

    @property
    def text(self) -> str:
        return f"{self.key} = {gin_text(self.value)}"


def _value_type(v: Any) -> str | None:
    """Type class of a grid value for the mixed-type check (None and macros mix with anything)."""
    if v is None or isinstance(v, GinMacro):
        return None
    if isinstance(v, GinRef):
        return "reference"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "sequence"
    if isinstance(v, dict):
        return "dict"
    return type(v).__name__
