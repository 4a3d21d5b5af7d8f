"""Every spec in registry/ runs the numbers its header cites: a hand-written table per spec.

Each table below is written from the spec's header (Source / Numbers / Deviation lines) and the
cited papers, not from the parsed config; each row's comment says where the number comes from.
The test parses the spec alone (as `polgrad.config.load_spec` does), builds its Algorithm, and
compares every row with what actually runs: the Algorithm's parts and attributes, and each
part's hyperparameter as gin binds it (or the part's default when the spec binds none, since
the default is then what runs). Rows the table does not list take the Algorithm's defaults
(`DEFAULTS`), so a spec that silently gains a KL term, a filter or a bonus fails too.

A second check keeps the tables complete: every binding line of a spec file must have a row, so
a number added to a spec without a cited row fails here.

Mutants this kills (mutation testing, issue 11): registry/dapo.gin with clip-higher lost
(`clip.ppo.eps_high = 0.2`), and with its dynamic-sampling filter lost (`Algorithm.filters`
removed); likewise any other spec number changed without its header.
"""

from __future__ import annotations

import glob
import os
import re

import gin
import pytest

from polgrad import registry
from polgrad.config import load_spec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC_DIR = os.path.join(REPO, "registry")
UNBOUND = "<left to the base config>"  # a required hyperparameter the spec must not bind

# What a spec runs when it binds nothing else (Algorithm's defaults, polgrad/algorithm.py).
DEFAULTS = {
    "Algorithm.kl": None,
    "Algorithm.kl_placement": "loss",
    "Algorithm.kl_coef": 0.0,
    "Algorithm.kl_controller": "kl_controller.fixed",
    "Algorithm.entropy_coef": 0.0,
    "Algorithm.value_init": None,
    "Algorithm.value_loss": "value_loss.clipped",
    "Algorithm.vf_coef": 0.5,
    "Algorithm.ppo_epochs": 1,
    "Algorithm.minibatches": 1,
    "Algorithm.group_size": 1,
    "Algorithm.reward_shaping": [],
    "Algorithm.filters": [],
}

TABLES: dict[str, dict[str, object]] = {
    # Rafailov et al. 2023 (DPO) eq. 7 and Appendix B: beta 0.1 by default, 0.5 for TL;DR
    # summarization (the value used here); batch 64 sequences = 32 pairs. No on-policy parts.
    "dpo": {
        "Algorithm.preference": "preference.dpo",
        "preference.dpo.beta": 0.5,
        "train.prompts_per_step": 32,
        "Algorithm.advantage": None,
        "Algorithm.clip": None,
        "Algorithm.aggregate": None,
    },
    # Shao et al. 2024 (DeepSeekMath) sec. 4.2: KL coefficient 0.04, 64 outputs per question, a
    # single policy update per exploration stage; eq. 4 is the k3 estimator; eq. 3 the
    # 1/G sum_i 1/|o_i| sum_t objective. eps: PPO's 0.2 (the paper gives none). Header deviation:
    # G = 8, not 64.
    "grpo": {
        "Algorithm.advantage": "advantage.grpo",
        "advantage.grpo.eps": 1e-6,  # verl's std + 1e-6 (header: not fixed by the paper)
        "Algorithm.clip": "clip.ppo",
        "clip.ppo.eps_low": 0.2,
        "clip.ppo.eps_high": 0.2,
        "Algorithm.aggregate": "aggregate.seq_mean_token_mean",
        "Algorithm.kl": "kl.k3",
        "Algorithm.kl_placement": "loss",
        "Algorithm.kl_coef": 0.04,
        "Algorithm.group_size": 8,  # deviation (paper: 64)
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # Yu et al. 2025 (DAPO): eps_low 0.2, eps_high 0.28 (clip-higher); token-level loss
    # (1/sum|o_i|); dynamic sampling drops groups whose accuracy is all 0 or all 1; soft overlong
    # punishment with a 4096-token cache below 20480 (here 2 below the budget); no KL.
    # Deviations in the header: G = 8 (paper 16), 4 optimizer steps per rollout batch (paper 16:
    # "the mini-batch size is set to 512, i.e., 16 gradient updates for each rollout step").
    "dapo": {
        "Algorithm.advantage": "advantage.grpo",
        "advantage.grpo.eps": 1e-6,  # the component's default
        "Algorithm.clip": "clip.ppo",
        "clip.ppo.eps_low": 0.2,
        "clip.ppo.eps_high": 0.28,  # clip-higher
        "Algorithm.aggregate": "aggregate.token_mean",
        "Algorithm.kl": None,
        "Algorithm.reward_shaping": ["reward_shaping.overlong"],
        "reward_shaping.overlong.cache_len": 2,  # scaled from the paper's 4096
        "reward_shaping.overlong.max_len": UNBOUND,  # L_max = the generation budget (base config)
        "Algorithm.filters": ["filter.zero_variance_groups"],  # dynamic sampling
        "Algorithm.max_sampling_rounds": 10,  # refill bound: verl DAPO recipe max_num_gen_batches
        "Algorithm.group_size": 8,  # deviation (paper: 16)
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 4,  # deviation (paper: 16 updates per rollout step)
    },
    # Liu et al. 2025 (Dr. GRPO): A_i = r_i - mean_G r (no std), loss sum_t / L_max (no 1/|o_i|),
    # beta = 0. eps 0.2 and G = 8: header says polgrad's choices.
    "dr_grpo": {
        "Algorithm.advantage": "advantage.dr_grpo",
        "Algorithm.clip": "clip.ppo",
        "clip.ppo.eps_low": 0.2,
        "clip.ppo.eps_high": 0.2,
        "Algorithm.aggregate": "aggregate.seq_mean_token_sum_norm",
        "aggregate.seq_mean_token_sum_norm.max_len": UNBOUND,  # L_max = the budget (base config)
        "Algorithm.kl": None,
        "Algorithm.group_size": 8,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # Zheng et al. 2025 (GSPO): "the clipping ranges in Equation (5) to 3e-4 and 4e-4"; eq. 5 is
    # 1/G sum_i min(s_i A_i, clip(s_i) A_i), no KL term. G = 8: header says polgrad's choice.
    "gspo": {
        "Algorithm.advantage": "advantage.grpo",
        "advantage.grpo.eps": 1e-6,
        "Algorithm.clip": "clip.gspo",
        "clip.gspo.eps_low": 3e-4,
        "clip.gspo.eps_high": 4e-4,
        "Algorithm.aggregate": "aggregate.seq_mean_token_mean",
        "Algorithm.kl": None,
        "Algorithm.group_size": 8,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # MiniMax 2025 (MiniMax-M1, CISPO): weight clip(r, 1 - eps_low, 1 + eps_high) with no lower
    # bound ("we did not impose a lower bound"), normalised by 1/sum_i |o_i|, no KL term. The
    # paper gives no eps_high: 0.28 is the component's default (header: polgrad's choice).
    "cispo": {
        "Algorithm.advantage": "advantage.grpo",
        "advantage.grpo.eps": 1e-6,
        "Algorithm.clip": "clip.cispo",
        "clip.cispo.eps_low": None,
        "clip.cispo.eps_high": 0.28,
        "Algorithm.aggregate": "aggregate.token_mean",
        "Algorithm.kl": None,
        "Algorithm.group_size": 8,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # Williams 1992; the chapter's eq. 49 with a batch-mean baseline and Table 5's
    # -(1/T) sum_t log pi (G_t - b): one sample per prompt, one gradient step, no clip, no KL.
    "reinforce": {
        "Algorithm.advantage": "advantage.reinforce",
        "Algorithm.clip": "clip.none",
        "Algorithm.aggregate": "aggregate.seq_mean_token_mean",
        "Algorithm.kl": None,
        "Algorithm.group_size": 1,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # Kool et al. 2019; Ahmadian et al. 2024 (RLOO with k = 2 and 4; no clipping); Table 5's
    # -(1/K) sum_i sum_t log pi (R_i - mean_{j != i} R_j). Header deviation: no KL term.
    "rloo": {
        "Algorithm.advantage": "advantage.rloo",
        "Algorithm.clip": "clip.none",
        "Algorithm.aggregate": "aggregate.seq_mean_token_sum",
        "Algorithm.kl": None,
        "Algorithm.group_size": 4,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # Li et al. 2023 (ReMax): REINFORCE with the greedy response's reward as the baseline, one
    # sample per prompt, sum over tokens, no clip. Header deviation: no KL term.
    "remax": {
        "Algorithm.advantage": "advantage.remax",
        "advantage.remax.per_token": False,  # the paper's sequence-level advantage
        "Algorithm.clip": "clip.none",
        "Algorithm.aggregate": "aggregate.seq_mean_token_sum",
        "Algorithm.kl": None,
        "Algorithm.group_size": 1,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # Hu 2025 (REINFORCE++) eq. 8-10: k1 = log(pi_old / pi_SFT) per token in the reward, its
    # undiscounted return-to-go (gamma 1), whitened over the batch. beta 0.01 and eps 0.2: header
    # says polgrad's choice.
    "reinforce_pp": {
        "Algorithm.advantage": "advantage.reinforce_pp",
        "advantage.reinforce_pp.gamma": 1.0,
        "advantage.reinforce_pp.eps": 1e-8,  # the component's default (whitening denominator)
        "Algorithm.clip": "clip.ppo",
        "clip.ppo.eps_low": 0.2,
        "clip.ppo.eps_high": 0.2,
        "Algorithm.aggregate": "aggregate.token_mean",
        "Algorithm.kl": "kl.k1",
        "Algorithm.kl_placement": "reward",
        "Algorithm.kl_coef": 0.01,
        "Algorithm.group_size": 1,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # Hu 2025, the -baseline variant: group-mean baseline, then REINFORCE++'s returns and global
    # whitening; KL in the loss. G = 8, k2, beta 0.01, eps 0.2: header says polgrad's choice.
    "reinforce_pp_baseline": {
        "Algorithm.advantage": "advantage.reinforce_pp_baseline",
        "advantage.reinforce_pp_baseline.gamma": 1.0,
        "advantage.reinforce_pp_baseline.eps": 1e-8,
        "Algorithm.clip": "clip.ppo",
        "clip.ppo.eps_low": 0.2,
        "clip.ppo.eps_high": 0.2,
        "Algorithm.aggregate": "aggregate.token_mean",
        "Algorithm.kl": "kl.k2",
        "Algorithm.kl_placement": "loss",
        "Algorithm.kl_coef": 0.01,
        "Algorithm.group_size": 8,
        "Algorithm.ppo_epochs": 1,
        "Algorithm.minibatches": 1,
    },
    # RLHF-PPO: Schulman et al. 2017 (eps 0.2, the best clip value of its comparison); GAE
    # (Schulman et al. 2016) with gamma 1, lambda 0.95; KL in the reward (Ziegler et al. 2019,
    # Ouyang et al. 2022). eps, value clip, gamma and lambda are OpenRLHF's train_ppo defaults;
    # the header calls vf_coef 0.5 and beta 0.05 common settings (InstructGPT's own KL reward
    # coefficient is 0.02). GAE advantages whitened as verl's masked_whiten (rsqrt(var + 1e-8)).
    "ppo": {
        "Algorithm.advantage": "advantage.gae",
        "advantage.gae.gamma": 1.0,
        "advantage.gae.lam": 0.95,
        "advantage.gae.whiten": True,  # verl's masked_whiten of the GAE advantages (its default)
        "advantage.gae.eps": 1e-8,  # masked_whiten's rsqrt(var + 1e-8)
        "Algorithm.clip": "clip.ppo",
        "clip.ppo.eps_low": 0.2,
        "clip.ppo.eps_high": 0.2,
        "Algorithm.aggregate": "aggregate.token_mean",
        "Algorithm.kl": "kl.k1",
        "Algorithm.kl_placement": "reward",
        "Algorithm.kl_coef": 0.05,
        "Algorithm.value_init": "value_init.policy",
        "Algorithm.value_loss": "value_loss.clipped",
        "value_loss.clipped.clip_eps": 0.2,
        "Algorithm.vf_coef": 0.5,
        "Algorithm.group_size": 1,
        "Algorithm.ppo_epochs": 2,
        "Algorithm.minibatches": 2,
    },
    # PPO with LoRA: registry/ppo.gin's numbers unchanged (the rows above), the critic sharing the
    # actor's adapter (ours, header). Hu et al. 2021 (LoRA), GPT-2 E2E (microsoft/LoRA examples/NLG
    # --lora_dim 4 --lora_alpha 32): rank 4, alpha 32 on the query and value projections; adapter
    # dropout 0 (header deviation: the paper's 0.1 would make the on-policy ratio differ from 1).
    "ppo_lora": {
        "Algorithm.advantage": "advantage.gae",
        "advantage.gae.gamma": 1.0,
        "advantage.gae.lam": 0.95,
        "advantage.gae.whiten": True,
        "advantage.gae.eps": 1e-8,
        "Algorithm.clip": "clip.ppo",
        "clip.ppo.eps_low": 0.2,
        "clip.ppo.eps_high": 0.2,
        "Algorithm.aggregate": "aggregate.token_mean",
        "Algorithm.kl": "kl.k1",
        "Algorithm.kl_placement": "reward",
        "Algorithm.kl_coef": 0.05,
        "Algorithm.value_init": "value_init.shared_lora",  # ours: actor and critic differ by their heads
        "Algorithm.value_loss": "value_loss.clipped",
        "value_loss.clipped.clip_eps": 0.2,
        "Algorithm.vf_coef": 0.5,
        "Algorithm.group_size": 1,
        "Algorithm.ppo_epochs": 2,
        "Algorithm.minibatches": 2,
        "train.lora_r": 4,  # Hu et al. 2021, GPT-2 E2E
        "train.lora_alpha": 32.0,  # Hu et al. 2021, GPT-2 E2E
        "train.lora_target_modules": ["q_proj", "v_proj"],  # W_q and W_v, as the paper's GPT-2 runs
        "train.lora_dropout": 0.0,  # deviation (paper: 0.1)
    },
}

PART_BINDINGS = (
    "advantage",
    "clip",
    "aggregate",
    "kl",
    "kl_controller",
    "value_init",
    "value_loss",
    "preference",
)
LIST_BINDINGS = ("reward_shaping", "filters")


def _spec_path(name: str) -> str:
    return os.path.join(SPEC_DIR, f"{name}.gin")


def _actual(algo, key: str):
    """What the built spec runs for `key` ('Algorithm.x' or a part's 'kind.name.param')."""
    if key.startswith("Algorithm."):
        attr = key.split(".", 1)[1]
        if attr in PART_BINDINGS:
            entry = algo.parts.get(key)
            return entry.full_name if entry is not None else None
        if attr in LIST_BINDINGS:
            return [algo.parts[f"{key}[{i}]"].full_name for i in range(len(getattr(algo, attr)))]
        return getattr(algo, attr)
    if key.startswith("train."):  # a run setting the spec fixes (dpo: pairs per step)
        return gin.query_parameter(key)
    kind, name, param = key.split(".")
    try:
        return gin.query_parameter(key)
    except ValueError:  # not bound: the part's default runs
        entry = registry.lookup(kind, name)
        (p,) = [p for p in registry.contract.hyperparameters(kind, entry.fn) if p.name == param]
        return UNBOUND if p.default is p.empty or p.default is gin.REQUIRED else p.default


def test_every_spec_has_a_table():
    names = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(SPEC_DIR, "*.gin"))}
    assert names == set(TABLES)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_spec_runs_the_numbers_its_header_cites(name):
    algo = load_spec(_spec_path(name))
    expected = {**DEFAULTS, **TABLES[name]}
    wrong = {k: (_actual(algo, k), v) for k, v in expected.items() if _actual(algo, k) != v}
    assert not wrong, f"registry/{name}.gin (actual, cited): {wrong}"


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_binding_of_the_spec_has_a_cited_row(name):
    bound = re.findall(r"^([A-Za-z_][\w.]*)\s*=", open(_spec_path(name)).read(), flags=re.M)
    missing = sorted(set(bound) - set(TABLES[name]) - {"Algorithm.name", "Algorithm.source"})
    assert not missing, f"registry/{name}.gin binds {missing} with no row in TABLES[{name!r}]"


def _header(name: str) -> str:
    lines = open(_spec_path(name)).read().splitlines()
    return "\n".join(line for line in lines[: next(i for i, s in enumerate(lines) if not s.startswith("#"))])


@pytest.mark.parametrize("name", sorted(TABLES))
def test_header_has_source_numbers_and_deviation_lines(name):
    header = _header(name)
    for field in ("# Source:", "# Numbers:", "# Deviation"):
        assert field in header, f"registry/{name}.gin: the header has no {field!r} line"


@pytest.mark.parametrize(
    "name",
    sorted(TABLES),
)
def test_header_cites_real_sources_only(name):
    """Headers cite papers and implementations, never an internal seed file."""
    header = _header(name)
    assert not re.search(r"seed \d{3}", header), f"registry/{name}.gin cites a seed file"
    assert "../shared" not in header and "DESIGN.md" not in header
