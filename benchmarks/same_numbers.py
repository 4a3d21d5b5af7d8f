"""Does a refactor change a run's numbers? The same short runs at two commits, compared bit for bit.

    python -m benchmarks.same_numbers --before c806995 --after HEAD

Each commit is checked out in its own git worktree and runs, from there and with its own empty
warm-start cache (so each builds its SFT policy and reward model with its own code), six runs of 6
steps with fixed seeds: GRPO, PPO, LoRA-PPO, DPO, GRPO with asynchronous rollouts (staleness 1) and
PPO on a reward model (the sort task's preference pairs). For every run it compares:

- metrics.jsonl, row by row, every key but the timing ones (`time*`, `*_s`, peak_mem_mb);
- summary.json, every key but the timing ones;
- every tensor of every `*.safetensors` under final/ (the policy, and the critic where there is one),
  with `torch.equal`.

It prints one line per run and writes `same_numbers.md` under --out; the exit status is 1 when any run
differs. A refactor that should not change float order must show "identical" on all six; one that
does (e.g. chunked log-probs) is compared with both sides built that way. The CPU is named in the
report: bit-identity holds on one machine, not across kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAST = ["train.steps = 6", "train.eval_every = 6", "train.eval_size = 16", "train.seed = 0"]
SMALL = ["train.prompts_per_step = 2", "Algorithm.group_size = 4"]
CASES: dict[str, tuple[str, list[str]]] = {
    "grpo": ("registry/grpo.gin", FAST + SMALL),
    "ppo": ("registry/ppo.gin", FAST + ["train.prompts_per_step = 4"]),
    "lora_ppo": ("registry/ppo_lora.gin", FAST + ["train.prompts_per_step = 4"]),
    "dpo": ("registry/dpo.gin", FAST),
    "async_grpo": ("registry/grpo.gin", FAST + SMALL + ["train.max_staleness = 1"]),
    "reward_model_ppo": (
        "registry/ppo.gin",
        FAST
        + ["train.prompts_per_step = 4", "train.task = @task.sort", "train.reward_source = 'reward_model'"],
    ),
}
# Beside the six: one run per optional role the six leave out (a refactor of the step's roles is
# checked on each): ReMax's greedy baseline, DAPO's dynamic sampling, an exact-KL part that needs the
# full logits, a critic warm-up, and an off-policy correction that recomputes π_old (clip.tis).
ROLES: dict[str, tuple[str, list[str]]] = {
    "remax": ("registry/remax.gin", FAST + SMALL),
    "dapo": ("registry/dapo.gin", FAST + SMALL),
    "grpo_kl_full": ("registry/grpo.gin", FAST + SMALL + ["Algorithm.kl = @kl.full"]),
    "ppo_warmup": (
        "registry/ppo.gin",
        FAST + ["train.prompts_per_step = 4", "train.critic_warmup_steps = 2"],
    ),
    "grpo_tis": ("registry/grpo.gin", FAST + SMALL + ["Algorithm.clip = @clip.tis"]),
}
CASES.update(ROLES)


def _timing(key: str) -> bool:
    """A wall-clock or memory figure (time_gen, rollout_wait_s, tokens_per_s, peak_mem_mb): it differs
    between any two runs, so it is not compared."""
    return key.startswith("time") or key.endswith("_s") or key == "peak_mem_mb"


def _untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not _timing(k)}


def _worktree(ref: str, root: Path) -> Path:
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=REPO, capture_output=True, text=True
    )
    if sha.returncode != 0:
        raise SystemExit(f"error: {ref!r} is not a commit of {REPO}: {sha.stderr.strip()}")
    path = root / sha.stdout.strip()[:12]
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), sha.stdout.strip()], cwd=REPO,
                       check=True, capture_output=True)  # fmt: skip
    return path


def _run(tree: Path, name: str, out: Path, cache: Path) -> Path:
    spec, bindings = CASES[name]
    run_dir = out / name
    if (run_dir / "summary.json").exists():
        return run_dir  # a re-run of the script keeps what finished
    cmd = [sys.executable, "-m", "polgrad.train", spec, "--out", str(run_dir), "--no-progress"]
    for b in bindings:
        cmd += ["--bind", b]
    env = {**os.environ, "PYTHONPATH": str(tree), "POLGRAD_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"error: {name} at {tree.name} failed: {tail}")
    return run_dir


def _differences(a: Path, b: Path) -> list[str]:
    """Where two run folders differ (empty: identical), the first few of each kind."""
    import torch
    from safetensors.torch import load_file

    out: list[str] = []
    rows_a = [_untimed(json.loads(x)) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rows_b = [_untimed(json.loads(x)) for x in (b / "metrics.jsonl").read_text().splitlines()]
    if len(rows_a) != len(rows_b):
        out.append(f"metrics.jsonl: {len(rows_a)} rows vs {len(rows_b)}")
    for ra, rb in zip(rows_a, rows_b, strict=False):
        for k in sorted(ra.keys() | rb.keys()):
            if ra.get(k) != rb.get(k):
                out.append(f"metrics step {ra.get('step')} {k}: {ra.get(k)!r} vs {rb.get(k)!r}")
    sa, sb = (_untimed(json.loads((d / "summary.json").read_text())) for d in (a, b))
    out += [
        f"summary {k}: {sa.get(k)!r} vs {sb.get(k)!r}"
        for k in sorted(sa.keys() | sb.keys())
        if sa.get(k) != sb.get(k)
    ]
    files_a = sorted(p.relative_to(a) for p in (a / "final").rglob("*.safetensors"))
    files_b = sorted(p.relative_to(b) for p in (b / "final").rglob("*.safetensors"))
    if files_a != files_b or not files_a:
        out.append(f"final/ weight files: {[str(f) for f in files_a]} vs {[str(f) for f in files_b]}")
    for f in set(files_a) & set(files_b):
        ta, tb = load_file(str(a / f)), load_file(str(b / f))
        bad = sorted(
            k for k in ta.keys() | tb.keys() if k not in ta or k not in tb or not torch.equal(ta[k], tb[k])
        )
        if bad:
            out.append(f"{f}: {len(bad)} of {len(ta)} tensors differ (first: {bad[0]})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a commit (sha, tag, branch)")
    ap.add_argument("--after", default="HEAD", help="a commit (default HEAD)")
    ap.add_argument("--out", default=None, help="where the runs and same_numbers.md go (default: a temp dir)")
    ap.add_argument("--only", default=",".join(CASES), help=f"comma-separated cases of {', '.join(CASES)}")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"error: unknown case {unknown[0]!r}; valid: {', '.join(CASES)}")
    out = Path(args.out or tempfile.mkdtemp(prefix="same_numbers_")).resolve()
    trees = {
        side: _worktree(ref, out / "trees") for side, ref in (("before", args.before), ("after", args.after))
    }
    from polgrad.machine import cpu_label

    lines = [
        f"# Same numbers: {args.before} ({trees['before'].name}) vs {args.after} ({trees['after'].name})",
        "",
        f"CPU: {cpu_label()}. Each side with its own warm-start cache; {FAST[0]}, seed 0.",
        "",
        "| run | result |",
        "|---|---|",
    ]
    differs = False
    for name in cases:
        dirs = [_run(trees[s], name, out / s, out / f"cache_{s}") for s in ("before", "after")]
        diff = _differences(*dirs)
        differs |= bool(diff)
        result = "identical (metrics, summary, final/ weights)" if not diff else "; ".join(diff[:3])
        print(f"{name:<18} {result}", flush=True)
        lines.append(f"| {name} | {result} |")
    for tree in trees.values():  # the checkouts go; the runs stay under --out (a re-run reuses them)
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    (out / "same_numbers.md").write_text("\n".join(lines) + "\n")
    print(f"report: {out / 'same_numbers.md'}")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
