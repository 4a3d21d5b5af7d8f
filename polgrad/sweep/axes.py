"""The parts of an experiment file that define its cells and what it claims, read and checked from
`Sweep`'s parameters in one line per mistake (the file, the line, the binding, the valid choices): the
seeds and the seed binding (`_read_seeds`), the grid's axes, zipped ones too (`_read_grid`), the
baseline (`_read_baseline`) and the predictions (`_read_predictions`). polgrad/sweep/experiment.py reads
the rest of the file and builds the `Experiment`; polgrad/sweep/tuning.py reads its grid with these.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from polgrad import results as _results
from polgrad.checks import is_int, is_real
from polgrad.errors import ConfigError, did_you_mean
from polgrad.sweep.values import _value_type, gin_text

EXPECTATIONS = ("lower", "higher", "no difference")


def _fail(file: str, where: str, msg: str) -> ConfigError:
    return ConfigError(f"{file}: {where}: {msg}" if where else f"{file}: {msg}")


def _check_key(file: str, where: str, key: Any) -> str:
    from gin import config_parser

    if not isinstance(key, str) or not key.strip():
        raise _fail(file, where, f"axis {key!r} must be a binding such as 'Algorithm.kl' (a string)")
    try:
        config_parser.parse_binding_key(key)
    except Exception as e:  # gin's own message names the problem
        raise _fail(file, where, f"'{key}' is not a gin binding key ({' '.join(str(e).split())})") from None
    return key


def _read_seeds(file: str, params: dict[str, Any], param, where) -> tuple[list[int], str]:
    """Sweep.seeds and Sweep.seed_binding."""
    if "seeds" not in params:
        raise _fail(file, "Sweep.seeds", "missing: list at least one seed, e.g. Sweep.seeds = [0, 1, 2]")
    seeds = params["seeds"]
    if is_int(seeds):
        seeds = [seeds]
    if not isinstance(seeds, (list, tuple)) or not seeds or not all(is_int(s) for s in seeds):
        raise _fail(file, where("seeds"), f"must be a non-empty list of ints, got {gin_text(seeds)}")
    if len(set(seeds)) != len(seeds):
        raise _fail(file, where("seeds"), f"lists a seed twice: {gin_text(seeds)}")
    seed_binding = param("seed_binding")
    if not isinstance(seed_binding, str):
        raise _fail(file, where("seed_binding"), "must be a binding key string such as 'train.seed'")
    _check_key(file, where("seed_binding"), seed_binding)
    return list(seeds), seed_binding


def _read_grid(
    file: str, params: dict[str, Any], param, where, seed_binding: str
) -> list[tuple[tuple[str, ...], list[Any]]]:
    """Sweep.grid as axes: (binding keys, values); a value is a tuple when the axis zips keys."""
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
    return axes


def _read_baseline(file: str, value: Any, specs, axes, where) -> dict[str, str]:
    """The baseline configuration as {column: value text}; default: the first spec and first values."""
    default = {
        "spec": Path(specs[0]).stem,
        **{k: gin_text(v) for keys, vals in axes for k, v in _firsts(keys, vals)},
    }
    if value is None:
        return default
    columns = {"spec": [Path(s).stem for s in specs]}
    for keys, vals in axes:
        for i, k in enumerate(keys):
            columns[k] = [gin_text(v[i] if len(keys) > 1 else v) for v in vals]
    if not isinstance(value, dict) or not value:
        raise _fail(
            file, where("baseline"), "must be a dict naming the baseline, e.g. {'Algorithm.kl_coef': 0.0}"
        )
    out = dict(default)
    for k, v in value.items():
        text = Path(v).stem if k == "spec" and isinstance(v, str) else gin_text(v)
        if k not in columns:
            raise _fail(
                file,
                where("baseline"),
                f"unknown column {k!r}; valid: {', '.join(columns)}" + did_you_mean(str(k), columns),
            )
        if text not in columns[k]:
            raise _fail(
                file, where("baseline"), f"{k} = {text} is not one of its values: {', '.join(columns[k])}"
            )
        out[k] = text
    return out


def _read_predictions(file: str, value: Any, specs, axes, where) -> list[dict[str, Any]]:
    """Sweep.predictions: [(claim, configuration dict, metric, 'lower' | 'higher' | 'no difference'
    [, margin]), ...], each a statement about that configuration minus the baseline, judged by the
    paired statistics; a 'no difference' with a margin is tested for equivalence within ±margin."""
    if not isinstance(value, (list, tuple)):
        raise _fail(
            file, where("predictions"), "must be a list of (claim, configuration, metric, expectation)"
        )
    out = []
    for i, item in enumerate(value):
        here = f"{where('predictions')}[{i}]"
        if not (isinstance(item, (list, tuple)) and len(item) in (4, 5) and isinstance(item[0], str)):
            raise _fail(file, here, "must be (claim, {column: value}, metric, expectation[, margin])")
        claim, config, metric, expected = item[:4]
        margin = item[4] if len(item) == 5 else None
        if margin is not None and (expected != "no difference" or not _positive_number(margin)):
            raise _fail(file, here, "a margin (> 0) goes only with the expectation 'no difference'")
        if metric not in _results.OUTCOME_METRICS:
            raise _fail(
                file,
                here,
                f"unknown metric {gin_text(metric)}" + did_you_mean(str(metric), _results.OUTCOME_METRICS),
            )
        if expected not in EXPECTATIONS:
            raise _fail(
                file, here, f"expectation must be one of {', '.join(EXPECTATIONS)}, got {gin_text(expected)}"
            )
        out.append(
            {
                "claim": claim,
                "config": _read_baseline(file, config, specs, axes, lambda _, h=here: h),
                "metric": metric,
                "expected": expected,
                "margin": margin,
            }
        )
    return out


def _positive_number(v: Any) -> bool:
    return is_real(v) and v > 0


def _firsts(keys, vals):
    first = vals[0]
    return zip(keys, first if len(keys) > 1 else (first,), strict=True)
