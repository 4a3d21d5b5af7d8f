"""`python -m benchmarks.bench`: a full polgrad GRPO step against TRL's GRPOTrainer on one CPU workload.

One command runs, interleaved A B / B A so that machine drift cancels within each pair:

    compare      polgrad (`polgrad.train.run`, registry/grpo.gin) vs TRL (`trl.GRPOTrainer`), >= 5 rounds,
                 at each `--precision` (fp32, bf16 or both: every round runs every framework x precision)
    numerics     one identical batch through TRL's `_compute_loss` and polgrad's `Algorithm.loss`
    composition  the composed `Algorithm.loss` vs one hand-fused GRPO loss function (same numbers)
    scaling      seconds per step vs group size G and vs completion length L, both frameworks
    compile      (not in the default) polgrad eager vs train.compile = True, interleaved: s/step, the
                 compile overhead and the break-even step (benchmarks/compile_bench.py), compile.csv
    sizes        (not in the default) s/step, tokens/s and roofline fraction against the model size (0.6M to
                 96M parameters) and the batch, both frameworks x precisions (benchmarks/sizes.py):
                 sizes.csv, sizes.png and a table
    metrics      what each per-step metric (kl_exact, entropy, the row) costs polgrad's step
                 (benchmarks/metric_cost.py): a table in summary.md and metric_cost.json
    lora         (--only lora, not in the default) PPO with full copies vs PPO with a shared LoRA:
                 peak RSS and s/step side by side (benchmarks/lora_bench.py), --lora-pairs rounds
    --scaling-large  the compare at 16 prompts x G=16 x 128 tokens (every precision), its own CSV

and writes results/bench/ for `--preset tiny`, results/bench/24m/ for `--preset 24m` (override with
--out); a non-default `--omp-wait-policy X` is a labelled variant written to <that>/omp_X/, and
`--gradient-checkpointing` (both frameworks recompute their layers in the backward, TRL's own
default; the headline runs neither, polgrad's default) one written to <that>/gradient_checkpointing/:

    grpo_vs_trl.csv        one row per interleaved round: seconds per step, tokens/s (end to end and
                           sampling alone), peak RSS, phases, model GFLOP/s and roofline fraction per
                           run (columns `polgrad_*`, `trl_*` in fp32, `polgrad_bf16_*`, `trl_bf16_*`),
                           the per-round ratios speedup = TRL s/step / polgrad s/step (fp32),
                           speedup_bf16, polgrad_bf16_over_fp32 = polgrad fp32 s/step / bf16 s/step,
                           polgrad's sampler/trainer approx_kl, load average before and after
    scaling_large.csv      the same columns for the 16 x 16 x 128 workload (--scaling-large)
    grpo_vs_trl_runs.csv   one row per run (framework, pair, every step time, every phase median)
    numerics.json          polgrad vs TRL on one batch: loss functions, advantages, end to end
    composition.csv        composed vs fused loss timings (forward, forward+backward)
    scaling.csv            one row per run of the G and L sweeps
    lora.csv               one row per round of --only lora: each arm's s/step, peak RSS, trainable
                           parameters, and the ratios full / LoRA
    summary.md             what the printout shows

The workload (defaults; flags change G, L, prompts, model size, threads, pairs, steps):
  model     one random-init Qwen2 from `polgrad.models.build_tiny` and its character tokenizer (vocab
            16), saved once with `save_pretrained`; both frameworks load policy and reference from it
            (fp32, sdpa). `--preset tiny`: hidden 128, 4 layers, 4 query / 2 kv heads (head_dim 32),
            SwiGLU 256, tied embeddings: 594k parameters. `--preset 24m`: hidden 512, 8 layers, 8 / 4
            heads (head_dim 64), SwiGLU 1408: 23.6M parameters. A real vocabulary: `24m_v32k` and
            `24m_v152k` (the 24m body at 32,000 and 151,936 tokens: the tokenizer padded with filler
            tokens, the tied embedding resized; their random-init model samples every token id), and
            `qwen05b`, Qwen2.5-0.5B's configuration (hidden 896, 24 layers, 14 / 2 heads, SwiGLU 4864,
            151,936 tokens, tied; 494M parameters) at 4 prompts x G=8 so that both frameworks fit
            24 GiB. --hidden, --vocab etc. override the preset.
  precision fp32, or bf16 as each framework's users switch it on: polgrad `train.bf16 = True`
            (DeepSpeed bf16: bf16 module, fp32 master weights and AdamW state), TRL `bf16=True`
            (fp32 model, Accelerate's bf16 autocast); both cast logits to fp32 for the log-softmax.
  data      prompts of polgrad's `add` task (digits=2); 8 prompts x G=8 samples per step = 64 rows.
  sampling  temperature 1, top_p 1, no top_k, exactly L=32 new tokens per completion (EOS below).
  loss      GRPO: group advantages (r - mean) / (std + 1e-4), Bessel's std (TRL's eps; polgrad's spec
            is rebound to advantage.grpo.eps = 1e-4), PPO clip eps 0.2, KL beta 0.04 with k3 in the
            loss, seq-mean-token-mean aggregation (TRL loss_type="grpo"), one gradient step per batch
            (num_iterations=1, one minibatch, one micro-batch of all 64 rows). TRL runs with
            use_bias_correction_kl=False: its default multiplies k3 by the (differentiable) ratio,
            which changes the KL gradient even on-policy, so it is not GRPO's loss.
  optimiser AdamW lr 1e-4, betas (0.9, 0.999), eps 1e-8, no weight decay, constant LR, grad-norm clip
            1.0 (each framework's own AdamW: polgrad torch AdamW via DeepSpeed, TRL adamw_torch_fused).
  reward    the task's verifiable reward with partial credit (task.add.partial=True), the same
            function for both (so advantages are not all zero); its cost is negligible.
  threads   torch.set_num_threads(2) and OMP/MKL_NUM_THREADS=2 in each run's process. OMP_WAIT_POLICY
            is the environment's own (`--omp-wait-policy default`): what `python -m polgrad.train`
            gets, so that is the headline. `passive` / `active` set it for every run and write a
            labelled variant: passive keeps a shared, oversubscribed CPU from stalling 2-thread runs
            5-20x (libgomp's spinning threads), but slows both frameworks on a quiet machine
            (polgrad 0.269 vs 0.185 s/step on the tiny workload, TRL more), so it is never the headline.
  roofline  model FLOPs per step from the workload (formula in benchmarks/roofline.py), and the
            fp32 and bf16 torch.mm peaks measured in the same run on the same threads.

EOS: a random-init model emits its EOS token now and then, and the two frameworks would then stop
different rows at different times. To give both exactly L tokens per completion without touching
either framework's code, the saved tokenizer gets one extra special token `<|never|>` as its EOS,
with an id equal to the model's vocabulary size: no logit exists for it, so neither sampler can
ever draw it, and both decode exactly L tokens (the old `<|eos|>` id stays an ordinary token).
The bench checks that every completion has exactly L tokens on both sides. `--eos natural` keeps
the model's real EOS instead (same model and sampling distribution, so the same length
distribution in expectation; compare tokens/s then).

Timing: each run is a fresh subprocess (`python -m benchmarks.bench --worker ...`, started from the
repository root; its peak RSS is its own, and neither framework's global state leaks into the other).
Seconds per step is the wall time between the ends of consecutive optimizer steps, the first
`--warmup` steps discarded, median over the rest. Phases: `sample` is the sampling loop alone, `gen`
the whole rollout call around it (tokenise, sample, decode text), then `reward`, `ref` (reference
log-probs), `policy_fwd` (policy forward with entropy), `loss` (the loss from log-probs), `backward`,
`optim` (grad clip + AdamW), and `other` = step - everything else. polgrad is timed through its
public phase hooks (`polgrad.hooks.listen`; its phases sample, sample/decode, reward, ref, policy_fwd,
loss, backward, optim map onto the ones above, see benchmarks/polgrad_run.py), never by patching it;
TRL, which has no hooks, by wrapping its own functions inside the worker (`_generate`,
`model.generate`, ...; no source change). polgrad's own metrics.jsonl phases (time_gen, time_ref,
time_update, ...) are reported too.

The numbers are the machine's: 2 shared cores, so the bench never asserts a timing;
tests/project/test_bench.py checks the machinery and the loss identities only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from benchmarks.compile_bench import ARMS as COMPILE_ARMS
from benchmarks.compile_bench import compile_report, compile_rows
from benchmarks.composition import composition_worker
from benchmarks.lora_bench import ARMS as LORA_ARMS
from benchmarks.lora_bench import lora_report, lora_rows, run_ppo, trainable_params
from benchmarks.metric_cost import metric_cost, metric_report
from benchmarks.numerics import loss_numerics
from benchmarks.polgrad_run import run_polgrad
from benchmarks.report import (
    compare_report,
    composition_report,
    logits_share,
    numerics_report,
    pair_rows,
    run_rows,
    scaling,
    scaling_report,
    write_csv,
)
from benchmarks.roofline import matmul_peak, roofline_report, step_flops
from benchmarks.sizes import SIZES, sizes_bench, sizes_report, sizes_summary
from benchmarks.sizes import draw as draw_sizes
from benchmarks.trl_run import run_trl, trl_available
from benchmarks.workers import env_omp_wait_policy, interleaved, loadavg, run_worker
from benchmarks.workload import (
    OMP_WAIT_POLICIES,
    PRECISIONS,
    PRESET_WORKLOADS,
    PRESETS,
    TRL_PIN,
    Workload,
    make_model,
)
from polgrad.io import atomic_write_text
from polgrad.machine import BF16_SLOW, bf16_slowdown, cpu_label


def _worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    w = Workload(**spec["workload"])
    import torch

    torch.set_num_threads(w.threads)
    work = tempfile.mkdtemp(prefix=f"bench-{spec['kind']}-")
    try:
        result = WORKERS[spec["kind"]](w, spec["model_dir"], work, **spec.get("extra", {}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    with open(spec["out"], "w") as f:
        json.dump(result, f)
    return 0


# `--worker SPEC` runs WORKERS[SPEC's kind](workload, model_dir, work_dir, **SPEC's extra)
WORKERS: dict[str, Callable[..., Any]] = {
    "polgrad": run_polgrad,
    "trl": run_trl,
    "numerics": loss_numerics,
    "composition": composition_worker,
    "peak": matmul_peak,
    "metrics": metric_cost,
    "polgrad_compiled": lambda w, model_dir, work: run_polgrad(w, model_dir, work, compile=True),
    **{a: (lambda w, model_dir, work, a=a: run_ppo(w, model_dir, work, a)) for a in LORA_ARMS},
}
LARGE = dict(prompts=16, group_size=16, max_new_tokens=128)  # --scaling-large
PARTS = ("compare", "numerics", "composition", "scaling", "metrics", "compile", "sizes", "lora")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pairs", type=int, default=5, help="interleaved polgrad/TRL pairs (>= 5 for the report)"
    )
    ap.add_argument("--steps", type=int, default=8, help="measured steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="discarded steps at the start of each run")
    ap.add_argument("--prompts", type=int, default=None, help="default 8 (4 for --preset qwen05b)")
    ap.add_argument("--group-size", "-G", type=int, default=8)
    ap.add_argument("--max-new-tokens", "-L", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--preset", choices=tuple(PRESETS), default="tiny", help="the model (see above)")
    for flag in ("--hidden", "--layers", "--heads", "--kv-heads", "--intermediate", "--vocab"):
        ap.add_argument(flag, type=int, default=None, help="overrides the preset")
    ap.add_argument(
        "--precision",
        default="fp32",
        help="fp32, bf16 or fp32,bf16 (every round runs each framework at each)",
    )
    ap.add_argument("--bf16", action="store_true", help="same as --precision bf16")
    ap.add_argument("--eos", choices=("never", "natural"), default="never")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--omp-wait-policy",
        choices=OMP_WAIT_POLICIES,
        default="default",
        help="OMP_WAIT_POLICY for every run ('default': the environment's own, the headline; passive/active: "
        "a labelled variant written to <out>/omp_<policy>/)",
    )
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="both frameworks recompute their layers in the backward (polgrad train.gradient_checkpointing, "
        "TRL's default): a labelled variant written to <out>/gradient_checkpointing/; without it neither "
        "does (polgrad's default)",
    )
    ap.add_argument(
        "--only",
        default="compare,numerics,composition,scaling,metrics",
        help="comma list of parts to run: compare, numerics, composition, scaling, metrics, compile (eager "
        "vs train.compile; not in the default), lora (PPO with full copies vs shared LoRA: <out>/lora.csv; "
        "not in the default)",
    )
    ap.add_argument("--frameworks", default="polgrad,trl", help="'polgrad' alone skips TRL")
    ap.add_argument("--lora-pairs", type=int, default=3, help="interleaved rounds of --only lora")
    ap.add_argument("--compile-pairs", type=int, default=3, help="interleaved rounds of --only compile")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"--only sizes: models, of {', '.join(SIZES)}")
    ap.add_argument(
        "--sizes-batch-prompts", default="2,8,32", help="--only sizes: prompts (x G) of the batch axis"
    )
    ap.add_argument("--sizes-pairs", type=int, default=3, help="--only sizes: interleaved rounds per point")
    ap.add_argument("--sizes-steps", type=int, default=3, help="--only sizes: measured steps per run")
    ap.add_argument("--sizes-warmup", type=int, default=1, help="--only sizes: discarded steps per run")
    ap.add_argument("--scaling-group-sizes", default="2,4,8,16")
    ap.add_argument("--scaling-lengths", default="16,32,64,128")
    ap.add_argument("--scaling-pairs", type=int, default=1)
    ap.add_argument(
        "--scaling-large", action="store_true", help="also the compare at 16 prompts x G=16 x 128 tokens"
    )
    ap.add_argument("--scaling-large-pairs", type=int, default=1)
    ap.add_argument(
        "--peak-sizes",
        default="1024,2048",
        help="square sizes of the torch.mm peak the roofline divides by (small ones for a smoke test)",
    )
    ap.add_argument("--composition-shape", default="64x512", help="BxT of the loss micro-benchmark")
    ap.add_argument("--composition-blocks", type=int, default=150, help="interleaved rounds of 5 calls each")
    ap.add_argument("--out", default=None, help="default results/bench[/<preset>][/omp_<policy>]")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker_main(args.worker)

    parts = set(_ints_or_names(args.only))
    precisions = ["bf16"] if args.bf16 else _precisions(args.precision)
    peak_sizes = _peak_sizes(args.peak_sizes)
    frameworks = [f for f in args.frameworks.split(",") if f]
    if "trl" in frameworks and not trl_available():
        print(f"TRL is not importable: polgrad side only (pip install '{TRL_PIN}' or the `bench` extra)")
        frameworks = [f for f in frameworks if f != "trl"]
    model = dict(PRESETS[args.preset])  # the preset, then any --hidden, --vocab, ... over it
    overrides = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")
    model.update({k: getattr(args, k) for k in overrides if getattr(args, k) is not None})
    prompts = (
        args.prompts if args.prompts is not None else PRESET_WORKLOADS.get(args.preset, {}).get("prompts", 8)
    )
    w = Workload(
        prompts=prompts,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        threads=args.threads,
        steps=args.steps,
        warmup=args.warmup,
        **model,
        eos=args.eos,
        seed=args.seed,
        omp_wait_policy=args.omp_wait_policy,
        gradient_checkpointing=args.gradient_checkpointing,
    )
    out = args.out or default_out(args.preset, w.omp_wait_policy, w.gradient_checkpointing)
    os.makedirs(out, exist_ok=True)
    omp = env_omp_wait_policy() if w.omp_wait_policy == "default" else w.omp_wait_policy.upper()
    bf16_ratio = bf16_slowdown()  # polgrad/machine.py: above BF16_SLOW the CPU emulates bf16
    report: list[str] = [
        "# polgrad bench"
        + ("" if w.omp_wait_policy == "default" else f" (variant: OMP_WAIT_POLICY={omp})")
        + (" (variant: gradient checkpointing in both frameworks)" if w.gradient_checkpointing else ""),
        "",
        f"`python -m benchmarks.bench {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(
            "  ", " "
        ),
        "",
        f"versions: {_versions()}; torch threads {w.threads}; OMP_WAIT_POLICY {omp}"
        + (" (the environment's, as `python -m polgrad.train` gets it)" if w.omp_wait_policy == "default" else
           " (set by the bench: a variant, not what `python -m polgrad.train` gets by default)")
        + f"; load average at start {loadavg():.2f}",
        "",
        f"CPU: {cpu_label()}; a 256x256 bf16 matmul takes {bf16_ratio:.2f}x the fp32 time here: "
        + ("bf16 is EMULATED on this CPU, every bf16 number below is of an emulated bf16 (not native)"
           if bf16_ratio > BF16_SLOW else "bf16 is native here"),
    ]  # fmt: skip

    def say(line: str = "") -> None:
        print(line, flush=True)

    longest = max(
        w.max_new_tokens,
        *(_ints(args.scaling_lengths) if "scaling" in parts else [0]),
        LARGE["max_new_tokens"] if args.scaling_large else 0,
    )
    with tempfile.TemporaryDirectory(prefix="polgrad-bench-") as tmp:
        info = make_model(os.path.join(tmp, "model"), w.replace(max_new_tokens=longest))
        model_dir = info["model_dir"]
        log_dir = os.path.join(tmp, "logs")
        report += [
            f"model: --preset {args.preset}, random-init Qwen2 from build_tiny({w.model_kwargs}), "
            f"{info['n_params']} parameters, vocab {info['vocab']}, EOS id {info['eos_id']} ({w.eos}); "
            f"precision {', '.join(precisions)}",
        ]
        say("\n".join(report))

        peak = None
        if "compare" in parts or args.scaling_large:
            say("\n[peak] torch.mm fp32 / bf16 ...")
            peak = run_worker("peak", w, model_dir, log_dir, sizes=peak_sizes)
            flops = step_flops(w, info["vocab"], info["prompt_len"])
            lines = roofline_report(w, flops, peak, info["prompt_len"])
            report += ["", *lines]
            say("\n".join(lines))

        if "compare" in parts:
            say(f"\n[compare] {args.pairs} interleaved rounds of {w.warmup}+{w.steps} steps ...")
            pairs = interleaved(
                w, model_dir, log_dir, args.pairs, frameworks, progress=say, precisions=precisions
            )
            rows = pair_rows(w, pairs, info["n_params"], flops["total"], peak)
            write_csv(os.path.join(out, "grpo_vs_trl.csv"), rows)
            write_csv(os.path.join(out, "grpo_vs_trl_runs.csv"), run_rows(pairs, frameworks))
            lines = compare_report(w, rows, frameworks)
            if any(f"{fw}_peak_rss_mb" in rows[0] for fw in frameworks):
                lines += ["", *logits_share(w, info["vocab"], rows, frameworks)]
            report += ["", *lines]
            say("\n" + "\n".join(lines))

        if args.scaling_large:
            lw = w.replace(**LARGE)
            lflops = step_flops(lw, info["vocab"], info["prompt_len"])["total"]
            say(f"\n[scaling-large] {args.scaling_large_pairs} round(s) at {lw.prompts} x G={lw.group_size} "
                f"x {lw.max_new_tokens} tokens ({lflops / 1e9:.0f} GFLOP per step) ...")  # fmt: skip
            pairs = interleaved(
                lw,
                model_dir,
                log_dir,
                args.scaling_large_pairs,
                frameworks,
                progress=say,
                precisions=precisions,
            )
            rows = pair_rows(lw, pairs, info["n_params"], lflops, peak)
            write_csv(os.path.join(out, "scaling_large.csv"), rows)
            lines = [
                f"## Scaling: {lflops / 1e9:.0f} GFLOP per step",
                "",
                *compare_report(lw, rows, frameworks),
            ]
            report += ["", *lines]
            say("\n".join(lines))

        if "numerics" in parts and "trl" in frameworks:
            say("\n[numerics] one batch through both losses ...")
            num = run_worker("numerics", w, model_dir, log_dir)
            atomic_write_text(os.path.join(out, "numerics.json"), json.dumps(num, indent=2, sort_keys=True))
            lines = numerics_report(num)
            report += ["", *lines]
            say("\n".join(lines))

        if "composition" in parts:
            b, t = (int(x) for x in args.composition_shape.lower().split("x"))
            say(f"\n[composition] Algorithm.loss vs fused_grpo_loss at B={b}, T={t} ...")
            comp = run_worker("composition", w, model_dir, log_dir, b=b, t=t, blocks=args.composition_blocks)
            write_csv(os.path.join(out, "composition.csv"), comp)
            lines = composition_report(comp)
            report += ["", *lines]
            say("\n".join(lines))

        if "scaling" in parts:
            gs, ls = _ints(args.scaling_group_sizes), _ints(args.scaling_lengths)
            say(
                f"\n[scaling] G in {gs} (L={w.max_new_tokens}), L in {ls} (G={w.group_size}), "
                f"{args.scaling_pairs} pair(s) per point ..."
            )
            sw = w.replace(steps=max(3, w.steps // 2))
            rows = scaling(sw, model_dir, log_dir, gs, ls, args.scaling_pairs, frameworks, progress=say)
            write_csv(os.path.join(out, "scaling.csv"), rows)
            lines = [
                "## Scaling (seconds per step; 'per G' / 'per L' = s/step divided by the swept value, "
                "relative to the smallest value: 1.00 everywhere = linear)",
                *scaling_report(rows, frameworks),
            ]
            report += ["", *lines]
            say("\n".join(lines))

        if "metrics" in parts:
            say("\n[metrics] what each per-step metric costs, and polgrad's step for scale ...")
            step = run_worker("polgrad", w, model_dir, log_dir)["s_per_step"]
            cost = run_worker("metrics", w, model_dir, log_dir)
            cost["s_per_step"] = step
            atomic_write_text(
                os.path.join(out, "metric_cost.json"), json.dumps(cost, indent=2, sort_keys=True)
            )
            lines = metric_report(cost, step, w)
            report += ["", *lines]
            say("\n".join(lines))

        if "sizes" in parts:
            names = [x.strip() for x in args.sizes.split(",") if x.strip()]
            bad = [n for n in names if n not in SIZES]
            if bad:
                raise SystemExit(f"error: unknown --sizes {bad}; valid: {', '.join(SIZES)}")
            if peak is None:
                say("\n[peak] torch.mm fp32 / bf16 ...")
                peak = run_worker("peak", w, model_dir, log_dir, sizes=peak_sizes)
            sw = w.replace(steps=args.sizes_steps, warmup=args.sizes_warmup)
            say(f"\n[sizes] {args.sizes_pairs} interleaved round(s) per point ...")
            sizes_csv = os.path.join(out, "sizes.csv")
            rows = sizes_bench(
                sw, tmp, log_dir, names, _ints(args.sizes_batch_prompts), args.sizes_pairs,
                frameworks, precisions, peak, progress=say, on_point=lambda rs: write_csv(sizes_csv, rs),
            )  # fmt: skip
            summ = sizes_summary(rows)
            draw_sizes(summ, os.path.join(out, "sizes.png"))
            lines = sizes_report(summ, sw, precisions, frameworks)
            report += [
                "",
                *lines,
                "",
                "Figure: sizes.png (s/step vs parameters, tokens/s vs batch, TRL/polgrad).",
            ]
            say("\n".join(lines))

        if "compile" in parts:
            say(f"\n[compile] {args.compile_pairs} interleaved rounds: eager vs train.compile = True ...")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")  # round 1 cold
            cw = w.replace(bf16=precisions[0] == "bf16")
            pairs = interleaved(cw, model_dir, log_dir, args.compile_pairs, COMPILE_ARMS, progress=say)
            rows = compile_rows(pairs, cw.warmup)
            write_csv(os.path.join(out, "compile.csv"), rows)
            label = f"{cw.prompts} prompts x G={cw.group_size} x {cw.max_new_tokens} tokens, {cw.precision}"
            lines = compile_report(rows, label)
            report += ["", *lines]
            say("\n".join(lines))

        if "lora" in parts:
            say(f"\n[lora] {args.lora_pairs} interleaved rounds: PPO full copies vs shared LoRA ...")
            pairs = interleaved(w, model_dir, log_dir, args.lora_pairs, LORA_ARMS, progress=say)
            rows = lora_rows(pairs, trainable_params(model_dir))
            write_csv(os.path.join(out, "lora.csv"), rows)
            lora_lines = lora_report(rows, info["n_params"])
            report += ["", *lora_lines]
            say("\n".join(lora_lines))

    summary_path = os.path.join(out, "summary.md")
    if parts == {"lora"} and os.path.exists(summary_path):  # keep the rest of the bench's summary
        report = merge_section(open(summary_path).read(), lora_lines)
    atomic_write_text(summary_path, "\n".join(report) + "\n")
    say(f"\nwrote {out}/")
    return 0


def merge_section(summary: str, section: list[str]) -> list[str]:
    """`summary`'s lines with its section titled like `section[0]` (up to the next '## ') replaced
    by `section`, or `section` appended: `--only lora` adds to the bench's summary.md."""
    lines = summary.rstrip("\n").split("\n")
    if section[0] in lines:
        start = lines.index(section[0])
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        return [*lines[:start], *section, *([""] + lines[end:] if end < len(lines) else [])]
    return [*lines, "", *section]


def default_out(preset: str, omp_wait_policy: str, gradient_checkpointing: bool = False) -> str:
    """results/bench (tiny) or results/bench/<preset>, and omp_<policy>/ and gradient_checkpointing/
    inside for a variant."""
    out = os.path.join("results", "bench", *([] if preset == "tiny" else [preset]))
    out = out if omp_wait_policy == "default" else os.path.join(out, f"omp_{omp_wait_policy}")
    return os.path.join(out, "gradient_checkpointing") if gradient_checkpointing else out


def _precisions(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in PRECISIONS]
    if bad or not names:
        raise SystemExit(f"error: --precision {s!r}: valid: {', '.join(PRECISIONS)} (comma-separated)")
    return names


def _peak_sizes(s: str) -> list[int]:
    try:
        sizes = _ints(s)
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"error: --peak-sizes {s!r}: comma-separated matrix sizes >= 1, e.g. 1024,2048")
    return sizes


def _ints_or_names(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in PARTS]
    if bad:
        raise SystemExit(f"error: unknown --only parts {bad}; valid: {', '.join(PARTS)}")
    return names


def _versions() -> str:
    import importlib.metadata as md

    out = []
    for pkg in ("torch", "transformers", "deepspeed", "peft", "trl", "accelerate"):
        with contextlib.suppress(md.PackageNotFoundError):
            out.append(f"{pkg} {md.version(pkg)}")
    return ", ".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
