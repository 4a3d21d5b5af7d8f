"""polgrad's errors: each one prints as a single line that says what is wrong and how to fix it.

`python -m polgrad.*` entry points catch `PolgradError` and print `error: <message>` with no
traceback; library callers get an ordinary exception they can catch.
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Iterable, Iterator


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


class WriteError(PolgradError):
    """A file could not be written: the disk is full, the folder read-only or not ours (see `write_error`)."""


# The OSErrors of a write that the user fixes outside polgrad (free space, permissions), as errno names.
WRITE_ERRNOS = ("ENOSPC", "EDQUOT", "EROFS", "EACCES", "EPERM", "EFBIG")


def is_write_failure(error: BaseException) -> bool:
    """True for an OSError whose errno is one of WRITE_ERRNOS (disk full, read-only, permission)."""
    import errno

    codes = {getattr(errno, name) for name in WRITE_ERRNOS if hasattr(errno, name)}
    return isinstance(error, OSError) and error.errno in codes


def write_error(error: OSError, path, fix: str = "") -> WriteError:
    """One line: '<reason> while writing <path>[; <fix>]', the reason from the errno ('no space left
    on device', 'read-only file system', 'permission denied'); `path` defaults to the error's own."""
    import os

    reason = os.strerror(error.errno) if error.errno else (error.strerror or str(error))
    where = error.filename if path is None and error.filename else path
    return WriteError(f"{reason[:1].lower()}{reason[1:]} while writing {where}" + (f"; {fix}" if fix else ""))


@contextlib.contextmanager
def gin_keeps_our_lines() -> Iterator[None]:
    """Inside: gin does not append "In call to configurable ..." lines to polgrad's own errors.

    gin wraps every exception raised inside a configurable in a proxy whose message gains the
    call site. polgrad's errors already name the part and the binding in one line, so for them
    the exception is re-raised unchanged; every other exception keeps gin's context. The entry
    points (`python -m polgrad.train`, `polgrad.train.run`, `python -m polgrad.sweep`) run inside
    it; gin is restored on exit, so importing polgrad patches nothing.
    """
    from gin import utils as gin_utils

    original = gin_utils.augment_exception_message_and_reraise
    if getattr(original, "_polgrad", False):  # nested: the outer context restores it
        yield
        return

    def augment(exception, message):
        if isinstance(exception, PolgradError):
            raise exception.with_traceback(exception.__traceback__)
        return original(exception, message)

    augment._polgrad = True
    gin_utils.augment_exception_message_and_reraise = augment
    try:
        yield
    finally:
        gin_utils.augment_exception_message_and_reraise = original
