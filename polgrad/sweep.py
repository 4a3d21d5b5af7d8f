"""`python -m polgrad.sweep experiments/X.gin`: expand a grid, validate it, run every cell, rank them.

## The experiment file

An experiment is one gin file. Ordinary gin lines say what *every* cell trains with (`include`
the base config, `import` a user's module, fixed bindings); lines on the configurable `Sweep`
say what varies. Grid values are real gin values: `@kl.k3` is a reference, `'loss'` a string.

    # experiments/kl_ablation.gin: which KL estimator, and where the penalty goes.
    include 'experiments/base_tiny.gin'      # the base config of every cell
    import my_project.parts                  # optional: a user's own registered parts
    train.steps = 200                        # fixed bindings, in every cell

    Sweep.name = 'kl_ablation'               # results/kl_ablation.{csv,md,png}; default: file stem
    Sweep.specs = ['registry/grpo.gin', 'registry/rloo.gin']     # algorithms to compare
    Sweep.grid = {
        'Algorithm.kl': [@kl.k1, @kl.k2, @kl.k3, @kl.abs],       # a component choice
        'Algorithm.kl_placement': ['reward', 'loss'],            # any binding, any gin value
        ('clip.ppo.eps_low', 'clip.ppo.eps_high'): [(0.2, 0.2), (0.2, 0.28)],  # zipped: varied together
    }
    Sweep.seeds = [0, 1, 2]
    Sweep.primary_metric = 'eval_accuracy'   # the leaderboard's sort key

That is 2 specs × 4 × 2 × 2 grid points × 3 seeds = 96 cells. `Sweep` parameters:

| parameter          | default           | meaning                                                |
|--------------------|-------------------|--------------------------------------------------------|
| `name`             | file stem         | results/<name>.csv, .md, .png and results/<name>/      |
| `specs`            | required          | spec gin files (registry/*.gin) to compare             |
| `grid`             | `{}`              | axis -> list of values; an axis is a binding, a macro  |
|                    |                   | name, or a tuple of bindings varied together (zipped)  |
| `seeds`            | required          | list of ints; each cell binds `<seed_binding> = seed`  |
| `seed_binding`     | `'train.seed'`    | the binding that carries the seed                      |
| `primary_metric`   | `'eval_accuracy'` | a summary.json metric; sorts the leaderboard           |
| `higher_is_better` | `True`            | direction of the primary metric                        |
| `num_cpus`         | `1`               | CPUs per cell (Ray request; threads per cell on Ray)   |
| `num_gpus`         | `0`               | GPUs per cell (Ray request; local GPU slots; 1/k packs |
|                    |                   | k cells on one GPU)                                    |
| `launcher`         | `'deepspeed'`     | multi-GPU cells: 'deepspeed' or 'torchrun'             |
| `timeout_s`        | `None`            | wall-clock limit per cell; over it: killed, failed     |

Every cell runs in a fresh process as

    python -m polgrad.train <includes...> <spec> --bind <fixed...> --bind <grid...> \\
        --bind '<seed_binding> = <seed>' --out results/<name>/runs/<cell-id> [--resume]

so later wins: the included files, then the spec, then the file's own bindings, then the cell's
grid values, then its seed. `Sweep` lines never reach the trainer. Paths in `include` and
`Sweep.specs` are tried relative to the working directory, then to the experiment file's folder
and its parents. The cell id is a readable prefix plus a hash of what the file says about the
cell (includes, spec, bindings, seed): e.g. `grpo-k3-loss-s0-1a2b3c4d`. It does not change
between runs or machines; editing an included file's *content* does not change it (start a new
experiment name, or delete the run folders, to redo such cells).

Before anything trains, the runner imports polgrad and the trainer module (so every
configurable is registered), then parses includes + spec + fixed + grid + seed bindings of each
cell with gin (and `gin.finalize()`, which also catches a `%gin.REQUIRED` left unset). A bad file
stops the sweep with one line naming the file and the binding: an unknown component (with the
valid names and the closest match), a binding to a parameter that does not exist, an axis
whose values mix types, a missing include or spec, no seeds, an empty axis or grid.

## Running

    python -m polgrad.sweep experiments/X.gin [--dry-run] [--parallel N] [--executor local|ray]
                            [--ray-address ADDR] [--results DIR]

`--dry-run` validates and prints the cells (id, spec, bindings, seed). Re-running the same file
skips finished cells (summary.json with status ok), resumes unfinished ones (`--resume` when the
run folder has checkpoints) and re-runs failed ones. A crashing cell is recorded as failed with
the last line of its stderr; the sweep goes on and exits 1 at the end with a summary (2 for a bad
experiment file, 130 when interrupted). `--executor local` (default) runs cells one at a time, or
N at a time with `--parallel N`, each with OMP_NUM_THREADS = cores // N (on a GPU node: each
running cell gets its own CUDA_VISIBLE_DEVICES slice, see `assign_gpu_slots`). `--executor ray`
hands cells to Ray as tasks asking for `num_cpus`/`num_gpus` (a local Ray, or `--ray-address`
of a cluster whose nodes share the results folder). POLGRAD_TRAIN_MODULE (or the hidden
`--train-module`) replaces `polgrad.train` by another module that obeys the same command line.

Results (see polgrad/results.py): results/<name>.csv (one row per cell, written atomically as
each cell ends), results/<name>.md (leaderboard), results/<name>.png (learning curves), and
results/<name>/runs/<cell-id>/ with config.gin, metrics.jsonl, summary.json, stdout.log (the
trainer's stdout and stderr), cell.json (the cell and its exact command) and checkpoints/.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import dataclasses
import datetime as _dt
import difflib
import hashlib
import importlib
import inspect
import itertools
import json
import math
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.errors import ConfigError, PolgradError

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
    "timeout_s": None,
}
LAUNCHERS = ("deepspeed", "torchrun")


# --------------------------------------------------------------------------------------------
# Reading the experiment file (gin's own parser; nothing is bound, nothing needs to be registered)
# --------------------------------------------------------------------------------------------


class GinRef:
    """A configurable reference as written (`@kl.k3`, `@scope/name()`); repr is its gin text."""

    def __init__(self, scoped_selector: str, evaluate: bool):
        self.scoped_selector, self.evaluate = scoped_selector, evaluate

    @property
    def selector(self) -> str:
        return self.scoped_selector.rsplit("/", 1)[-1]

    def __repr__(self) -> str:
        return f"@{self.scoped_selector}{'()' if self.evaluate else ''}"

    def __eq__(self, other):
        return type(other) is type(self) and repr(other) == repr(self)

    def __hash__(self):
        return hash(repr(self))


class GinMacro:
    """A macro as written (`%LR`); repr is its gin text."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name}"

    def __eq__(self, other):
        return type(other) is type(self) and other.name == self.name

    def __hash__(self):
        return hash(repr(self))


def _delegate():
    from gin import config_parser

    class _Delegate(config_parser.ParserDelegate):
        def configurable_reference(self, scoped_name, evaluate):
            return GinRef(scoped_name, evaluate)

        def macro(self, name):
            return GinMacro(name)

    return _Delegate()


def gin_text(value: Any) -> str:
    """The gin text of a parsed value (Python literal syntax; references and macros as written)."""
    return repr(value)


@dataclasses.dataclass(frozen=True)
class Binding:
    """One `key = value` line, as text, with where it came from."""

    key: str  # 'Algorithm.kl', 'scope/advantage.grpo.eps', or a macro name 'LR'
    value: Any
    line: int = 0

    @property
    def text(self) -> str:
        return f"{self.key} = {gin_text(self.value)}"


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

    @property
    def swept_columns(self) -> list[str]:
        return [k for keys, _ in self.axes for k in keys]


@dataclasses.dataclass(frozen=True)
class Cell:
    """One grid cell: a spec, one value per axis, a seed; everything the trainer is called with."""

    id: str
    index: int
    spec: str  # spec file as written in the experiment
    spec_name: str  # its stem: 'grpo'
    spec_path: str  # resolved path
    config_files: tuple[str, ...]  # resolved includes + spec, in order
    swept: tuple[tuple[str, str], ...]  # (binding key, gin text) of the grid values
    seed: int
    bindings: tuple[str, ...]  # imports, fixed, grid, seed: what goes to --bind, in order

    def describe(self) -> str:
        return ", ".join(f"{k} = {v}" for k, v in self.swept) or "(no grid bindings)"


def _fail(file: str, where: str, msg: str) -> ConfigError:
    return ConfigError(f"{file}: {where}: {msg}" if where else f"{file}: {msg}")


def _closest(word: str, choices: Sequence[str], cutoff: float = 0.6) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return f"; did you mean '{close[0]}'?" if close else ""


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


def _value_type(v: Any) -> str | None:
    """Type class of a grid value for the mixed-type check (None and macros mix with anything)."""
    if v is None or isinstance(v, GinMacro):
        return None
    if isinstance(v, GinRef):
        return "reference"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, (list, tuple)):
        return "sequence"
    if isinstance(v, dict):
        return "dict"
    return type(v).__name__


def _check_key(file: str, where: str, key: Any) -> str:
    from gin import config_parser

    if not isinstance(key, str) or not key.strip():
        raise _fail(file, where, f"axis {key!r} must be a binding such as 'Algorithm.kl' (a string)")
    try:
        config_parser.parse_binding_key(key)
    except Exception as e:  # gin's own message names the problem
        raise _fail(file, where, f"'{key}' is not a gin binding key ({' '.join(str(e).split())})") from None
    return key


def load_experiment(path: str) -> Experiment:
    """Read and check an experiment file (syntax and Sweep parameters; bindings are checked later)."""
    from gin import config_parser

    file = str(path)
    if not Path(file).is_file():
        raise ConfigError(f"{file}: experiment file not found")
    text = Path(file).read_text()
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
                            + _closest(st.arg_name, list(SWEEP_DEFAULTS)),
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

    def param(name):
        return params.get(name, SWEEP_DEFAULTS[name])

    def where(name):
        return f"line {lines[name]}: Sweep.{name}" if name in lines else f"Sweep.{name}"

    # Includes and specs: files that must exist.
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

    # Seeds.
    if "seeds" not in params:
        raise _fail(file, "Sweep.seeds", "missing: list at least one seed, e.g. Sweep.seeds = [0, 1, 2]")
    seeds = params["seeds"]
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = [seeds]
    if (
        not isinstance(seeds, (list, tuple))
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        raise _fail(file, where("seeds"), f"must be a non-empty list of ints, got {gin_text(seeds)}")
    if len(set(seeds)) != len(seeds):
        raise _fail(file, where("seeds"), f"lists a seed twice: {gin_text(seeds)}")
    seed_binding = param("seed_binding")
    if not isinstance(seed_binding, str):
        raise _fail(file, where("seed_binding"), "must be a binding key string such as 'train.seed'")
    _check_key(file, where("seed_binding"), seed_binding)

    # The grid.
    grid = param("grid")
    if not isinstance(grid, dict):
        raise _fail(file, where("grid"), "must be a dict {'binding': [values, ...], ...}")
    if "grid" in params and not grid:
        raise _fail(
            file,
            where("grid"),
            "is empty: give at least one axis, or leave Sweep.grid out to compare the specs only",
        )
    axes: list[tuple[tuple[str, ...], list[Any]]] = []
    seen_keys: set[str] = set()
    for raw_key, values in grid.items():
        label = f"{where('grid')}[{raw_key!r}]"
        keys = tuple(
            _check_key(file, label, k) for k in (raw_key if isinstance(raw_key, tuple) else (raw_key,))
        )
        if not keys:
            raise _fail(file, label, "an axis needs at least one binding")
        for k in keys:
            if k in seen_keys:
                raise _fail(file, label, f"binding '{k}' appears on two axes")
            if k == seed_binding:
                raise _fail(file, label, f"'{k}' is the seed binding: list seeds in Sweep.seeds")
            seen_keys.add(k)
        if not isinstance(values, (list, tuple)):
            raise _fail(file, label, f"values must be a list, got {gin_text(values)}")
        if not values:
            raise _fail(file, label, "has no values")
        if len(keys) > 1:
            for v in values:
                if not isinstance(v, (list, tuple)) or len(v) != len(keys):
                    raise _fail(
                        file,
                        label,
                        f"zips {len(keys)} bindings, so each value must be a tuple of "
                        f"{len(keys)}; got {gin_text(v)}",
                    )
            columns = [[v[i] for v in values] for i in range(len(keys))]
            values = [tuple(v) for v in values]
        else:
            columns = [list(values)]
        for k, col in zip(keys, columns, strict=True):
            types = {t for t in map(_value_type, col) if t is not None}
            if len(types) > 1:
                hint = ""
                if "reference" in types and any(isinstance(v, str) and v.startswith("@") for v in col):
                    hint = "; write a reference without quotes (@kl.k1, not '@kl.k1')"
                raise _fail(
                    file,
                    f"{label}: '{k}'" if len(keys) > 1 else label,
                    f"values mix types ({', '.join(sorted(types))}): "
                    f"{gin_text(col)}; every value of an axis must be of one type{hint}",
                )
        texts = [gin_text(v) for v in values]
        if len(set(texts)) != len(texts):
            raise _fail(file, label, f"lists a value twice: {gin_text(list(values))}")
        axes.append((keys, list(values)))

    name = param("name") or Path(file).stem
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", name):
        raise _fail(
            file, where("name"), f"must be a plain name (letters, digits, _ . -), got {gin_text(name)}"
        )
    primary = param("primary_metric")
    if primary not in _results.METRICS:
        raise _fail(
            file,
            where("primary_metric"),
            f"unknown metric {gin_text(primary)}; valid: "
            f"{', '.join(_results.METRICS)}{_closest(str(primary), _results.METRICS)}",
        )
    higher = param("higher_is_better")
    if not isinstance(higher, bool):
        raise _fail(file, where("higher_is_better"), "must be True or False")
    num_cpus, num_gpus = param("num_cpus"), param("num_gpus")
    for pname, v in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
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
    timeout_s = param("timeout_s")
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0
    ):
        raise _fail(file, where("timeout_s"), "must be a positive number of seconds or None")

    return Experiment(
        file=file,
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
        timeout_s=timeout_s,
        lines=lines,
    )


# --------------------------------------------------------------------------------------------
# Expanding the grid
# --------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    """A short readable form of a gin value for the cell id: @kl.k3 -> k3, 'loss' -> loss."""
    text = text.strip()
    if text.startswith("@"):
        text = text.rstrip("()").rsplit("/", 1)[-1].rsplit(".", 1)[-1]
    text = re.sub(r"[^A-Za-z0-9.]+", "_", text).strip("_.")
    return text[:12] or "x"


def cell_id(
    includes: Sequence[str], spec: str, bindings: Sequence[str], seed: int, slugs: Sequence[str]
) -> str:
    """Readable prefix + 8 hex of sha1 over (includes, spec, sorted bindings, seed): stable everywhere."""
    payload = json.dumps(
        {"includes": list(includes), "spec": spec, "bindings": sorted(bindings), "seed": seed},
        sort_keys=True,
    )
    digest = hashlib.sha1(payload.encode()).hexdigest()[:8]
    prefix = "-".join([_slug(Path(spec).stem), *slugs, f"s{seed}"])
    prefix = re.sub(r"[^A-Za-z0-9_.\-]", "_", prefix)[:48].rstrip("-_.")
    return f"{prefix}-{digest}"


def expand(exp: Experiment) -> list[Cell]:
    """Every cell: specs × product of the axes × seeds, in that nesting order."""
    cells: list[Cell] = []
    fixed = [b.text for b in exp.fixed]
    for spec, spec_path in zip(exp.specs, exp.spec_paths, strict=True):
        for combo in itertools.product(*[values for _, values in exp.axes]):
            swept: list[tuple[str, str]] = []
            for (keys, _), value in zip(exp.axes, combo, strict=True):
                parts = value if len(keys) > 1 else (value,)
                swept.extend((k, gin_text(v)) for k, v in zip(keys, parts, strict=True))
            grid = [f"{k} = {v}" for k, v in swept]
            for seed in exp.seeds:
                seed_line = f"{exp.seed_binding} = {seed}"
                cid = cell_id(
                    exp.includes, spec, [*fixed, *grid, seed_line], seed, [_slug(v) for _, v in swept]
                )
                cells.append(
                    Cell(
                        id=cid,
                        index=len(cells),
                        spec=spec,
                        spec_name=Path(spec).stem,
                        spec_path=spec_path,
                        config_files=(*exp.include_paths, spec_path),
                        swept=tuple(swept),
                        seed=seed,
                        bindings=(*exp.imports, *fixed, *grid, seed_line),
                    )
                )
    ids = [c.id for c in cells]
    if len(set(ids)) != len(ids):  # only if two values have the same gin text, which load_experiment forbids
        raise ConfigError(f"{exp.file}: the grid expands to duplicate cells")
    return cells


# --------------------------------------------------------------------------------------------
# Validating every cell with gin before anything trains
# --------------------------------------------------------------------------------------------


def _gin_selectors() -> list[str]:
    try:
        import gin.config as gc

        complete = [s for s, _ in gc._REGISTRY.items()]
        return sorted({*complete, *(gc._REGISTRY.minimal_selector(s) for s in complete)})
    except Exception:  # gin internals moved: no suggestions, the message still names the binding
        return []


def _gin_parameters(selector: str) -> list[str] | None:
    try:
        import gin.config as gc

        configurable = gc._REGISTRY.get_match(selector)
        fn = configurable.wrapped
        if inspect.isclass(fn):
            fn = fn.__init__
        params = inspect.signature(fn).parameters.values()
        return [
            p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"
        ]
    except Exception:
        return None


def _unknown_reference(selector: str) -> str:
    """One line for an unknown `@selector`: polgrad's registry message for a registered kind."""
    from polgrad import registry

    kind, _, name = selector.partition(".")
    if name and "." not in name and kind in registry.KINDS:
        try:
            registry.lookup(kind, name)
        except PolgradError as e:
            return str(e)
    return f"unknown configurable '@{selector}'{_closest(selector, _gin_selectors())}"


def explain_gin_error(exc: BaseException) -> str:
    """gin's multi-line error as one line, with the valid names and the closest match where we can."""
    msg = str(exc)
    first = msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__
    m = re.search(r"No configurable matching reference '@([^']+?)(?:\(\))?'", msg)
    if m:
        return _unknown_reference(m.group(1).rsplit("/", 1)[-1])
    m = re.search(r"No configurable matching '([^']+)'", msg)
    if m:
        return f"unknown configurable '{m.group(1)}'{_closest(m.group(1), _gin_selectors())}"
    m = re.search(r"Configurable '([^']+)' doesn't have a parameter named '([^']+)'", msg)
    if m:
        params = _gin_parameters(m.group(1))
        valid = f"; valid parameters: {', '.join(params)}{_closest(m.group(2), params)}" if params else ""
        return f"'{m.group(1)}' has no parameter '{m.group(2)}'{valid}"
    loc = re.search(r'In file "([^"]+)", line (\d+)', msg)
    return first + (f" ({loc.group(1)}, line {loc.group(2)})" if loc else "")


def _refs(value: Any):
    if isinstance(value, GinRef):
        yield value
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _refs(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _refs(k)
            yield from _refs(v)


def import_train_module(train_module: str) -> None:
    """Import polgrad and the trainer module so that every configurable a cell binds is registered."""
    import polgrad  # noqa: F401  (registers the built-in parts)

    modules = [train_module]
    if train_module == DEFAULT_TRAIN_MODULE:
        modules.append("polgrad.trainer")  # registers `train`; polgrad.train imports it lazily
    try:
        for module in modules:
            importlib.import_module(module)
    except Exception as e:
        raise PolgradError(
            f"cannot import the trainer module '{train_module}' ({type(e).__name__}: "
            f"{' '.join(str(e).split())}); set {TRAIN_MODULE_ENV} or install polgrad"
        ) from None


def validate(exp: Experiment, cells: Sequence[Cell], train_module: str) -> None:
    """Parse every cell's config as the trainer will; raise one ConfigError line on the first problem."""
    import gin

    import_train_module(train_module)
    f = exp.file
    for stmt in exp.imports:  # a user's module: its parts must register before we check names
        try:
            gin.parse_config(stmt)  # gin's own import, exactly as the trainer will run it
        except Exception as e:
            raise _fail(f, f"'{stmt}'", f"cannot import ({' '.join(str(e).split())})") from None

    # Component names first: the registry's message is the most useful one.
    named: list[tuple[str, Any]] = [(f"line {b.line}: {b.key}", b.value) for b in exp.fixed]
    for keys, values in exp.axes:
        label = f"line {exp.lines.get('grid', 0)}: Sweep.grid['{keys[0] if len(keys) == 1 else keys}']"
        named.extend((label, v) for v in values)
    for where, value in named:
        for ref in _refs(value):
            if not gin.config._REGISTRY.matching_selectors(ref.selector):
                raise _fail(f, f"{where} = {ref!r}", _unknown_reference(ref.selector))

    # Then gin, one binding at a time on top of each spec (to name the culprit), and every cell whole.
    try:
        for spec, spec_path in zip(exp.specs, exp.spec_paths, strict=True):
            gin.clear_config()
            for path in (*exp.include_paths, spec_path):
                try:
                    gin.parse_config_file(path)
                except Exception as e:
                    raise _fail(
                        f, f"while reading {path} (for spec '{spec}')", explain_gin_error(e)
                    ) from None
            checks = [(f"'{s}'", s) for s in exp.imports]
            checks += [(f"line {b.line}: binding '{b.text}'", b.text) for b in exp.fixed]
            for keys, values in exp.axes:
                for value in values:
                    parts = value if len(keys) > 1 else (value,)
                    for k, v in zip(keys, parts, strict=True):
                        checks.append((f"Sweep.grid binding '{k} = {gin_text(v)}'", f"{k} = {gin_text(v)}"))
            seed_text = f"{exp.seed_binding} = {exp.seeds[0]}"
            checks.append((f"Sweep.seed_binding '{seed_text}'", seed_text))
            for where, text in checks:
                try:
                    gin.parse_config(text)
                except Exception as e:
                    raise _fail(f, where, explain_gin_error(e)) from None
        for cell in cells:
            gin.clear_config()
            try:
                gin.parse_config_files_and_bindings(
                    list(cell.config_files), list(cell.bindings), finalize_config=True
                )
            except Exception as e:
                raise _fail(
                    f, f"cell {cell.id} ({cell.spec}; {cell.describe()})", explain_gin_error(e)
                ) from None
    finally:
        gin.clear_config()


# --------------------------------------------------------------------------------------------
# GPU slots and launch commands (local executor on a GPU node; Ray assigns its own GPUs)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GpuSlot:
    """The GPUs one concurrently running cell owns."""

    index: int
    devices: tuple[int, ...]

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(d) for d in self.devices)


def assign_gpu_slots(
    n_gpus: int, gpus_per_cell: float, n_cells: int, devices: Sequence[int] | None = None
) -> list[GpuSlot]:
    """Split `n_gpus` GPUs (physical ids `devices`, default 0..n-1) into disjoint slots of `gpus_per_cell`.

    Returns min(n_cells, capacity) slots; cells run concurrently one per slot. gpus_per_cell = 1/k
    (k integer) packs k cells onto each GPU; GPUs left over (n_gpus not a multiple) stay idle.
    """
    devices = list(range(n_gpus)) if devices is None else [int(d) for d in devices]
    if len(devices) != n_gpus:
        raise ValueError(f"{len(devices)} device ids given for {n_gpus} GPUs")
    if gpus_per_cell <= 0:
        raise ValueError(f"gpus_per_cell must be > 0, got {gpus_per_cell}")
    if n_cells <= 0:
        return []
    if gpus_per_cell < 1:
        share = round(1 / gpus_per_cell)
        if not math.isclose(share * gpus_per_cell, 1.0):
            raise ValueError(f"a fraction of a GPU must be 1/k, got {gpus_per_cell}")
        groups = [(d,) for d in devices for _ in range(share)]
    else:
        k = int(gpus_per_cell)
        if k != gpus_per_cell:
            raise ValueError(f"gpus_per_cell above 1 must be whole, got {gpus_per_cell}")
        if k > n_gpus:
            raise ValueError(f"a cell needs {k} GPUs but only {n_gpus} are visible")
        groups = [tuple(devices[i : i + k]) for i in range(0, n_gpus - k + 1, k)]
    return [GpuSlot(i, g) for i, g in enumerate(groups[:n_cells])]


def launch_command(
    train_module: str,
    slot: GpuSlot | None,
    *,
    launcher: str = "deepspeed",
    master_port: int = 29500,
    python: str | None = None,
) -> tuple[list[str], dict[str, str | None]]:
    """(command prefix, environment changes; None = unset) to start the trainer on `slot`.

    No slot or one device: `python -m <train_module>` with CUDA_VISIBLE_DEVICES = the slot's device.
    Several devices: `deepspeed --include localhost:<ids> --master_port P --no_local_rank --module`
    (the DeepSpeed launcher picks GPUs by --include and wants CUDA_VISIBLE_DEVICES unset), or
    `torchrun --standalone --nproc_per_node k -m` with CUDA_VISIBLE_DEVICES = the slot.
    """
    python = python or sys.executable
    if slot is None:
        return [python, "-m", train_module], {}
    if len(slot.devices) <= 1:
        return [python, "-m", train_module], {"CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices}
    if launcher == "deepspeed":
        prefix = [
            python,
            "-m",
            "deepspeed.launcher.runner",
            "--include",
            f"localhost:{slot.cuda_visible_devices}",
            "--master_port",
            str(master_port),
            "--no_local_rank",
            "--module",
            train_module,
        ]
        return prefix, {"CUDA_VISIBLE_DEVICES": None}
    if launcher == "torchrun":
        prefix = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(len(slot.devices)),
            "-m",
            train_module,
        ]
        return prefix, {"CUDA_VISIBLE_DEVICES": slot.cuda_visible_devices}
    raise ValueError(f"unknown launcher '{launcher}'; valid: {', '.join(LAUNCHERS)}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _visible_gpus() -> list[int]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [int(d) for d in env.split(",") if d.strip().isdigit()]
    try:
        import torch

        return list(range(torch.cuda.device_count()))
    except Exception:
        return []


# --------------------------------------------------------------------------------------------
# Running one cell in a fresh process
# --------------------------------------------------------------------------------------------

_RUNNING: dict[str, subprocess.Popen] = {}
_RUNNING_LOCK = threading.Lock()
_STOPPING = threading.Event()  # set on ^C / SIGTERM: no new trainer may start


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return summary if isinstance(summary, dict) else None
    except (OSError, ValueError):
        return None


def _failed(cell: Cell, where: str, error: BaseException, limit: int | None = None) -> dict[str, Any]:
    """The outcome of a cell whose runner raised `error` (recorded as failed; the sweep goes on)."""
    text = " ".join(str(error).split())
    return {
        "cell_id": cell.id,
        "status": "failed",
        "summary": None,
        "error": f"{where}: {type(error).__name__}: {text if limit is None else text[:limit]}",
    }


def is_finished(run_dir: Path) -> bool:
    summary = read_summary(run_dir)
    return summary is not None and summary.get("status") == "ok"


def has_checkpoints(run_dir: Path) -> bool:
    ckpt = run_dir / "checkpoints"
    return ckpt.is_dir() and any(ckpt.iterdir())


def last_step(run_dir: Path) -> int | None:
    """The step of the last complete line of metrics.jsonl (reads only the file's tail)."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 4096))
            tail = fh.read().decode(errors="replace")
    except OSError:
        return None
    for line in reversed(tail.splitlines()):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def _kill_stale_trainer(run_dir: Path) -> None:
    """A trainer left running by a sweep that was killed alone (not its process group): stop it."""
    pid_file = run_dir / "trainer.pid"
    try:
        pid = int(pid_file.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError, IndexError):
        return
    if str(run_dir) not in cmdline:
        return  # the pid was reused by something else
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.1)


def _error_line(stderr_tail: Sequence[str], returncode: int) -> str:
    lines = [ln.strip() for ln in stderr_tail if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln[len("error:") :].strip()
    if lines:
        return lines[-1]
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def run_cell(
    cell: Cell,
    run_dir: str | os.PathLike,
    *,
    train_module: str,
    threads: int,
    slot: GpuSlot | None = None,
    launcher: str = "deepspeed",
    timeout_s: float | None = None,
    experiment: str = "",
) -> dict[str, Any]:
    """Run the trainer for `cell` into `run_dir` and wait; return its outcome (status, error, summary)."""
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    _kill_stale_trainer(run_dir)
    resume = has_checkpoints(run_dir)
    if not resume:  # a fresh start must not append to a dead attempt's curves
        for stale in ("metrics.jsonl", "summary.json", "config.gin"):
            (run_dir / stale).unlink(missing_ok=True)
    else:
        (run_dir / "summary.json").unlink(missing_ok=True)
    prefix, env_changes = launch_command(train_module, slot, launcher=launcher, master_port=_free_port())
    cmd = [*prefix, *cell.config_files]
    for b in cell.bindings:
        cmd += ["--bind", b]
    cmd += ["--out", str(run_dir)] + (["--resume"] if resume else [])
    env = dict(os.environ)
    threads = max(1, int(threads))
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "POLGRAD_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "POLGRAD_CELL_ID": cell.id,
        }
    )
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    info = {
        "experiment": experiment,
        "cell": dataclasses.asdict(cell),
        "command": shlex.join(cmd),
        "cwd": os.getcwd(),
        "env": {k: env_changes.get(k, env.get(k)) for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")},
        "environment": _results.environment(),
        "started_at": started,
        "resume": resume,
    }
    _results.atomic_write_text(run_dir / "cell.json", json.dumps(info, indent=2, default=str) + "\n")
    tail: deque[str] = deque(maxlen=30)
    with open(run_dir / "stdout.log", "a", buffering=1) as log:
        log.write(f"=== {started} {'resume' if resume else 'start'}: {shlex.join(cmd)}\n")
        log.flush()
        with _RUNNING_LOCK:
            if _STOPPING.is_set():
                raise KeyboardInterrupt
            # Same process group as the sweep: killing the sweep's group stops its trainers too.
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.PIPE, env=env, text=True, errors="replace"
            )
            _RUNNING[cell.id] = proc
        (run_dir / "trainer.pid").write_text(f"{proc.pid}\n")

        def pump():
            for line in proc.stderr:
                log.write(line)
                tail.append(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(cell.id, None)
        reader.join(timeout=10)
    (run_dir / "trainer.pid").unlink(missing_ok=True)
    summary = read_summary(run_dir)
    rc = proc.returncode
    if timed_out:
        status, error = "failed", f"timed out after {timeout_s:g} s (Sweep.timeout_s)"
    elif rc == 0 and summary is not None and summary.get("status") == "ok":
        status, error = "ok", ""
    elif rc == 0:
        status, error = "failed", "trainer exited 0 without a summary.json with status ok"
    else:
        status, error = "failed", _error_line(tail, rc)
    return {
        "cell_id": cell.id,
        "status": status,
        "error": error,
        "returncode": rc,
        "summary": summary,
        "resumed": resume,
        "environment": _results.environment(),
    }


def _row(exp: Experiment, cell: Cell, run_dir: Path, results_dir: Path, outcome: dict[str, Any]) -> dict:
    summary = outcome.get("summary") or {}
    ok = outcome["status"] == "ok"
    row: dict[str, Any] = {
        "experiment": exp.name,
        "cell_id": cell.id,
        "spec": cell.spec_name,
        "spec_file": cell.spec,
    }
    row.update(dict(cell.swept))
    row["seed"] = cell.seed
    for m in _results.METRICS:
        row[m] = summary.get(m) if ok else None
    row["steps"] = summary.get("steps") if ok else None
    row["status"] = outcome["status"]
    row["error"] = outcome.get("error", "")
    try:
        row["run_dir"] = str(run_dir.resolve().relative_to(results_dir.resolve()))
    except ValueError:
        row["run_dir"] = str(run_dir)
    row.update(outcome.get("environment") or _results.environment())
    row["finished_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    return row


def _recorded_environment(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "cell.json").read_text()).get("environment")
    except (OSError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------
# Executors
# --------------------------------------------------------------------------------------------


class _Progress:
    """tqdm bar over cells: done / running / failed, and the newest running cell's step.

    Workers only mark cells running or stopped; the main thread draws, at most every 0.5 s on a
    terminal and every 30 s into a log file (one `ok`/`FAILED` line per cell goes there anyway).
    """

    def __init__(self, total: int, done: int, name: str):
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.interval = 0.5 if tty else 30.0
        self.bar = tqdm(
            total=total,
            initial=done,
            desc=name,
            unit="cell",
            dynamic_ncols=True,
            mininterval=self.interval,
            file=sys.stderr,
        )
        self.ok, self.failed = done, 0
        self.running: dict[str, Path] = {}
        self.lock = threading.Lock()
        self.last_draw = 0.0

    def start(self, cell: Cell, run_dir: Path) -> None:
        with self.lock:
            self.running[cell.id] = run_dir

    def stop(self, cell: Cell) -> None:
        with self.lock:
            self.running.pop(cell.id, None)

    def finish(self, cell: Cell, outcome: dict[str, Any]) -> None:
        self.stop(cell)
        if outcome["status"] == "ok":
            self.ok += 1
            self.bar.write(f"ok      {cell.id}", file=sys.stderr)
        else:
            self.failed += 1
            self.bar.write(f"FAILED  {cell.id}: {outcome['error']}", file=sys.stderr)
        self.bar.update(1)
        self.refresh(force=True)

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_draw < self.interval:
            return
        self.last_draw = now
        with self.lock:
            running = list(self.running.items())
        text = f"ok {self.ok} · failed {self.failed} · running {len(running)}"
        if running:
            cid, run_dir = running[-1]
            step = last_step(run_dir)
            text += f" · {cid} step {step if step is not None else '-'}"
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


def _run_local(exp, todo, run_dirs, record, progress, *, parallel, train_module) -> None:
    slots: list[GpuSlot | None]
    if exp.num_gpus > 0:
        gpus = _visible_gpus()
        try:
            slots = list(assign_gpu_slots(len(gpus), exp.num_gpus, len(todo), devices=gpus))
        except ValueError as e:
            raise PolgradError(f"{exp.file}: Sweep.num_gpus = {exp.num_gpus:g}: {e}") from None
        if not slots:
            raise PolgradError(f"{exp.file}: Sweep.num_gpus = {exp.num_gpus:g} but no GPU is visible")
        workers = min(parallel or len(slots), len(slots))
        slots = slots[:workers]
    else:
        workers = max(1, parallel or 1)
        slots = [None] * workers
    workers = min(workers, max(1, len(todo)))
    threads = max(1, _results.cpu_count() // workers)
    free: queue.Queue = queue.Queue()
    for s in slots[:workers]:
        free.put(s)

    def work(cell: Cell):
        slot = free.get()
        try:
            progress.start(cell, run_dirs[cell.id])
            try:
                return run_cell(
                    cell,
                    run_dirs[cell.id],
                    train_module=train_module,
                    threads=threads,
                    slot=slot,
                    launcher=exp.launcher,
                    timeout_s=exp.timeout_s,
                    experiment=exp.name,
                )
            finally:
                progress.stop(cell)
        finally:
            free.put(slot)

    pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="cell")
    futures = {pool.submit(work, c): c for c in todo}
    try:
        pending = set(futures)
        while pending:
            done, pending = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
            for fut in done:
                cell = futures[fut]
                try:
                    outcome = fut.result()
                except Exception as e:  # the runner's own bug or an OS error: record, go on
                    outcome = _failed(cell, "sweep runner", e)
                record(cell, outcome)
                progress.finish(cell, outcome)
            progress.refresh()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def _ray_cell(
    cell: Cell,
    run_dir: str,
    train_module: str,
    num_cpus: float,
    launcher: str,
    timeout_s: float | None,
    experiment: str,
) -> dict[str, Any]:
    """Body of one Ray task: run the cell on whatever GPUs Ray gave this worker."""
    slot = None
    try:
        import ray

        gpu_ids = ray.get_gpu_ids()
        if gpu_ids:
            slot = GpuSlot(0, tuple(int(g) for g in gpu_ids))
    except Exception:
        pass
    return run_cell(
        cell,
        run_dir,
        train_module=train_module,
        threads=max(1, int(num_cpus)),
        slot=slot,
        launcher=launcher,
        timeout_s=timeout_s,
        experiment=experiment,
    )


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError as e:
        raise PolgradError(f"--executor ray needs Ray: pip install 'polgrad[ray]' ({e})") from None


def _run_ray(exp, todo, run_dirs, record, progress, *, parallel, train_module, address) -> None:
    import ray

    started_here = not ray.is_initialized()
    if started_here:
        import logging

        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
        if address:
            ray.init(address=address, **kwargs)
        else:
            ray.init(include_dashboard=False, **kwargs)
    remote = ray.remote(_ray_cell).options(num_cpus=exp.num_cpus, num_gpus=exp.num_gpus, max_retries=0)
    limit = parallel or len(todo)
    queue_ = list(todo)
    inflight: dict[Any, Cell] = {}
    try:
        while queue_ or inflight:
            while queue_ and len(inflight) < limit:
                cell = queue_.pop(0)
                ref = remote.remote(
                    cell,
                    str(run_dirs[cell.id]),
                    train_module,
                    exp.num_cpus,
                    exp.launcher,
                    exp.timeout_s,
                    exp.name,
                )
                inflight[ref] = cell
                progress.start(cell, run_dirs[cell.id])
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=0.5)
            for ref in done:
                cell = inflight.pop(ref)
                try:
                    outcome = ray.get(ref)
                except Exception as e:
                    outcome = _failed(cell, "ray", e, limit=300)
                record(cell, outcome)
                progress.finish(cell, outcome)
            progress.refresh()
    finally:
        for ref in inflight:
            ray.cancel(ref, force=True)
        if started_here:
            ray.shutdown()


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(
    exp: Experiment,
    cells: Sequence[Cell],
    *,
    results_dir: str | os.PathLike = "results",
    parallel: int | None = None,
    executor: str = "local",
    train_module: str = DEFAULT_TRAIN_MODULE,
    ray_address: str | None = None,
    command: str = "",
) -> int:
    """Run the cells not yet finished, record each in the CSV, write the report; 0 iff every cell is ok."""
    exp_dir = Path(results_dir) / exp.name
    exp_dir.mkdir(parents=True, exist_ok=True)
    with _sweep_lock(exp_dir):
        return _run(
            exp,
            cells,
            results_dir=Path(results_dir),
            parallel=parallel,
            executor=executor,
            train_module=train_module,
            ray_address=ray_address,
            command=command,
        )


@contextlib.contextmanager
def _sweep_lock(exp_dir: Path):
    """One sweep per experiment folder at a time (released by the OS even on SIGKILL)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(exp_dir / ".sweep.lock", "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            raise PolgradError(
                f"{exp_dir} is in use by another sweep (pid {holder}); wait for it to end or stop it"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _run(exp, cells, *, results_dir, parallel, executor, train_module, ray_address, command) -> int:
    _STOPPING.clear()
    exp_dir = results_dir / exp.name
    runs = exp_dir / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    order = [c.id for c in cells]
    meta = {
        "name": exp.name,
        "file": exp.file,
        "command": command,
        "primary_metric": exp.primary_metric,
        "higher_is_better": exp.higher_is_better,
        "swept_columns": exp.swept_columns,
        "cells": [
            {
                "id": c.id,
                "spec": c.spec_name,
                "spec_file": c.spec,
                "spec_path": c.spec_path,
                "swept": dict(c.swept),
                "seed": c.seed,
            }
            for c in cells
        ],
    }
    _results.atomic_write_text(exp_dir / "experiment.json", json.dumps(meta, indent=2) + "\n")
    csv_file = _results.csv_path(exp.name, results_dir)
    run_dirs = {c.id: runs / c.id for c in cells}

    def record(cell: Cell, outcome: dict[str, Any]) -> None:
        _results.upsert_row(csv_file, _row(exp, cell, run_dirs[cell.id], results_dir, outcome), order=order)

    # Finished cells are skipped; their row is written if a kill came between summary.json and the CSV.
    rows = {r.get("cell_id"): r for r in _results.read_rows(csv_file)}
    todo = []
    for cell in cells:
        if is_finished(run_dirs[cell.id]):
            if rows.get(cell.id, {}).get("status") != "ok":
                record(
                    cell,
                    {
                        "status": "ok",
                        "error": "",
                        "summary": read_summary(run_dirs[cell.id]),
                        "environment": _recorded_environment(run_dirs[cell.id]),
                    },
                )
        else:
            todo.append(cell)
    skipped = len(cells) - len(todo)
    print(
        f"{exp.name}: {len(cells)} cells, {skipped} already finished, {len(todo)} to run "
        f"({executor}{f', {parallel} at a time' if parallel else ''}); results in {results_dir}/",
        file=sys.stderr,
    )

    old_term = (
        signal.signal(signal.SIGTERM, _interrupt)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    progress = _Progress(len(cells), skipped, exp.name)
    try:
        if todo:
            if executor == "ray":
                _run_ray(
                    exp,
                    todo,
                    run_dirs,
                    record,
                    progress,
                    parallel=parallel,
                    train_module=train_module,
                    address=ray_address,
                )
            else:
                _run_local(
                    exp, todo, run_dirs, record, progress, parallel=parallel, train_module=train_module
                )
    except KeyboardInterrupt:
        with _RUNNING_LOCK:
            _STOPPING.set()
            procs = list(_RUNNING.values())
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        progress.close()  # before the message, so the bar does not overwrite it
        print(f"{exp.name}: interrupted; re-run the same command to resume", file=sys.stderr)
        return 130
    finally:
        progress.close()
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)

    md, png = _results.write_report(exp.name, results_dir)
    final = {r.get("cell_id"): r for r in _results.read_rows(csv_file)}
    failed = [c for c in cells if final.get(c.id, {}).get("status") != "ok"]
    print(
        f"{exp.name}: {len(cells) - len(failed)} ok, {len(failed)} failed of {len(cells)} cells; "
        f"{csv_file}, {md}, {png}",
        file=sys.stderr,
    )
    for c in failed:
        err = final.get(c.id, {}).get("error") or "not run"
        print(f"  failed {c.id}: {err}  (log: {run_dirs[c.id] / 'stdout.log'})", file=sys.stderr)
    return 1 if failed else 0


def format_cells(exp: Experiment, cells: Sequence[Cell]) -> str:
    sizes = " × ".join(
        [
            f"{len(exp.specs)} specs",
            *(f"{len(v)} {'/'.join(k)}" for k, v in exp.axes),
            f"{len(exp.seeds)} seeds",
        ]
    )
    lines = [f"{exp.name}: {sizes} = {len(cells)} cells"]
    width = max(len(c.id) for c in cells)
    spec_w = max(len(c.spec_name) for c in cells)
    for c in cells:
        lines.append(f"{c.id:<{width}}  {c.spec_name:<{spec_w}}  seed={c.seed:<4} {c.describe()}")
    return "\n".join(lines)


def prepare(path: str, train_module: str | None = None) -> tuple[Experiment, list[Cell]]:
    """Read, expand and validate an experiment file; raise one line on any problem."""
    exp = load_experiment(path)
    cells = expand(exp)
    validate(exp, cells, train_module or os.environ.get(TRAIN_MODULE_ENV) or DEFAULT_TRAIN_MODULE)
    return exp, cells


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(
        prog="python -m polgrad.sweep",
        description="Run a grid of training runs "
        "declared in an experiment gin file (see the module docstring).",
    )
    ap.add_argument("experiment", help="experiment gin file, e.g. experiments/kl_ablation.gin")
    ap.add_argument("--dry-run", action="store_true", help="validate, print the cells, run nothing")
    ap.add_argument("--parallel", type=int, default=None, metavar="N", help="cells at a time (default 1)")
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--ray-address", default=None, help="Ray cluster address (default: start a local Ray)")
    ap.add_argument("--results", default="results", metavar="DIR", help="results folder (default: results)")
    ap.add_argument("--train-module", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.parallel is not None and args.parallel < 1:
        ap.error("--parallel must be >= 1")
    train_module = args.train_module or os.environ.get(TRAIN_MODULE_ENV) or DEFAULT_TRAIN_MODULE
    try:
        if args.executor == "ray":
            _require_ray()
        exp, cells = prepare(args.experiment, train_module)
        if args.dry_run:
            print(format_cells(exp, cells))
            return 0
        command = shlex.join(["python", "-m", "polgrad.sweep", *argv])
        return run(
            exp,
            cells,
            results_dir=args.results,
            parallel=args.parallel,
            executor=args.executor,
            train_module=train_module,
            ray_address=args.ray_address,
            command=command,
        )
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # Run the imported module, not __main__: Ray pickles `_ray_cell` and `Cell` by reference then.
    from polgrad.sweep import main as _main

    raise SystemExit(_main())
