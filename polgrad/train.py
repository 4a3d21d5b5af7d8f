"""`python -m polgrad.train SPEC.gin [MORE.gin ...] [--bind 'X.y = z' ...] [--out DIR] [--resume]`
`[--allow-config-change]`

One training run. Gin files are parsed in order (later bindings win), then the `--bind`s. The
experiment and spec files in this repo `include` a base config for the tiny default model, so
`python -m polgrad.train registry/grpo.gin` alone needs one: the base config
polgrad/defaults/base_tiny.gin, shipped inside the package, is parsed first from any working
directory (`--base ''` turns that off; parsing it again through an `include` is harmless, later
bindings win). `--binding` is another spelling of `--bind` (the one the sweep passes under
DeepSpeed's launcher, which refuses `--bind`).

The run folder `--out` has one owner: the trainer locks it (polgrad/runlock.py; under a launcher,
rank 0 does), and a second trainer on it stops at once in one line naming the holder. A folder that
holds a run (metrics.jsonl, summary.json, checkpoints/) is continued only with `--resume`, never
started over; a `--resume` whose bindings change training refuses in one line naming each binding
(old -> new) unless `--allow-config-change`, whose use the run folder records
(polgrad/resume_config.py; `train.steps` may grow). An `--out` that cannot be a writable folder is one
line before any work.

Errors in the configuration or the data, and a write that fails (disk full, read-only folder),
print one line `error: ...` and exit 2; a crash during training prints its traceback followed by a
last line `error: ...` and exits 1. ^C or SIGTERM during training: the current step finishes and is
checkpointed, then one line says how to resume, exit code 130 (SIGINT) or 143 (SIGTERM); a second ^C
stops at once (polgrad/stopping.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from typing import Any

from polgrad.config import DEFAULT_BASE, parse_config
from polgrad.run_folder import RunFolder


def run(out_dir: str, *, resume: bool | None = None, progress: bool | None = None) -> dict[str, Any]:
    """One run of the parsed gin configuration into `out_dir`: build its inputs (`config.build()`,
    every check the sweep's dry run makes too) and hand them to `polgrad.trainer.train`; returns the
    summary. `resume` / `progress` override `train.resume` / `train.progress` when given. This is
    the boundary below which nothing reads gin."""
    import dataclasses

    from polgrad import config, resume_config
    from polgrad.trainer import train

    cfg, algo, task = config.build()
    overrides = {"resume": resume, "progress": progress}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    record = config.record(cfg, algo)
    old = resume_config.saved_config(out_dir) if cfg.resume else None  # the diff here, where gin is read
    if old is not None:
        override = resume_config.override(resume_config.diff(old, record.bindings))
        record = dataclasses.replace(record, resume_override=override)
    return train(cfg, algo, task, out_dir, record=record)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m polgrad.train", description="Run one polgrad training run.")
    ap.add_argument("configs", nargs="+", help="gin files: a spec from registry/ and/or an experiment base")
    # --binding is the same flag: DeepSpeed's launcher reads `--bind` as an abbreviation of its own
    # --bind_cores_to_rank / --bind_core_list and refuses it, so the sweep spells it --binding there.
    ap.add_argument(
        "--bind",
        "--binding",
        action="append",
        default=[],
        dest="bind",
        help="extra gin binding, e.g. 'Algorithm.kl_coef = 0.01'",
    )
    ap.add_argument("--out", default=None, help="run directory (default results/runs/<spec>-<time>)")
    ap.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    ap.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: train on with bindings that differ from the run's config.gin (recorded in "
        "resume_overrides.jsonl)",
    )
    ap.add_argument("--base", default=DEFAULT_BASE, help="base config parsed first ('' for none)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. in logs)")
    # The deepspeed launcher passes --local_rank unless given --no_local_rank; LOCAL_RANK is read
    # from the environment (distributed.setup), so the flag is accepted and otherwise unused.
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    from polgrad import distributed, stopping
    from polgrad.errors import PolgradError, WriteError, is_write_failure, write_error

    out = args.out or os.path.join(
        "results",
        "runs",
        f"{os.path.splitext(os.path.basename(args.configs[-1]))[0]}-{time.strftime('%Y%m%d-%H%M%S')}",
    )
    try:
        parse_config(args.configs, args.bind, base=args.base)
        from polgrad import resume_config, runlock

        # One owner per run folder (rank 0 of a launcher writes the files, so only it locks).
        with runlock.acquire(out) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext():
            if not args.resume:
                runlock.check_not_a_run(out)  # never a silent overwrite
            else:
                resume_config.check(out, allow=args.allow_config_change)  # no silent config change
            # No bar in a log file (sweep cells write stderr to stdout.log): only on a terminal.
            with stopping.on_signals():  # ^C / SIGTERM: finish the step, checkpoint it, stop
                progress = not args.no_progress and sys.stderr.isatty()
                summary = run(out, resume=args.resume, progress=progress)
            distributed.finish()  # the ranks end together (rank 0 may still be writing the model)
    except stopping.Stopped as e:
        ckpt = os.path.join(RunFolder(out).checkpoints_of("policy"), f"step{e.step}")
        print(
            f"{e}, with its checkpoint {ckpt}; to continue, run the same command with --resume "
            "(a sweep: run the sweep again)",
            file=sys.stderr,
        )
        return e.exit_code
    except PolgradError as e:
        # gin appends "In call to configurable ..." lines to errors raised inside what it calls at the
        # build (a task factory, the Algorithm; a run's parts no longer pass through gin): keep ours.
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, WriteError) and "re-run" not in line:  # disk full: the run folder is kept
            line += "; free space and re-run with --resume"
        print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "error: interrupted; re-run with --resume to continue from the last checkpoint", file=sys.stderr
        )
        return stopping.exit_code()
    except Exception as e:  # noqa: BLE001 - last line must be the one-line error the sweep records
        if is_write_failure(e):
            # A full disk or a read-only folder: one line naming the file (or the run folder when the
            # OS error does not say which file); what is written stays, a resume goes on from it.
            where = e.filename or f"the run folder {out}"
            print(f"error: {write_error(e, where, 'free space and re-run with --resume')}", file=sys.stderr)
            return 2
        traceback.print_exc()
        print(f"error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    collapsed = summary.get("collapsed")  # the collapse rule's words (polgrad/summary.py)
    print(
        f"done: {out}  eval_accuracy={summary.get('eval_accuracy')}  "
        f"final_train_reward={summary.get('final_train_reward')}" + (f"  {collapsed}" if collapsed else "")
    )
    if summary.get("status") == "unstable":
        print(f"warning: {summary.get('unstable')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from polgrad import distributed

    distributed.leave(main())  # a rank that ended with its group skips finalization (distributed.leave)
