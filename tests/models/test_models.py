"""Models: the character tokenizer, the tiny preset, the cached SFT warm start (hit, key, atomicity),
loading, the scalar-head model, the Bradley-Terry reward model and the value_init builders."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import gin
import pytest
import torch
from transformers import AutoTokenizer

import polgrad
from polgrad import models, pretrain
from polgrad.config_parts import part
from polgrad.errors import ConfigError, DataError
from polgrad.models import ScalarHeadModel, build_tiny, build_tokenizer, encode_prompts, encode_sequences
from polgrad.pretrain import reward_model as rm_module
from polgrad.pretrain import sft as sft_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def add_task():
    return polgrad.get("task", "add")()


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory, add_task):
    """An untrained tiny policy saved like a warm start (model + tokenizer)."""
    path = tmp_path_factory.mktemp("policy")
    model, tok = build_tiny(add_task, seed=1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory, policy_dir):
    path = tmp_path_factory.mktemp("rm")
    ScalarHeadModel.from_backbone(policy_dir, head_init_std=0.3, seed=2).save_pretrained(path)
    models.load_tokenizer(policy_dir).save_pretrained(path)
    return str(path)


def _ids():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 16, (3, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row
    return ids, mask


# --- tokenizer --------------------------------------------------------------------------------


def test_tokenizer_round_trip_and_reload(tmp_path):
    alphabet = "0123456789+= \nab"
    tok = build_tokenizer(alphabet)
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id] == [0, 1, 2, 3]
    assert len(tok) == 4 + len(alphabet)
    text = "12+ 3=\nab"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1  # BOS + one token per character
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok(text, add_special_tokens=False)["input_ids"] == ids[1:]
    assert tok("1?")["input_ids"][-1] == tok.unk_token_id
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again(text)["input_ids"] == ids
    assert again.decode(ids + [tok.eos_token_id, tok.pad_token_id], skip_special_tokens=True) == text
    assert (again.pad_token_id, again.bos_token_id, again.eos_token_id) == (0, 1, 2)
    assert again.padding_side == "left"
    assert again.get_vocab() == tok.get_vocab()
    with pytest.raises(ConfigError):
        build_tokenizer("")


def test_encoders_pad_and_mask():
    tok = build_tokenizer("0123456789+=")
    ids, mask = encode_prompts(tok, ["1+2=", "10+20="])
    assert ids.shape == mask.shape == (2, 7)
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 1, 1] and ids[0, :2].tolist() == [0, 0] and ids[0, 2] == 1
    ids, attn, resp = encode_sequences(tok, ["1+2=", "10+20="], ["3", "30"])
    three = tok("3", add_special_tokens=False)["input_ids"]
    assert ids[0].tolist() == tok("1+2=")["input_ids"] + three + [2, 0, 0, 0]  # BOS 1+2= 3 EOS PAD...
    assert attn[0].tolist() == [1] * 7 + [0, 0, 0] and resp[0].tolist() == [0] * 5 + [1, 1, 0, 0, 0]
    assert resp[1].tolist() == [0] * 7 + [1, 1, 1]


# --- tiny preset ------------------------------------------------------------------------------


def test_tiny_model_size_head_dim_and_seed(add_task):
    model, tok = build_tiny(add_task)
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    assert 200_000 <= n <= 5_000_000, n
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads >= 32
    assert cfg.vocab_size == len(tok) and cfg.eos_token_id == tok.eos_token_id
    assert cfg._attn_implementation in ("sdpa", "eager")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert cfg.max_position_embeddings >= 2 + add_task.max_prompt_chars + add_task.max_response_chars
    same, _ = build_tiny(add_task)
    other, _ = build_tiny(add_task, seed=1)
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(model.state_dict()[w], same.state_dict()[w])
    assert not torch.equal(model.state_dict()[w], other.state_dict()[w])
    with pytest.raises(ConfigError, match="head_dim"):
        build_tiny(add_task, heads=8)


# --- SFT cache --------------------------------------------------------------------------------

SMALL = {"sft_steps": 3, "batch_size": 8, "target_accuracy": None, "progress": False}
ONE_LAYER = {"layers": 1}


def test_sft_cache_hit_and_key(tmp_path, monkeypatch):
    path = pretrain.warm_start("add", {"digits": 1}, ONE_LAYER, seed=0, cache_dir=tmp_path, **SMALL)
    info = models.read_info(path)
    assert info["stats"]["steps"] == 3 and info["task"] == "add" and info["model_kwargs"]["layers"] == 1
    assert 0.0 <= info["stats"]["heldout_greedy_accuracy"] <= 1.0
    assert (tmp_path / "sft").is_dir() and path.startswith(str(tmp_path / "sft"))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "polgrad.json"):
        assert (tmp_path / "sft" / path.rsplit("/", 1)[1] / f).is_file()

    def boom(*a, **k):
        raise AssertionError("a cache hit must not train")

    monkeypatch.setattr(sft_module, "_sft", boom)
    t0 = time.perf_counter()
    assert pretrain.warm_start("add", {"digits": 1}, ONE_LAYER, seed=0, cache_dir=tmp_path, **SMALL) == path
    assert time.perf_counter() - t0 < 5.0
    # spelling out a default model kwarg is the same key; progress/threads are not part of it
    same = dict(SMALL, progress=True, threads=2)
    assert (
        pretrain.warm_start(
            "add", {"digits": 1}, {**ONE_LAYER, "hidden": 128}, seed=0, cache_dir=tmp_path, **same
        )
        == path
    )
    # so is a default task kwarg, spelled out or left implicit: the key holds the task's full
    # configuration, as the trainer's config builds it (train_config.TrainConfig.task_kwargs)
    spelled = {"digits": 1, "reverse": False, "partial": False}
    assert pretrain.warm_start("add", spelled, ONE_LAYER, seed=0, cache_dir=tmp_path, **SMALL) == path
    assert info["task_kwargs"] == {"digits": 1, "reverse": False, "pad": False, "partial": False,
                                   "eval_fraction": 0.1}  # fmt: skip
    monkeypatch.undo()
    other = pretrain.warm_start("add", {"digits": 1}, ONE_LAYER, seed=1, cache_dir=tmp_path, **SMALL)
    assert other != path
    with pytest.raises(ConfigError, match="unknown model kwargs"):
        pretrain.warm_start("add", {}, {"width": 3}, cache_dir=tmp_path, **SMALL)


def test_sft_cache_is_atomic(tmp_path, monkeypatch):
    def killed(*a, **k):
        raise RuntimeError("simulated crash after the weights were written")

    monkeypatch.setattr(sft_module, "write_info", killed)
    with pytest.raises(RuntimeError, match="simulated crash"):
        pretrain.warm_start("add", {"digits": 1}, ONE_LAYER, seed=0, cache_dir=tmp_path, **SMALL)
    monkeypatch.undo()
    root = tmp_path / "sft"
    assert [p.name for p in root.iterdir() if p.is_dir()] == []  # no entry, no tmp dir left
    path = pretrain.warm_start("add", {"digits": 1}, ONE_LAYER, seed=0, cache_dir=tmp_path, **SMALL)
    name = path.rsplit("/", 1)[1]
    # a run killed with SIGKILL leaves only its tmp dir: the next call cleans it and never trusts it
    import shutil

    shutil.rmtree(path)
    stale = root / f".tmp-{name}-99999-deadbeef"
    stale.mkdir()
    (stale / "config.json").write_text("{half")
    assert pretrain.warm_start("add", {"digits": 1}, ONE_LAYER, seed=0, cache_dir=tmp_path, **SMALL) == path
    assert not stale.exists() and (root / name / "polgrad.json").is_file()


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("POLGRAD_CACHE", str(tmp_path / "c"))
    assert models.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("POLGRAD_CACHE")
    assert models.default_cache_dir().parts[-2:] == (".cache", "polgrad")


@pytest.mark.slow
def test_warm_start_beats_untrained(tmp_path, add_task):
    # the default warm start (the trainer's for task.add), from the shared cache most runs start from
    path = pretrain.warm_start("add", {"digits": 2}, {}, seed=0, progress=False)
    stats = models.read_info(path)["stats"]
    untrained, tok = build_tiny(add_task, seed=0)
    base = pretrain.heldout_accuracy(untrained.eval(), tok, add_task, n=pretrain.SFT_EVAL_EXAMPLES, seed=0)
    assert stats["stopped_at_target"], stats["probe_history"]
    assert stats["heldout_greedy_accuracy"] >= base + 0.08, (stats, base)
    again = pretrain.heldout_accuracy(
        models.load_reference(path),
        models.load_tokenizer(path),
        add_task,
        n=pretrain.SFT_EVAL_EXAMPLES,
        seed=0,
    )
    assert again == stats["heldout_greedy_accuracy"]  # the saved checkpoint is the evaluated one


# --- loading ----------------------------------------------------------------------------------


def test_load_policy_and_reference(policy_dir):
    policy, ref = models.load_policy(policy_dir), models.load_reference(policy_dir)
    assert policy.training and all(p.requires_grad for p in policy.parameters())
    assert not ref.training and not any(p.requires_grad for p in ref.parameters())
    ids, mask = _ids()
    with torch.no_grad():
        assert torch.equal(
            policy(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits
        )
    with pytest.raises(DataError):
        models.load_policy(policy_dir + "/nope")


def test_scalar_head_save_load_round_trip(tmp_path, policy_dir):
    m = ScalarHeadModel.from_backbone(policy_dir, head_init_std=0.5, seed=3).eval()
    ids, mask = _ids()
    with torch.no_grad():
        v = m(ids, mask)
    assert v.shape == ids.shape and v.dtype == torch.float32
    m.save_pretrained(tmp_path / "sh")
    assert (tmp_path / "sh" / models.HEAD_FILE).is_file()
    back = ScalarHeadModel.from_pretrained(tmp_path / "sh").eval()
    with torch.no_grad():
        assert torch.equal(back(ids, mask), v)
    rm = models.load_reward_model(tmp_path / "sh")
    assert not rm.training and not any(p.requires_grad for p in rm.parameters())
    with pytest.raises(DataError, match="value_head"):
        ScalarHeadModel.from_pretrained(policy_dir)
    # left padding does not change a row's values (positions count attended tokens only)
    with torch.no_grad():
        alone = m(ids[:1, 2:], mask[:1, 2:])
    assert torch.allclose(alone[0], v[0, 2:], atol=1e-5)


# --- reward model -----------------------------------------------------------------------------


@pytest.mark.slow
def test_reward_model_beats_chance_and_is_cached(tmp_path, monkeypatch):
    sort = polgrad.get("task", "sort")()
    # the default sort warm start, from the shared cache (the trainer's reward-model tests use it too)
    policy = pretrain.warm_start("sort", {}, {}, seed=0, progress=False)
    # the default reward model (the trainer's for task.sort), shared with the reward-model runs' tests
    path, acc = pretrain.train_reward_model(policy, sort, seed=0, progress=False)
    info = models.read_info(path)
    assert acc == info["stats"]["heldout_pairwise_accuracy"] and info["stats"]["heldout_pairs"] >= 256
    assert acc >= 0.7, info["stats"]
    rm = models.load_reward_model(path)
    tok = models.load_tokenizer(path)
    held = sort.preference_pairs(64, 123)
    assert pretrain.pairwise_accuracy(rm, tok, held) > 0.6
    monkeypatch.setattr(rm_module, "_train_rm", lambda *a, **k: pytest.fail("a cache hit must not train"))
    assert pretrain.train_reward_model(policy, "sort", seed=0, progress=False) == (path, acc)


# --- value_init -------------------------------------------------------------------------------


def _backbone_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_value_init_policy_shares_backbone_with_fresh_head(policy_dir, rm_dir):
    critic = polgrad.get("value_init", "policy")(policy_path=policy_dir, reward_model_path=None)
    assert isinstance(critic, ScalarHeadModel) and critic.training
    assert all(p.requires_grad for p in critic.parameters())
    assert _backbone_equal(critic.backbone, models.load_policy(policy_dir).model)
    ids, mask = _ids()
    values = critic(ids, mask)
    assert values.shape == ids.shape and (values == 0).all()  # zero head: V = 0 at step 0
    values.sum().backward()
    assert critic.head.weight.grad is not None and critic.head.weight.grad.abs().sum() > 0
    gin.bind_parameter("value_init.policy.head_init_std", 0.1)
    noisy = part("value_init", "policy")(policy_path=policy_dir, reward_model_path=rm_dir)
    assert noisy(ids, mask).abs().sum() > 0
    with pytest.raises(ConfigError):
        polgrad.get("value_init", "policy")(
            policy_path=policy_dir, reward_model_path=None, head_init_std=-1.0
        )


def test_value_init_random_differs_and_is_seeded(policy_dir):
    make = polgrad.get("value_init", "random")
    a = make(policy_path=policy_dir, reward_model_path=None)
    b = make(policy_path=policy_dir, reward_model_path=None)
    c = make(policy_path=policy_dir, reward_model_path=None, seed=1)
    assert type(a.backbone) is type(models.load_policy(policy_dir).model)
    assert not _backbone_equal(a.backbone, models.load_policy(policy_dir).model)
    assert _backbone_equal(a.backbone, b.backbone) and not _backbone_equal(a.backbone, c.backbone)
    ids, mask = _ids()
    assert a(ids, mask).shape == ids.shape and a.training


def test_value_init_reward_model(policy_dir, rm_dir):
    critic = polgrad.get("value_init", "reward_model")(policy_path=policy_dir, reward_model_path=rm_dir)
    rm = models.load_reward_model(rm_dir)
    ids, mask = _ids()
    assert critic.training and all(p.requires_grad for p in critic.parameters())
    with torch.no_grad():
        assert torch.equal(critic(ids, mask), rm(ids, mask))
    assert critic.head.weight.data_ptr() != rm.head.weight.data_ptr()  # a copy, not the frozen RM
    with pytest.raises(ConfigError, match=r"value_init\.reward_model") as err:
        polgrad.get("value_init", "reward_model")(policy_path=policy_dir, reward_model_path=None)
    assert "\n" not in str(err.value)


def test_importing_components_does_not_import_transformers():
    code = "import sys, polgrad.components; sys.exit('transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_polgrad_json_is_plain_json(tmp_path):
    path = pretrain.warm_start("add", {"digits": 1}, ONE_LAYER, seed=0, cache_dir=tmp_path, **SMALL)
    info = json.loads((tmp_path / "sft" / path.rsplit("/", 1)[1] / "polgrad.json").read_text())
    assert info["version"] == models.MODEL_CODE_VERSION and len(info["key"]) == 64
