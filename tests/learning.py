"""The learning check of the end-to-end tests: did a run beat its own starting policy on held-out
prompts, paired prompt by prompt?

A fixed rise of the train reward ("the last 10 steps beat the first 10 by 0.03") is not a test
that holds on every machine: CPUs round differently (AVX2, AVX-512, AMX), so the SFT warm start
differs from one machine to another (held-out accuracy 0.34 on one, 0.52 on another), and a fixed
margin is either vacuous on one machine or out of reach on another; the train reward of 10 steps
of 64 samples also has a standard error (~0.02) of the size of the margin.

Instead each run is its own paired control: the trainer evaluates the starting policy (step 0) and
the final policy greedily on the same held-out prompts and records every prompt's result in
eval.jsonl. A prompt the final policy solves and the start did not is an improvement (b), the
reverse a regression (c); under "no learning" each discordant prompt is either with probability
1/2, so P(Binom(b + c, 1/2) >= b) is an exact one-sided p-value (McNemar's exact test). It
compares the policy with itself on the same prompts, whatever the machine's warm start, and needs
no second training run. The threshold 1e-3 keeps a test that passes by chance at one in a thousand.
"""

from __future__ import annotations

import json
from pathlib import Path

from scipy.stats import binomtest

P_LEARNS = 1e-3  # one-sided exact p below which a run counts as having learned


def held_out_change(run_dir: str | Path) -> dict:
    """Paired change in greedy held-out accuracy from the first record of eval.jsonl (step 0, the
    starting policy) to the last: improved (b), regressed (c) and the exact one-sided p of b vs c."""
    records = [json.loads(line) for line in open(Path(run_dir) / "eval.jsonl") if line.strip()]
    first, last = records[0], records[-1]
    assert first["step"] == 0 and last["step"] > 0, [r["step"] for r in records]
    assert first["prompts"] == last["prompts"], "the evaluations must score the same prompts"
    pairs = list(zip(first["correct"], last["correct"], strict=True))
    b = sum(1 for before, after in pairs if after and not before)
    c = sum(1 for before, after in pairs if before and not after)
    p = binomtest(b, b + c, 0.5, alternative="greater").pvalue if b + c else 1.0
    return {
        "n": len(pairs),
        "before": first["accuracy"],
        "after": last["accuracy"],
        "improved": b,
        "regressed": c,
        "p": p,
    }


def assert_learns(run_dir: str | Path) -> dict:
    """The run's final policy solves significantly more held-out prompts than its start did."""
    ch = held_out_change(run_dir)
    summary = (
        f"held-out accuracy {ch['before']:.3f} -> {ch['after']:.3f} on {ch['n']} prompts: "
        f"{ch['improved']} improved, {ch['regressed']} regressed, exact one-sided p {ch['p']:.2g}"
    )
    print(summary)
    assert ch["p"] < P_LEARNS, summary
    return ch
