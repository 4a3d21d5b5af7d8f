"""torch.compile (inductor, CPU) of the hot paths, behind the one setting `train.compile`.

    compile_models(*modules)   each module's forward compiled in place (`nn.Module.compile`,
                               dynamic shapes): parameter names, state_dict and checkpoints unchanged
    is_compiled(module)        whether `compile_models` compiled it; the HF rollout then decodes
                               with the compiled lean step (polgrad/rollout/static_decode.py)

What it compiles: the policy's, reference's and critic's forwards (the sampler's prefill, the
reference and critic forwards, and the training forward with its backward through AOTAutograd),
compiled with dynamic shapes (`dynamic=True`: batches and sequence lengths change every step
without recompiling), and the lean decode step, which `static_decode.step_fixed` writes with fixed
shapes (the whole cache under a key mask) so that one graph serves every token of every rollout of
one (batch, prompt length + max_new_tokens): each new such shape (the evaluation's batch, a longer
padded prompt, a refill round, a greedy baseline) compiles another graph, and past torch's
recompile limit (8) the new shapes decode eagerly, with a warning. The async producer's copy of the
policy (polgrad/producer.py) is not compiled: deepcopy drops the compiled forward, so async runs
decode eagerly.

Cost and gain (benchmarks/bench.py `--only compile`, results/bench/profile.md): compiling takes
tens of seconds at the first step, paid once per process, and each step is then faster by the
fraction the bench reports; a run shorter than the break-even step loses time, which is why it is
off by default. The compiled path agrees with the eager one to float tolerance (inductor fuses and
reorders float operations), not bit for bit (tests/models/test_compile.py); the eager path is untouched.
"""

from __future__ import annotations

import torch


def compile_models(*modules: torch.nn.Module | None) -> None:
    """Compile each module's forward in place (None entries are skipped)."""
    for module in modules:
        if module is not None and not is_compiled(module):
            module.compile(dynamic=True)


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is compiled (`nn.Module.compile`)."""
    return getattr(module, "_compiled_call_impl", None) is not None
