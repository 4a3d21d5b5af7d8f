"""The md's Tuning section: which values a sweep's tuning stage chose for each configuration, and why.

`section(record)` formats experiment.json's "tuning" (written by polgrad/sweep/tuning.py: the grid, the
tuning seeds and metric, and per configuration the values tuned, the chosen ones and the mean over
the tuning seeds of every value); an experiment without a tuning stage gets no section.
"""

from __future__ import annotations

from typing import Any

__all__ = ["section"]


def _mean(v: dict[str, Any]) -> str:
    if v["mean"] is None:
        return f"not ranked ({v['n_ok']} of {v['n']} runs ok)"
    return f"{v['mean']:.4g}"


def _values(values: dict[str, str]) -> str:
    return ", ".join(f"`{k} = {v}`" for k, v in values.items()) or "(none)"


def section(record: dict[str, Any] | None) -> list[str]:
    """The md lines of the Tuning section (with a leading blank line), [] without a tuning record."""
    if not record:
        return []
    direction = "highest" if record.get("higher_is_better", True) else "lowest"
    grid = "; ".join(f"`{k}` ∈ {{{', '.join(vals)}}}" for k, vals in record["grid"].items())
    lines = [
        "",
        "## Tuning",
        "",
        f"Each configuration's {', '.join(f'`{k}`' for k in record['grid'])} were chosen before this "
        f"evaluation, on the tuning seeds {', '.join(map(str, record['seeds']))} (disjoint from the "
        f"evaluation seeds): the value with the {direction} mean {record['metric']} over those seeds (ties: "
        "the first value declared; a value with an unstable or failed tuning run is not ranked). A binding "
        "a configuration does not read (the KL coefficient without a KL term) is not tuned there. Grid: "
        f"{grid}. The tuning runs: {record['experiment']}.md.",
        "",
        f"| configuration | chosen | mean {record['metric']} per value (tuning seeds) |",
        "|---|---|---|",
    ]
    for c in record["configurations"]:
        label = " · ".join(
            [c["config"]["spec"], *(f"{k}={v}" for k, v in c["config"].items() if k != "spec")]
        )
        chosen = _values(c["chosen"]) + (f" ({c['note']})" if c.get("note") else "")
        means = "; ".join(f"{_values(v['values'])}: {_mean(v)}" for v in c["values"])
        lines.append(f"| {label} | {chosen} | {means} |".replace("\n", " "))
    return lines
