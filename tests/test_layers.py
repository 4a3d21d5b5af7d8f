"""The architecture as a test: no import cycle inside polgrad, and the layer rule of CONTRIBUTING.md.

Every `import` and `from ... import` in polgrad/ counts, at module level and inside functions
(a function-level import hides a cycle; it does not remove it). The layers are the table in
CONTRIBUTING.md ("Architecture"); a test below checks that the two agree.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "polgrad"

# Bottom to top: a module imports polgrad modules only from its own layer or a lower one (never
# from a higher one; inside a layer the cycle test keeps the order). `__main__` modules are entry
# points (nothing imports them) and are exempt from the rule, not from the cycle test. The root
# `polgrad/__init__.py` gathers the built-in parts, so it counts as the layer of the parts.
LAYERS: list[list[str]] = [
    [
        "polgrad.errors",
        "polgrad.registry",
        "polgrad.hooks",
        "polgrad.io",
        "polgrad.runlock",
        "polgrad.collective",
        "polgrad.stopping",
    ],
    ["polgrad.models"],
    ["polgrad.components", "polgrad.tasks", "polgrad.checks"],
    ["polgrad.rollout", "polgrad.batch", "polgrad.evaluation", "polgrad.tracking"],
    [
        "polgrad.spec_checks",
        "polgrad.table5",
        "polgrad.algorithm",
        "polgrad.train_config",
        "polgrad.distributed",
        "polgrad.checkpoints",
        "polgrad.pretrain",
    ],
    ["polgrad.config"],
    ["polgrad.export", "polgrad.producer", "polgrad.run", "polgrad.resume_config", "polgrad.offline"]
    + ["polgrad.trainer"]
    + ["polgrad.train"],
    ["polgrad.results"],
    ["polgrad.sweep"],
]


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path], name: str | None = None) -> set[str]:
    """The polgrad modules that `path` (module `name`) imports anywhere in its body."""
    me = name or module_name(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "polgrad":
                    out.add(resolve(alias.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me if is_pkg else me.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "polgrad":
                continue
            for alias in node.names:  # `from polgrad import models` imports the module polgrad.models
                sub = f"{mod}.{alias.name}"
                out.add(sub if sub in modules else resolve(mod))
    out.discard(None)
    out.discard(me)
    return out


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


ROOT_LAYER = 2  # `import polgrad` registers the built-in parts (components, tasks)


def layer_of(module: str) -> tuple[int, str] | None:
    if module == "polgrad":
        return ROOT_LAYER, "polgrad"
    best = None
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > len(best[1])
            ):
                best = (i, prefix)
    return best


def violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in sorted(g.items()):
        if src.endswith(".__main__"):
            continue
        ls = layer_of(src)
        if ls is None:
            bad.append(f"{src} is in no layer: add it to LAYERS and to CONTRIBUTING.md")
            continue
        for dst in sorted(targets):
            ld = layer_of(dst)
            if ld is None:
                bad.append(f"{dst} is in no layer")
            elif ld[0] > ls[0]:
                bad.append(f"{src} (layer {ls[0]}) imports {dst} (layer {ld[0]})")
    return bad


def test_no_import_cycle_inside_polgrad():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_every_module_obeys_the_layer_rule():
    bad = violations(graph())
    assert not bad, "\n".join(bad)


def test_the_checks_see_a_planted_cycle_and_an_upward_import(tmp_path):
    """Non-vacuity: the same functions flag a cycle and an upward import in a doctored graph."""
    g = graph()
    g["polgrad.errors"] = {*g["polgrad.errors"], "polgrad.trainer"}  # errors (bottom) -> trainer (top)
    assert any("polgrad.errors" in c and "polgrad.trainer" in c for c in cycles(g))
    assert any(v.startswith("polgrad.errors (layer 0) imports polgrad.trainer") for v in violations(g))
    # and a function-level import is seen like a module-level one
    tmp = tmp_path / "probe.py"
    tmp.write_text("def f():\n    from polgrad import trainer\n")
    assert "polgrad.trainer" in imports_of(tmp, all_modules(), name="polgrad.probe")


def test_contributing_states_the_same_layers():
    text = (REPO / "CONTRIBUTING.md").read_text()
    block = re.search(r"<!-- layers -->\n(.*?)<!-- /layers -->", text, re.S)
    assert block, "CONTRIBUTING.md must hold the layer table between <!-- layers --> markers"
    stated = [re.findall(r"`(polgrad[\w.]*)`", line) for line in block.group(1).splitlines()]
    stated = [names for names in stated if names]
    assert stated == list(reversed(LAYERS)), "CONTRIBUTING.md's layer table differs from tests/test_layers.py"


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_over_500_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 500, f"{path.relative_to(REPO)} has {n} lines: split it by job"


def test_train_reads_in_at_most_80_lines():
    tree = ast.parse((PKG / "trainer.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train")
    assert fn.end_lineno - fn.lineno + 1 <= 80


def test_no_polgrad_docs_point_outside_the_project():
    for path in [REPO / "README.md", REPO / "CONTRIBUTING.md", *PKG.rglob("*.py")]:
        assert "../shared" not in path.read_text(), path
    assert os.path.isfile(REPO / "CONTRIBUTING.md")
