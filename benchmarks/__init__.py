"""polgrad's benchmarks: polgrad vs TRL's GRPOTrainer, loss numerics, HF vs vLLM rollouts.

A plain folder at the repository root, not part of the installed package: run it from the root as
`python -m benchmarks.bench` (or `python -m benchmarks.vllm_bench`). It uses polgrad only through its
public API; polgrad's phases are timed through `polgrad.hooks`, never by patching polgrad.
"""
