"""The registration-time checks of a part against its kind's contract (polgrad/registry/kinds.py):
its metadata keys and values, and its signature (the loop's call, positional names in the loop's
order, the keywords with their defaults, and gin-bindable hyperparameters)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from polgrad.errors import RegistryError, did_you_mean
from polgrad.registry.kinds import META_KEYS, NO_HYPERPARAMETERS, call_parameters, signature_text


def check_meta(kind: str, full_name: str, at: str, meta: dict[str, Any]) -> None:
    """Every metadata key is declared for `kind` and has an allowed value."""
    declared = META_KEYS[kind]
    for key, value in meta.items():
        if key not in declared:
            valid = ", ".join(declared) or "(none)"
            raise RegistryError(
                f"{full_name} ({at}): unknown metadata key '{key}'{did_you_mean(key, declared)}; "
                f"keys of {kind}: {valid}"
            )
        why = declared[key].check(value)
        if why:
            raise RegistryError(f"{full_name} ({at}): metadata {key}={value!r} {why}")


def hyperparameters(kind: str, fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """The part's own parameters that the loop does not pass: gin binds them."""
    passed = call_parameters(kind)
    n_pos = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in passed)
    kw = {p.name for p in passed if p.kind is p.KEYWORD_ONLY}
    params = list(inspect.signature(inspect.unwrap(fn)).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = {p.name for p in positional[:n_pos]} | kw
    return [p for p in params if p.name not in taken and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def check_signature(kind: str, full_name: str, at: str, fn: Callable[..., Any]) -> None:
    """`fn` accepts the call its kind's Protocol describes; its other parameters are gin-bindable."""
    head = f"{full_name} ({at})"
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise RegistryError(
            f"{head}: cannot read the signature of {fn!r} ({e}); register a Python function"
        ) from None
    passed = call_parameters(kind)
    want_pos = [p.name for p in passed if p.kind is p.POSITIONAL_OR_KEYWORD]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    if len(positional) < len(want_pos) and not var_pos:
        got = ", ".join(p.name for p in positional) or "none"
        raise RegistryError(
            f"{head}: accepts {len(positional)} positional parameters ({got}) but the loop passes "
            f"{len(want_pos)}: ({', '.join(want_pos)}); the signature of {kind} is {signature_text(kind)}"
        )
    # a positional parameter named as another position's tensor: swapped arguments (one named as a
    # keyword the loop passes is the check below's: "takes it positionally")
    for i, p in enumerate(positional[: len(want_pos)]):
        if p.name != want_pos[i] and p.name in want_pos:
            raise RegistryError(
                f"{head}: its parameter {i + 1} is named '{p.name}' but the loop passes '{want_pos[i]}' "
                f"there ('{p.name}' comes as parameter {want_pos.index(p.name) + 1}); order the parameters "
                f"as {signature_text(kind)}"
            )
    consumed = {p.name for p in positional[: len(want_pos)]}
    by_name = {p.name: p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for want in (p for p in passed if p.kind is p.KEYWORD_ONLY):
        own = by_name.get(want.name)
        if own is None or own.name in consumed:
            if var_kw and own is None:
                continue
            why = "takes it positionally" if own is not None else "does not accept it"
            raise RegistryError(
                f"{head}: the loop passes keyword '{want.name}' and the part {why}; add "
                f"`*, {want.name}=None` (or **kwargs) after the {len(want_pos)} positional parameters"
            )
        if want.default is not inspect.Parameter.empty and own.default is inspect.Parameter.empty:
            raise RegistryError(
                f"{head}: the loop may omit keyword '{want.name}'; give it a default ({want.name}=None)"
            )
    for p in hyperparameters(kind, fn):
        if p.kind is not p.KEYWORD_ONLY and p.default is inspect.Parameter.empty:
            raise RegistryError(
                f"{head}: parameter '{p.name}' is not passed by the loop and has no default; make it "
                f"keyword-only (after `*`) so gin binds it ({full_name}.{p.name} = ...), or give it a default"
            )
        if kind in NO_HYPERPARAMETERS:
            raise RegistryError(
                f"{head}: a {kind} part takes no hyperparameters ('{p.name}'): {NO_HYPERPARAMETERS[kind]}, "
                "so no gin binding would reach it; register one part per setting instead"
            )
