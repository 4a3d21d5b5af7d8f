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

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Keep the one line when gin re-raises it. gin re-raises an exception from inside a
        configurable as an instance of a subclass of its type, made on the spot, whose `__str__`
        appends "In call to configurable ..." lines. A polgrad error already names the part and the
        binding in its one line, so a subclass whose `__str__` is defined outside polgrad renders
        only the first line; every other exception keeps gin's context. Nothing of gin is patched."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("__str__")
        if own is not None and not str(getattr(own, "__module__", "")).startswith("polgrad"):
            cls.__str__ = lambda self, _own=own: _own(self).split("\n", 1)[0]
            # gin's proxy is built without arguments: its args (and repr) are the message's too
            cls.args = property(lambda self: (str(self),))
            cls.__repr__ = lambda self: f"{type(self).__name__}({str(self)!r})"


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
