"""Which bindings a built cell reads: the dry run's test for a grid axis that changes nothing.

A binding `kind.name.param` is *read* by a cell when the cell calls the part `kind.name`: a part
of its Algorithm that the loop calls, its task (`train.task`), its trackers (`train.loggers`), or a
part that one of those is bound to by reference (followed through gin's bindings). Of the
Algorithm's own parameters, those the built spec never reads are not read (`_unread_algorithm`: the
KL's coefficient, placement and controller when `Algorithm.kl = None`; the value loss and its weight
when no part needs a critic), and neither are the parts they name. Every `train.*` binding is read.
A binding of anything else (a user's own `gin.configurable`, a macro) counts as read: nothing here
can tell, and the check only ever refuses what it knows to be unread.

`check_axes` applies the rule the dry run enforces (polgrad/sweep/validation.py): a grid axis is
refused when, in some cell, its binding is not read *and* varying it gives cells that are otherwise
identical (same spec, same seed, the same values of every binding they read): identical runs would
be compared as if they differed. An axis read in some cells and not in others passes when it is
zipped with the binding that decides (experiments/clip_rules.gin zips `Algorithm.clip` with
`clip.ppo.eps_high`); those cells' labels then leave it out (`Cell.unread`, the CSV's `not_read`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import gin
from gin import config_parser

from polgrad import registry
from polgrad.algorithm import Algorithm
from polgrad.errors import ConfigError
from polgrad.train_config import TrainConfig

__all__ = ["Reads", "bound_keys", "check_axes", "reads_of"]


@dataclass(frozen=True)
class Reads:
    """What one built cell calls: each slot and the part it builds ('Algorithm.clip' -> clip.ppo), and
    the Algorithm parameters it never reads, each with the binding that makes it so."""

    slots: dict[str, registry.Entry]
    unread_algorithm: dict[str, str]

    @property
    def called(self) -> set[str]:
        return {e.full_name for e in self.slots.values()}

    def why_unread(self, key: str) -> str | None:
        """None when the cell reads the binding `key` ('clip.tis.cap'), else what it builds instead."""
        try:
            _, selector, _ = config_parser.parse_binding_key(key)
            fn = gin.get_configurable(selector)
        except (ValueError, KeyError, SyntaxError):
            return None  # a macro or a name gin resolves otherwise: not ours to judge
        if fn is gin.get_configurable("Algorithm"):  # polgrad.config_parts' maker of the Algorithm
            return self.unread_algorithm.get(f"Algorithm.{key.rpartition('.')[2]}")
        entry = registry.entry_of(fn)
        if entry is None or entry.full_name in self.called:
            return None
        instead = [f"{slot} = @{e.full_name}" for slot, e in self.slots.items() if e.kind == entry.kind]
        if instead:
            return "builds " + ", ".join(instead)
        return self.unread_algorithm.get(f"Algorithm.{entry.kind}", f"builds no {entry.kind} part")


def _unread_algorithm(algo: Algorithm) -> dict[str, str]:
    """The Algorithm parameters the built spec never reads, each with the reason (a binding)."""
    out = {}
    if algo.kl is None:
        out.update(dict.fromkeys(("kl_coef", "kl_placement", "kl_controller"), "builds Algorithm.kl = None"))
    if not algo.needs_critic:
        out.update(dict.fromkeys(("vf_coef", "value_loss"), "builds no critic (no part needs one)"))
    return {f"Algorithm.{k}": v for k, v in out.items()}


def _referenced(value: Any) -> Iterable[registry.Entry]:
    """The registered parts a bound value names (a reference, or a list or tuple of them)."""
    for v in value if isinstance(value, (list, tuple)) else (value,):
        entry = registry.entry_of(v)
        if entry is not None:
            yield entry


def reads_of(cfg: TrainConfig, algo: Algorithm) -> Reads:
    """What the cell built by `config.build()` (gin's config still parsed) calls."""
    unread = _unread_algorithm(algo)
    slots = {b: e for b, e in algo.parts.items() if b not in unread}
    slots["train.task"] = registry.entry_of(cfg.task)
    for i, name in enumerate(cfg.loggers):
        slots[f"train.loggers[{i}]"] = registry.lookup("tracker", name)
    todo = list(slots.values())
    while todo:  # parts bound to a called part by reference are called too
        entry = todo.pop()
        for param, value in gin.get_bindings(entry.full_name).items():
            for ref in _referenced(value):
                slot = f"{entry.full_name}.{param}"
                if ref.full_name not in {e.full_name for e in slots.values()}:
                    slots[slot] = ref
                    todo.append(ref)
    return Reads(slots=slots, unread_algorithm=unread)


def bound_keys() -> list[str]:
    """Every `selector.param` gin's parsed config binds (its short names: 'Algorithm.kl'), Sweep's aside."""
    out = []
    for (scope, selector), params in gin.config._CONFIG.items():  # gin has no public list of its bindings
        try:
            fn = gin.get_configurable(selector)
        except (ValueError, KeyError):
            continue
        if selector == "gin.macro":
            continue  # a macro's value: read wherever a read binding names it
        entry = registry.entry_of(fn)
        name = entry.full_name if entry else getattr(fn, "__name__", selector.rpartition(".")[2])
        if fn is TrainConfig:
            name = "train"
        if name == "Sweep":
            continue
        out.extend(f"{scope + '/' if scope else ''}{name}.{p}" for p in params)
    return out


def check_axes(file: str, cells: Sequence[Any], why: dict[str, dict[str, str]]) -> None:
    """Refuse a grid axis that some cell does not read when varying it gives otherwise identical cells.

    `why[cell.id]` maps each swept key the cell does not read to what the cell builds instead.
    """
    groups: dict[tuple, list[Any]] = {}
    for c in cells:
        unread = why.get(c.id, {})
        read = tuple((k, v) for k, v in c.swept if k not in unread)
        groups.setdefault((c.spec, c.seed, read), []).append(c)
    for same in groups.values():
        if len(same) < 2:
            continue
        a, b = same[0], same[1]
        axes = [k for (k, va), (_, vb) in zip(a.swept, b.swept, strict=True) if va != vb]
        named = " and ".join(f"'{k}'" for k in axes)
        listed = ", ".join(c.id for c in same)
        raise ConfigError(
            f"{file}: Sweep.grid {'axes' if len(axes) > 1 else 'axis'} {named} not read by cells {listed} "
            f"({a.spec_name}: the cell {why[a.id][axes[0]]}), so they would train identical runs "
            "compared as if they differed: remove the axis, or zip it with the binding that makes it "
            "act (a tuple key, as experiments/clip_rules.gin does); the rule: CONTRIBUTING.md, "
            "'Adding an experiment'"
        )
