"""train.compile: the compiled hot paths agree with the eager ones to float tolerance.

Inductor fuses and reorders float operations, so the compiled path is not bit-identical to the eager
one; the eager path (train.compile = False, the default) is not touched by any of it.
"""

from __future__ import annotations

import json
import os

import gin
import pytest
import torch

from polgrad import registry
from polgrad.config import parse_config
from polgrad.models import build_tiny, compiled, encode_prompts, position_ids_from_mask
from polgrad.rollout.static_decode import StaticDecoder

pytestmark = pytest.mark.cpu_matrix

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _decoders(model, tok, prompts: list[str], rows: torch.Tensor, length: int):
    from transformers import DynamicCache

    ids, pmask = encode_prompts(tok, prompts)
    decoders = []
    for flag in (False, True):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(
                input_ids=ids,
                attention_mask=pmask.long(),
                position_ids=position_ids_from_mask(pmask),
                past_key_values=cache,
                use_cache=True,
            )
        dec = StaticDecoder(model, len(rows), ids.shape[1] + length, compiled=flag)
        dec.load_prefill(cache, pmask[rows].long(), rows)
        decoders.append(dec)
    start = position_ids_from_mask(pmask[rows].long())[:, -1] + 1
    return decoders, start


def test_the_compiled_decode_step_gives_the_eager_steps_logits():
    """Teacher-forced through 12 tokens of 6 rows (2 prompts of different lengths, left-padded): the
    compiled fixed-shape step (whole cache under the key mask) and the eager step give the same
    logits to float error."""
    task = registry.get("task", "add")()
    model, tok = build_tiny(task, seed=0)
    model.eval()
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    (eager, comp), start = _decoders(model, tok, ["1+2=", "12+34="], rows, 12)
    tokens = torch.randint(0, model.config.vocab_size, (6, 12), generator=torch.Generator().manual_seed(0))
    for i in range(12):
        a = eager.step(tokens[:, i], start + i)
        b = comp.step(tokens[:, i], start + i)
        # fp32 logits of size ~1-10: summation order differs (measured ~5e-7); 1e-4 absolute is
        # far below any change a wrong mask, position or cache write makes (>= 1e-2)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    assert comp.t == eager.t


def _run(tmp_path, name: str, bindings: list[str]):
    from polgrad.train import run as train

    gin.clear_config()
    parse_config(
        [os.path.join(REPO, "registry", "ppo.gin")],
        ["train.steps = 3", "train.prompts_per_step = 8", "train.eval_every = 3", "train.eval_size = 16",
         "train.checkpoint_every = 100", "train.progress = False", *bindings],
    )  # fmt: skip
    try:
        train(str(tmp_path / name))
    finally:
        gin.clear_config()
    rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    from polgrad.models import load_policy

    return rows, load_policy(str(tmp_path / name / "final")).state_dict()


@pytest.mark.slow
def test_a_compiled_ppo_run_trains_as_the_eager_one_to_float_tolerance(tmp_path, monkeypatch):
    """PPO (policy, reference and critic compiled; sampling, reference, critic and training
    forwards, the backward, the decode step) for 3 steps against the same run eager: the same
    samples and rewards, losses and weights equal to float tolerance."""
    from polgrad.rollout import static_decode

    seen, steps = [], []
    real, real_step = compiled.compile_models, static_decode._compiled_step

    def spy(*modules):
        real(*modules)
        seen.append(sum(compiled.is_compiled(m) for m in modules if m is not None))

    monkeypatch.setattr(compiled, "compile_models", spy)
    monkeypatch.setattr(static_decode, "_compiled_step", lambda: (steps.append(1), real_step())[1])
    eager, w_eager = _run(tmp_path, "eager", [])
    assert seen == [] and steps == []
    comp, w_comp = _run(tmp_path, "compiled", ["train.compile = True"])
    assert seen == [3] and len(steps) >= 3  # policy, reference, critic; the decode steps of every rollout
    for a, b in zip(eager, comp, strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["response_len"] == b["response_len"]
        for key in ("pg_loss", "value_loss", "kl_exact", "entropy"):
            # float64 losses of float32 forwards that round differently (~1e-7 relative)
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert eager[-1]["eval_accuracy"] == comp[-1]["eval_accuracy"]
    for k in w_eager:  # 3 AdamW steps of lr 1e-4-scale moves: weights agree far below one step
        torch.testing.assert_close(w_comp[k], w_eager[k], rtol=0, atol=1e-5)
