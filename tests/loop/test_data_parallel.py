"""Data parallelism: one trainer step at world size 2 is one step at world size 1 on both batches.

tests/dp_worker.py runs, under torchrun (2 CPU processes, gloo), the trainer's own functions
(`build_models`, `collect_kept`, `Algorithm.prepare`, `update`) for one optimizer step at each
ZeRO stage, and then, in one plain process at world size 1 and stage 0, the same `prepare` and
`update` on the two ranks' batches concatenated. What must hold:

- the ranks sampled different prompts (each rank's step seed includes its rank);
- advantages: rank r's rows equal the reference's rows of rank r's part (group statistics are
  rank-local, batch statistics such as REINFORCE++'s and PPO's whitening are reduced over ranks);
- the logged update metrics, batch metrics and the step's metrics row (reward mean and std,
  accuracy, response length, KL per token and per sequence, explained variance) of each rank equal
  the reference's (reduced over ranks, not per-rank shares or per-rank batches);
- the reduced gradient of the step and the weights after it equal the reference's.

Tolerances. Both sides run the same forwards in fp32 on the same rows; they differ only in how
rows are grouped into micro-batches (12+12+8 per rank vs 12x5+4) and in the order in which the
per-token terms, micro-batches and ranks are summed. Each gradient entry is a sum of ~10^3-10^4
fp32 terms, so its rounding error is at most ~n * 2^-24 ~ 1e-4 relative to the sum of |terms|, in
practice (random-walk accumulation) ~sqrt(n) * 2^-24 ~ 1e-5 of the largest gradient: we allow
1e-5 * max|g_ref|. A wrong reduction is an error of order the gradient itself (a rank's share is
about half of it; a per-micro-batch denominator or a ZeRO-3 overwrite of the accumulated gradient
changes it by tens of percent), so the check is five orders of magnitude from what it guards.
Weights: Adam's first step moves a weight by lr * g / (|g| + eps) (bias-corrected m = g, v = g^2),
eps = 1e-4 in the worker; its derivative in g is at most lr / eps per unit of gradient, so a
gradient error of GRAD_REL * max|g| moves a weight by at most (lr / eps) * GRAD_REL * max|g_ref|
(computed per case below, ~2e-5 here).
Update metrics (pg_loss, entropy, clip fractions, KL and value losses) are float64 means of
per-token terms taken from the fp32 forwards of the update, whose micro-batches differ between
the sides, so they carry the same fp32 rounding as the gradient: UPDATE_REL = 1e-5 relative, and
an absolute floor of 1e-9 for metrics that are ~0 (e.g. an approx-KL of 1e-13 on the first step).
A metric that is a cancellation of O(1) terms is compared relative to the size of its terms, not
its own size: on-policy GRPO's pg_loss is the mean of -ratio * adv with advantages that sum to
zero in each group, so the metric is ~1e-8 while each term is O(max|adv|). Its fp32 rounding is
that of the terms (2^-24 * |term| each, summed in another order on the other side), which depends
on how the CPU's kernels sum (AVX2 and AMX builds differ by ~4e-8 here), so the bound is
UPDATE_REL * 2 * max|adv| (the step is on-policy, one epoch of one minibatch, so the ratio is 1 up
to rounding and |term| = |adv|; the factor 2 is margin). Every spec here has advantages that
cancel (group-normalised, or whitened over the batch for ppo and reinforce_pp). A wrong
reduction cannot show in such a metric (it stays ~0); the gradient check below is the one that
guards it. Likewise the float64 adv_mean is compared relative to max|adv|.
Everything computed before the update (advantages, batch metrics, rewards, KL to the reference,
explained variance) comes from the very tensors each rank collected, in float64 on both sides, so
only the order of float64 sums differs: F64_REL = 1e-9 relative (a floor of 1e-12).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cpu_matrix

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "dp_worker.py"
GRAD_REL, UPDATE_REL, F64_REL = 1e-5, 1e-5, 1e-9  # see the module docstring
LR, ADAM_EPS = 1e-3, 1e-4  # the worker's train.lr and train.adam_eps

# spec -> ZeRO stages: GRPO (group statistics, KL in the loss) at every stage; the others where
# their batch statistics, critic and dynamic sampling meet the partitioned and unpartitioned cases.
# reinforce+rwhiten: REINFORCE with the task scores whitened over the batch first (reward_shaping.whiten).
# ppo_lora: the LoRA critic in the policy's engine (shared adapter; +own: the critic's own adapter).
CASES = {
    "grpo": "0,1,2,3",
    "ppo": "0,3",
    "reinforce_pp": "0,3",
    "dapo": "0,3",
    "reinforce+rwhiten": "2",
    "ppo_lora": "0,3",
    "ppo_lora+own": "2",
}


def _run(args: list[str], cwd: Path, timeout: int = 900) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
    }
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args[-4:])} failed:\n{proc.stderr[-3000:]}"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dp")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cases = ";".join(f"{spec}={stages}" for spec, stages in CASES.items())  # one launch for all of them
    _run([*launcher, str(WORKER), str(out), cases], cwd=out)
    _run([sys.executable, str(WORKER), str(out), cases, "--reference"], cwd=out)
    return out


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _close(a: float, b: float, rel: float, scale: float = 0.0) -> bool:
    """|a - b| within `rel` of the larger of |a|, |b| and `scale` (the size of the summed terms)."""
    return abs(a - b) <= rel * max(abs(a), abs(b), scale, 1e-12)


PARAMS = [(spec, int(s)) for spec, stages in CASES.items() for s in stages.split(",")]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "stage"), PARAMS, ids=[f"{s}-zero{z}" for s, z in PARAMS])
def test_a_step_at_world_size_2_is_a_step_on_the_concatenated_batch(outputs, spec, stage):
    ranks = [_load(outputs / f"{spec}_stage{stage}_rank{r}.pt") for r in (0, 1)]
    ref = _load(outputs / f"{spec}_stage{stage}_reference.pt")
    assert [r["world_size"] for r in ranks] == [2, 2]
    # each rank sampled its own prompts
    assert ranks[0]["prompts"] != ranks[1]["prompts"]

    # advantages: rank r's rows are the reference's rows of part r (columns padded to the longest)
    n0 = ranks[0]["adv"].shape[0]
    for r, rows in ((0, slice(0, n0)), (1, slice(n0, None))):
        adv, want = ranks[r]["adv"], ref["adv"][rows]
        assert adv.shape[0] == want.shape[0]
        t = adv.shape[1]
        assert torch.all(want[:, t:] == 0)
        err = (adv - want[:, :t]).abs().max().item()
        assert err <= F64_REL * max(want.abs().max().item(), 1e-12), (
            f"rank {r} advantages differ by {err:.3g}"
        )

    # metrics: every rank logs the reference's numbers (not its own share or its own batch's):
    # the update's metrics, the batch metrics of prepare, and the step's metrics row (rewards of
    # every sample, KL per token and per sequence, explained variance; no timings in it)
    # metrics that cancel: the size of their terms (see the module docstring)
    max_adv = ref["adv"].abs().max().item()
    term_scale = {"pg_loss": 2.0 * max_adv, "adv_mean": max_adv}
    for r in ranks:
        assert r["n_updates"] == ref["n_updates"] and r["skipped"] == ref["skipped"] == 0
        for source in ("metrics", "prep", "row"):
            assert set(r[source]) == set(ref[source])
            for k, v in ref[source].items():
                got = r[source][k]
                if k in ref["metrics"]:  # from the update's fp32 forwards
                    ok = _close(got, v, UPDATE_REL, term_scale.get(k, 0.0)) or abs(got - v) <= 1e-9
                else:
                    ok = got == v or _close(got, v, F64_REL, term_scale.get(k, 0.0)) or abs(got - v) <= 1e-12
                assert ok, (source, k, got, v)

    # the reduced gradient of the step, and the weights after it
    g_ref = ref["grads"]
    scale = max(g.abs().max().item() for g in g_ref.values())
    for r in ranks:
        err = {n: (r["grads"][n].reshape(g.shape) - g).abs().max().item() for n, g in g_ref.items()}
        worst = max(err, key=err.get)
        assert err[worst] <= GRAD_REL * scale, f"{worst}: gradient error {err[worst]:.3g}, scale {scale:.3g}"
        param_atol = (LR / ADAM_EPS) * GRAD_REL * scale
        perr = {n: (r["params"][n] - p).abs().max().item() for n, p in ref["params"].items()}
        worst = max(perr, key=perr.get)
        assert perr[worst] <= param_atol, f"{worst}: weight error {perr[worst]:.3g} > {param_atol:.3g}"
