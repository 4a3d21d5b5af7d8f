"""The md's Tuning section: which values a sweep's tuning stage chose for each configuration, and why.

`section(record)` formats experiment.json's "tuning" (written by polgrad/sweep/tuning.py: the grid, the
tuning seeds and metric, and per configuration the values tuned, the chosen ones and the mean over
the tuning seeds of every value; with `chosen_by`, the experiment whose tuning stage chose, under
Sweep.tuned_by); an experiment without a tuning stage gets no section.
`tuned_note` is the sentence the findings add where two configurations ran at different tuned values.
"""

from __future__ import annotations

from typing import Any

__all__ = ["section", "tuned_note", "tuned_values"]


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
    source = record.get("chosen_by")  # Sweep.tuned_by: another experiment's tuning stage chose
    runs = f"../{source}/{record['experiment']}" if source else record["experiment"]
    lines = [
        "",
        "## Tuning",
        "",
        f"Each configuration's {', '.join(f'`{k}`' for k in record['grid'])} were chosen before this "
        + (
            f"evaluation, by {source}'s tuning stage and not re-tuned here (Sweep.tuned_by), "
            if source
            else "evaluation, "
        )
        + f"on the tuning seeds {', '.join(map(str, record['seeds']))} (disjoint from the "
        f"evaluation seeds): the value with the {direction} mean {record['metric']} over those seeds (ties: "
        "the first value declared; a value with an unstable or failed tuning run is not ranked). A binding "
        "a configuration does not read (the KL coefficient without a KL term) is not tuned there. Grid: "
        f"{grid}. The tuning runs: {runs}/{record['experiment']}.md.",
        "",
        f"| configuration | chosen | mean {record['metric']} per value (tuning seeds) |",
        "|---|---|---|",
    ]
    at_edges = []
    for c in record["configurations"]:
        label = " · ".join(
            [c["config"]["spec"], *(f"{k}={v}" for k, v in c["config"].items() if k != "spec")]
        )
        at_edge = [] if c.get("note") else edges(record["grid"], c["chosen"])  # a fallback is no choice
        if at_edge:
            at_edges.append(f"{label} ({', '.join(at_edge)})")
        chosen = _values(c["chosen"]) + (f" ({c['note']})" if c.get("note") else "")
        chosen += " (at the grid's edge)" if at_edge else ""
        means = "; ".join(f"{_values(v['values'])}: {_mean(v)}" for v in c["values"])
        lines.append(f"| {label} | {chosen} | {means} |".replace("\n", " "))
    if at_edges:
        lines += [
            "",
            f"{len(at_edges)} of {len(record['configurations'])} configurations chose a value at an edge "
            f"of its numeric grid: {'; '.join(at_edges)}. Their best value may lie beyond the grid; a grid "
            "extended past that edge would say."
            + (
                f" {f'{source} keeps the edge (its ' if source else 'The experiment keeps the edge ('}"
                f"Sweep.tuning['at_edge']): {record['at_edge']}"
                if record.get("at_edge")
                else ""
            ),
        ]
    return lines


def edge_count(record: dict[str, Any] | None) -> int:
    """How many configurations of a tuning record chose a value at an edge of a numeric grid axis."""
    return sum(
        bool(not c.get("note") and edges(record["grid"], c["chosen"]))
        for c in (record or {}).get("configurations", [])
    )


def edges(grid: dict[str, list[str]], chosen: dict[str, str]) -> list[str]:
    """'train.lr = 3e-05, the smallest' for each chosen value that is the smallest or largest of a
    numeric grid axis of at least 3 values (with 2 every choice is an edge, and says nothing). An axis
    that zips several bindings (its values are tuples) has no order, and is not checked."""
    out = []
    for name, value in chosen.items():
        try:
            values = sorted(float(v) for v in grid.get(name, []))
            x = float(value)
        except (TypeError, ValueError):
            continue
        if len(values) >= 3 and x in (values[0], values[-1]):
            out.append(f"{name} = {value}, the {'smallest' if x == values[0] else 'largest'}")
    return out


def tuned_note(
    tuned: dict[tuple[str, ...], dict[str, str]] | None, key: tuple[str, ...], baseline: tuple[str, ...]
) -> str:
    """' The two ran at different tuned values (...) ...' when a tuning stage chose different values for
    `key` and the baseline in a binding both read, else ''. A difference (or an equivalence) found
    between them is then one of each configuration at its own tuned value: the protocol's comparison,
    and worth saying. A binding only one of them reads (β for a spec with a KL term against one without)
    is no difference of tuned values: the other has no such setting."""
    values = tuned_values(tuned, key, baseline)
    if not values:
        return ""
    return (
        f" The two ran at different tuned values ({values}): this compares each configuration at its own "
        "tuned value, not the configuration alone."
    )


def tuned_values(
    tuned: dict[tuple[str, ...], dict[str, str]] | None, key: tuple[str, ...], baseline: tuple[str, ...]
) -> str:
    """'train.lr = 3e-05 against 0.0001': the tuned bindings both read whose chosen values differ."""
    if not tuned or key not in tuned or baseline not in tuned:
        return ""
    mine, base = tuned[key], tuned[baseline]
    return "; ".join(f"{n} = {mine[n]} against {base[n]}" for n in mine if n in base and mine[n] != base[n])
