"""A stand-in for `python -m polgrad.train` that obeys its command-line contract, for the sweep tests.

    python -m fake_train CONFIG.gin [MORE.gin ...] [--bind 'x = v' ...] [--out DIR] [--resume]

Parses the files and bindings with gin, writes DIR/config.gin, one metrics.jsonl row per step
(flushed), a checkpoint every `checkpoint_every` steps, and summary.json atomically at the end.
Metrics are a deterministic function of (lr, kl, seed, step). `crash_at` makes it fail with a
one-line `error: ...` on stderr (`error_line = False`: a bare exception line instead; `progress_bar`: a
progress bar after it; `kill_signal`: killed by that signal instead of exiting 1); `sleep_s` slows
each step down so tests can catch it running.
`table5` (a dict, default None) goes into summary.json as the Table-5 row, as the trainer writes it;
`status = 'unstable'` makes summary.json say so, as the trainer does when too many steps were skipped.
`warm_start` (a text formatted with {seed} and {lr}, default None: not written) is summary.json's
`warm_start`, the policy the trainer records it started from.
Every start appends a line to DIR/invocations.jsonl (resume flag, first step, OMP_NUM_THREADS,
start and end time, pid, rank) so tests can count launches and see overlap. Imports only gin (fast start).

Under a launcher (RANK / WORLD_SIZE set, e.g. torchrun) every rank runs the steps, but only rank 0
writes config.gin, metrics, checkpoints and summary.json (with `world_size` and `zero_stage`, as
polgrad.train does); `crash_rank` limits `crash_at` to one rank. `--binding` is `--bind` (the
spelling DeepSpeed's launcher needs). Ranks join no process group.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

import gin


@gin.configurable("k1", module="fakekl")
def fake_k1():
    return "k1"


@gin.configurable("k2", module="fakekl")
def fake_k2():
    return "k2"


@gin.configurable("k3", module="fakekl")
def fake_k3():
    return "k3"


@gin.configurable("fake_train")
def settings(
    *,
    steps: int = 4,
    sleep_s: float = 0.0,
    seed: int = 0,
    lr: float = 0.1,
    kl=None,
    crash_at=None,
    crash_message: str = "boom",
    checkpoint_every: int = 2,
    eval_every: int = 2,
    table5=None,
    zero_stage: int = 0,
    crash_rank=None,
    status: str = "ok",
    warm_start=None,
    kill_signal=None,
    progress_bar: bool = False,
    error_line: bool = True,
):
    return dict(
        kill_signal=kill_signal,
        progress_bar=progress_bar,
        error_line=error_line,
        status=status,
        warm_start=None if warm_start is None else str(warm_start).format(seed=seed, lr=lr),
        zero_stage=zero_stage,
        crash_rank=crash_rank,
        steps=steps,
        sleep_s=sleep_s,
        seed=seed,
        lr=lr,
        kl=kl() if callable(kl) else kl,
        crash_at=crash_at,
        crash_message=crash_message,
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        table5=dict(table5) if table5 is not None else None,
    )


def _metrics(cfg: dict, step: int) -> dict:
    key = f"{cfg['lr']}|{cfg['kl']}"
    base = (zlib.crc32(key.encode()) % 1000) / 1000.0  # deterministic per (lr, kl)
    progress = (step + 1) / cfg["steps"]
    reward = round(0.2 + 0.6 * base * progress + 0.01 * cfg["seed"], 6)
    row = {
        "step": step,
        "reward_mean": reward,
        "reward_std": 0.1,
        "kl": round(0.01 * (step + 1) * (1 + base), 6),
        "entropy": round(2.0 - progress, 6),
        "tokens_per_s": 1000.0,
        "response_len": 5.0,
        "peak_mem_mb": 123.0,
        "time_s": 0.1 * (step + 1),
    }
    if (step + 1) % cfg["eval_every"] == 0 or step + 1 == cfg["steps"]:
        row["eval_accuracy"] = round(0.5 * base * progress + 0.02 * cfg["seed"], 6)
    return row


def _atomic_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fake_train")
    ap.add_argument("configs", nargs="+")
    ap.add_argument("--bind", "--binding", action="append", default=[], dest="bind")
    ap.add_argument("--out", default="fake_out")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args(argv)
    try:
        gin.parse_config_files_and_bindings(args.configs, args.bind)
        cfg = settings()
    except Exception as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    out = Path(args.out)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    (out / "checkpoints").mkdir(parents=True, exist_ok=True)
    start = 0
    if args.resume:
        ckpts = sorted(int(p.stem.split("_")[1]) for p in (out / "checkpoints").glob("step_*.json"))
        start = ckpts[-1] if ckpts else 0
    started = time.time()
    with open(out / "invocations.jsonl", "a") as fh:
        fh.write(
            json.dumps(
                {
                    "resume": args.resume,
                    "start_step": start,
                    "t0": started,
                    "omp": os.environ.get("OMP_NUM_THREADS"),
                    "pid": os.getpid(),
                    "rank": rank,
                    "world_size": world_size,
                }
            )
            + "\n"
        )
    if rank != 0:
        return _other_rank(cfg, start, rank)
    (out / "config.gin").write_text(gin.config_str())
    # Resuming: drop rows logged after the checkpoint (they will be logged again).
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists():
        kept = [ln for ln in metrics_path.read_text().splitlines() if ln.strip()]
        kept = [ln for ln in kept if json.loads(ln)["step"] < start]
        metrics_path.write_text("".join(ln + "\n" for ln in kept))
    print(
        f"fake_train: steps {start}..{cfg['steps'] - 1}, kl={cfg['kl']}, lr={cfg['lr']}, seed={cfg['seed']}"
    )
    rows = []
    with open(metrics_path, "a") as fh:
        for step in range(start, cfg["steps"]):
            if cfg["crash_at"] is not None and step == cfg["crash_at"] and cfg["crash_rank"] in (None, 0):
                return _crash(cfg, step)
            time.sleep(cfg["sleep_s"])
            row = _metrics(cfg, step)
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            if (step + 1) % cfg["checkpoint_every"] == 0:
                _atomic_json(out / "checkpoints" / f"step_{step + 1}.json", {"step": step + 1})
    last = _metrics(cfg, cfg["steps"] - 1)
    evals = [_metrics(cfg, s) for s in range(cfg["steps"])]
    summary = {
        "status": cfg["status"],
        "steps": cfg["steps"],
        "final_train_reward": sum(_metrics(cfg, s)["reward_mean"] for s in range(cfg["steps"])[-2:])
        / min(2, cfg["steps"]),
        "eval_accuracy": [r["eval_accuracy"] for r in evals if "eval_accuracy" in r][-1],
        "kl": last["kl"],
        "entropy": last["entropy"],
        "tokens_per_s": 1000.0,
        "wall_time_s": round(0.1 * cfg["steps"], 6),
        "peak_mem_mb": 123.0,
        "world_size": world_size,
        "zero_stage": cfg["zero_stage"],
    }
    if cfg["status"] == "unstable":  # as polgrad.train says it (train.unstable_skip_frac)
        summary["unstable"] = f"unstable: {cfg['steps'] - 1} of {cfg['steps']} optimizer steps skipped"
    if cfg["warm_start"] is not None:  # as polgrad.train records the policy it started from
        summary["warm_start"] = cfg["warm_start"]
    if cfg["table5"] is not None:  # what polgrad.train writes: the Algorithm's Table-5 row
        summary["table5"] = cfg["table5"]
    with open(out / "invocations.jsonl", "a") as fh:
        fh.write(json.dumps({"end": time.time(), "pid": os.getpid()}) + "\n")
    _atomic_json(out / "summary.json", summary)
    return 0


def _crash(cfg: dict, step: int) -> int:
    """The crash at `step`: a traceback and the one-line `error:` (or, with `error_line` False, the
    exception's own last line), then a progress bar on stderr (`progress_bar`: as HF's loading bars
    draw it, carriage returns and all), then exit 1, or death by `kill_signal` (as the OOM killer's)."""
    print("Traceback (most recent call last): ...", file=sys.stderr)
    message = f"{cfg['crash_message']} at step {step}"
    print(f"error: {message}" if cfg["error_line"] else f"RuntimeError: {message}", file=sys.stderr)
    if cfg["progress_bar"]:
        sys.stderr.write("\rLoading weights:   0%|          | 0/3 [00:00<?, ?it/s]")
        sys.stderr.write("\rLoading weights: 100%|##########| 3/3 [00:00<00:00, 99.0it/s]\n")
    sys.stderr.flush()
    if cfg["kill_signal"]:
        os.kill(os.getpid(), cfg["kill_signal"])
        time.sleep(10)  # the signal ends it
    return 1


def _other_rank(cfg: dict, start: int, rank: int) -> int:
    """A rank other than 0: the same steps (and crash), nothing written."""
    for step in range(start, cfg["steps"]):
        if cfg["crash_at"] is not None and step == cfg["crash_at"] and cfg["crash_rank"] in (None, rank):
            print(f"error: {cfg['crash_message']} at step {step} on rank {rank}", file=sys.stderr)
            return 1
        time.sleep(cfg["sleep_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
