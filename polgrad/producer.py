"""Asynchronous rollouts: a producer samples the next batches from stale weights while the trainer updates.

`train.max_staleness = k` > 0 (polgrad/sampling.py's AsyncSampler). Version j of the policy is its
weights after j steps (version 0: the starting policy). Step s trains on a rollout sampled with

    v(s) = max(s - k, first)      first = 0, or on a resume without the saved versions the step resumed at

from the step's own seed, so the run is a deterministic function of (seed, k): with k = 0 every
step samples with the weights it updates (the synchronous loop, exactly), and with k > 0 the
rollout of step s + k can be sampled from version s while the trainer updates on step s. The
producer holds the weight snapshots the coming steps need (cloned after each step, `begin`) and
samples with its own copy of the policy module (hf backend) or with the run's vLLM engine
(`train.rollout_backend = 'vllm'`); each rollout is sampled in a short-lived thread from its
version's snapshot, one at a time in step order, at most k + 1 steps ahead. A thread ends when its
rollout is done, so nothing is left running when the trainer stops, and an exception in it is
re-raised in the trainer (`sample`) as it was.

vLLM: the producer owns the engine while the run is async (the trainer no longer syncs it after its
steps). Before sampling step s it loads the snapshot of v(s) into the engine
(`VLLMRollout.load_weights`: the policy's state_dict names, as `sync_weights` feeds them), unless the
engine holds that version already: it starts with version `start` (the starting weights, or those
the sampler synced on a resume: polgrad/sampling.py), so each version is loaded once. It never reads
the module the trainer is updating.

Determinism: a rollout depends only on the weights of its version (loaded by value), the examples
and the generator seed (hf.generate draws from its private generator). The producer's thread never
calls torch.set_num_threads (process-wide, `own_threads=False`): it decodes with the thread count
it inherits from the trainer (`train.threads`), which is what the synchronous loop decodes with
unless OMP_WAIT_POLICY=passive makes `decode_threads` (polgrad/models/threads.py) pick one. The
vLLM path calls `VLLMRollout.generate(own_threads=False)` for the same reason, with a consequence:
vLLM decodes with the trainer's thread count, not the engine's `num_threads` (1), so on a machine
with few cores the producer's and the trainer's OpenMP teams compete for them (`train.threads = 1`
avoids that).
A vLLM rollout depends on the weights, the examples and the per-row seeds drawn from the generator
seed (polgrad/rollout/vllm.py): loaded at start-up or from a snapshot, the same weights sample the
same rollout bit for bit. vLLM's CPU sampler also draws from torch's global RNG at every decode step;
generate restores the global RNG states when it returns. From the producer's thread that is safe
because the trainer draws nothing from the global RNGs during the loop (prompts, sampling and
minibatch order have their own seeded generators; dropout is off): a part that did would see vLLM's
draws in flight and lose its determinism. A checkpoint written while vLLM samples may record a
global torch RNG state moved by those draws; nothing reads it.

Off-policy: the trainer keeps the producer's log-probs as `rollout_logp` (the behaviour policy)
and recomputes `old_logp` with its own weights when the rollout is stale (polgrad/trainer.py
collect), so a clip part with `off_policy` (clip.tis, clip.icepop) reweights by π_old/π_behaviour,
and any other (clip.ppo) ignores the staleness. `metrics` logs the staleness, the trainer's wait
and the statistics of w = π_old/π_behaviour per step.

Resume: a checkpoint at step s also saves the versions max(s - k, 0) .. s - 1 (the rollouts of
steps s .. s + k - 1 come from them; DeepSpeed's checkpoint holds version s) to
checkpoints/sampler/step{s}.pt, written before DeepSpeed's and atomically, so a resumed run samples
what the uninterrupted one sampled.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from polgrad import collective
from polgrad.errors import PolgradError
from polgrad.io import atomic_path
from polgrad.layout import FULL_COPIES, Layout
from polgrad.rollout import hf as hf_rollout

Weights = dict[str, Tensor]


@dataclasses.dataclass
class _Request:
    """One rollout to sample: its step, version (weights), examples and generate() arguments."""

    step: int
    version: int
    weights: Weights
    examples: list
    kwargs: dict[str, Any]
    thread: threading.Thread | None = None
    rollout: Any = None
    error: BaseException | None = None


class Producer:
    """Samples step s's rollout from version v(s) (module docstring), up to k steps ahead."""

    def __init__(
        self,
        module: torch.nn.Module,
        tokenizer,
        *,
        max_staleness: int,
        steps: int,
        start: int,
        draw: Callable[[int], tuple[list, dict[str, Any]]],
        saved: dict[int, Weights] | None = None,
        vllm: Any = None,
        keep_distribution: bool = False,
        layout: Layout = FULL_COPIES,
    ):
        """draw(step) -> (examples, generate() kwargs) of the step's first sampling round, as the
        trainer's collect asks for them; saved: the versions of a resumed run's checkpoint; vllm: the
        run's VLLMRollout, which then samples instead of a copy of `module` and must hold version
        `start` (the run's starting weights, or those the sampler synced on a resume);
        keep_distribution: the hf rollouts carry their sampling distributions (`Rollout.policy_logp_all`,
        within `hf.MAX_KEPT_DISTRIBUTION`), the exact KL's policy side, for fresh rollouts only (version
        = step); `sample` hands them out once and never from a stale rollout. layout: the run's model
        layout (polgrad/layout.py; default: full copies), which loads a version into the vLLM engine."""
        self.vllm, self.keep_distribution = vllm, keep_distribution
        self.model = _sampling_copy(module) if vllm is None else None
        # how a version's snapshot reaches the vLLM engine (polgrad/layout.py): all its weights, or with
        # LoRA its adapter, cut out with the policy module's peft config (read for that config only)
        self.layout, self.policy = layout, module
        self.engine_version: int | None = start  # the version the vLLM engine holds (None: unknown)
        self.reloads: list[int] = []  # the versions loaded into the vLLM engine, in order
        self.tokenizer, self.k, self.steps, self.draw = tokenizer, int(max_staleness), int(steps), draw
        self.versions: dict[int, Weights] = dict(saved or {})
        self.first = max(start - self.k, 0)
        missing = [v for v in range(self.first, start) if v not in self.versions]
        if missing:
            print(
                f"warning: async rollouts resume at step {start} without the saved weights of versions "
                f"{missing} (checkpoints/sampler/step{start}.pt): steps up to {start + self.k - 1} sample "
                "with less staleness than the uninterrupted run",
                file=sys.stderr,
            )
            self.first = start
        self.step = start
        self.requests: dict[tuple[int, int], _Request] = {}
        self.last: threading.Thread | None = None
        self.queued = start  # the first step whose first round is not queued yet
        self.stale = False  # the last rollout `sample` returned came from older weights than the trainer's
        self._staleness: list[float] = []  # per sequence, this step
        self._wait = 0.0

    def version(self, step: int) -> int:
        return max(step - self.k, self.first)

    # ------------------------------------------------------------------ the trainer's calls
    def begin(self, step: int, module: torch.nn.Module) -> None:
        """A step begins: `module` holds version `step`; queue the rollouts of steps step .. step + k."""
        self.step, self._staleness, self._wait = step, [], 0.0
        self.versions[step] = _snapshot(module, step)
        self.versions = {v: w for v, w in self.versions.items() if v >= self.version(step)}
        self.requests = {key: r for key, r in self.requests.items() if r.step >= step}
        for s in range(max(step, self.queued), min(step + self.k + 1, self.steps)):
            self._submit(s, *self.draw(s))
            self.queued = s + 1

    def sample(self, examples, **kwargs) -> Any:
        """The rollout of the current step for these arguments (queued, or sampled now from v(step))."""
        t0 = time.perf_counter()
        req = self.requests.get((self.step, kwargs["generator_seed"]))
        if req is None:  # a round not drawn ahead: e.g. a further round of dynamic sampling
            req = self._submit(self.step, list(examples), kwargs)
        elif req.examples != list(examples) or req.kwargs != kwargs:  # one stream draws both: a bug
            raise PolgradError(
                f"step {self.step}: the rollout sampled ahead for seed {kwargs['generator_seed']} has other "
                "prompts or arguments than the trainer's round of that seed; the producer's `draw` must be "
                "the sampler's prompt stream (polgrad/sampling.py PromptStream)"
            )
        while req.thread.is_alive():  # short joins: Ctrl-C still reaches the trainer
            req.thread.join(0.5)
        self._wait += time.perf_counter() - t0
        if req.error is not None:
            raise req.error
        self.stale = req.version < self.step
        self._staleness += [float(self.step - req.version)] * len(req.rollout)
        rollout = req.rollout
        # the distributions go to the trainer once, and only from a fresh rollout (an older policy's
        # are not the exact KL's π_θ); the request keeps none
        req.rollout = dataclasses.replace(rollout, policy_logp_all=None)
        return req.rollout if self.stale else rollout

    def metrics(self, batch) -> dict[str, float]:
        """Staleness (per sampled sequence), the trainer's wait for rollouts (s) and the statistics of
        the per-token weights w = π_old/π_behaviour = exp(old_logp - rollout_logp) of the trained batch."""
        stale = torch.tensor(self._staleness or [0.0], dtype=torch.float64)
        valid = batch.mask > 0
        w = torch.exp((batch.old_logp - batch.rollout_logp.to(batch.old_logp.dtype))[valid])
        sums = torch.stack(
            [stale.sum(), torch.tensor(float(stale.numel())), w.sum(), torch.tensor(float(w.numel()))]
        )
        stale_sum, n_seq, w_sum, n_tok = collective.all_sum(sums.double()).tolist()
        maxima = torch.stack(
            [
                stale.max(),
                w.max() if w.numel() else torch.tensor(1.0),
                -(w.min() if w.numel() else torch.tensor(1.0)),
            ]
        )
        stale_max, w_max, w_min_neg = collective.all_max(maxima.double()).tolist()
        return {
            "staleness_mean": stale_sum / max(n_seq, 1.0),
            "staleness_max": stale_max,
            "is_ratio_mean": w_sum / max(n_tok, 1.0),
            "is_ratio_max": w_max,
            "is_ratio_min": -w_min_neg,
            "rollout_wait_s": self._wait,
        }

    def save(self, directory: str, step: int) -> None:
        """Save the versions steps step .. step + k - 1 sample with (< step) as directory/step{step}.pt."""
        keep = {v: w for v, w in self.versions.items() if max(step - self.k, self.first) <= v < step}
        _atomic_torch_save(keep, os.path.join(directory, f"step{step}.pt"))

    def close(self) -> None:
        """Wait for the rollouts still being sampled (none after the last step) and drop the weights."""
        for req in self.requests.values():
            while req.thread is not None and req.thread.is_alive():
                req.thread.join(0.5)
        self.requests, self.versions = {}, {}

    # ------------------------------------------------------------------ the producer's side
    def _submit(self, step: int, examples: list, kwargs: dict[str, Any]) -> _Request:
        v = self.version(step)
        req = _Request(step, v, self.versions[v], examples, dict(kwargs))
        req.thread = threading.Thread(
            target=self._run, args=(req, self.last), name=f"polgrad-producer-{step}"
        )
        req.thread.daemon = True
        self.requests[(step, kwargs["generator_seed"])] = req
        self.last = req.thread
        req.thread.start()
        return req

    def _run(self, req: _Request, previous: threading.Thread | None) -> None:
        """Sample `req` once the previous request is done (one rollout at a time, in order)."""
        try:
            if previous is not None:
                previous.join()
            if self.vllm is not None:
                req.rollout = self._vllm_sample(req)
                return
            self.model.load_state_dict(req.weights)
            rows = len(req.examples) * req.kwargs["group_size"]
            # only a fresh rollout's distributions are the trainer's policy (exact KL): a stale one
            # (every step but the first with k > 0) would hold B x T x V floats for nothing
            keep = (
                self.keep_distribution
                and req.version == req.step
                and hf_rollout.distribution_fits(self.model, rows, req.kwargs["max_new_tokens"])
            )
            req.rollout = hf_rollout.generate(
                self.model,
                self.tokenizer,
                req.examples,
                own_threads=False,
                keep_distribution=keep,
                **req.kwargs,
            )
        except BaseException as e:  # noqa: BLE001 - handed to the trainer, which raises it
            req.error = e

    def _vllm_sample(self, req: _Request) -> Any:
        """Load version req.version into the vLLM engine unless it holds it already, then sample."""
        if self.engine_version != req.version:
            self.engine_version = None  # a failed load leaves the engine's weights unknown
            self.layout.load_vllm(self.vllm, req.weights, self.policy)
            self.engine_version = req.version
            self.reloads.append(req.version)
        return self.vllm.generate(req.examples, own_threads=False, **req.kwargs)


def _partitioned(module: torch.nn.Module) -> bool:
    """True when ZeRO-3 partitions `module`'s parameters (each rank holds a shard, `ds_id` marks them)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def _sampling_copy(module: torch.nn.Module) -> torch.nn.Module:
    """The producer's own module: a copy of `module` that samples outside the trainer's engine. Under
    ZeRO-3 the module's parameters are shards with DeepSpeed's hooks on them, so the copy is built
    from its config instead (its weights are loaded from each version's gathered snapshot anyway)."""
    if not _partitioned(module):
        return copy.deepcopy(module).eval()
    # a peft policy under ZeRO-3 never gets here: models.lora.check_settings refuses it with the config
    dtype = next(module.parameters()).dtype
    model = type(module)(module.config).to(dtype)
    model.generation_config = copy.deepcopy(module.generation_config)
    return model.eval()


def _snapshot(module: torch.nn.Module, version: int) -> Weights:
    """Version `version`'s weights, whole: gathered on every rank under ZeRO-3 (collective: every rank
    calls it, as every rank begins every step). At world size > 1 the ranks' snapshots must be the
    same weights (data parallelism keeps them so): an exact digest of each (`_digest`) is compared
    across ranks and a difference stops the run in one line instead of sampling silently from
    diverged policies."""
    if _partitioned(module):
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            weights = {n: t.detach().clone() for n, t in module.state_dict().items()}
    else:
        weights = {n: t.detach().clone() for n, t in module.state_dict().items()}
    if collective.world_size() > 1:
        digest = _digest(weights)
        device = next(iter(weights.values())).device
        if device.type == "cuda":  # nccl reduces CUDA tensors only
            digest = digest.to(device)
        hi, lo = collective.all_max(digest.clone()), collective.all_min(digest.clone())
        if hi.item() != lo.item():
            raise PolgradError(
                f"async rollouts: the ranks' weights of version {version} differ (digests "
                f"{lo.item()} to {hi.item()}): the data-parallel ranks have diverged; report it "
                "with the run's config.gin"
            )
    return weights


def _digest(weights: Weights) -> Tensor:
    """An int64 digest of the weights' bits: each element's bit pattern times its position (mod
    65521, + 1), summed per tensor (wrapping mod 2^64: exact, so no CPU's summation order changes it)
    and weighted by the tensor's index. Equal weights give equal digests on any machine; a changed
    bit, a permutation within a tensor or a swap of two tensors changes it (NaNs compare as bits)."""
    total = torch.zeros((), dtype=torch.int64)
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    for i, name in enumerate(sorted(weights)):
        t = weights[name].detach().contiguous().reshape(-1)
        flat = t.view(ints[t.element_size()]) if t.is_floating_point() else t
        for start in range(0, flat.numel(), _DIGEST_CHUNK):  # bounded memory for a large embedding
            bits = flat[start : start + _DIGEST_CHUNK].to(torch.int64)
            pos = (torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) + start) % 65521 + 1
            total += ((bits * pos).sum() * (i + 1)).cpu()
    return total


_DIGEST_CHUNK = 1 << 22  # elements per step of `_digest` (32 MiB of int64)


def load_saved(directory: str, step: int) -> dict[int, Weights]:
    """The versions a checkpoint at `step` saved ({} if it has none: a synchronous run's checkpoint)."""
    path = os.path.join(directory, f"step{step}.pt")
    return torch.load(path, weights_only=True) if os.path.exists(path) else {}


def _atomic_torch_save(obj: Any, path: str) -> None:
    """torch.save through io.atomic_path (temp file beside `path`, fsync, os.replace: a crash leaves
    the old file or the new; the mode a new file gets, not mkstemp's 0600; a full disk is one line)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
