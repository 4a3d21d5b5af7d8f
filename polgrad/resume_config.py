"""A resume trains what the run trained: the config of `--resume` against the one in the run folder.

The run folder's `config.gin` holds every binding the run trains with (gin's `config_str()`,
written when it starts). On `--resume` from a checkpoint, `check` compares the new config with
it, binding by binding (gin's parser on both texts; a binding one side leaves unset counts at the
configurable's default). Every difference that changes training is refused in one line naming
each binding (old -> new), before any model is built (in a sweep's cell, the line says to undo the
change or `--restart` the cell: the sweep resumes a cell with the bindings its file gives now).
Allowed without a word:

- `train.steps` may grow (a run is continued for more steps; shrinking it is a change);
- `ALLOWED`: bindings that only change what is shown or stored beside training: the progress bar
  (`train.progress`), `train.resume`, when checkpoints are written (`train.checkpoint_every`),
  the trackers (`train.loggers` and every `tracker.*` hyperparameter), the reward's time limit
  (`train.reward_timeout_s`) and the thread count (`train.threads`: float summation order only).

`--allow-config-change` lets a resume train on with the new bindings anyway. The run then says so
(`polgrad.loop_state.start_or_resume`, `apply`): every changed binding takes effect from the resumed step
(the loop's KL coefficient restarts at a changed `Algorithm.kl_coef`, the optimizer's groups take a
changed `train.lr`, `train.critic_lr` or `train.adam_eps`, which the checkpoint would otherwise
restore), one JSON line {"time", "step", "changes": {binding: [old, new]}, "overridden":
[binding, ...]} is appended to `resume_overrides.jsonl` (a resume that only grows `train.steps` or
changes an allowed binding is recorded too, with "overridden" empty), and `config.gin` is
rewritten with the new bindings (what trains from then on; the next resume compares with it).
So `config.gin`, `operative_config.gin` and `resume_overrides.jsonl` together say what trained
at every step.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any

import gin
from gin import config_parser

from polgrad import checkpoints, registry, run_folder
from polgrad.errors import ConfigError
from polgrad.run_folder import RunFolder

CONFIG_FILE = run_folder.CONFIG
RECORD_FILE = run_folder.RESUME_OVERRIDES
GROWS = ("train.steps",)  # may be larger on resume
ALLOWED = (
    "train.progress",
    "train.resume",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.loggers",
    "train.reward_timeout_s",  # a limit added after a reward hung: stops a run, never changes one
    "train.threads",  # how many cores; the numbers differ by float summation order only
)
ALLOWED_KINDS = ("tracker",)  # every hyperparameter of a part of this kind
_UNSET = object()


class _Ref:
    """A `@name` / `@name()` reference or a `%MACRO` in a parsed value: equal by its text."""

    def __init__(self, text: str):
        self.text = text

    def __eq__(self, other) -> bool:
        return isinstance(other, _Ref) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return self.text


class _Delegate(config_parser.ParserDelegate):
    def configurable_reference(self, scoped_configurable_name, evaluate):
        return _Ref(f"@{scoped_configurable_name}{'()' if evaluate else ''}")

    def macro(self, macro_name):
        return _Ref(f"%{macro_name}")


def _full_name(selector: str) -> str:
    """A configurable's canonical name however a file wrote it: a part's `kind.name` (for
    'ppo' or 'polgrad.components.clip.ppo' too), another's own name ('Algorithm', 'train')."""
    try:
        fn = gin.get_configurable(selector)  # gin's public lookup: full name, module or short name
    except (KeyError, ValueError):
        return selector
    entry = registry.entry_of(fn)
    return entry.full_name if entry else selector.rpartition(".")[2]


def _name(scope: str, selector: str, arg: str) -> str:
    """The binding's full name ('clip.ppo.eps_high', 'Algorithm.kl_coef', 'MACRO'), scope first."""
    if arg:
        selector = _full_name(selector)
    name = f"{selector}.{arg}" if arg else selector
    return f"{scope}/{name}" if scope else name


def bindings(text: str) -> dict[str, Any]:
    """{full binding name: parsed value} of a gin text (`config.gin`, `gin.config_str()`); a value
    that is a macro (`Algorithm.kl_coef = %KL`) is its macro's value, so that changing `KL = ...`
    shows as a change of every binding that reads it (and acts on it: `polgrad.loop_state`)."""
    out: dict[str, Any] = {}
    for st in config_parser.ConfigParser(text, _Delegate()):
        if isinstance(st, config_parser.BindingStatement):
            out[_name(st.scope, st.selector, st.arg_name)] = st.value
    for name, value in out.items():
        seen = set()
        while isinstance(value, _Ref) and value.text.startswith("%") and value.text not in seen:
            seen.add(value.text)
            value = out.get(value.text[1:], value)
        out[name] = value
    return _one_async_setting(out)


# Before asynchronous rollouts were one setting, train.async_rollouts switched them on and
# train.max_staleness (default 1 then) said how stale; off, max_staleness did nothing.
_OLD_ASYNC, _OLD_STALENESS_DEFAULT = "train.async_rollouts", 1


def _one_async_setting(out: dict[str, Any]) -> dict[str, Any]:
    """The bindings of a config.gin written before train.async_rollouts was removed, in today's terms:
    async on with staleness k (unset: 1) is train.max_staleness = k, async off is 0."""
    if _OLD_ASYNC not in out:
        return out
    out = dict(out)
    if out.pop(_OLD_ASYNC) is True:
        out["train.max_staleness"] = out.get("train.max_staleness", _OLD_STALENESS_DEFAULT)
    else:
        out["train.max_staleness"] = 0
    return out


def _default(name: str) -> Any:
    """The default of the parameter a binding name sets (its configurable's signature), else _UNSET."""
    selector, _, arg = name.rsplit("/", 1)[-1].rpartition(".")
    try:
        fn = gin.get_configurable(selector) if selector else None
        param = inspect.signature(fn).parameters.get(arg) if fn is not None else None  # through the wrapper
    except (KeyError, TypeError, ValueError):
        return _UNSET
    if param is None or param.default is inspect.Parameter.empty or param.default is gin.REQUIRED:
        return _UNSET
    return param.default


def diff(old_text: str, new_text: str) -> dict[str, tuple[Any, Any]]:
    """{binding: (old, new)} for every binding whose value differs (unset = the default; _UNSET if none)."""
    old, new = bindings(old_text), bindings(new_text)
    out = {}
    for name in sorted(old.keys() | new.keys()):
        a, b = old.get(name, _UNSET), new.get(name, _UNSET)
        a = _default(name) if a is _UNSET else a
        b = _default(name) if b is _UNSET else b
        if a is _UNSET or b is _UNSET or type(a) is not type(b) or a != b:
            if not (a is _UNSET and b is _UNSET):
                out[name] = (a, b)
    return out


def _allowed(name: str, old: Any, new: Any) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base in ALLOWED or base.split(".", 1)[0] in ALLOWED_KINDS:
        return True
    if base in GROWS:
        return isinstance(old, int) and isinstance(new, int) and new >= old
    return False


def training_changes(changes: dict[str, tuple[Any, Any]]) -> dict[str, tuple[Any, Any]]:
    """The changes that change training: all but `ALLOWED`, `ALLOWED_KINDS` and a grown `train.steps`."""
    return {k: v for k, v in changes.items() if not _allowed(k, *v)}


def show(value: Any) -> str:
    return "(unset)" if value is _UNSET else repr(value)


def describe(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k}: {show(a)} -> {show(b)}" for k, (a, b) in changes.items())


def saved_config(run_dir: str | os.PathLike) -> str | None:
    path = RunFolder(run_dir).config
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def check(run_dir: str | os.PathLike, *, allow: bool) -> dict[str, tuple[Any, Any]]:
    """The training changes of this process's gin config against `run_dir`'s config.gin; refused
    in one line (ConfigError) unless `allow`. {} when the folder has no config.gin or no checkpoint
    (the resume then starts the run afresh)."""
    old = saved_config(run_dir)
    if old is None or not checkpoints.tag_steps(RunFolder(run_dir).checkpoints_of("policy")):
        return {}
    if not allow:
        _check_async_matches_rows(run_dir, bindings(gin.config_str()).get("train.max_staleness", 0))
    changes = training_changes(diff(old, gin.config_str()))
    if changes and not allow:
        cell = os.environ.get("POLGRAD_CELL_ID")  # a sweep's cell: the sweep passes no such flag
        ways = (
            f"undo the change, or re-run the sweep with --restart {cell} (it moves the old run folder aside)"
            if cell
            else f"resume with its bindings, or pass --allow-config-change to train on with the new ones "
            f"(recorded in {RECORD_FILE}), or choose a new --out"
        )
        raise ConfigError(
            f"--resume with a config that changes training: {describe(changes)} (the run in {run_dir} "
            f"trained with {os.path.join(str(run_dir), CONFIG_FILE)}); {ways}"
        )
    return changes


def _check_async_matches_rows(run_dir: str | os.PathLike, max_staleness: Any) -> None:
    """The run's own rows say whether it sampled asynchronously (an async step logs `staleness_max`):
    a resume that would switch that, whatever its config.gin says (a config.gin from before
    train.max_staleness was the one async setting bound it with async off), is refused in one line."""
    path = RunFolder(run_dir).metrics
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (FileNotFoundError, json.JSONDecodeError):
        return
    if not rows:
        return
    was_async = any("staleness_max" in r for r in rows)
    now_async = isinstance(max_staleness, int) and max_staleness > 0
    if was_async != now_async:
        how = "asynchronously (its metrics rows log staleness)" if was_async else "synchronously"
        fix = "bind the train.max_staleness it ran with" if was_async else "bind train.max_staleness = 0"
        raise ConfigError(
            f"--resume of {run_dir}: the run sampled {how}, and train.max_staleness = {max_staleness} "
            f"would make it {'synchronous' if was_async else 'asynchronous'}; {fix} to resume it, or "
            "choose a new --out"
        )


def override(changes: dict[str, tuple[Any, Any]]) -> dict[str, Any] | None:
    """What a resume's record in resume_overrides.jsonl says of its `changes` (None: there are none):
    every change {binding: [old, new]}, and under "overridden" those that change training
    (--allow-config-change). Computed by the entry point; the loop adds the time and step and
    writes it (polgrad/loop_state.py), without reading gin."""
    if not changes:
        return None
    return {
        "changes": {k: [show(a), show(b)] for k, (a, b) in changes.items()},
        "overridden": sorted(training_changes(changes)),  # trained on under --allow-config-change
    }
