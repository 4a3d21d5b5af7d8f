"""Reward-model ensembles (Coste et al. 2024, "Reward Model Ensembles Help Mitigate Overoptimization"):
the reward_ensemble parts (mean, worst-case, uncertainty-weighted), the members' training (same pairs,
own initialisation seed), the scorer that combines them, and the config's one-line errors."""

from __future__ import annotations

from types import SimpleNamespace

import gin
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import polgrad
from polgrad import config_parts, models, pretrain
from polgrad.build import RewardModelScorer
from polgrad.components import reward_ensemble
from polgrad.errors import ConfigError, ShapeError
from polgrad.tasks.rewards import RewardGuard

F64 = torch.float64
# float64 arithmetic on O(1e3) scores: a mean or variance of <= 8 terms is exact to ~1e-12 relative
TOL = 1e-9


# --------------------------------------------------------------------------- the parts
def test_known_values():
    # K = 3 members, B = 2 sequences. Column 0: (1, 3, 2), column 1: (4, 0, 2).
    #   mean  = (6/3, 6/3) = (2, 2); worst = (1, 0)
    #   population variance: col 0 ((1-2)^2 + (3-2)^2 + 0) / 3 = 2/3; col 1 (4 + 4 + 0) / 3 = 8/3
    #   uncertainty, lam = 0.5: (2 - 1/3, 2 - 4/3) = (5/3, 2/3); lam = 0 is the mean
    s = torch.tensor([[1.0, 4.0], [3.0, 0.0], [2.0, 2.0]], dtype=F64)
    assert reward_ensemble.mean(s).tolist() == [2.0, 2.0]
    assert reward_ensemble.worst(s).tolist() == [1.0, 0.0]
    torch.testing.assert_close(reward_ensemble.uncertainty(s), torch.tensor([5 / 3, 2 / 3], dtype=F64))
    assert reward_ensemble.uncertainty(s, lam=0.0).tolist() == [2.0, 2.0]
    torch.testing.assert_close(reward_ensemble.uncertainty(s, lam=1.5), torch.tensor([1.0, -2.0], dtype=F64))


_SCORES = st.integers(1, 6).flatmap(
    lambda k: st.integers(1, 5).flatmap(
        lambda b: st.lists(
            st.floats(-1e3, 1e3, allow_nan=False, allow_subnormal=False), min_size=k * b, max_size=k * b
        ).map(lambda xs, k=k, b=b: torch.tensor(xs, dtype=F64).reshape(k, b))
    )
)


@settings(max_examples=200, deadline=None)
@given(_SCORES, st.floats(0, 10, allow_nan=False), st.floats(-100, 100, allow_nan=False))
def test_properties(s, lam, shift):
    mean, worst, unc = (
        reward_ensemble.mean(s),
        reward_ensemble.worst(s),
        reward_ensemble.uncertainty(s, lam=lam),
    )
    scale = 1 + float(s.abs().max())
    # the pessimistic rules never score above the mean
    assert (worst <= mean + TOL * scale).all() and (unc <= mean + TOL * scale).all()
    # the order of the members does not matter
    perm = s[torch.randperm(s.shape[0])]
    torch.testing.assert_close(reward_ensemble.worst(perm), worst, rtol=0, atol=0)
    torch.testing.assert_close(reward_ensemble.mean(perm), mean, rtol=0, atol=TOL * scale)
    # a shift of every member's score shifts each rule's score (the variance is shift-invariant)
    for rule, out in ((reward_ensemble.mean, mean), (reward_ensemble.worst, worst)):
        torch.testing.assert_close(rule(s + shift), out + shift, rtol=0, atol=TOL * (scale + 100))
    var_scale = scale * scale * (1 + lam)
    torch.testing.assert_close(
        reward_ensemble.uncertainty(s + shift, lam=lam), unc + shift, rtol=0, atol=TOL * (var_scale + 100)
    )
    # members that agree: every rule gives their score; one member is that member
    same = s[:1].expand_as(s).clone()
    for rule in (reward_ensemble.mean, reward_ensemble.worst, reward_ensemble.uncertainty):
        torch.testing.assert_close(rule(same), s[0], rtol=0, atol=TOL * scale)
        assert rule(s[:1]).tolist() == s[0].tolist()


@pytest.mark.parametrize("name", ["mean", "worst", "uncertainty"])
@pytest.mark.parametrize(
    "bad, message",
    [
        (torch.zeros(3), r"member_scores must be \[K,B\]"),
        (torch.zeros(2, 3, 1), r"member_scores must be \[K,B\]"),
        (torch.zeros(0, 3), r"member_scores needs K >= 1 reward models"),
        (torch.zeros(2, 3, dtype=torch.int64), "member_scores must be a float tensor"),
        ([[1.0]], r"member_scores must be \[K,B\]"),
    ],
)
def test_shape_checks(name, bad, message):
    with pytest.raises(ShapeError, match=rf"^reward_ensemble\.{name}: {message}"):
        getattr(reward_ensemble, name)(bad)


@pytest.mark.parametrize("lam", [-0.1, float("inf"), float("nan"), "1"])
def test_bad_lambda(lam):
    with pytest.raises(ConfigError, match=r"^reward_ensemble\.uncertainty\.lam must be a finite number >= 0"):
        reward_ensemble.uncertainty(torch.zeros(2, 2), lam=lam)


def test_the_parts_are_registered_for_gin():
    assert polgrad.registry.names("reward_ensemble") == ["mean", "uncertainty", "worst"]
    with gin.unlock_config():
        gin.parse_config("reward_ensemble.uncertainty.lam = 2.0")
    try:
        s = torch.tensor([[0.0], [2.0]], dtype=F64)  # mean 1, variance 1: 1 - 2 * 1 = -1
        uncertainty = config_parts.bind(gin.get_configurable("reward_ensemble.uncertainty"))
        assert uncertainty(s).tolist() == [-1.0]
    finally:
        gin.clear_config()


# --------------------------------------------------------------------------- the scorer
class _Member(torch.nn.Module):
    def __init__(self, scores):
        super().__init__()
        self.scores = torch.tensor(scores, dtype=torch.float32)


def test_the_scorer_combines_every_members_score(monkeypatch):
    from polgrad.rollout import hf as hf_rollout

    monkeypatch.setattr(hf_rollout, "rollout_scores", lambda model, rollout: model.scores)
    rollout = SimpleNamespace(examples=[None] * 3, texts=["a", "b", "c"])
    members = [_Member([1.0, 5.0, 0.0]), _Member([3.0, -1.0, 0.0])]
    seen = []

    def combine(member_scores):
        seen.append(member_scores.clone())
        return member_scores.min(0).values

    scorer = RewardModelScorer(members, RewardGuard(), combine=combine)
    assert scorer(rollout, None).tolist() == [1.0, -1.0, 0.0]  # the combined score is trained on
    assert scorer.proxy(rollout).tolist() == [1.0, -1.0, 0.0]  # and logged as the proxy
    assert seen[0].shape == (2, 3) and seen[0].dtype == F64 and seen[0][1].tolist() == [3.0, -1.0, 0.0]
    # one reward model: its own score, the combine never called
    single = RewardModelScorer(members[1], RewardGuard(), combine=lambda s: pytest.fail("called"))
    assert single(rollout, None).tolist() == [3.0, -1.0, 0.0]
    with pytest.raises(ValueError, match="needs `combine`"):
        RewardModelScorer(members, RewardGuard())


# --------------------------------------------------------------------------- the config
FAST = ["train.task = @task.sort", "train.max_new_tokens = 8"]


@pytest.mark.parametrize(
    "bindings, message",
    [
        (
            ["train.rm_ensemble = 0", "train.reward_source = 'reward_model'"],
            r"train\.rm_ensemble must be an integer >= 1",
        ),
        (
            ["train.rm_ensemble = 2.5", "train.reward_source = 'reward_model'"],
            r"train\.rm_ensemble must be an integer >= 1",
        ),
        (["train.rm_ensemble = 3"], r"need train\.reward_source = 'reward_model' \(got 'task'\)"),
        (["train.rm_pairs = 0"], r"^train\.rm_pairs must be a positive integer"),
        (["train.rm_pairs = 2.5"], r"^train\.rm_pairs must be a positive integer"),
        (["train.rm_combine = @reward_ensemble.worst"], r"need train\.reward_source = 'reward_model'"),
        (
            ["train.rm_combine = @kl.k1", "train.reward_source = 'reward_model'"],
            r"train\.rm_combine must be a registered reward_ensemble part .*"
            r"valid names: mean, uncertainty, worst",
        ),
    ],
)
def test_config_errors_are_one_line(bindings, message):
    from polgrad.config import build, parse_config

    parse_config(["registry/ppo.gin"], [*FAST, *bindings])
    try:
        with pytest.raises(ConfigError, match=message) as err:
            build()
        assert "\n" not in str(err.value)
    finally:
        gin.clear_config()


def test_the_default_combine_is_the_mean():
    from polgrad.config import build, parse_config

    parse_config(
        ["registry/ppo.gin"], [*FAST, "train.reward_source = 'reward_model'", "train.rm_ensemble = 2"]
    )
    try:
        cfg, _, _ = build()
        assert cfg.rm_ensemble == 2 and cfg.ensemble_combine.entry.fn is polgrad.get(
            "reward_ensemble", "mean"
        )
    finally:
        gin.clear_config()


def test_rm_pairs_and_rm_steps_reach_every_members_training(monkeypatch):
    """train.rm_pairs and train.rm_steps are what each member's Bradley-Terry run is given (pairs and
    steps), and left unset the run's own defaults stand (nothing passed)."""
    from polgrad import build as build_lib
    from polgrad.config import build, parse_config

    calls = []
    monkeypatch.setattr(
        build_lib.pretrain, "train_reward_model", lambda *a, **kw: (calls.append(kw), ("rm", 0.5))[1]
    )
    layout = SimpleNamespace(reward_model_form=lambda: None, reward_model=lambda policy, path, k: k)
    for extra, want in (
        (["train.rm_pairs = 64", "train.rm_steps = 5"], {"pairs": 64, "steps": 5}),
        ([], {}),
    ):
        calls.clear()
        parse_config(
            ["registry/ppo.gin"],
            [*FAST, "train.reward_source = 'reward_model'", "train.rm_ensemble = 2", *extra],
        )
        try:
            cfg, algo, task = build()
        finally:
            gin.clear_config()
        _, _, scorers = build_lib.reward_models(cfg, algo, task, None, "policy", layout)
        assert scorers == [0, 1] and [c["member"] for c in calls] == [0, 1]
        assert [{k: c[k] for k in ("pairs", "steps") if k in c} for c in calls] == [want, want]


# --------------------------------------------------------------------------- the members
@pytest.mark.slow
def test_members_share_the_pairs_and_differ_in_their_seed(tmp_path, monkeypatch):
    """Member 0 is the single reward model (the same cache entry as without `member`); member 1 is
    trained on the same pairs from its own initialisation seed: another entry, other scores. That a
    reward model learns is test_models' claim (the default 300 steps on 4,096 pairs); a few steps, as
    here, left member 0 at chance on one thread (0.53 on 128 held-out pairs after 40 steps), so no
    accuracy bound."""
    policy = pretrain.warm_start("sort", {}, {}, seed=0, progress=False)  # the shared default warm start
    kw = dict(pairs=512, steps=8, seed=0, cache_dir=tmp_path, progress=False, heldout_pairs=128)
    single = pretrain.train_reward_model(policy, "sort", **kw)
    assert pretrain.train_reward_model(policy, "sort", member=0, **kw) == single
    m1_path, m1_acc = pretrain.train_reward_model(policy, "sort", member=1, **kw)
    m2_path, m2_acc = pretrain.train_reward_model(policy, "sort", member=2, **kw)
    assert len({single[0], m1_path, m2_path}) == 3
    info0, info1 = models.read_info(single[0]), models.read_info(m1_path)
    assert info0["data"] == info1["data"]  # the same training and held-out pairs
    assert info1["rm"]["member"] == 1 and "member" not in info0["rm"]
    assert info1["stats"]["heldout_pairwise_accuracy"] == m1_acc and 0 <= m2_acc <= 1
    sort = polgrad.get("task", "sort")()
    tok = models.load_tokenizer(policy)
    pairs = sort.preference_pairs(16, 99)
    from polgrad.pretrain.reward_model import _pair_scores

    with torch.no_grad():
        s0 = _pair_scores(models.load_reward_model(single[0]), tok, pairs)[0]
        s1 = _pair_scores(models.load_reward_model(m1_path), tok, pairs)[0]
        s2 = _pair_scores(models.load_reward_model(m2_path), tok, pairs)[0]
    assert not torch.allclose(s0, s1) and not torch.allclose(s1, s2)  # another member, another function
    with pytest.raises(ConfigError, match="member must be an integer >= 0"):
        pretrain.train_reward_model(policy, "sort", member=-1, **kw)


@pytest.mark.slow
def test_a_lora_ensemble_is_k_frozen_adapters_on_one_backbone_and_a_run_trains_on_it(tmp_path):
    """train.rm_ensemble = 2 with LoRA: member 0 is adapter 'reward' + reward_head, member 1 adapter
    'reward_1' + reward_head_1, both frozen on the policy's one backbone and outside the optimizer;
    the scorer trains on their worst-case score; a short run logs the proxy beside the gold."""
    import json
    import os

    from polgrad import distributed
    from polgrad.build import build_models
    from polgrad.config import build, parse_config
    from polgrad.models import sequence_scores
    from polgrad.sampling import step_seed
    from polgrad.train import run as train

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    bindings = [
        "train.task = @task.sort",
        "train.reward_source = 'reward_model'",
        "train.rm_ensemble = 2",
        "train.rm_combine = @reward_ensemble.worst",
        "train.rm_steps = 30",
        "train.progress = False",
        "train.eval_size = 16",
        "train.steps = 2",
        "train.checkpoint_every = 100",
    ]
    parse_config([os.path.join(repo, "registry", "ppo_lora.gin")], bindings)
    try:
        cfg, algo, task = build()
        distributed.setup(seed=cfg.seed)
        m = build_models(cfg, algo, task, out_dir=str(tmp_path), seed_of=lambda s: step_seed(cfg.seed, s))
        a, b = m.score.members
        assert (a.adapter, a.head_name, b.adapter, b.head_name) == (
            "reward",
            "reward_head",
            "reward_1",
            "reward_head_1",
        )
        assert a.frozen and b.frozen and list(a.parameters()) == list(b.parameters()) == []
        module = m.engine.module
        members = [p for n, p in module.named_parameters() if ".reward" in n or n.startswith("reward_head")]
        assert len(members) == 2 * (2 + 2 * 2 * 4) and not any(p.requires_grad for p in members)
        in_optimizer = {id(p) for g in m.engine.optimizer.param_groups for p in g["params"]}
        assert not in_optimizer & {id(p) for p in members}
        ids = torch.randint(3, module.config.vocab_size, (3, 7))
        attn = torch.ones_like(ids)
        with torch.no_grad():
            s0, s1 = sequence_scores(a, ids, attn), sequence_scores(b, ids, attn)
        assert not torch.equal(s0, s1)  # two reward models, not one twice
        rollout = SimpleNamespace(examples=[None] * 3, texts=["x"] * 3)
        from polgrad.rollout import hf as hf_rollout

        real = hf_rollout.rollout_scores
        hf_rollout.rollout_scores = lambda model, r: sequence_scores(model, ids, attn)
        try:
            assert m.score.proxy(rollout).tolist() == torch.minimum(s0, s1).double().tolist()
        finally:
            hf_rollout.rollout_scores = real
    finally:
        gin.clear_config()
    parse_config([os.path.join(repo, "registry", "ppo_lora.gin")], bindings)
    try:
        train(str(tmp_path / "run"))
    finally:
        gin.clear_config()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(
        {"reward_mean", "gold_reward_mean", "rm_heldout_accuracy"} <= set(r) for r in rows
    )
