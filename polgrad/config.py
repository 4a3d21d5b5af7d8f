"""One config pipeline: parse gin, validate, explain errors in one line, build what a run needs.

`python -m polgrad.train`, the sweep's dry run, the benchmarks and `python -m polgrad.registry
--table` all read a configuration through this module, so a mistake reads the same everywhere:

    parse_config(files, bindings)   gin files (after the base) then `--bind`s; a gin error becomes a
                                    ConfigError naming the file, line or binding, with the valid
                                    names and the closest match (`explain`)
    build()                         the run's validated `TrainConfig` (the `train.*` bindings,
                                    polgrad/train_config.py), its `Algorithm` and its task: the
                                    trainer's inputs (`polgrad.trainer.train(cfg, algo, task, ...)`)
    record(cfg, algo)               the `ConfigRecord` a run writes down (config.gin, operative config)
    load_spec / table_row_from_file / comparison_table
                                    a spec file to its Algorithm and Table-5 row

The explanations come from gin's public parser (`gin.config_parser`) and `gin.get_configurable`:
each statement of the files is checked against what is registered, never by reading gin's
error text.
"""

from __future__ import annotations

import glob
import importlib
import inspect
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gin
from gin import config_parser

from polgrad import config_parts, registry, table5
from polgrad.algorithm import Algorithm
from polgrad.errors import ConfigError, PolgradError, did_you_mean
from polgrad.models import lora
from polgrad.tasks.base import check_eval_size
from polgrad.train_config import TrainConfig

# Bindings that existed once: a file that still binds one is told what replaced it.
REMOVED = {
    "train.async_rollouts": "asynchronous rollouts are one setting, train.max_staleness = k (0, the "
    "default, is the synchronous loop; k > 0 samples step s from the weights of step s - k)",
}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The defaults every run starts from, shipped inside the package (package data): an absolute path, so a
# run reads the same defaults from any working directory, in a checkout or an installed polgrad.
DEFAULT_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "defaults", "base_tiny.gin")


def build() -> tuple[TrainConfig, Algorithm, Any]:
    """The run's `TrainConfig`, `Algorithm` and task from the parsed gin config, every check applied.

    The trainer runs exactly this, and the sweep's dry run calls it for every cell, so a bad cell
    fails before anything trains with the message the trainer would give.
    """
    for selector, cls in (("Algorithm", Algorithm), ("train", TrainConfig)):
        for name in _unbound_required(selector, cls):
            raise ConfigError(f"{selector}.{name} is required: bind it in a gin file or with --bind")
    try:
        algo = config_parts.algorithm()  # every part bound now: nothing below reads gin
        cfg = TrainConfig()
        _check_task_bindings(cfg)
        task = cfg.task()  # a task's own checks (e.g. task.file's path and columns)
    except PolgradError as e:
        raise ConfigError(_first_line(e)) from None
    except (TypeError, ValueError) as e:  # a value of the wrong kind handed to a part or a task
        raise ConfigError(_first_line(e)) from None
    _check_task_needs(cfg, algo, task)
    config_parts.refuse_unbound(_parts(cfg, algo))
    check_eval_size(task, cfg.eval_size)  # before the warm start, not after it at the first evaluation
    if cfg.asynchronous and algo.offline:
        raise ConfigError(
            f"train.max_staleness = {cfg.max_staleness} (asynchronous rollouts): {algo.name} samples nothing "
            "(Algorithm.preference); leave it at 0"
        )
    value_init = algo.parts.get("Algorithm.value_init")
    if cfg.critic_warmup_steps and value_init is None:
        raise ConfigError(
            f"train.critic_warmup_steps = {cfg.critic_warmup_steps}: {algo.name} has no critic; a warm-up "
            "needs a critic with its own engine (e.g. Algorithm.value_init = @value_init.policy), or bind "
            "it to 0"
        )
    lora.check_value_init(cfg, value_init, algo.name)  # a critic on the LoRA backbone: its own checks
    if cfg.critic_warmup_steps >= cfg.steps:  # the run would end 'ok' with the starting policy
        raise ConfigError(
            f"train.critic_warmup_steps = {cfg.critic_warmup_steps} is not below train.steps = {cfg.steps}: "
            f"every step would train the critic alone and {algo.name} would never update the policy; bind "
            f"train.critic_warmup_steps below {cfg.steps}, or raise train.steps"
        )
    return cfg, algo, task


@dataclass(frozen=True)
class ConfigRecord:
    """The gin configuration a run writes into its folder, handed to the trainer by the entry point so
    that nothing below it reads gin: `bindings`, the parsed bindings (config.gin; a resume compares
    them with the folder's), `operative`, the values the run uses (operative_config.gin and the
    model card): gin's for what it built, then each bound part's hyperparameters, and on a resume
    `resume_override`, what differs from the folder's config.gin (`resume_config.override`), or None."""

    bindings: str
    operative: str
    resume_override: Mapping[str, Any] | None = None


def _parts(cfg: TrainConfig, algo: Algorithm) -> list[Any]:
    """Every part a built run calls: the Algorithm's, the reward-ensemble combine and the trackers."""
    return [algo.part(b) for b in algo.parts] + [cfg.ensemble_combine, *cfg.trackers().values()]


def record(cfg: TrainConfig, algo: Algorithm) -> ConfigRecord:
    """The `ConfigRecord` of the parsed gin configuration (at the entry point, after `build`)."""
    parts = config_parts.part_blocks(_parts(cfg, algo))
    operative = gin.operative_config_str().rstrip("\n") + "\n\n" + parts + "\n"
    return ConfigRecord(gin.config_str(), operative)


def _check_task_bindings(cfg: TrainConfig) -> None:
    """A task parameter without a default must be bound (task.file.path): say which, by its binding."""
    bound = gin.get_bindings(cfg.task)
    for p in inspect.signature(cfg.task).parameters.values():
        if p.default is inspect.Parameter.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            if p.name not in bound:
                raise ConfigError(
                    f"task.{cfg.task_name}.{p.name} is required (train.task = @task.{cfg.task_name}): "
                    "bind it in a gin file or with --bind"
                )


def _check_task_needs(cfg: TrainConfig, algo: Algorithm, task: Any) -> None:
    """Every Task method a part declares it needs (`needs_task`, e.g. DPO's 'preference_pairs') exists
    on the run's task: else one line naming the part, the spec, the task and the tasks that have it."""
    for binding, entry in algo.parts.items():
        method = entry.meta.get("needs_task")
        if method is None or callable(getattr(task, method, None)):
            continue
        having = _tasks_with(method)
        raise ConfigError(
            f"{binding} = @{entry.full_name} (spec {algo.name!r}) needs the task's {method}(), and "
            f"train.task = @task.{cfg.task_name} ({type(task).__qualname__}) has none; tasks with "
            f"{method}: {', '.join(having) or '(none registered)'}; pick one of them or add {method} to "
            "the task (polgrad/tasks/base.py)"
        )
    # A learned reward model is trained on the task's preference pairs (polgrad/pretrain/reward_model.py).
    if cfg.reward_source == "reward_model" and not callable(getattr(task, "preference_pairs", None)):
        having = _tasks_with("preference_pairs")
        raise ConfigError(
            f"train.reward_source = 'reward_model' trains a reward model on the task's preference_pairs(), "
            f"and train.task = @task.{cfg.task_name} ({type(task).__qualname__}) has none; tasks with "
            f"preference_pairs: {', '.join(having) or '(none registered)'}; pick one of them, or "
            "train.reward_source = 'task'"
        )


def _tasks_with(method: str) -> list[str]:
    """The registered tasks whose factory's declared return type has `method`."""
    return [n for n in registry.names("task") if _task_has(registry.lookup("task", n), method)]


def _task_has(entry: registry.Entry, method: str) -> bool:
    """Whether a task factory's declared return type (its annotation) has `method`."""
    try:
        cls = typing.get_type_hints(inspect.unwrap(entry.fn)).get("return")
    except Exception:  # noqa: BLE001 - an annotation that does not resolve: unknown, not listed
        return False
    return cls is not None and callable(getattr(cls, method, None))


def check_world_size(cfg: TrainConfig, world_size: int) -> None:
    """The checks of a run that depend on its number of data-parallel ranks (`world_size`).

    vLLM rollouts run one in-process engine inside the trainer's process; at world size > 1 each
    rank would start its own inside the trainer's process group, which polgrad does not test.
    """
    if world_size > 1 and cfg.rollout_backend == "vllm":
        raise ConfigError(
            "train.rollout_backend = 'vllm' is supported on one process only (each rank would start its "
            "own in-process engine, which is not tested): use 'hf' at world size > 1"
        )


def _unbound_required(selector: str, cls: Any) -> list[str]:
    """The required parameters of `cls` (no default, or %gin.REQUIRED) that no binding sets."""
    out = []
    for p in inspect.signature(cls).parameters.values():
        if p.default is gin.REQUIRED or p.default is inspect.Parameter.empty:
            try:
                gin.query_parameter(f"{selector}.{p.name}")
            except ValueError:
                out.append(p.name)
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------- parsing
def resolve(path: str) -> str:
    """A config path as given, or relative to the repository root."""
    if os.path.exists(path):
        return path
    alt = os.path.join(REPO_ROOT, path)
    return alt if os.path.exists(alt) else path


_SEARCH_PATHS: set[str] = set()


def _import_builtins() -> None:
    import polgrad.components  # noqa: F401  (registers the built-in parts, trackers included)
    import polgrad.tasks  # noqa: F401  (registers the built-in tasks)


def parse_config(files: Sequence[str], bindings: Sequence[str] = (), base: str | None = DEFAULT_BASE) -> None:
    """Parse `base` (if any), the files, then the bindings into gin's global config.

    Raises a one-line ConfigError naming the file and line (or the binding) on any problem.
    """
    _import_builtins()
    if REPO_ROOT not in _SEARCH_PATHS:  # gin appends without checking: add it once
        _SEARCH_PATHS.add(REPO_ROOT)
        gin.add_config_file_search_path(REPO_ROOT)
    paths = [resolve(f) for f in files]
    for p in paths:
        if not os.path.isfile(p):
            raise ConfigError(f"config file {p} does not exist")
    if base:
        paths = [resolve(base), *paths]
    for p in paths:
        check_include_cycle(p)  # gin would recurse until Python's limit
        try:
            gin.parse_config_file(p)
        except Exception as e:  # noqa: BLE001 - explained below from the file's statements
            raise ConfigError(f"{p}: {explain_file(p, e)}") from None
    for b in bindings:
        try:
            gin.parse_config(b)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--bind {b!r}: {explain_text(b, e)}") from None


class _Recorder(config_parser.ParserDelegate):
    """Collects the references and macros a statement's value names (gin's public parser delegate)."""

    def __init__(self) -> None:
        self.refs: list[str] = []
        self.macros: list[str] = []

    def configurable_reference(self, scoped_configurable_name, evaluate):
        self.refs.append(scoped_configurable_name)
        return scoped_configurable_name

    def macro(self, macro_name):
        self.macros.append(macro_name)
        return macro_name


def _known_selectors() -> list[str]:
    names = [e.full_name for e in registry.entries()]
    return sorted({*names, "Algorithm", "train", "Sweep"})


class _Ambiguous(str):
    """gin's own one-line message for a selector that matches several configurables."""


def _configurable(selector: str) -> Any:
    """The configurable `selector` names; None if unknown; an _Ambiguous message if it names several."""
    try:
        return gin.get_configurable(selector)
    except ValueError:
        return None
    except KeyError as e:  # several configurables end with this name
        return _Ambiguous(f"{_first_line(e).strip(chr(34) + chr(39))}: write the full name")


def unknown_selector(selector: str) -> str:
    """One line for a name gin does not know: the registry's message for a registered kind."""
    name = selector.rsplit("/", 1)[-1]
    kind, _, part = name.partition(".")
    if part and "." not in part and kind in registry.KINDS:
        try:
            registry.lookup(kind, part)
        except PolgradError as e:
            return str(e)
    return f"unknown configurable '{name}'{did_you_mean(name, _known_selectors())}"


def _parameters(fn: Any) -> tuple[list[str], bool]:
    """The parameters a binding may set: for a registered part only its hyperparameters (the loop
    passes the others), for any other configurable every named parameter."""
    entry = registry.entry_of(fn)
    if entry is not None:
        params = registry.contract.hyperparameters(entry.kind, entry.fn)
    else:
        params = list(inspect.signature(fn).parameters.values())
    names = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
    return names, any(p.kind == p.VAR_KEYWORD for p in params)


def check_statement(stmt: Any, recorder: _Recorder) -> str | None:
    """What is wrong with one parsed statement, or None."""
    if isinstance(stmt, config_parser.ImportStatement):
        try:
            importlib.import_module(stmt.module)
        except Exception as e:  # noqa: BLE001 - reported in one line
            return (
                f"cannot import '{stmt.module}' ({type(e).__name__}: {_first_line(e)}); "
                "a user module must be importable from the working directory: run from the folder "
                "that holds it or add that folder to PYTHONPATH"
            )
        return None
    if isinstance(stmt, config_parser.BindingStatement) and stmt.selector and stmt.arg_name:
        fn = _configurable(stmt.selector)
        if fn is None or isinstance(fn, _Ambiguous):
            return fn or unknown_selector(stmt.selector)
        params, var_kw = _parameters(fn)
        removed = REMOVED.get(f"{stmt.selector}.{stmt.arg_name}")
        if removed:
            return f"{stmt.selector}.{stmt.arg_name} no longer exists: {removed}"
        if stmt.arg_name not in params and not var_kw:
            return (
                f"'{stmt.selector}' has no parameter '{stmt.arg_name}'; valid parameters: "
                f"{', '.join(params) or '(none)'}{did_you_mean(stmt.arg_name, params)}"
            )
    for ref in recorder.refs:
        fn = _configurable(ref.rsplit("/", 1)[-1])
        if fn is None or isinstance(fn, _Ambiguous):
            return fn or unknown_selector(ref)
    return None


def _statements(text: str) -> list[tuple[Any, _Recorder]]:
    """gin's own parse of `text`, statement by statement, with what each value references.

    The parser is a lazy iterator, so the references recorded while producing one statement are
    that statement's.
    """
    out = []
    recorder = _Recorder()
    for stmt in config_parser.ConfigParser(text, recorder):
        mine = _Recorder()
        mine.refs, mine.macros = list(recorder.refs), list(recorder.macros)
        recorder.refs.clear()
        recorder.macros.clear()
        out.append((stmt, mine))
    return out


def _explain_statements(text: str, where: Callable[[Any], str], base_dir: str | None) -> str | None:
    try:
        parsed = _statements(text)
    except Exception as e:  # noqa: BLE001 - a syntax error: gin's first line carries the position
        return f"syntax error: {_first_line(e)}"
    for stmt, rec in parsed:
        if isinstance(stmt, config_parser.IncludeStatement):
            path = _find_include(stmt.filename, base_dir)
            if path is None:
                return (
                    f"{where(stmt)}include '{stmt.filename}' not found (looked in the working "
                    f"directory and {REPO_ROOT})"
                )
            problem = _explain_file_text(path)
            if problem:
                return f"{where(stmt)}in {path}: {problem}"
            continue
        problem = check_statement(stmt, rec)
        if problem:
            return where(stmt) + problem
    return None


def check_include_cycle(path: str) -> None:
    """A ConfigError naming the files of an include cycle reachable from the gin file `path` (a file
    that includes itself, or a -> b -> a), which gin follows until Python's recursion limit. Each file
    is read once; a file that does not parse is left to gin and `explain_file`."""
    done: set[str] = set()

    def visit(file: str, chain: list[tuple[str, str]], line: int) -> None:
        real, seen = os.path.realpath(file), [r for r, _ in chain]
        if real in seen:
            names = [name for _, name in chain[seen.index(real) :]] + [file]
            raise ConfigError(
                f"{path}: include cycle {' -> '.join(names)} (line {line} of {chain[-1][1]} includes "
                f"{file} again); remove that include"
            )
        if real in done:
            return
        try:
            with open(file) as f:
                statements = [stmt for stmt, _ in _statements(f.read())]
        except Exception:  # noqa: BLE001 - unreadable or a syntax error: gin's parse says which
            statements = []
        for stmt in statements:
            found = isinstance(stmt, config_parser.IncludeStatement) and _find_include(
                stmt.filename, os.path.dirname(file)
            )
            if found:
                visit(found, [*chain, (real, file)], stmt.location.line_num)
        done.add(real)

    visit(path, [], 0)


def _find_include(name: str, base_dir: str | None) -> str | None:
    for cand in (name, os.path.join(base_dir or "", name), os.path.join(REPO_ROOT, name)):
        if cand and os.path.isfile(cand):
            return cand
    return None


def _explain_file_text(path: str) -> str | None:
    with open(path) as f:
        text = f.read()

    def where(stmt: Any) -> str:
        return f"line {stmt.location.line_num}: " if getattr(stmt, "location", None) else ""

    return _explain_statements(text, where, os.path.dirname(path))


def explain_file(path: str, error: BaseException) -> str:
    """One line for a gin error while parsing the file `path`."""
    try:
        found = _explain_file_text(path)
    except Exception:  # noqa: BLE001 - fall back to gin's own first line
        found = None
    return found or _first_line(error)


def explain_text(text: str, error: BaseException) -> str:
    """One line for a gin error while parsing the binding(s) `text`."""
    try:
        found = _explain_statements(text, lambda stmt: "", None)
    except Exception:  # noqa: BLE001
        found = None
    return found or _first_line(error)


# ---------------------------------------------------------------------------------- specs
def specs_dir() -> str:
    """registry/ beside the package (a source checkout) or under the current directory."""
    here = os.path.join(REPO_ROOT, "registry")
    return here if os.path.isdir(here) else os.path.join(os.getcwd(), "registry")


def load_spec(path: str, bindings: Sequence[str] = (), base: str | None = None) -> Algorithm:
    """Parse one spec gin file (after `base`, if given; gin's bindings cleared first) and build it."""
    if not os.path.isfile(path):
        raise ConfigError(f"spec file {path} does not exist; specs live in {specs_dir()}")
    gin.clear_config()
    parse_config([path], bindings, base=base)
    try:
        return config_parts.algorithm()
    except PolgradError as e:
        raise ConfigError(f"{path}: {_first_line(e)}") from None
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{path}: {_first_line(e)}") from None


def table_row_from_file(spec_path: str, bindings: Sequence[str] = ()) -> dict[str, str]:
    """The Table-5 row of a spec gin file plus `bindings`. Clears gin's bindings before and after."""
    try:
        return load_spec(spec_path, bindings).table_row()
    finally:
        gin.clear_config()


def comparison_table(folder: str | None = None) -> str:
    """Markdown Table 5 for every spec file in `folder` (default registry/).

    The chapter's five rows come first, in its order (REINFORCE, RLOO, PPO, GRPO, DPO), each with
    the chapter's core loss and how the spec deviates from it (polgrad.table5.CHAPTER); then every
    other spec. Column meanings: polgrad.table5.
    """
    folder = folder or specs_dir()
    paths = sorted(glob.glob(os.path.join(folder, "*.gin")))
    if not paths:
        raise ConfigError(f"no spec files (*.gin) in {folder}")
    by_name = {os.path.splitext(os.path.basename(p))[0]: p for p in paths}
    order = [n for n in table5.CHAPTER if n in by_name] + [n for n in by_name if n not in table5.CHAPTER]
    head = ["Method", "Type", "Reward model", "Value function", "Reference policy", "Core loss", "Chapter"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in order:
        row = table_row_from_file(by_name[name])
        chapter = table5.CHAPTER.get(name)
        row["chapter"] = f"{chapter[0]} — {chapter[1]}" if chapter else "not in the chapter's table"
        cells = [str(row[c]).replace("|", "\\|") for c in (*table5.COLUMNS, "chapter")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
