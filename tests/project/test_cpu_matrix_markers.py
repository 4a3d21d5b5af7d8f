"""Every test that compares numbers across ranks, backends, precisions or kernels carries
`@pytest.mark.cpu_matrix` (or its module's `pytestmark` does), so that `.ci/cpu_matrix` runs it again
under AVX2 and AVX-512 kernels (CONTRIBUTING.md, "Tests that hold on any machine").

The scan finds such a test by what it runs, read from the test modules' source (ast). A test reaches
what its body, its decorators and its fixtures use, following names into the module's own functions,
fixtures and constants (transitively). It is such a test when what it reaches
- runs with a setting whose numbers differ from the plain run's: more than one rank (`spawn(...,
  nprocs=2)`, a torchrun or DeepSpeed launcher command, `Sweep.processes_per_cell = 2`,
  `train.world_size = 2`, `world_size=2`), ZeRO-3 (`train.zero_stage = 3`, `zero_stage=3`), vLLM
  (`train.rollout_backend = 'vllm'`, `VLLMRollout(...)`), bf16 (`train.bf16 = True`, `bf16=True`,
  `--precision ...bf16`), compiled kernels (`train.compile = True`, `torch.compile`, `compiled=...`)
  or the async producer forced onto the synchronous run (`--force-async`, a patched
  `TrainConfig.asynchronous`),
- and runs something: a subprocess, `mp.spawn`, a sweep (`polgrad.sweep.main` without `--dry-run`,
  `polgrad.sweep.run`), the trainer (`polgrad.train.run`, `polgrad.trainer.train`), the bench's CLI,
  a DeepSpeed engine (`make_engine`), the async `Producer` or a vLLM engine. A test that only
  parses, builds or refuses such a setting (the config error tests, a dry run, a launcher's argument
  parser) runs nothing of it; NOT_RUN names, with the reason, the one test the scan cannot tell so.
Tests on the fake trainer (tests/fake_train.py, the `fake_trainer` fixture) are exempt: it imports no
torch, so its ranks compute nothing that could round differently.

The signals are the scan's and err on the side of precision: a marked test the scan does not find
(e.g. a producer compared with the synchronous sampler, or ZeRO stages compared with plain PyTorch)
is marked by hand, and nothing here flags a test for carrying the marker.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

# String settings: (pattern, what it runs), matched in str constants and in f-strings' literal parts.
# A gin binding starts its line (in a file or a --bind), so prose that quotes one is no setting.
_BINDING = r"(?m)^\s*{}\s*=\s*{}\s*$"
SETTINGS = [
    (re.compile(_BINDING.format(r"Sweep\.processes_per_cell", r"(?:[2-9]|[1-9]\d+)")), "more than one rank"),
    (re.compile(_BINDING.format(r"train\.world_size", r"(?:[2-9]|[1-9]\d+)")), "more than one rank"),
    (re.compile(r"^(?:torch\.distributed\.run|deepspeed\.launcher\.runner)$"), "more than one rank"),
    (re.compile(_BINDING.format(r"train\.zero_stage", "3")), "ZeRO-3"),
    (re.compile(_BINDING.format(r"train\.rollout_backend", "['\"]vllm['\"]")), "vLLM"),
    (re.compile(_BINDING.format(r"train\.bf16", "True")), "bf16"),
    (re.compile(_BINDING.format(r"train\.compile", "True")), "compiled kernels"),
    (re.compile(r"^--force-async$"), "async forced onto the synchronous run"),
]
# Keyword settings: name -> (test of the constant value, what it runs).
KEYWORDS = {
    "nprocs": (lambda v: isinstance(v, int) and v >= 2, "more than one rank"),
    "world_size": (lambda v: isinstance(v, int) and v >= 2, "more than one rank"),
    "zero_stage": (lambda v: v == 3, "ZeRO-3"),
    "bf16": (lambda v: v is True, "bf16"),
}
# Calls that run something; the qualified names after resolving the module's imports.
RUNS = {
    "subprocess.run",
    "subprocess.Popen",
    "subprocess.call",
    "subprocess.check_call",
    "subprocess.check_output",
    "polgrad.sweep.main",
    "polgrad.sweep.run",
    "benchmarks.bench.main",
    "polgrad.train.run",
    "polgrad.trainer.train",
    "polgrad.distributed.make_engine",
    "polgrad.producer.Producer",
    "polgrad.rollout.vllm.VLLMRollout",
}
MARK = "cpu_matrix"
# Tests that reach a setting and a run yet never run the setting, with why; an entry that names no
# such test fails the scan, so the list cannot go stale.
NOT_RUN = {
    "tests/sweep/test_ray_cluster.py::test_a_placement_the_cluster_cannot_hold_is_one_line": (
        "the sweep refuses the 2-rank placement (exit 2) before any rank starts"
    ),
}


def _imports(tree: ast.Module) -> dict[str, str]:
    """Local name -> qualified name, from every import statement of the module (any scope)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _qualified(func: ast.expr, imports: dict[str, str]) -> str:
    if isinstance(func, ast.Name):
        return imports.get(func.id, func.id)
    if isinstance(func, ast.Attribute):
        return f"{_qualified(func.value, imports)}.{func.attr}"
    return ""


def _facts(node: ast.AST, imports: dict[str, str]) -> tuple[list, list, set[str]]:
    """One walk of a definition: its settings (what it runs, the signal, line), its runs (name, line)
    and the names it uses (fixtures by their parameter names)."""
    settings, runs, names = [], [], set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):  # f-strings' literal parts too
            settings += [
                (what, m.group(0).strip(), n.lineno) for pat, what in SETTINGS if (m := pat.search(n.value))
            ]
        elif isinstance(n, ast.keyword) and n.arg in KEYWORDS and isinstance(n.value, ast.Constant):
            test, what = KEYWORDS[n.arg]
            if test(n.value.value):
                settings.append((what, f"{n.arg}={n.value.value!r}", n.value.lineno))
        elif isinstance(n, (ast.List, ast.Tuple)):
            items = [e.value if isinstance(e, ast.Constant) else None for e in n.elts]
            for flag, value in zip(items, items[1:], strict=False):
                if flag == "--precision" and isinstance(value, str) and "bf16" in value.split(","):
                    settings.append(("bf16", f"--precision {value}", n.lineno))
        elif isinstance(n, ast.Call):
            _call(n, imports, settings, runs)
    return settings, runs, names


def _call(n: ast.Call, imports: dict[str, str], settings: list, runs: list) -> None:
    name = _qualified(n.func, imports)
    if name in RUNS and not (name == "polgrad.sweep.main" and _dry(n)):
        runs.append((name, n.lineno))
    if name.endswith(".spawn") and any(k.arg == "nprocs" for k in n.keywords):
        runs.append((name, n.lineno))
    running = []
    if name in ("torch.compile", "polgrad.rollout.vllm.VLLMRollout"):
        running.append(("compiled kernels" if "compile" in name else "vLLM", name, n.lineno))
    for k in n.keywords:
        off = isinstance(k.value, ast.Constant) and k.value.value in (False, None)
        if k.arg == "compiled" and not off:
            running.append(("compiled kernels", f"compiled={ast.unparse(k.value)}", n.lineno))
    if _is_setattr_asynchronous(n):
        settings.append(("async forced onto the synchronous run", "TrainConfig.asynchronous", n.lineno))
    settings += running  # settings that run by themselves
    runs += [(signal, line) for _, signal, line in running]


def _dry(call: ast.Call) -> bool:
    return any(isinstance(s, ast.Constant) and s.value == "--dry-run" for s in ast.walk(call))


def _is_setattr_asynchronous(call: ast.Call) -> bool:
    return (
        isinstance(call.func, ast.Attribute)
        and call.func.attr == "setattr"
        and any(isinstance(a, ast.Constant) and a.value == "asynchronous" for a in call.args)
    )


def _marked(decorators: list[ast.expr]) -> bool:
    return any(
        isinstance(n, ast.Attribute)
        and n.attr == MARK
        and isinstance(n.value, ast.Attribute)
        and n.value.attr == "mark"
        for d in decorators
        for n in ast.walk(d)
    )


def _pytestmark(body: list[ast.stmt]) -> list[ast.expr]:
    return [
        s.value
        for s in body
        if isinstance(s, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in s.targets)
    ]


def _autouse(body: list[ast.stmt]) -> set[str]:
    """The names of a scope's autouse fixtures."""
    return {
        s.name
        for s in body
        if isinstance(s, ast.FunctionDef)
        for d in s.decorator_list
        if isinstance(d, ast.Call)
        and any(
            k.arg == "autouse" and isinstance(k.value, ast.Constant) and k.value.value for k in d.keywords
        )
    }


def _uses_fake_trainer(
    func: ast.FunctionDef, marks: list[ast.expr], autouse: set[str], scope: dict[str, ast.AST] | None = None
) -> bool:
    """Whether `func` runs on the fake trainer: it takes the `fake_trainer` fixture, directly, by a mark,
    autouse, or through a fixture of its module (`scope`) that takes it (test_sweep_multiprocess's
    fake_ranks)."""
    params = {a.arg for a in func.args.args}
    used = {
        s.value
        for d in [*func.decorator_list, *marks]
        for c in ast.walk(d)
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "usefixtures"
        for s in c.args
        if isinstance(s, ast.Constant)
    }
    names = params | used | autouse
    if "fake_trainer" in names:
        return True
    scope = scope or {}
    return any(
        isinstance(scope.get(n), ast.FunctionDef)
        and scope[n] is not func
        and _uses_fake_trainer(scope[n], [], set(), {k: v for k, v in scope.items() if k != n})
        for n in params | used
    )


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """A scope's functions, classes and assigned names."""
    defs = {}
    for s in body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[s.name] = s
        elif isinstance(s, (ast.Assign, ast.AnnAssign)):
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        defs[n.id] = s
    return defs


def _reach(test: ast.AST, scopes: list[dict[str, ast.AST]], facts) -> list[ast.AST]:
    """The test and every definition it reaches by name (fixtures by their parameter names)."""
    todo, seen = [test], {}
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        for name in facts(node)[2]:
            scope = next((sc for sc in scopes if name in sc), None)
            if scope is not None:
                todo.append(scope[name])
    return list(seen.values())


def _tests(tree: ast.Module):
    """(test function, the scopes its names resolve in, the marks over it, its autouse fixtures)."""
    module_marks, module = _pytestmark(tree.body), _definitions(tree.body)
    for s in tree.body:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)) and s.name.startswith("test"):
            yield s, [module], module_marks, _autouse(tree.body)
        elif isinstance(s, ast.ClassDef) and s.name.startswith("Test"):
            marks = [*module_marks, *s.decorator_list, *_pytestmark(s.body)]
            for f in s.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test"):
                    yield f, [_definitions(s.body), module], marks, _autouse(tree.body) | _autouse(s.body)


def unmarked(source: str, filename: str = "tests/test_x.py") -> dict[str, str]:
    """Test id -> one line, for every test of `source` that runs a cpu_matrix setting unmarked."""
    tree = ast.parse(source)
    imports, cache = _imports(tree), {}

    def facts(node: ast.AST):
        if id(node) not in cache:
            cache[id(node)] = _facts(node, imports)
        return cache[id(node)]

    found = {}
    for func, scopes, marks, autouse in _tests(tree):
        if _marked([*marks, *func.decorator_list]) or _uses_fake_trainer(func, marks, autouse, scopes[-1]):
            continue
        settings, runs = [], []
        for node in _reach(func, scopes, facts):
            settings += facts(node)[0]
            runs += facts(node)[1]
        if settings and runs:
            what, signal, line = min(settings, key=lambda s: s[2])
            run, run_line = min(runs, key=lambda r: r[1])
            test_id = f"{filename}::{func.name}"
            found[test_id] = (
                f"{test_id} runs {what} ({signal!r}, line {line}; runs {run}, line {run_line}) "
                f"without @pytest.mark.{MARK}: mark it (or its module's pytestmark)"
            )
    return found


def test_every_test_that_runs_a_cpu_matrix_setting_is_marked():
    found = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        found.update(unmarked(path.read_text(), str(path.relative_to(TESTS.parent))))
    assert sorted(set(NOT_RUN) - set(found)) == [], "NOT_RUN names a test the scan does not flag"
    unmarked_tests = [line for test_id, line in found.items() if test_id not in NOT_RUN]
    assert not unmarked_tests, "\n".join(unmarked_tests)


# The scan's own rules, on small modules written here.
HEAD = "import subprocess\nimport pytest\nimport torch.multiprocessing as mp\nfrom polgrad.train import run\n"
SPAWN = "def test_t(tmp_path):\n    mp.spawn(work, args=(2,), nprocs=2, join=True)\n"
METHOD = "class TestC:\n    def test_t(self):\n        run(['train.bf16 = True'])\n"
ZERO3 = "def _train(b):\n    run(b)\n\n\ndef test_t(tmp_path):\n    _train(['train.zero_stage = 3'])\n"


def test_the_scan_flags_an_unmarked_test_by_what_it_runs():
    assert list(unmarked(HEAD + SPAWN)) == ["tests/test_x.py::test_t"]
    (line,) = unmarked(HEAD + ZERO3).values()  # the setting and the run reached through a helper
    assert "runs ZeRO-3 ('train.zero_stage = 3', line 10; runs polgrad.train.run, line 6)" in line
    fixture = (
        "@pytest.fixture\ndef out():\n    subprocess.run(['python', '-m', 'torch.distributed.run'])\n\n\n"
    )
    assert list(unmarked(HEAD + fixture + "def test_t(out):\n    pass\n")) == ["tests/test_x.py::test_t"]
    assert list(unmarked(HEAD + METHOD)) == ["tests/test_x.py::test_t"]


@pytest.mark.parametrize(
    "source",
    [
        HEAD + "@pytest.mark.cpu_matrix\n" + SPAWN,
        HEAD + "pytestmark = [pytest.mark.vllm, pytest.mark.cpu_matrix]\n" + SPAWN,
        HEAD + "@pytest.mark.cpu_matrix\n" + METHOD,
    ],
    ids=["decorator", "module pytestmark", "class"],
)
def test_the_marker_on_the_test_its_class_or_its_module_counts(source):
    assert unmarked(source) == {}


@pytest.mark.parametrize(
    "source",
    [
        # a setting built or refused, never run
        HEAD
        + "def test_t():\n    with pytest.raises(ValueError):\n        build(['train.zero_stage = 3'])\n",
        # a binding quoted in prose
        HEAD + "def test_t():\n    r = run([])\n    assert 'warning: train.bf16 = True is slow' in r\n",
        # a dry run
        HEAD + "from polgrad import sweep\n\n\ndef test_t():\n"
        "    sweep.main([write('Sweep.processes_per_cell = 2'), '--dry-run'])\n",
        # the fake trainer, by parameter and by an autouse fixture
        HEAD + "def test_t(fake_trainer):\n    subprocess.run(['Sweep.processes_per_cell = 2'])\n",
        HEAD + "@pytest.fixture(autouse=True)\ndef fake_trainer():\n    pass\n\n\n"
        "def test_t():\n    subprocess.run(['Sweep.processes_per_cell = 2'])\n",
        HEAD + "@pytest.fixture\ndef ranks(fake_trainer):\n    pass\n\n\n"
        "def test_t(ranks):\n    subprocess.run(['Sweep.processes_per_cell = 2'])\n",
        # one rank, ZeRO-2, fp32
        HEAD + "def test_t():\n    mp.spawn(work, nprocs=1)\n"
        "    run(['train.zero_stage = 2', 'train.bf16 = False'], bf16=False, zero_stage=2)\n",
    ],
    ids=[
        "refused",
        "prose",
        "dry run",
        "fake trainer",
        "autouse fake trainer",
        "fixture on it",
        "plain settings",
    ],
)
def test_what_runs_no_cpu_matrix_setting_is_not_flagged(source):
    assert unmarked(source) == {}
