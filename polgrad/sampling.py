"""Where a run's rollouts come from: one `Sampler`, chosen once when the models are built.

The loop calls every sampler the same way and never asks which one it has:

    begin(step, module)   a step begins; `module` holds the weights of version `step`
    sample(seed)          -> Rollout of the sampling round with this seed: the sampler draws its
                          prompts itself (`PromptStream`: train.prompts_per_step of the task's train
                          split, and the generate() arguments), so the prompts a round trains on and
                          those an async producer sampled ahead are one draw
    old_logp(rollout, module, temperature)  -> [B,T] float64: π_old's log-probs of the rollout's tokens,
                          the sampler's own (`sampled_logp`: same weights, same temperature), or a
                          no-grad forward of the trainer's `module` (`recomputed_logp`): always for a
                          spec whose parts compare the two (meta needs_rollout_logp, e.g. clip.tis),
                          and for an async rollout sampled from older weights (stale)
    sync(module)          the trainer's optimizer changed the weights (after a step that updated)
    resumed(module)       the weights were loaded from a checkpoint (a resume, before the first step)
    metrics(batch)        what the sampler adds to the step's metrics row ({} when synchronous)
    save(directory, step) what a checkpoint at `step` must hold to resume exactly (async: old weights)
    close()               the run ends: wait for what is in flight, free the engine

Three implementations, picked by `make_sampler` from `train.rollout_backend` and
`train.max_staleness`:

    HFSampler     Hugging Face generation with the policy module itself (the default, CPU)
    VLLMSampler   a vLLM engine, loaded with the policy's weights after every step that updated
    AsyncSampler  polgrad.producer.Producer: step s samples from the weights of step max(s - k, 0)
                  (hf or vLLM inside), so the rollouts of later steps are sampled while this one trains
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from polgrad import config, hooks, producer
from polgrad.algorithm import Algorithm
from polgrad.layout import FULL_COPIES, Layout
from polgrad.rollout import hf as hf_rollout
from polgrad.run_folder import RunFolder


class Sampler(Protocol):
    """What the loop asks of a rollout source (module docstring)."""

    def begin(self, step: int, module: torch.nn.Module) -> None: ...
    def sample(self, seed: int) -> hf_rollout.Rollout: ...
    def old_logp(
        self, rollout: hf_rollout.Rollout, module: torch.nn.Module, temperature: float
    ) -> torch.Tensor: ...
    def sync(self, module: torch.nn.Module) -> None: ...
    def resumed(self, module: torch.nn.Module) -> None: ...
    def metrics(self, batch: Any) -> dict[str, float]: ...
    def save(self, directory: str, step: int) -> None: ...
    def close(self) -> None: ...


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The seed of every random draw of `step` on `rank` (prompts, sampling, minibatch order)."""
    return (int(seed) * 1_000_003 + int(step) * 7919 + 17 + int(rank) * 104_729) % (2**31 - 1)


def round_seed(seed: int, sampling_round: int) -> int:
    """The seed of sampling round r of a step whose seed is `seed` (round 0: the step's own)."""
    return (int(seed) + int(sampling_round) * 15_485_863) % (2**31 - 1)


def sample_kwargs(cfg: config.TrainConfig, algo: Algorithm, seed: int) -> dict[str, Any]:
    """The generate() arguments of a sampling round with this seed (every sampler takes the same)."""
    return dict(
        group_size=algo.group_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        greedy_baseline=algo.needs_baseline_rollout,
        generator_seed=seed,
    )


class PromptStream:
    """A run's prompts: the sampling round with seed `seed` draws `prompts_per_step` examples of the
    task's train split, and samples them with `sample_kwargs` of that seed. The one place prompts
    are drawn (the synchronous samplers per round, the async producer ahead of the trainer)."""

    def __init__(self, cfg: config.TrainConfig, algo: Algorithm, task: Any):
        self.cfg, self.algo, self.task = cfg, algo, task

    def __call__(self, seed: int) -> tuple[list, dict[str, Any]]:
        examples = self.task.examples("train", self.cfg.prompts_per_step, seed=seed)
        return examples, sample_kwargs(self.cfg, self.algo, seed)


def sampled_logp(rollout: hf_rollout.Rollout, module: torch.nn.Module, temperature: float) -> torch.Tensor:
    """[B,T] float64: the log-probs the sampler drew the tokens with (π_old's: same weights and
    temperature)."""
    return rollout.rollout_logp.double()


def recomputed_logp(rollout: hf_rollout.Rollout, module: torch.nn.Module, temperature: float) -> torch.Tensor:
    """[B,T] float64: π_old's log-probs from a no-grad forward of the trainer's `module` (0 off the mask).
    Off-policy corrections (e.g. clip.tis) compare the sampler's log-probs with these, and a stale
    async rollout's are not π_old's."""
    with torch.no_grad(), hooks.phase("old_logp"):
        logp = hf_rollout.response_logprobs(module, rollout, temperature=temperature)
    return logp.double() * rollout.mask.double()


class HFSampler:
    """Samples with the policy module the trainer updates (Hugging Face generation, polgrad/rollout/hf.py).

    `keep_distribution` (the run has a reference, so it measures the exact KL): each rollout carries
    the distributions its tokens were drawn from (`Rollout.policy_logp_all`), which are the current
    policy's (this sampler is never stale), so the KL needs only the reference's forward; not when
    they would exceed `hf_rollout.MAX_KEPT_DISTRIBUTION` elements."""

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer: Any,
        prompts: Callable[[int], tuple[list, dict[str, Any]]],
        keep_distribution: bool = False,
        recompute: bool = False,
    ):
        self.module, self.tokenizer, self.keep_distribution = module, tokenizer, keep_distribution
        self.prompts = prompts
        self.old_logp = recomputed_logp if recompute else sampled_logp  # `recompute`: needs_rollout_logp

    def begin(self, step: int, module: torch.nn.Module) -> None:
        pass

    def sample(self, seed: int) -> hf_rollout.Rollout:
        examples, kwargs = self.prompts(seed)
        rows = len(examples) * kwargs["group_size"]
        keep = self.keep_distribution and hf_rollout.distribution_fits(
            self.module, rows, kwargs["max_new_tokens"]
        )
        return hf_rollout.generate(self.module, self.tokenizer, examples, keep_distribution=keep, **kwargs)

    def sync(self, module: torch.nn.Module) -> None:
        pass  # it samples with the module itself

    def resumed(self, module: torch.nn.Module) -> None:
        pass

    def metrics(self, batch: Any) -> dict[str, float]:
        return {}

    def save(self, directory: str, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class VLLMSampler:
    """Samples with a vLLM engine (polgrad/rollout/vllm.py) that gets the policy's weights (with LoRA:
    its adapter, as a vLLM LoRARequest) after every step that updated them, and after a resume loaded
    them."""

    def __init__(
        self,
        vllm: Any,
        prompts: Callable[[int], tuple[list, dict[str, Any]]],
        recompute: bool = False,
        layout: Layout = FULL_COPIES,
    ):
        self.vllm, self.prompts = vllm, prompts
        self.layout = layout  # how the weights reach the engine
        self.old_logp = recomputed_logp if recompute else sampled_logp  # `recompute`: needs_rollout_logp

    def begin(self, step: int, module: torch.nn.Module) -> None:
        pass

    def sample(self, seed: int) -> hf_rollout.Rollout:
        examples, kwargs = self.prompts(seed)
        return self.vllm.generate(examples, **kwargs)

    def sync(self, module: torch.nn.Module) -> None:
        with hooks.phase("sync"):
            self._load(module)

    def resumed(self, module: torch.nn.Module) -> None:
        self._load(module)

    def _load(self, module: torch.nn.Module) -> None:
        """The policy's weights into the engine, as the layout keeps them: all of them, or with LoRA
        the adapter alone (the engine started from the frozen base; until the first sync it samples
        the base, which a fresh adapter, B = 0, leaves unchanged)."""
        self.layout.sync_vllm(self.vllm, module)

    def metrics(self, batch: Any) -> dict[str, float]:
        return {}

    def save(self, directory: str, step: int) -> None:
        pass

    def close(self) -> None:
        self.vllm.close()


class AsyncSampler:
    """Asynchronous rollouts (`train.max_staleness` = k > 0): a
    `producer.Producer`, started at the first step the loop runs (0, or the step a resume loads), with
    the versions that checkpoint saved. With vLLM the producer owns the engine: the trainer's `sync`
    does nothing, a resume loads the checkpoint's weights into the engine before the producer starts."""

    def __init__(
        self,
        cfg: config.TrainConfig,
        algo: Algorithm,
        task: Any,
        out_dir: str,
        module: torch.nn.Module,
        tokenizer: Any,
        seed_of: Callable[[int], int],
        vllm: Any = None,
        keep_distribution: bool = False,
        layout: Layout = FULL_COPIES,
    ):
        self.cfg, self.algo, self.task, self.out_dir = cfg, algo, task, out_dir
        self.keep_distribution = keep_distribution
        self.layout = layout
        self.module, self.tokenizer, self.seed_of, self.vllm = module, tokenizer, seed_of, vllm
        self.producer: producer.Producer | None = None
        self.prompts = PromptStream(cfg, algo, task)
        self.old_logp = recomputed_logp if algo.needs_rollout_logp else self._old_logp_of_its_version

    @property
    def stale(self) -> bool:
        """The last rollout came from older weights than the trainer's."""
        return self.producer is not None and self.producer.stale

    def _old_logp_of_its_version(
        self, rollout: hf_rollout.Rollout, module: torch.nn.Module, temperature: float
    ) -> torch.Tensor:
        """The sampler's log-probs when the rollout came from the trainer's weights; recomputed when stale."""
        return (recomputed_logp if self.stale else sampled_logp)(rollout, module, temperature)

    def _start(self, step: int) -> producer.Producer:
        cfg, seed_of = self.cfg, self.seed_of

        def draw(s: int) -> tuple[list, dict[str, Any]]:
            return self.prompts(seed_of(s))  # step s's first round: the draw its `sample(seed)` makes

        saved = (
            producer.load_saved(str(RunFolder(self.out_dir).checkpoints_of("sampler")), step) if step else {}
        )
        return producer.Producer(
            self.module,
            self.tokenizer,
            vllm=self.vllm,
            layout=self.layout,
            max_staleness=cfg.max_staleness,
            steps=cfg.steps,
            start=step,
            draw=draw,
            saved=saved,
            keep_distribution=self.keep_distribution,
        )

    def begin(self, step: int, module: torch.nn.Module) -> None:
        if self.producer is None:
            self.producer = self._start(step)
        self.producer.begin(step, module)

    def sample(self, seed: int) -> hf_rollout.Rollout:
        examples, kwargs = self.prompts(seed)
        return self.producer.sample(examples, **kwargs)

    def sync(self, module: torch.nn.Module) -> None:
        pass  # the producer snapshots the weights at `begin`, and loads them into vLLM itself

    def resumed(self, module: torch.nn.Module) -> None:
        if self.vllm is not None:  # the engine must hold the version the producer starts at
            self.layout.sync_vllm(self.vllm, module)

    def metrics(self, batch: Any) -> dict[str, float]:
        return self.producer.metrics(batch)

    def save(self, directory: str, step: int) -> None:
        if self.producer is not None:
            self.producer.save(directory, step)

    def close(self) -> None:
        if self.producer is not None:  # first: its thread may still be sampling with the vLLM engine
            self.producer.close()
        if self.vllm is not None:
            self.vllm.close()


def make_sampler(
    cfg: config.TrainConfig,
    algo: Algorithm,
    task: Any,
    out_dir: str,
    module: torch.nn.Module,
    tokenizer: Any,
    policy_path: str,
    seed_of: Callable[[int], int],
    layout: Layout = FULL_COPIES,
    keep_distribution: bool = False,
) -> Sampler:
    """The run's sampler (module docstring). A preference spec (DPO) samples nothing: it gets the
    HF sampler, or with train.rollout_backend = 'vllm' the vLLM one (its engine is started, synced on
    a resume and closed, as before, but never sampled from); it is never asynchronous. The vLLM
    engine loads the starting policy from `policy_path`; `layout` (polgrad/layout.py; default: full
    copies) says what it is started with and how the policy's weights reach it. `keep_distribution`:
    the HF sampler keeps the sampling distributions for the exact KL (HFSampler; the async one's hf
    producer too, and the loop reads them when the rollout is not stale)."""
    vllm = None
    if cfg.rollout_backend == "vllm":
        from polgrad.rollout.vllm import VLLMRollout  # optional extra: imported only when chosen

        # what the layout's engine needs: with LoRA it keeps the frozen base and samples with the adapter
        vllm = VLLMRollout(
            policy_path, seed=cfg.seed, chat_template=cfg.chat_template, **layout.vllm_options()
        )
    if cfg.asynchronous and not algo.offline:
        return AsyncSampler(
            cfg,
            algo,
            task,
            out_dir,
            module,
            tokenizer,
            seed_of,
            vllm=vllm,
            keep_distribution=keep_distribution,
            layout=layout,
        )
    if vllm is not None:
        return VLLMSampler(
            vllm, PromptStream(cfg, algo, task), recompute=algo.needs_rollout_logp, layout=layout
        )
    return HFSampler(
        module,
        tokenizer,
        PromptStream(cfg, algo, task),
        keep_distribution=keep_distribution,
        recompute=algo.needs_rollout_logp,
    )
