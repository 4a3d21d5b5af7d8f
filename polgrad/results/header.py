"""The head of an experiment's md: title, question, the machine line (where and with which versions
and commit the rows ran, when their cells finished, when the report was written, the command), the
warm-start design and the budget."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence

from polgrad.results.warm_starts import warm_start_paragraph


def cells_ran(rows: Sequence[dict[str, str]]) -> str:
    """When the rows' cells ran, from their finished_at (UTC): 'cells finished A to B' ('' when no row
    records it). The report's own date is when it was written, which a regenerated md moves."""
    times = []
    for r in rows:
        try:
            times.append(
                _dt.datetime.fromisoformat(str(r.get("finished_at", ""))).astimezone(_dt.timezone.utc)
            )
        except ValueError:
            continue
    if not times:
        return ""
    first, last = (t.strftime("%Y-%m-%d %H:%M UTC") for t in (min(times), max(times)))
    return f"cells finished {first}" + (f" to {last}" if last != first else "")


def header(
    experiment: str, rows: Sequence[dict[str, str]], *, question: str, command: str, budget: str
) -> list[str]:
    """Title, question, the machine and versions the rows ran on, the warm-start design, the budget."""
    envs = {
        k: sorted({str(r.get(k, "")) for r in rows if r.get(k)})
        for k in (
            "hostname",
            "cpu_count",
            "cpu",
            "python",
            "torch",
            "transformers",
            "deepspeed",
            "git_commit",
            "user_modules",
        )
    }

    def one(k):
        return ", ".join(envs[k]) or "?"

    date = f"report {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}"
    ran = cells_ran(rows)
    lines = [f"# {experiment}", ""]
    if question:
        lines += [f"**Question.** {question}", ""]
    lines += [
        f"Machine: {one('hostname')} ({one('cpu_count')} CPUs"
        + (f": {'; '.join(envs['cpu'])}" if envs["cpu"] else "")  # rows that record the CPU (model · ISA)
        + f") · python {one('python')} · torch "
        f"{one('torch')} · transformers {one('transformers')} · deepspeed {one('deepspeed')} · "
        f"commit {one('git_commit')}"
        + (f" · user modules {'; '.join(envs['user_modules'])}" if envs["user_modules"] else "")
        + (f" · {ran}" if ran else "")
        + f" · {date} · command: `{command}`",
        "",
    ]
    lines += warm_start_paragraph(rows)  # one warm start, one per seed, or not recorded; broken pairing
    if budget:  # Sweep.budget, as the sweep's dry run stated it (polgrad/sweep/budget.py)
        lines += [f"**Budget.** {budget}", ""]
    return lines
