"""registry/dapo.gin's clip-higher acts: its upper clip bound (1 + eps_high = 1.28) binds in a real run.

With one optimizer step per rollout batch the ratio pi/pi_old is exactly 1 on every token, so no
clip bound is ever active and `clip.ppo.eps_high = 0.28` changes nothing (issue 21). The spec takes
several minibatch updates per batch, as the paper does; from the second one on the policy has moved,
and some tokens with a positive advantage pass 1.28: the step's `clip/clip_high` (the fraction of
tokens where the upper bound is active, polgrad/components/clip.py) is > 0.
"""

from __future__ import annotations

import json
import os

import gin

from polgrad.config import parse_config
from polgrad.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_clip_higher_binds_in_a_dapo_run(tmp_path):
    gin.clear_config()
    try:
        parse_config(
            [os.path.join(REPO, "registry", "dapo.gin")],
            [
                "train.steps = 1",
                "train.prompts_per_step = 4",
                "train.eval_every = 100",
                "train.eval_size = 16",
                "train.checkpoint_every = 100",
                "train.progress = False",
            ],
        )
        train(str(tmp_path / "run"))
    finally:
        gin.clear_config()
    (row,) = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert row["optimizer_steps"] > 1, row  # several updates on one rollout batch
    assert row["clip/approx_kl"] > 0, row  # the ratio left 1
    assert row["clip/clip_high"] > 0, row  # and the upper bound 1 + eps_high was active
