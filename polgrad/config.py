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

The explanations (polgrad/config_explain.py) come from gin's public parser (`gin.config_parser`) and
`gin.get_configurable`: each statement of the files is checked against what is registered, never by
reading gin's error text.
"""

from __future__ import annotations

import glob
import inspect
import os
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gin

from polgrad import config_parts, registry, table5
from polgrad.algorithm import Algorithm
from polgrad.config_explain import REPO_ROOT, _first_line, check_include_cycle, explain_file, explain_text
from polgrad.errors import ConfigError, PolgradError
from polgrad.models import lora
from polgrad.tasks.base import check_eval_size
from polgrad.train_config import TrainConfig

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
