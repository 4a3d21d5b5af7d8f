"""The architecture as a test: no import cycle inside polgrad, and the layer rule of CONTRIBUTING.md.

Every `import` and `from ... import` in polgrad/ counts, at module level and inside functions
(a function-level import hides a cycle; it does not remove it). The layers are the table in
CONTRIBUTING.md ("Architecture"); a test below checks that the two agree.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
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
        "polgrad.run_folder",
        "polgrad.runlock",
        "polgrad.collective",
        "polgrad.stopping",
        "polgrad.machine",
        "polgrad.collapse",
        "polgrad.checks",
        "polgrad.defaults",
    ],
    ["polgrad.models"],
    ["polgrad.components", "polgrad.tasks"],
    ["polgrad.rollout", "polgrad.batch", "polgrad.evaluation", "polgrad.tracking"],
    [
        "polgrad.spec_checks",
        "polgrad.table5",
        "polgrad.algorithm",
        "polgrad.config_parts",
        "polgrad.train_config",
        "polgrad.distributed",
        "polgrad.checkpoints",
        "polgrad.pretrain",
    ],
    ["polgrad.config_explain", "polgrad.config"],
    [
        "polgrad.layout",
        "polgrad.export",
        "polgrad.producer",
        "polgrad.sampling",
        "polgrad.critic",
        "polgrad.reference",
        "polgrad.build",
        "polgrad.summary",
        "polgrad.resume_config",
        "polgrad.loop_state",
        "polgrad.offline",
    ],
    ["polgrad.trainer", "polgrad.train"],
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


# The lab: what the repository keeps beside the library (its studies, benchmarks, examples, tests)
LAB = ("studies", "benchmarks", "examples", "tests")


def lab_imports(path: Path) -> list[str]:
    """The lab modules `path` imports anywhere in its body (importlib of a name is not an import)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        found += [n for n in names if n.split(".")[0] in LAB]
    return found


def test_the_library_imports_no_study_or_lab_code(tmp_path):
    bad = {module_name(p): found for p in sorted(PKG.rglob("*.py")) if (found := lab_imports(p))}
    assert not bad, f"the library imports lab code (a study plugs in through Sweep.studies): {bad}"
    planted = tmp_path / "planted.py"  # the check sees a planted import, at module level or in a function
    planted.write_text("import studies.replication\ndef f():\n    from benchmarks.bench import main\n")
    assert lab_imports(planted) == ["studies.replication", "benchmarks.bench"]


LIBRARY_WITHOUT_THE_LAB = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        lab = ("studies", "benchmarks", "polgrad.sweep", "polgrad.results")
        if name.split(".")[0] in lab or name.startswith(lab[2:]):
            raise ImportError(f"blocked: {name}")
sys.meta_path.insert(0, Blocked())
import polgrad, polgrad.trainer, polgrad.train, polgrad.offline, polgrad.export
from polgrad import config
config.parse_config(["registry/grpo.gin"], ["train.steps = 1"])
cfg, algo, task = config.build()
print("built", algo.name, cfg.steps)
"""


def test_the_library_imports_and_builds_a_run_without_the_sweep_results_or_studies():
    """The library (parts, registry, spec, loop, models, rollout, tasks, config) is importable and
    builds a run with the sweep, the results code and every study unimportable."""
    proc = subprocess.run(
        [sys.executable, "-c", LIBRARY_WITHOUT_THE_LAB], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "built grpo 1" in proc.stdout, proc.stderr[-2000:]


def test_contributing_states_the_same_layers():
    text = (REPO / "CONTRIBUTING.md").read_text()
    block = re.search(r"<!-- layers -->\n(.*?)<!-- /layers -->", text, re.S)
    assert block, "CONTRIBUTING.md must hold the layer table between <!-- layers --> markers"
    stated = [re.findall(r"`(polgrad[\w.]*)`", line) for line in block.group(1).splitlines()]
    stated = [names for names in stated if names]
    assert stated == list(reversed(LAYERS)), (
        "CONTRIBUTING.md's layer table differs from tests/project/test_layers.py"
    )


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(REPO)))
def test_no_module_over_500_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 500, f"{path.relative_to(REPO)} has {n} lines: split it by job"


def test_train_reads_in_at_most_80_lines():
    tree = ast.parse((PKG / "trainer.py").read_text())
    for name in ("train", "_train"):  # the signature and its session, then the loop
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        assert fn.end_lineno - fn.lineno + 1 <= 80, name


# --------------------------------------------------------------------------- explicit inputs
# gin is the configuration layer: the parts' hookup and binding (config_parts), the config pipeline
# and the TrainConfig it builds, a resume's comparison of gin texts, and the entry points
# (`polgrad.train`, the sweep). The registry, the Algorithm and its checks hold plain functions and
# bound parts; nothing the run executes below them reads gin: the loop gets its inputs passed in
# (tests/loop/test_config_parts.py checks the same at run time: a rebinding after the build changes
# nothing in a step).
GIN_MODULES = {
    "polgrad.config_parts",
    "polgrad.config",
    "polgrad.config_explain",
    "polgrad.train_config",
    "polgrad.resume_config",
    "polgrad.train",
}


def gin_importers(modules: dict[str, Path]) -> set[str]:
    """The polgrad modules that import gin anywhere in their body (module or function level)."""
    out = set()
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            if any(n == "gin" or n.startswith("gin.") for n in names):
                out.add(name)
    return out


def test_no_gin_below_the_entry_points_and_config(tmp_path):
    modules = all_modules()
    below = {m for m in gin_importers(modules) if m not in GIN_MODULES and not m.startswith("polgrad.sweep")}
    assert not below, f"gin imported below the entry points and config: {sorted(below)}"
    # the loop and everything it runs are gin-free
    for name in (
        "polgrad.trainer",
        "polgrad.build",
        "polgrad.loop_state",
        "polgrad.sampling",
        "polgrad.critic",
    ):
        assert name in modules and name not in gin_importers({name: modules[name]})
    # non-vacuity: a function-level `from gin import ...` in a planted module is seen
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from gin import config_parser\n")
    assert gin_importers({"polgrad.probe": probe}) == {"polgrad.probe"}


def test_train_takes_its_inputs():
    import inspect

    from polgrad.trainer import train

    params = inspect.signature(train).parameters
    assert list(params) == ["cfg", "algo", "task", "out_dir", "record"]
    assert params["record"].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_models_bundle_is_complete_when_built_and_never_patched():
    import dataclasses

    from polgrad.build import Models

    m = Models(engine=None, tokenizer=None, sampler=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.sampler = object()  # type: ignore[misc]


# --------------------------------------------------------------------------- one readable step
STEP_ROOTS = ("rl_step", "collector_for")  # the step, and the collectors it is handed (chosen once)
STEP_MAX_LINES = 250


def step_functions(tree: ast.Module, roots: tuple[str, ...] = STEP_ROOTS) -> list[ast.AST]:
    """The module-level functions and classes of the loop module a step reaches from `roots` by name."""
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    seen, todo = {r for r in roots if r in defs}, [r for r in roots if r in defs]
    while todo:
        for node in ast.walk(defs[todo.pop()]):
            if isinstance(node, ast.Name) and node.id in defs and node.id not in seen:
                seen.add(node.id)
                todo.append(node.id)
    return [defs[name] for name in sorted(seen)]


# What a branch may not test in the step: the names by which a spec or a config enables an optional
# role (issue: "an optional-feature branch is a branch whose condition depends on which roles the spec
# or config enables": reference, critic, reward model, LoRA, dynamic sampling, baseline rollout,
# warm-up, async, logits-needing parts), and the batch fields those roles fill. A branch on any field
# of the models bundle counts too (`m.sampler.stale`, `isinstance(m.critic, ...)`): the step asks its
# strategies to act, not what they are.
FEATURE_NAMES = frozenset(
    {
        "reference", "ref_logp", "kl_exact", "kl_seq", "measure_kl", "needs_reference",
        "critic", "values", "old_values", "returns", "needs_critic", "value_init",
        "critic_warmup_steps", "warmup", "warm_up",
        "reward_model", "reward_source", "gold", "gold_scores", "needs_reward_model", "proxy", "rm_ensemble",
        "lora", "lora_enabled", "adapter",
        "filters", "max_sampling_rounds",
        "baseline", "baseline_scores", "needs_baseline_rollout", "greedy_baseline",
        "stale", "asynchronous", "max_staleness", "needs_rollout_logp", "producer",
        "needs_logits", "logits", "ref_logits", "return_logits",
        "offline", "rollout_backend", "vllm",
    }
)  # fmt: skip
# Not followed: the numerical kernels and the plumbing every layer uses, whose options are arguments
# (`response_logprobs(..., return_logits=...)` is one forward with or without its logits).
NOT_FOLLOWED = ("polgrad.rollout", "polgrad.components", "polgrad.collective", "polgrad.hooks")


def _names_in(test: ast.AST) -> set[str]:
    """Every identifier, attribute name and string constant a condition mentions."""
    out: set[str] = set()
    for n in ast.walk(test):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def branch_tests(tree: ast.AST) -> list[ast.AST]:
    """The conditions of every branch in `tree`, the branches both rules count: if, conditional
    expression, while, comprehension if, match, and an and/or outside those."""
    tests: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append(node.test)
        elif isinstance(node, ast.comprehension):
            tests.extend(node.ifs)
        elif isinstance(node, ast.Match):
            tests.append(node.subject)
    inside = {id(n) for t in tests for n in ast.walk(t)}
    return tests + [n for n in ast.walk(tree) if isinstance(n, ast.BoolOp) and id(n) not in inside]


def feature_branches(functions: list[ast.AST], fields: set[str], name: str = "m") -> list[str]:
    """The branches of `functions` whose condition names an optional role (FEATURE_NAMES) or tests the
    models bundle `name` (any of its `fields`), as 'function:line'. A branch: an if, a conditional
    expression, a while, a comprehension's if, a match, and an `and` / `or` outside those conditions
    (`x = m.reference and m.reference.collect(...)` branches too)."""

    def names_a_role(test: ast.AST) -> bool:
        on_bundle = any(
            isinstance(n, ast.Attribute) and n.attr in fields and isinstance(n.value, ast.Name)
            and n.value.id == name
            for n in ast.walk(test)
        )  # fmt: skip
        return on_bundle or bool(_names_in(test) & FEATURE_NAMES)

    out = []
    for fn in functions:
        out += [f"{getattr(fn, 'name', '?')}:{t.lineno}" for t in branch_tests(fn) if names_a_role(t)]
    return sorted(out)


def called_elsewhere(functions: list[ast.AST], tree: ast.Module, modules: dict[str, Path]) -> list[ast.AST]:
    """The module-level functions of other polgrad modules (NOT_FOLLOWED aside) that `functions` call,
    directly (`from polgrad.summary import response_lengths`) or through a module (`stopping.sampled`),
    and every such function those call in turn: what the step runs besides its own module's code,
    except the strategies' methods (chosen once, called without asking which one it is)."""
    done: set[tuple[str, str]] = set()
    found: list[ast.AST] = []
    todo = [(fn, tree) for fn in functions]
    while todo:
        fn, module_tree = todo.pop()
        aliases: dict[str, tuple[str, str | None]] = {}  # local name -> (module, function or None)
        for node in module_tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("polgrad"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    aliases[a.asname or a.name] = (sub, None) if sub in modules else (node.module, a.name)
        for call in ast.walk(fn):
            if not isinstance(call, ast.Call):
                continue
            f = call.func
            if isinstance(f, ast.Name) and f.id in aliases and aliases[f.id][1]:
                target = aliases[f.id]
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in aliases:
                mod, attr = aliases[f.value.id]
                target = (mod, f.attr) if attr is None else (None, None)
            else:
                continue
            mod, func = target
            if mod is None or mod not in modules or mod.startswith(NOT_FOLLOWED) or (mod, func) in done:
                continue
            done.add((mod, func))
            other = ast.parse(modules[mod].read_text())
            for node in other.body:
                if isinstance(node, ast.FunctionDef) and node.name == func:
                    found.append(node)
                    todo.append((node, other))
    return found


def _optional_fields() -> set[str]:
    """Every field of the models bundle: a branch on any of them (not only the None-default ones)
    counts, so an if-ladder rebuilt on the strategies is seen too."""
    import dataclasses

    from polgrad.build import Models

    return {f.name for f in dataclasses.fields(Models)}


def test_one_rl_step_reads_in_at_most_250_lines_of_the_loop_module():
    """rl_step and every function of polgrad/trainer.py it reaches (the collectors, collect, update,
    micro_step, the row): at most 250 lines. The spec's losses are the step's second file
    (polgrad/algorithm.py: `prepare` and `loss`); samplers, critics, references and scorers are
    strategies (polgrad/sampling.py, critic.py, reference.py, build.py) the step calls without asking
    which one it has."""
    tree = ast.parse((PKG / "trainer.py").read_text())
    fns = step_functions(tree)
    names = {fn.name for fn in fns}
    assert {"rl_step", "collect", "collect_once", "collect_kept", "update", "micro_step", "step_row"} <= names
    lines = sum(fn.end_lineno - fn.lineno + 1 for fn in fns)
    assert lines <= STEP_MAX_LINES, f"the step spans {lines} lines of trainer.py ({sorted(names)})"


def test_the_step_never_branches_on_an_optional_role():
    """0 optional-feature branches in the step: over the loop module's step functions and every
    polgrad function they call elsewhere (the strategies' methods aside: chosen once at build)."""
    fields = _optional_fields()
    assert {"reference", "sampler", "critic", "score", "baseline"} <= fields
    tree = ast.parse((PKG / "trainer.py").read_text())
    fns = step_functions(tree, roots=("rl_step", "collect_once", "collect_kept"))  # collector_for chooses
    assert {"collect", "update", "micro_step", "step_row"} <= {f.name for f in fns}
    elsewhere = called_elsewhere(fns, tree, all_modules())
    assert {"response_lengths", "counted"} <= {f.name for f in elsewhere}  # followed out of trainer.py
    spec = spec_step_methods()
    assert {f.name for f in spec} == set(SPEC_STEP_METHODS)
    branches = feature_branches(fns + elsewhere + spec, fields)
    assert branches == [], f"the step branches on optional roles at {branches}"


# The step's second file: the spec's formulas (polgrad/algorithm.py), which the step calls as
# `algo.prepare(...)` and `algo.loss(...)`; their optional terms (KL in the reward or the loss, the
# critic's loss, ReMax's baseline) are chosen once when the spec is built.
SPEC_STEP_METHODS = ("prepare", "keep", "_shaped_and_kept", "loss")


def spec_step_methods(source: str | None = None) -> list[ast.AST]:
    tree = ast.parse(source if source is not None else (PKG / "algorithm.py").read_text())
    algo = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Algorithm")
    return [n for n in algo.body if isinstance(n, ast.FunctionDef) and n.name in SPEC_STEP_METHODS]


def test_the_branch_rule_sees_a_planted_branch_in_the_spec_formulas():
    source = (PKG / "algorithm.py").read_text()
    old = "        value_loss = self._critic_term.value_loss("
    assert old in source
    planted = source.replace(old, "        if self.needs_critic:\n            pass\n" + old)
    assert feature_branches(spec_step_methods(source), _optional_fields()) == []
    assert len(feature_branches(spec_step_methods(planted), _optional_fields())) == 1


def test_the_branch_rule_sees_planted_branches(tmp_path):
    fields = _optional_fields()
    # in the step: a test of the bundle, of a spec's flag, of a config's setting, of a row key
    planted = ast.parse(
        "from polgrad.summary import helper\n"
        "def rl_step(m, algo, cfg, row):\n"
        "    if m.reference is not None:\n        pass\n"
        "    x = 1 if algo.needs_logits else 0\n"
        "    while cfg.critic_warmup_steps:\n        break\n"
        "    if 'kl_seq' in row:\n        pass\n"
        "    if isinstance(m.sampler, object):\n        pass\n"
        "    if row:\n        pass\n"  # a data branch: not counted
        "    y = m.critic and m.critic.row(row)\n"
        "    z = [r for r in row if r.gold_scores is not None]\n"
        "    match cfg.rollout_backend:\n        case 'vllm':\n            pass\n"
        "    helper(row)\n"
    )
    assert len(feature_branches(step_functions(planted), fields)) == 8
    # and one in a function of another module the step calls
    pkg = tmp_path / "polgrad"
    pkg.mkdir()
    (pkg / "summary.py").write_text("def helper(row, gold=None):\n    return row if gold is None else gold\n")
    modules = {"polgrad.summary": pkg / "summary.py"}
    elsewhere = called_elsewhere(step_functions(planted), planted, modules)
    assert [f.name for f in elsewhere] == ["helper"]
    assert feature_branches(elsewhere, fields) == ["helper:2"]


# --------------------------------------------------------------------------- one owner of the model layout
# Where the run's roles differ between full copies and one LoRA backbone is the layout's business
# (polgrad/layout.py) and the adapters' own (polgrad/models/lora.py). Anywhere else a branch that
# asks about LoRA (its condition names lora, peft or an adapter: `cfg.lora`, `is_peft(m)`,
# `hasattr(m, "peft_config")`, `vllm.lora_enabled`) is counted; at most 3 may remain, each a
# one-line refusal (today 2: best-of-n refuses LoRA, the vLLM engine refuses an adapter it was not
# started for). The count on ed346e6 was 28 (35 by this stricter pattern).
LAYOUT_MODULES = ("polgrad/layout.py", "polgrad/models/lora.py")
LORA_PATTERN = re.compile(r"lora|peft|adapter", re.IGNORECASE)
MAX_LORA_BRANCHES = 3


def lora_branches(paths: dict[str, Path]) -> list[str]:
    """'file:line' of every branch on LoRA in `paths` ({relative name: path})."""
    out = []
    for rel, path in sorted(paths.items()):
        lines = sorted(
            t.lineno
            for t in branch_tests(ast.parse(path.read_text()))
            if any(LORA_PATTERN.search(name) for name in _names_in(t))
        )
        out += [f"{rel}:{n}" for n in lines]
    return out


def test_lora_is_asked_about_only_by_the_layout():
    paths = {
        str(p.relative_to(REPO)): p
        for p in PKG.rglob("*.py")
        if str(p.relative_to(REPO)) not in LAYOUT_MODULES
    }
    assert all((REPO / m).is_file() for m in LAYOUT_MODULES)
    found = lora_branches(paths)
    assert len(found) <= MAX_LORA_BRANCHES, f"{len(found)} branches on LoRA outside the layout: {found}"


def test_the_lora_rule_sees_planted_branches(tmp_path):
    planted = tmp_path / "sampling.py"
    planted.write_text(
        "def load(vllm, module, cfg, m):\n"
        "    if vllm.lora_enabled:\n        vllm.sync_adapter(module)\n"
        "    rank = cfg.lora_r if cfg.lora_r else None\n"
        "    peft = hasattr(module, 'peft_config') and module\n"
        "    names = [n for n in m if is_peft(n)]\n"
        "    if cfg.lr:\n        pass\n"  # not about LoRA: not counted
    )
    assert lora_branches({"sampling.py": planted}) == [
        "sampling.py:2", "sampling.py:4", "sampling.py:5", "sampling.py:6"
    ]  # fmt: skip


# --------------------------------------------------------------------------- one owner of the run folder
RUN_FILE_NAMES = frozenset(
    {"config.gin", "resume_overrides.jsonl", "metrics.jsonl", "eval.jsonl", "summary.json",
     "operative_config.gin", "checkpoints", "checkpoints/", ".lock"}
)  # fmt: skip


def run_file_spellings(tree: ast.Module) -> list[int]:
    """The lines where a string constant is exactly a run-folder file name (docstrings aside; a name
    inside a longer text, an f-string or a concatenation is another file's, e.g. a cache key's lock)."""
    docs = {
        id(n.body[0].value)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)
    }  # fmt: skip
    inside = {
        id(c)
        for n in ast.walk(tree)
        if isinstance(n, ast.JoinedStr) or (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Add))
        for c in ast.walk(n)
    }
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and n.value in RUN_FILE_NAMES and id(n) not in docs | inside
    ]


def test_the_run_folder_names_its_files_once():
    """Every file a run writes is named in polgrad/run_folder.py only: the rest asks a RunFolder."""
    from polgrad import run_folder

    assert {
        getattr(run_folder, k)
        for k in dir(run_folder)
        if k.isupper() and isinstance(getattr(run_folder, k), str)
    } >= RUN_FILE_NAMES - {"checkpoints/"}  # the folder's prefix, as a Ray node's file names start
    spelled = {
        str(p.relative_to(REPO)): lines
        for p in sorted(PKG.rglob("*.py"))
        if p.name != "run_folder.py" and (lines := run_file_spellings(ast.parse(p.read_text())))
    }
    assert spelled == {}, f"run-folder file names spelled outside polgrad/run_folder.py: {spelled}"
    # non-vacuity: a planted spelling is seen; a docstring, an f-string and a concatenation are not
    planted = ast.parse(
        'def f(d):\n    """reads metrics.jsonl"""\n    a = d / "metrics.jsonl"\n'
        '    b = f"{d}/summary.json"\n    c = str(d) + ".lock"\n    return open(d / "config.gin")\n'
    )
    assert run_file_spellings(planted) == [3, 6]


# --------------------------------------------------------------------------- nothing global at import
def module_level_patches(tree: ast.Module) -> list[str]:
    """Assignments at module level (or in a function the module calls at its level) to an attribute
    or item of an imported name: a patch of another module made by importing this one."""
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {a.asname or a.name for a in node.names}
    local = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def top_level(stmts):
        for st in stmts:
            if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            yield st
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from top_level(getattr(st, field, []) or [])

    def patches(stmts) -> list[str]:
        out = []
        for st in stmts:
            for node in ast.walk(st):
                targets = node.targets if isinstance(node, ast.Assign) else []
                targets = [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else targets
                for t in targets:
                    root = t
                    while isinstance(root, (ast.Attribute, ast.Subscript)):
                        root = root.value
                    if t is not root and isinstance(root, ast.Name) and root.id in imported:
                        out.append(ast.unparse(t))
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr"
                ):
                    out.append(ast.unparse(node))
        return out

    found = patches(list(top_level(tree.body)))
    for st in top_level(tree.body):  # a module-level call of its own function that patches
        for node in ast.walk(st):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in local:
                found += patches(local[node.func.id].body)
    return found


def test_no_module_level_monkeypatch():
    bad = {
        name: found
        for name, path in all_modules().items()
        if (found := module_level_patches(ast.parse(path.read_text(), str(path))))
    }
    assert not bad, f"module-level patches of other modules: {bad}"
    # non-vacuity: the old errors.py pattern (a function that patches gin, called at import) is seen
    planted = ast.parse(
        "def _keep():\n    from gin import utils as gin_utils\n    gin_utils.augment = None\n_keep()\n"
        "import deepspeed\ndeepspeed.ops.table['x'] = False\n"
    )
    assert module_level_patches(planted) == ["deepspeed.ops.table['x']", "gin_utils.augment"]


IMPORT_PROBE = """
import json, os, pkgutil, importlib, sys
import torch, gin, gin.utils, transformers  # third-party state as polgrad finds it
env = dict(os.environ)
augment = gin.utils.augment_exception_message_and_reraise
import polgrad
after_polgrad = dict(os.environ)
names = sorted(m.name for m in pkgutil.walk_packages(polgrad.__path__, "polgrad.")
               if not m.name.endswith("__main__") and not m.name.startswith("polgrad.rollout.vllm"))
for name in names:
    importlib.import_module(name)
def changed(a, b):
    return {k: b.get(k) for k in set(a) | set(b) if a.get(k) != b.get(k)}
print(json.dumps({
    "n": len(names),
    "polgrad": changed(env, after_polgrad),
    "all": changed(env, dict(os.environ)),
    "gin_patched": gin.utils.augment_exception_message_and_reraise is not augment,
}))
"""


def test_import_polgrad_leaves_the_environment_and_gin_unchanged():
    """`import polgrad` (and every module of it but the optional vLLM backend, which imports vLLM)
    writes no environment variable and patches no third-party module."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "DS_ACCELERATOR")}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] > 50
    assert got["polgrad"] == {} and got["all"] == {}
    assert got["gin_patched"] is False


SHM_PROBE = """
import json, os
os.environ.pop("LOCAL_RANK", None)
os.environ.pop("DS_ACCELERATOR", None)
import deepspeed.ops
before = dict(deepspeed.ops.__compatible_ops__)
from polgrad import distributed
with distributed.session(seed=0):
    during = os.environ.get("LOCAL_RANK")
print(json.dumps({"same": dict(deepspeed.ops.__compatible_ops__) == before, "during": during,
                  "after": [os.environ.get("LOCAL_RANK"), os.environ.get("DS_ACCELERATOR")]}))
"""


def test_setup_leaves_deepspeeds_op_table_as_it_found_it():
    """distributed.setup marks the shm comm op incompatible only while init_distributed builds its ops
    (so nothing is JIT-compiled) and restores DeepSpeed's table after it; a run's session also takes
    back the environment variables it set. In a fresh process, where DeepSpeed is not initialised yet."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", SHM_PROBE], capture_output=True, text=True, cwd=REPO, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"same": True, "during": "0", "after": [None, None]}


def test_a_run_session_restores_the_environment():
    """distributed.session: setup's LOCAL_RANK (and DS_ACCELERATOR) are there during the run and gone
    after it, so a later subprocess is not taken for a launcher's rank."""
    from polgrad import distributed

    saved = {k: os.environ.pop(k, None) for k in ("LOCAL_RANK", "DS_ACCELERATOR")}
    try:
        with distributed.session(seed=0) as info:
            assert os.environ["LOCAL_RANK"] == "0" and info.world_size == 1
        assert "LOCAL_RANK" not in os.environ and "DS_ACCELERATOR" not in os.environ
    finally:
        for k, v in saved.items():
            if v is not None:
                os.environ[k] = v


def test_no_polgrad_docs_point_outside_the_project():
    pages = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "results" / "README.md"]
    pages += sorted((REPO / "docs").glob("*.md"))
    for path in [*pages, *PKG.rglob("*.py")]:
        assert "../shared" not in path.read_text(), path
    assert os.path.isfile(REPO / "CONTRIBUTING.md")


# --------------------------------------------------------------------------- one access style for Batch
BATCH_MODULES = ("trainer.py", "algorithm.py", "offline.py", "producer.py", "critic.py", "sampling.py")
BATCH_BY_KEY = re.compile(r"\b(batch|mb|out|sampled|raw|part|kept)(\[\s*[\"']|\.get\(\s*[\"'])")


def batch_reads_by_key(text: str) -> list[str]:
    """Lines that read a Batch like a dict (`batch["adv"]`, `mb.get("values")`) instead of by attribute."""
    return [line.strip() for line in text.splitlines() if BATCH_BY_KEY.search(line)]


def test_polgrad_reads_a_batch_by_attribute_only():
    """Batch stays a read-only mapping for users' parts and tests, but polgrad's own step and spec read
    it one way: `batch.adv`, None when not computed."""
    bad = {name: found for name in BATCH_MODULES if (found := batch_reads_by_key((PKG / name).read_text()))}
    assert not bad, bad
    assert batch_reads_by_key('    adv = batch["adv"]\n    v = mb.get("values")\n') == [
        'adv = batch["adv"]',
        'v = mb.get("values")',
    ]


# --------------------------------------------------------------------------- tests/ mirrors the package
TESTS = REPO / "tests"
# the test folders that are not a sub-package of polgrad/: the loop and polgrad's top-level modules,
# the studies, and the project (architecture, docs, CI, examples, benchmarks)
TEST_FOLDERS_BEYOND_THE_PACKAGE = {"loop", "studies", "project"}


def test_tests_mirror_the_package_in_folders():
    """Every test file sits in a folder named after a sub-package of polgrad/ (or loop/, studies/,
    project/), none at the top of tests/, and their names are unique (pytest imports them by name)."""
    packages = {p.parent.name for p in PKG.glob("*/__init__.py")}
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 100
    loose = [p.name for p in files if p.parent == TESTS]
    assert loose == [], f"test files at the top of tests/ (put each in its package's folder): {loose}"
    folders = {p.relative_to(TESTS).parts[0] for p in files}
    stray = folders - packages - TEST_FOLDERS_BEYOND_THE_PACKAGE
    assert not stray, f"test folders that mirror no folder of polgrad/: {sorted(stray)}"
    names = [p.name for p in files]
    assert len(names) == len(set(names)), "two test files share a name"


def _fixtures(path: Path) -> set[str]:
    """The names of the pytest fixtures `path` defines."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            for d in node.decorator_list:
                target = d.func if isinstance(d, ast.Call) else d
                if ast.unparse(target) in ("pytest.fixture", "fixture"):
                    found.add(node.name)
    return found


def test_a_fixture_of_conftest_is_not_defined_again_in_a_test_file():
    shared = _fixtures(TESTS / "conftest.py")
    assert "fake_trainer" in shared
    again = {
        str(p.relative_to(TESTS)): sorted(shared & own)
        for p in sorted(TESTS.rglob("test_*.py"))
        if (own := _fixtures(p)) & shared
    }
    assert not again, f"fixtures of tests/conftest.py defined again (use the shared one): {again}"
