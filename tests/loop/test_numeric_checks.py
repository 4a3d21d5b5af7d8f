"""One owner for "is this a number?": polgrad.checks.is_int / is_real, and a source scan keeping it so.

A bool is an int to Python, so every binding check used to spell `isinstance(x, bool) or not
isinstance(x, (int, float))` by hand (three private `_is_int`/`_is_real`/`_is_number` copies and
dozens of inline tests). The scan below fails when a module under polgrad/ grows its own copy again.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from polgrad.checks import is_int, is_real

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "polgrad"
OWNER = PKG / "checks.py"
PRIVATE_COPIES = {"_is_int", "_is_real", "_is_number"}
NUMERIC_TYPES = {"int", "float", "Integral", "Real", "Number", "Complex", "Rational"}

# Sites that test a bool next to a numeric type on purpose and are NOT is_int/is_real; each with why.
ALLOWED = {
    # numbers.Number also takes complex (a CSV cell shown as text), which no is_real variant accepts
    "polgrad/tasks/files.py": 1,
}


@pytest.mark.parametrize(
    "value, want_int, want_real",
    [
        (True, False, False),
        (False, False, False),
        (1, True, True),
        (0, True, True),
        (-3, True, True),
        (1.0, False, True),
        (math.nan, False, True),
        (math.inf, False, True),
        (-math.inf, False, True),
        ("1", False, False),
        (None, False, False),
        ([1], False, False),
        (1 + 0j, False, False),
        (np.int64(1), False, False),
        (np.float32(1.0), False, False),
        (np.float64(1.0), False, True),  # a subclass of float
        (np.bool_(True), False, False),
        (Fraction(1, 2), False, False),
    ],
)
def test_builtin_types_only_by_default(value, want_int, want_real):
    assert (is_int(value), is_real(value)) == (want_int, want_real)


@pytest.mark.parametrize(
    "value, want_int, want_real",
    [
        (True, False, False),
        (1, True, True),
        (1.0, False, True),
        (math.nan, False, True),
        ("1", False, False),
        (None, False, False),
        (1 + 0j, False, False),
        (np.int64(1), True, True),
        (np.float32(1.0), False, True),
        (np.bool_(True), False, False),
        (Fraction(1, 2), False, True),
    ],
)
def test_abc_also_takes_numpy_and_fractions(value, want_int, want_real):
    assert (is_int(value, abc=True), is_real(value, abc=True)) == (want_int, want_real)


def _isinstance_of(node: ast.AST) -> tuple[str, set[str]] | None:
    """(the tested expression, the type names) of `isinstance(x, T)` or `not isinstance(x, T)`."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node = node.operand
    if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
        return None
    if len(node.args) != 2:
        return None
    types = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
    names = {t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", "") for t in types}
    return ast.dump(node.args[0]), names


def hand_rolled(source: str, filename: str = "<src>") -> list[str]:
    """Each private numeric-check copy and each `isinstance(x, bool)` + numeric-type test of one x."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.FunctionDef) and node.name in PRIVATE_COPIES:
            found.append(f"{filename}:{node.lineno}: def {node.name}")
        if isinstance(node, ast.BoolOp):
            tests = [t for t in map(_isinstance_of, node.values) if t]
            bools = {x for x, names in tests if "bool" in names}
            if any(x in bools and names & NUMERIC_TYPES for x, names in tests):
                found.append(f"{filename}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_scan_finds_every_spelling():
    """The scan is not vacuous: each spelling the refactor removed is found, a bool flag is not."""
    src = """
def _is_number(x):
    return True
a = isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0
b = not isinstance(v, numbers.Real) or isinstance(v, bool)
c = all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
ok1 = not isinstance(flag, bool)
ok2 = isinstance(a, bool) or isinstance(b, int)
"""
    hits = hand_rolled(src)
    assert [h.split(":")[1] for h in hits] == ["2", "4", "5", "6"], hits


def test_no_module_rolls_its_own_numeric_check():
    counts: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        if path == OWNER:
            continue
        rel = str(path.relative_to(REPO))
        hits = hand_rolled(path.read_text(), rel)
        if hits:
            counts[rel] = hits
    unexpected = [h for rel, hits in counts.items() if len(hits) != ALLOWED.get(rel, 0) for h in hits]
    assert not unexpected, (
        "use polgrad.checks.is_int / is_real (abc=True for numbers.Integral/Real) instead of: "
        + "; ".join(unexpected)
    )
    stale = [rel for rel in ALLOWED if rel not in counts]
    assert not stale, f"ALLOWED lists files with no such site any more: {stale}"
