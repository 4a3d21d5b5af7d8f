"""Where an experiment file's paths lead, and what an experiment that includes another inherits.

resolve_path   a path as given, else beside the experiment file, else in its parent folders
inherit        an included experiment (it sets Sweep parameters) is inherited, not passed to gin
"""

from __future__ import annotations

import os
from pathlib import Path


def resolve_path(path: str, experiment_file: str) -> str | None:
    """`path` as given, else relative to the experiment file's folder, else to its parents."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p) if p.is_file() else None
    if p.is_file():
        return str(p.resolve())
    for folder in [Path(experiment_file).resolve().parent, *Path(experiment_file).resolve().parents]:
        if (folder / p).is_file():
            return str(folder / p)
    return None


def _same_file(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and Path(a).resolve() == Path(b).resolve()


def _rebase(path: str, parent: str, child: str) -> str:
    """`path` as written in experiment `parent`, written so that `child` means the same file: as written
    when it resolves there alike (so an inheriting pilot's cells keep the ids of its experiment's), else
    relative to `child`'s folder, else absolute (left unresolved if `parent` cannot find it either)."""
    target = resolve_path(path, parent)
    if target is None or _same_file(resolve_path(path, child), target):
        return path
    rel = os.path.relpath(target, Path(child).resolve().parent)
    return rel if _same_file(resolve_path(rel, child), target) else str(Path(target).resolve())


def inherit(file: str, statements, read, fail, depth: int = 0):
    """An include that is itself an experiment (it sets Sweep parameters) is inherited, not passed to gin:
    its includes, imports, bindings and Sweep parameters (but its name) come first and this file's
    override them (a pilot is its experiment with other seeds and another name: the cells cannot drift
    apart). Its include and spec paths are rebased to mean the same files from here (`_rebase`)."""
    includes, imports, fixed, params, lines = statements
    out_includes, out_imports, out_fixed, out_params = [], [], [], {}
    for inc, line in includes:
        found = resolve_path(inc, file)
        parent = read(found, Path(found).read_text()) if found is not None else None
        if parent is None or not parent[3]:  # not found (reported later) or a plain config file
            out_includes.append((inc, line))
            continue
        if depth >= 8:
            raise fail(file, f"line {line}: include '{inc}'", "experiments include each other in a cycle")
        p_includes, p_imports, p_fixed, p_params, _ = inherit(found, parent, read, fail, depth=depth + 1)
        # the parent's includes and specs as this file would write them (they were written for the parent)
        out_includes += [(_rebase(p_inc, found, file), line) for p_inc, _ in p_includes]
        if isinstance(p_params.get("specs"), (list, tuple)):
            p_params["specs"] = [
                _rebase(x, found, file) if isinstance(x, str) else x for x in p_params["specs"]
            ]
        p_params.pop("name", None)  # a child names its own results (default: its file's name)
        # nor is a child gated by its parent's pilot: a pilot runs before the gate it feeds
        p_params.pop("pilot_gate", None)
        p_params.pop("pilot", None)
        out_imports += [i for i in p_imports if i not in out_imports]
        out_fixed += p_fixed
        out_params.update(p_params)
    out_params.update(params)
    return (
        out_includes,
        out_imports + [i for i in imports if i not in out_imports],
        out_fixed + fixed,
        out_params,
        lines,
    )
