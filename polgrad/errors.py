"""polgrad's errors: each one prints as a single line that says what is wrong and how to fix it.

`python -m polgrad.*` entry points catch `PolgradError` and print `error: <message>` with no
traceback; library callers get an ordinary exception they can catch.
"""

from __future__ import annotations


class PolgradError(Exception):
    """Base class: the message is one line, names the offending thing and the valid choices."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # force one line


class RegistryError(PolgradError, KeyError):
    """Unknown kind or name, duplicate registration."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class ShapeError(PolgradError, ValueError):
    """A tensor handed to a component has the wrong shape, dtype or values."""


class ConfigError(PolgradError, ValueError):
    """A gin binding or experiment file is invalid."""


class DataError(PolgradError, ValueError):
    """A data file is missing, malformed, lacks a column, or is empty."""
