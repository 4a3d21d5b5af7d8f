"""Best-of-n sampling against a run's reward model: the non-RL reference curve of over-optimisation.

For each of `prompts` held-out prompts the warm-start policy samples N responses (the run's
temperature, top_p and token budget); the run's reward model (or ensemble, combined as the run
combines it) scores each, the proxy, and the task's verifier scores each, the gold. Best-of-n
picks, among n responses, the one the proxy ranks highest. Its expected proxy and gold are
estimated without bias from the N samples of a prompt (`best_of_n_means`). Its KL to the policy it
samples from is at most `kl_best_of_n(n) = log n - (n - 1) / n` nats per response (Stiennon et al.
2020, appendix; Gao et al. 2023, "Scaling Laws for Reward Model Overoptimization", section 2), with
equality only for a policy without atoms; a small model's policy puts much of its mass on a few
responses, so the rows' `kl` is the plug-in estimate from the samples (`kl_best_of_n_sampled`) and
the bound is kept beside it (`kl_bound`).

    best_of_n(cfg, algo, task, ns=..., prompts=..., samples=..., seed=...) -> rows, one per n:
        {"n", "kl", "sqrt_kl", "kl_bound", "proxy", "gold", "prompts", "samples"}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from polgrad import build, config, models
from polgrad.algorithm import Algorithm
from polgrad.checks import is_int
from polgrad.errors import ConfigError, ShapeError
from polgrad.layout import FullCopies
from polgrad.models.threads import default_num_threads, torch_threads
from polgrad.rollout import hf as hf_rollout
from polgrad.tasks.rewards import RewardGuard


def kl_best_of_n(n: int) -> float:
    """The bound KL(best-of-n || pi) <= log n - (n - 1) / n nats per response (Stiennon et al. 2020;
    Gao et al. 2023, section 2; Beirami et al. 2024). n = 1: 0. Equality for a policy without atoms
    (no response has positive probability), e.g. a continuous one."""
    if not is_int(n) or n < 1:
        raise ConfigError(f"best-of-n needs n >= 1 (an integer), got {n!r}")
    return math.log(n) - (n - 1) / n


def kl_best_of_n_sampled(proxy: Tensor, n: int) -> float:
    """Plug-in estimate of KL(best-of-n || pi) from N samples per prompt, in nats per response.

    proxy [P,N]. Within a prompt, samples with the same proxy score are one outcome (identical
    responses score alike); outcome i of the ascending order has empirical probability p_i = c_i / N
    and cumulative F_i. Best-of-n of the empirical policy picks it with q_i = F_i^n - F_{i-1}^n, and
    KL = sum_i q_i log(q_i / p_i), averaged over prompts. A policy that puts real mass on a few
    responses gets a KL below `kl_best_of_n(n)`, the bound for a policy with no atoms (Beirami et al.
    2024, "Theoretical guarantees on the best-of-n alignment policy"); with N distinct samples it is
    the bound's discrete analogue (it tends to it as N grows)."""
    if proxy.dim() != 2:
        raise ShapeError(f"kl_best_of_n_sampled: proxy must be [P,N], got {tuple(proxy.shape)}")
    kl_best_of_n(n)  # checks n
    total = 0.0
    for row in proxy.double():
        _, counts = torch.unique(row, sorted=True, return_counts=True)  # ascending scores
        p = counts.double() / row.numel()
        cdf = p.cumsum(0).clamp(max=1.0)
        q = cdf**n - torch.cat([cdf.new_zeros(1), cdf[:-1]]) ** n
        total += float(torch.where(q > 0, q * torch.log(q / p), torch.zeros_like(q)).sum())
    return total / proxy.shape[0]


def best_of_n_means(proxy: Tensor, gold: Tensor, n: int) -> tuple[float, float]:
    """Unbiased estimates of E[proxy] and E[gold] of the best-of-n response, from N >= n samples per prompt.

    proxy, gold [P,N]: P prompts x N samples. Within a prompt, sort the samples by proxy ascending;
    the sample of rank k (1-based) is the proxy-best of a uniformly random n-subset with probability
    C(k-1, n-1) / C(N, n) (the subset must hold it and n - 1 of the k - 1 below it). The estimate is
    the weighted sum over ranks, averaged over prompts: the mean over all C(N, n) subsets of the
    best-of-n's value (Nakano et al. 2021, WebGPT, appendix; Gao et al. 2023). n = 1 is the plain
    mean; n = N the proxy-best sample. Ties in the proxy (identical responses) have equal gold.
    """
    if proxy.dim() != 2 or proxy.shape != gold.shape:
        raise ShapeError(
            "best_of_n_means: proxy and gold must both be [P,N], got "
            f"{tuple(proxy.shape)} and {tuple(gold.shape)}"
        )
    p, big_n = proxy.shape
    if not 1 <= n <= big_n:
        raise ConfigError(f"best_of_n_means: n = {n} must be in 1..N = {big_n} (the samples per prompt)")
    total = math.comb(big_n, n)
    weights = torch.tensor(
        [math.comb(k - 1, n - 1) / total for k in range(1, big_n + 1)], dtype=torch.float64
    )
    order = proxy.double().argsort(dim=1, stable=True)
    sorted_proxy = proxy.double().gather(1, order)
    sorted_gold = gold.double().gather(1, order)
    return float((sorted_proxy @ weights).mean()), float((sorted_gold @ weights).mean())


def best_of_n(
    cfg: config.TrainConfig,
    algo: Algorithm,
    task: Any,
    *,
    ns: Sequence[int],
    prompts: int,
    samples: int,
    seed: int,
    chunk: int = 8,
) -> list[dict[str, Any]]:
    """The best-of-n rows of the run `cfg` describes (its warm start, reward model(s), combine, sampling).

    `samples` responses for each of the first `prompts` held-out prompts, sampled `chunk` prompts at a
    time (chunk j with generator seed seed * 1000003 + j); one row per n in `ns` (each <= samples):
    `kl` the plug-in estimate from the samples (`kl_best_of_n_sampled`), `kl_bound` log n - (n-1)/n."""
    if cfg.reward_source != "reward_model":
        raise ConfigError(
            "best-of-n ranks samples by a reward model: needs train.reward_source = 'reward_model'"
        )
    if cfg.lora is not None:
        raise ConfigError("best-of-n loads the full reward model: run it with train.lora_r = 0")
    if not ns or any(not is_int(n) or not 1 <= n <= samples for n in ns):
        raise ConfigError(
            f"best-of-n: every n must be an integer in 1..{samples} (the samples per prompt), got {ns}"
        )
    policy_path = build.warm_start(cfg)
    policy = models.load_policy(policy_path)
    tokenizer = models.load_tokenizer(policy_path, chat_template=cfg.chat_template)
    _, rm_accuracy, members = build.reward_models(cfg, algo, task, policy, policy_path, FullCopies())
    guard = RewardGuard("zero", cfg.task_name, timeout_s=cfg.reward_timeout_s)
    scorer = build.RewardModelScorer(members, guard, guard, combine=cfg.ensemble_combine)
    examples = task.eval_examples(prompts)
    proxy, gold = [], []
    with torch_threads(cfg.threads or default_num_threads()), torch.no_grad():
        for i in range(0, len(examples), chunk):
            rollout = hf_rollout.generate(
                policy,
                tokenizer,
                examples[i : i + chunk],
                group_size=samples,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                max_new_tokens=cfg.max_new_tokens,
                generator_seed=seed * 1_000_003 + i // chunk,  # distinct across seeds and chunks
            )
            proxy.append(scorer.proxy(rollout).view(-1, samples))
            gold.append(scorer.gold(rollout, task).view(-1, samples))
    proxy_t, gold_t = torch.cat(proxy), torch.cat(gold)
    rows = []
    for n in ns:
        p, g = best_of_n_means(proxy_t, gold_t, n)
        kl = kl_best_of_n_sampled(proxy_t, n)
        rows.append(
            {
                "n": n,
                "kl": kl,
                "sqrt_kl": math.sqrt(max(kl, 0.0)),
                "kl_bound": kl_best_of_n(n),
                "proxy": p,
                "gold": g,
                "prompts": len(examples),
                "samples": samples,
                "rm_heldout_accuracy": rm_accuracy,
            }
        )
    return rows
