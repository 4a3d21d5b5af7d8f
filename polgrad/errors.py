"""polgrad's errors: each one prints as a single line that says what is wrong and how to fix it.

`python -m polgrad.*` entry points catch `PolgradError` and print `error: <message>` with no
traceback; library callers get an ordinary exception they can catch.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(word: str, choices: Iterable[str], cutoff: float = 0.6) -> str:
    """ "; did you mean 'x'?" for the closest of `choices` to `word` (difflib), or "" if none is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=cutoff)
    return f"; did you mean '{close[0]}'?" if close else ""


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


def _keep_polgrad_errors_one_line() -> None:
    """Stop gin from appending "In call to configurable ..." lines to polgrad's own errors.

    gin wraps every exception raised inside a configurable in a proxy whose message gains the
    call site. polgrad's errors already name the part and the binding in one line, so for them
    the exception is re-raised unchanged; every other exception keeps gin's context.
    """
    from gin import utils as gin_utils

    original = gin_utils.augment_exception_message_and_reraise
    if getattr(original, "_polgrad", False):
        return

    def augment(exception, message):
        if isinstance(exception, PolgradError):
            raise exception.with_traceback(exception.__traceback__)
        return original(exception, message)

    augment._polgrad = True
    gin_utils.augment_exception_message_and_reraise = augment


_keep_polgrad_errors_one_line()
