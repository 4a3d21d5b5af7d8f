"""Reading an experiment file: gin's own parser, nothing bound, nothing needs to be registered.

`load_experiment(path)` checks the file's syntax and its `Sweep` parameters (see the package
docstring for the syntax) and returns an `Experiment`: what every cell shares (includes, imports,
fixed bindings) and what varies (specs, grid axes, seeds). The bindings themselves are checked
later, with gin, by `polgrad.sweep.validation`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.checks import is_int, is_real
from polgrad.errors import ConfigError, did_you_mean
from polgrad.results.studies import load as load_studies
from polgrad.sweep import budget as _budget
from polgrad.sweep import pilot_gate
from polgrad.sweep.axes import _fail, _read_baseline, _read_grid, _read_predictions, _read_seeds
from polgrad.sweep.budget import Budget
from polgrad.sweep.inherit import inherit, resolve_path
from polgrad.sweep.ray_checks import RaySettings, read_settings
from polgrad.sweep.values import Binding, _delegate, gin_text

# The trainer every cell runs (POLGRAD_TRAIN_MODULE replaces it by a module with the same command line).
DEFAULT_TRAIN_MODULE = "polgrad.train"
TRAIN_MODULE_ENV = "POLGRAD_TRAIN_MODULE"

# Sweep parameters and their defaults (None = required).
SWEEP_DEFAULTS: dict[str, Any] = {
    "name": None,
    "specs": None,
    "grid": {},
    "seeds": None,
    "seed_binding": "train.seed",
    "primary_metric": "eval_accuracy",
    "higher_is_better": True,
    "num_cpus": 1,
    "num_gpus": 0,
    "launcher": "deepspeed",
    "processes_per_cell": 1,
    "placement": "PACK",
    "ray": {},  # --executor ray's settings (polgrad/sweep/ray_checks.RaySettings)
    "timeout_s": None,
    "baseline": None,
    "question": "",
    "predictions": [],
    "tuning": None,  # checked and expanded by polgrad.sweep.tuning
    "tuned_by": None,  # another experiment whose tuning stage's choice the cells bind (polgrad.sweep.tuning)
    "budget": None,
    "studies": [],  # study plug-ins (polgrad/results/studies.py), by module name
    "pilot": None,  # the pilot CSV the gate reads (polgrad/sweep/pilot_gate.py)
    "pilot_gate": None,
}
LAUNCHERS = ("deepspeed", "torchrun")
# Ray placement-group strategies for the ranks of a cell (--executor ray; polgrad/sweep/ray_cells.py)
PLACEMENTS = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclasses.dataclass
class Experiment:
    """An experiment file, read: what every cell shares and what varies."""

    file: str
    name: str
    includes: list[str]  # as written
    include_paths: list[str]  # resolved
    imports: list[str]  # gin import statements as text ('import x.y', 'from a import b')
    fixed: list[Binding]
    specs: list[str]  # as written
    spec_paths: list[str]  # resolved
    axes: list[tuple[tuple[str, ...], list[Any]]]  # (keys, values); a value is a tuple if len(keys) > 1
    seeds: list[int]
    seed_binding: str
    primary_metric: str
    higher_is_better: bool
    num_cpus: float
    num_gpus: float
    launcher: str
    timeout_s: float | None
    lines: dict[str, int] = dataclasses.field(default_factory=dict)  # Sweep param -> line
    baseline: dict[str, str] = dataclasses.field(default_factory=dict)  # column -> value text
    question: str = ""
    predictions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    processes_per_cell: int = 1  # data-parallel trainer processes (ranks) per CPU cell
    placement: str = "PACK"  # how Ray places a cell's ranks on nodes (--executor ray)
    ray: RaySettings = dataclasses.field(default_factory=RaySettings)  # Sweep.ray (--executor ray)
    # Sweep.tuning as written; polgrad.sweep.tuning.plan replaces it by a checked tuning.Plan
    tuning: Any = None
    # Sweep.tuned_by: the experiment whose recorded tuning choice the evaluation cells bind, not re-tuned
    tuned_by: str | None = None
    budget: Budget | None = None  # Sweep.budget (polgrad/sweep/budget.py)
    studies: list[str] = dataclasses.field(default_factory=list)  # Sweep.studies: modules, checked
    pilot_gate: Any = None  # Sweep.pilot_gate and Sweep.pilot, read (pilot_gate.Gate) or None

    @property
    def swept_columns(self) -> list[str]:
        return [k for keys, _ in self.axes for k in keys]


def _read_statements(
    file: str, text: str
) -> tuple[list[tuple[str, int]], list[str], list[Binding], dict[str, Any], dict[str, int]]:
    """The file's includes (with lines), imports, fixed bindings, Sweep parameters and their lines."""
    from gin import config_parser

    includes: list[tuple[str, int]] = []
    imports: list[str] = []
    fixed: list[Binding] = []
    params: dict[str, Any] = {}
    lines: dict[str, int] = {}
    try:
        for st in config_parser.ConfigParser(text, _delegate()):
            line = st.location.line_num if getattr(st, "location", None) else 0
            if isinstance(st, config_parser.IncludeStatement):
                includes.append((st.filename, line))
            elif isinstance(st, config_parser.ImportStatement):
                imports.append(st.format())
            elif isinstance(st, config_parser.BlockDeclaration):
                continue  # its bindings follow as BindingStatements
            elif isinstance(st, config_parser.BindingStatement):
                if st.selector == "Sweep" and st.arg_name:
                    if st.scope:
                        raise _fail(
                            file, f"line {line}", f"Sweep.{st.arg_name} cannot be scoped ('{st.scope}/')"
                        )
                    if st.arg_name not in SWEEP_DEFAULTS:
                        raise _fail(
                            file,
                            f"line {line}: Sweep.{st.arg_name}",
                            f"unknown Sweep parameter '{st.arg_name}'; valid: {', '.join(SWEEP_DEFAULTS)}"
                            + did_you_mean(st.arg_name, list(SWEEP_DEFAULTS)),
                        )
                    params[st.arg_name], lines[st.arg_name] = st.value, line
                else:
                    sel = f"{st.selector}.{st.arg_name}" if st.arg_name else st.selector
                    key = f"{st.scope}/{sel}" if st.scope else sel
                    fixed.append(Binding(key, st.value, line))
    except ConfigError:
        raise
    except SyntaxError as e:
        raise _fail(file, f"line {e.lineno}", f"gin syntax error: {e.msg}") from None
    except Exception as e:  # tokenize errors (an unclosed bracket) and the like
        raise _fail(file, "", f"cannot parse: {' '.join(str(e).split())}") from None
    return includes, imports, fixed, params, lines


def _resolve_files(
    file: str, includes: list[tuple[str, int]], params: dict[str, Any], where
) -> tuple[list[str], list[str], list[str]]:
    """Includes and specs: files that must exist. Returns (include paths, specs, spec paths)."""
    include_paths = []
    for inc, line in includes:
        found = resolve_path(inc, file)
        if found is None:
            raise _fail(
                file,
                f"line {line}: include '{inc}'",
                "file not found (looked in the working "
                "directory, then beside the experiment file and in its parent folders)",
            )
        include_paths.append(found)
    if "specs" not in params:
        raise _fail(
            file, "Sweep.specs", "missing: list the spec files to compare, e.g. ['registry/grpo.gin']"
        )
    specs = params["specs"]
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, (list, tuple)) or not specs or not all(isinstance(s, str) for s in specs):
        raise _fail(file, where("specs"), "must be a non-empty list of spec file paths (strings)")
    if len(set(specs)) != len(specs):
        raise _fail(file, where("specs"), "lists a spec twice")
    spec_paths = []
    for s in specs:
        found = resolve_path(s, file)
        if found is None:
            raise _fail(
                file,
                f"{where('specs')}: '{s}'",
                "spec file not found (looked in the working "
                "directory, then beside the experiment file and in its parent folders)",
            )
        spec_paths.append(found)
    stems = [Path(s).stem for s in specs]
    if len(set(stems)) != len(stems):
        raise _fail(file, where("specs"), f"two specs share a name ({', '.join(stems)}); rename one")

    return include_paths, list(specs), spec_paths


def load_experiment(path: str) -> Experiment:
    """Read and check an experiment file (syntax and Sweep parameters; bindings are checked later)."""
    file = str(path)
    if not Path(file).is_file():
        raise ConfigError(f"{file}: experiment file not found")
    statements = _read_statements(file, Path(file).read_text())
    includes, imports, fixed, params, lines = inherit(file, statements, _read_statements, _fail)

    def param(name):
        return params.get(name, SWEEP_DEFAULTS[name])

    def where(name):
        return f"line {lines[name]}: Sweep.{name}" if name in lines else f"Sweep.{name}"

    include_paths, specs, spec_paths = _resolve_files(file, includes, params, where)
    seeds, seed_binding = _read_seeds(file, params, param, where)
    axes = _read_grid(file, params, param, where, seed_binding)

    name = param("name") or Path(file).stem
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", name):
        raise _fail(
            file, where("name"), f"must be a plain name (letters, digits, _ . -), got {gin_text(name)}"
        )
    primary = param("primary_metric")
    if primary not in _results.OUTCOME_METRICS:
        raise _fail(
            file,
            where("primary_metric"),
            f"unknown metric {gin_text(primary)}; valid: "
            f"{', '.join(_results.OUTCOME_METRICS)}{did_you_mean(str(primary), _results.OUTCOME_METRICS)}",
        )
    higher = param("higher_is_better")
    if not isinstance(higher, bool):
        raise _fail(file, where("higher_is_better"), "must be True or False")
    num_cpus, num_gpus = param("num_cpus"), param("num_gpus")
    for pname, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if not is_real(v) or v < 0:
            raise _fail(file, where(pname), f"must be a number >= 0, got {gin_text(v)}")
    if num_cpus <= 0:
        raise _fail(file, where("num_cpus"), "must be > 0")
    if num_gpus > 1 and num_gpus != int(num_gpus):
        raise _fail(file, where("num_gpus"), "above 1 must be a whole number of GPUs")
    launcher = param("launcher")
    if launcher not in LAUNCHERS:
        raise _fail(
            file, where("launcher"), f"unknown launcher {gin_text(launcher)}; valid: {', '.join(LAUNCHERS)}"
        )
    processes = param("processes_per_cell")
    if not is_int(processes) or processes < 1:
        raise _fail(file, where("processes_per_cell"), f"must be an int >= 1, got {gin_text(processes)}")
    if processes > 1 and num_gpus > 0 and processes != num_gpus:
        raise _fail(
            file,
            where("processes_per_cell"),
            f"a GPU cell runs one process per GPU (Sweep.num_gpus = {gin_text(num_gpus)}); "
            "processes_per_cell is for CPU cells (Sweep.num_gpus = 0)",
        )
    placement = param("placement")
    if placement not in PLACEMENTS:
        raise _fail(
            file,
            where("placement"),
            f"unknown placement {gin_text(placement)}; valid: {', '.join(PLACEMENTS)}"
            f"{did_you_mean(str(placement), PLACEMENTS)}",
        )
    try:
        ray = read_settings(param("ray"))
    except ValueError as e:
        raise _fail(file, where("ray"), str(e)) from None
    timeout_s = param("timeout_s")
    if timeout_s is not None and (not is_real(timeout_s) or timeout_s <= 0):
        raise _fail(file, where("timeout_s"), "must be a positive number of seconds or None")

    tuned_by = param("tuned_by")
    if tuned_by is not None:
        if not isinstance(tuned_by, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", tuned_by):
            raise _fail(
                file,
                where("tuned_by"),
                f"must be an experiment's name (Sweep.name of the experiment whose tuning stage chose the "
                f"values), got {gin_text(tuned_by)}",
            )
        if param("tuning") is not None:
            raise _fail(
                file,
                where("tuned_by"),
                f"the values come from {tuned_by}'s tuning stage, so this experiment tunes nothing itself: "
                "add Sweep.tuning = None (an included file may set it)",
            )
        if tuned_by == name:
            raise _fail(file, where("tuned_by"), f"names this experiment ({name}): name the one that tuned")

    budget = _budget.read(file, param("budget"), where("budget"))
    _budget.check_file(file, budget, fixed, axes)
    baseline = _read_baseline(file, param("baseline"), specs, axes, where)
    predictions = _read_predictions(file, param("predictions"), specs, axes, where)
    gate = pilot_gate.read(
        file,
        param("pilot"),
        param("pilot_gate"),
        name,
        lambda value, at: _read_baseline(file, value, specs, axes, lambda _: at),
        where,
    )
    question = param("question")
    if not isinstance(question, str):
        raise _fail(file, where("question"), "must be a string: the question the experiment answers")
    studies = param("studies")
    try:
        load_studies(studies, "Sweep.studies", lambda: _results.repo_root(Path(file).resolve().parent))
    except ConfigError as e:
        raise _fail(file, where("studies"), str(e).removeprefix("Sweep.studies: ")) from None

    return Experiment(
        file=file,
        baseline=baseline,
        question=question,
        predictions=predictions,
        name=name,
        includes=[i for i, _ in includes],
        include_paths=include_paths,
        imports=imports,
        fixed=fixed,
        specs=list(specs),
        spec_paths=spec_paths,
        axes=axes,
        seeds=list(seeds),
        seed_binding=seed_binding,
        primary_metric=primary,
        higher_is_better=higher,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        launcher=launcher,
        processes_per_cell=processes,
        placement=placement,
        ray=ray,
        timeout_s=timeout_s,
        lines=lines,
        tuning=param("tuning"),
        tuned_by=tuned_by,
        budget=budget,
        studies=list(studies),
        pilot_gate=gate,
    )
