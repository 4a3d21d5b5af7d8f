"""benchmarks/: the loss identity behind the composition benchmark, and a smoke run of the machinery.

Timings are never asserted here (2 shared cores); only that the bench runs, writes its files, and that
its workload is what it claims (exactly L tokens per completion, the same loss as TRL's).
"""

from __future__ import annotations

import csv
import json
import math
import os

import gin
import pytest
import torch

from benchmarks import bench
from benchmarks.numerics import fused_grpo_loss, grpo_algorithm, loss_inputs, loss_numerics
from benchmarks.timing import PhaseClock, patched
from benchmarks.trl_run import trl_available
from benchmarks.workload import Workload, make_model
from polgrad.registry import StepCounts

HAS_TRL = trl_available()
# CI's set-up installs the `bench` extra: there a missing TRL is an error, not a skip.
if os.environ.get("CI") == "true" and not HAS_TRL:
    raise ImportError("CI=true but TRL is not installed: `bash .ci/setup --test` installs the bench extra")
# A model small enough for a step in well under a second (head_dim must stay >= 32).
TINY = ["--hidden", "64", "--heads", "2", "--kv-heads", "1", "--layers", "1", "--intermediate", "64"]


def _composed(algo, x, leaf, counts):
    loss, _, metrics = algo.loss({**x, "logp": leaf}, counts, kl_coef=algo.kl_coef)
    return loss, metrics


def _fused(x, leaf, counts):
    return fused_grpo_loss(
        leaf,
        x["old_logp"],
        x["ref_logp"],
        x["adv"],
        x["mask"],
        x["entropy"],
        num_tokens=counts.num_tokens,
        num_seqs=counts.num_seqs,
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fused_loss_equals_composed_algorithm_loss_float64(seed):
    """The hand-fused GRPO loss is the composed registry/grpo.gin loss: value, gradient, metrics (1e-12)."""
    algo = grpo_algorithm()
    x = loss_inputs(16, 24, seed=seed)
    # garbage in the padding must not leak into either loss or gradient
    pad = x["mask"] == 0
    for k in ("logp", "old_logp", "ref_logp"):
        x[k] = x[k].masked_fill(pad, float("nan"))
    counts = StepCounts.of_step([x["mask"]])
    leaf_c = x["logp"].clone().requires_grad_(True)
    leaf_f = x["logp"].clone().requires_grad_(True)
    loss_c, metrics_c = _composed(algo, x, leaf_c, counts)
    loss_f, metrics_f = _fused(x, leaf_f, counts)
    loss_c.backward()
    loss_f.backward()
    assert torch.isfinite(loss_c) and torch.isfinite(leaf_c.grad).all()
    assert abs(float(loss_c.detach()) - float(loss_f.detach())) <= 1e-12
    assert float((leaf_c.grad - leaf_f.grad).abs().max()) <= 1e-12
    assert set(metrics_f) <= set(metrics_c)
    for k, v in metrics_f.items():
        assert abs(float(metrics_c[k]) - float(v)) <= 1e-12, k
    # not vacuous: both clip bounds bind somewhere and the KL term is non-zero
    assert float(metrics_c["clip/clip_low"]) > 0 and float(metrics_c["clip/clip_high"]) > 0
    assert float(metrics_c["kl_loss"]) > 0


def test_fused_loss_known_value():
    """Two tokens, A = 1, eps 0.2, beta 0.04, worked by hand from the formula in the docstring.

    token 1: rho = 1, pg = -1; x = logp - ref = 0.2, k3 = e^-0.2 - 1 + 0.2.
    token 2: rho = e^-0.5 < 0.8 with A > 0 (min picks rho*A, no clipping), pg = -e^-0.5; x = 0, k3 = 0.
    loss = mean over the sequence's two tokens (one sequence).
    """
    dt = torch.float64
    logp = torch.tensor([[-1.0, -2.0]], dtype=dt, requires_grad=True)
    old = torch.tensor([[-1.0, -1.5]], dtype=dt)
    ref = torch.tensor([[-1.2, -2.0]], dtype=dt)
    adv = torch.ones(1, 2, dtype=dt)
    mask = torch.ones(1, 2, dtype=dt)
    loss, metrics = fused_grpo_loss(logp, old, ref, adv, mask, num_tokens=2.0, num_seqs=1.0)
    expected = ((-1.0 + 0.04 * (math.exp(-0.2) - 1.0 + 0.2)) + (-math.exp(-0.5))) / 2.0
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-15)
    assert float(metrics["clip/clip_low"]) == 0.0 and float(metrics["clip/clip_high"]) == 0.0
    algo = grpo_algorithm()
    composed, _, _ = algo.loss(
        {"logp": logp, "old_logp": old, "ref_logp": ref, "adv": adv, "mask": mask},
        StepCounts.of_step([mask]),
        kl_coef=algo.kl_coef,
    )
    assert float(composed.detach()) == pytest.approx(expected, abs=1e-15)


def test_workload_rejects_bad_settings():
    with pytest.raises(ValueError):
        Workload(warmup=0)
    with pytest.raises(ValueError):
        Workload(group_size=1)
    with pytest.raises(ValueError):
        Workload(eos="sometimes")
    assert Workload(prompts=3, group_size=4).batch == 12


@pytest.mark.skipif(not HAS_TRL, reason="needs trl (bash .ci/setup --test)")
@pytest.mark.parametrize("on", [False, True])
def test_both_frameworks_get_the_workloads_gradient_checkpointing(tmp_path, on):
    """TRL's GRPOConfig checkpoints activations by default and polgrad does not: the bench gave TRL its
    default while polgrad ran without, and the peak-memory gap it reported was that setting's (issue
    41's profile). Each framework now gets the workload's setting, off in the headline."""
    from benchmarks.polgrad_run import polgrad_bindings
    from benchmarks.trl_run import trl_config

    w = Workload(gradient_checkpointing=on)
    assert trl_config(w, str(tmp_path), steps=1).gradient_checkpointing is on
    assert f"train.gradient_checkpointing = {on}" in polgrad_bindings(w, str(tmp_path), 1)


def test_logits_share_known_value():
    """qwen05b's workload: 4 prompts x G 8 = 32 rows, 32 response tokens + 1 kept position, V = 151,936:
    32 * 33 * 151,936 logits * 4 bytes = 641,777,664 B = 612.05 MiB, above one 2^24-logit chunk; against
    peaks of 14,620 and 11,958 MiB that is 4.2% and 5.1%. The tiny vocabulary's [64, 33, 16] fits one
    chunk."""
    from benchmarks.report import logits_share

    w = Workload(prompts=4, group_size=8, max_new_tokens=32)
    rows = [{"polgrad_peak_rss_mb": 14620.0, "trl_peak_rss_mb": 11958.0}]
    (line,) = logits_share(w, 151_936, rows, ["polgrad", "trl"])
    assert (
        "[32, 33, 151936] logits a training forward keeps is 612 MiB, 4.2% of polgrad's and 5.1% of trl's"
        in line
    )
    assert "holds 16777216 of them (64 MiB fp32) at a time" in line
    (small,) = logits_share(Workload(), 16, rows, ["polgrad", "trl"])
    assert "[64, 33, 16] logits" in small and "fit one chunk" in small


def test_step_flops_known_value():
    """hidden 64, 1 layer, 2 query / 1 kv heads (head_dim 32), SwiGLU 64, vocab 16, by hand:
    N = 64*(64 + 2*32) + 64*64 + 3*64*64 = 24576 linear weights; F(rows, S, n) = rows*(2*N*S +
    4*layers*d_attn*S(S+1)/2 + 2*V*H*n) with d_attn = 64. B = 2 rows, P = 1, L = 1:
    gen F(2, 1, 1) = 2*(49152 + 256 + 2048) = 102912; ref F(2, 2, 1) = 2*(98304 + 768 + 2048) = 202240;
    train 3*202240 = 606720; total 911872."""
    from benchmarks.roofline import step_flops

    w = Workload(prompts=1, group_size=2, max_new_tokens=1, hidden=64, layers=1, heads=2, kv_heads=1,
                 intermediate=64)  # fmt: skip
    f = step_flops(w, vocab=16, prompt_len=1)
    assert (f["gen"], f["ref"], f["train"], f["total"]) == (102912, 202240, 606720, 911872)


@pytest.mark.parametrize("preset", ["tiny", "24m"])
def test_presets_match_the_built_model(preset):
    """--preset's model: the 24m preset has 23.6M parameters, and the roofline's N is the built model's
    count of decoder linear weights (biases and norms excluded), counted here from its modules."""
    from benchmarks.roofline import model_shape
    from benchmarks.workload import PRESETS, bench_task
    from polgrad import models

    w = Workload(**PRESETS[preset])
    model, _ = models.build_tiny(bench_task(), **w.model_kwargs)
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert model_shape(w, model.config.vocab_size)["N"] == linear
    if preset == "24m":
        assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 23.6
        assert model.config.head_dim == 64


def test_output_folders_and_precision_flag():
    """The headline (default OMP policy) goes to results/bench[/<preset>]; a set policy is a variant."""
    assert bench.default_out("tiny", "default") == os.path.join("results", "bench")
    assert bench.default_out("24m", "default") == os.path.join("results", "bench", "24m")
    assert bench.default_out("24m", "passive") == os.path.join("results", "bench", "24m", "omp_passive")
    assert bench.default_out("24m", "default", True) == os.path.join(
        "results", "bench", "24m", "gradient_checkpointing"
    )
    assert bench._precisions("fp32,bf16") == ["fp32", "bf16"]
    with pytest.raises(SystemExit, match="valid: fp32, bf16"):
        bench._precisions("fp16")
    assert bench._peak_sizes("256,512") == [256, 512]
    for bad in ("0", "x", ""):
        with pytest.raises(SystemExit, match="--peak-sizes .*comma-separated matrix sizes >= 1"):
            bench._peak_sizes(bad)
    assert Workload().omp_wait_policy == "default"


def test_worker_env_keeps_the_users_omp_policy(monkeypatch):
    from benchmarks.workers import worker_env

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("LOCAL_RANK", "0")  # what polgrad's setup() leaves in a process that trained
    assert "LOCAL_RANK" not in worker_env(Workload())
    assert worker_env(Workload())["OMP_WAIT_POLICY"] == "ACTIVE"  # default: the environment's own
    assert worker_env(Workload(omp_wait_policy="passive"))["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert "OMP_WAIT_POLICY" not in worker_env(Workload())


def test_phase_clock_and_patches_restore():
    class Obj:
        def f(self, x):
            return x + 1

    o = Obj()
    clock = PhaseClock()
    clock.add("before", 1.0)  # no step open yet: kept apart
    with patched([(o, "f", clock.timed("work", o.f))]):
        clock.new_step()
        assert o.f(1) == 2 and o.f(2) == 3
    assert "f" not in vars(o) and o.f(1) == 2
    assert clock.extra == {"before": 1.0}
    assert set(clock.steps[0]) == {"work"} and clock.steps[0]["work"] >= 0


def test_never_eos_model(tmp_path):
    """The bench tokenizer's EOS has no logit, so no sampler can stop a completion early."""
    from polgrad import models

    w = Workload(hidden=64, heads=2, kv_heads=1, layers=1, intermediate=64)
    info = make_model(str(tmp_path / "m"), w)
    tok = models.load_tokenizer(info["model_dir"])
    model = models.load_policy(info["model_dir"])
    assert tok.eos_token_id == model.config.vocab_size == info["vocab"]
    assert model.get_output_embeddings().weight.shape[0] == info["vocab"]


def test_a_real_vocabulary_model_encodes_text_as_the_character_one_and_samples_every_id(tmp_path):
    """--vocab (the 24m_v32k, 24m_v152k and qwen05b presets): the tokenizer is padded with fillers and
    the tied embedding resized to V; prompts encode to the same ids as with the 16-token tokenizer;
    a filler id decodes as its name; the never-EOS sits at id V, past every logit."""
    from benchmarks.workload import PRESET_WORKLOADS, PRESETS, bench_task
    from polgrad import models

    v = 1000
    w = Workload(hidden=64, heads=2, kv_heads=1, layers=1, intermediate=64, vocab=v)
    info = make_model(str(tmp_path / "m"), w)
    tok = models.load_tokenizer(info["model_dir"])
    model = models.load_policy(info["model_dir"])
    assert model.config.vocab_size == info["vocab"] == v == tok.eos_token_id
    assert model.get_output_embeddings().weight.shape == (v, 64)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    chars = models.build_tokenizer(bench_task().alphabet)
    prompt = "12+34="
    assert tok(prompt)["input_ids"] == chars(prompt)["input_ids"]
    assert tok.decode([v - 1]) == f"<|t{v - 1}|>"
    with pytest.raises(ValueError, match="vocab must be 0"):
        Workload(vocab=-1)
    assert PRESETS["24m_v152k"]["vocab"] == PRESETS["qwen05b"]["vocab"] == 151_936
    assert PRESET_WORKLOADS["qwen05b"]["prompts"] == 4


def test_the_qwen05b_preset_is_qwen2_5_0_5b_shaped():
    """494M parameters (Qwen2.5-0.5B's count with tied embeddings), head_dim 64, on the meta device
    (no memory)."""
    from benchmarks.workload import PRESETS, bench_task
    from polgrad import models

    w = Workload(**PRESETS["qwen05b"])
    with torch.device("meta"):
        model, _ = models.build_tiny(bench_task(), **w.model_kwargs)
        model.resize_token_embeddings(w.vocab, mean_resizing=False)
    assert model.config.head_dim == 64 and model.config.tie_word_embeddings
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == 494


@pytest.mark.cpu_matrix
@pytest.mark.parametrize("frameworks", ["polgrad,trl" if HAS_TRL else "polgrad"])
def test_cli_compare_and_composition_smoke(tmp_path, frameworks, capsys):
    """One interleaved pair of fresh-process runs on a tiny workload, plus a tiny composition benchmark."""
    out = tmp_path / "out"
    argv = [
        "--only",
        "compare,composition",
        "--frameworks",
        frameworks,
        "--pairs",
        "1",
        "--steps",
        "1",
        "--warmup",
        "1",
        "-G",
        "2",
        "-L",
        "4",
        "--prompts",
        "2",
        "--threads",
        "1",
        *TINY,
        "--precision",
        "fp32,bf16",
        "--peak-sizes",  # the default 2048 takes ~45 s per bf16 mm on a CPU without native bf16 (AVX2)
        "256",
        "--composition-shape",
        "4x8",
        "--composition-blocks",
        "3",
        "--out",
        str(out),
    ]
    assert bench.main(argv) == 0
    rows = list(csv.DictReader(open(out / "grpo_vs_trl.csv")))
    assert len(rows) == 1
    fws = frameworks.split(",")
    for fw in fws:
        assert float(rows[0][f"{fw}_s_per_step"]) > 0
        assert float(rows[0][f"{fw}_tokens_per_step"]) == 2 * 2 * 4  # every completion exactly L tokens
        assert float(rows[0][f"{fw}_peak_rss_mb"]) > 0
    for key in (*fws, *(f"{fw}_bf16" for fw in fws)):  # every framework at both precisions
        assert float(rows[0][f"{key}_s_per_step"]) > 0
        assert 0 < float(rows[0][f"{key}_roofline"]) < 1, key  # achieved GFLOP/s over the measured peak
    assert float(rows[0]["peak_fp32_gflops"]) > 0 and float(rows[0]["peak_bf16_gflops"]) > 0
    assert "torch.mm, square 256," in open(out / "summary.md").read()  # the sizes it measured at
    assert 0 <= float(rows[0]["polgrad_approx_kl"]) < 1e-9  # fp32 sampler and trainer agree to rounding
    assert 0 <= float(rows[0]["polgrad_bf16_approx_kl"]) < 1e-3  # bf16: rounding (0 on short rows)
    assert float(rows[0]["polgrad_bf16_over_fp32"]) > 0
    if "trl" in fws:
        assert float(rows[0]["speedup"]) > 0 and float(rows[0]["speedup_bf16"]) > 0
    summary = open(out / "summary.md").read()
    assert "## Roofline" in summary and "OMP_WAIT_POLICY" in summary and "variant" not in summary
    comp = list(csv.DictReader(open(out / "composition.csv")))
    assert [r["pass"] for r in comp] == ["forward", "forward+backward"]
    assert os.path.getsize(out / "summary.md") > 0
    assert "speedup" in capsys.readouterr().out or "trl" not in fws


@pytest.mark.skipif(not HAS_TRL, reason="needs the `bench` extra (trl)")
def test_polgrad_loss_equals_trl_grpo_loss(tmp_path):
    """On identical float64 inputs, polgrad's GRPO loss is TRL's loss_type='grpo' loss (beta 0.04, k3,
    use_bias_correction_kl=False), value and gradient; end to end (own fp32 forwards) they agree to fp32."""
    w = Workload(
        prompts=2,
        group_size=4,
        max_new_tokens=8,
        hidden=64,
        heads=2,
        kv_heads=1,
        layers=1,
        intermediate=64,
        threads=1,
    )
    info = make_model(str(tmp_path / "m"), w)
    num = loss_numerics(w, info["model_dir"], str(tmp_path))
    assert num["frac_tokens_clipped"] > 0 and num["mean_kl_k3"] > 0
    assert num["fn_noguard_loss_abs_diff"] <= 1e-12
    assert num["fn_noguard_grad_max_abs_diff"] <= 1e-12
    assert num["adv_max_abs_diff"] <= 1e-6  # TRL's std carries a float32 Bessel factor
    assert num["e2e_logp_max_abs_diff"] <= 1e-5
    assert num["e2e_grad_cosine"] >= 1 - 1e-6
    gin.clear_config()


@pytest.mark.skipif(not HAS_TRL, reason="needs the `bench` extra (trl)")
def test_polgrad_rloo_step_equals_trl_rlootrainer_step(tmp_path):
    """One step of registry/rloo.gin (+ TRL's default KL: k1 summed in the reward, beta 0.05) and one of
    trl.RLOOTrainer (1.16) on the same weights, prompts and forced completions: TRL's own scoring, KL
    penalty and leave-one-out advantages equal polgrad's, and so does the gradient (on-policy; each
    framework's own fp32 forward). Tolerances: fp32 log-probs differ by ~5e-7 per token, so the summed
    old log-probs by < 1e-5 over 8 tokens, the advantages by beta x that (< 1e-6)."""
    from benchmarks.rloo_numerics import rloo_numerics

    w = Workload(prompts=2, group_size=4, max_new_tokens=8, hidden=64, heads=2, kv_heads=1, layers=1,
                 intermediate=64, threads=1)  # fmt: skip
    info = make_model(str(tmp_path / "m"), w)
    num = rloo_numerics(w, info["model_dir"], str(tmp_path))
    assert num["adv_max_abs"] > 0.01 and num["kl_seq_mean"] != 0  # a non-trivial batch
    assert num["old_logps_max_abs_diff"] <= 1e-5
    assert num["adv_max_abs_diff"] <= 1e-6
    assert num["adv_without_kl_max_abs_diff"] > 1e-4  # the KL penalty is part of what agrees
    assert num["grad_rel_diff"] <= 1e-5 and num["grad_cosine"] >= 1 - 1e-9
    assert num["loss_trl_formula_diff"] <= 1e-6 and num["loss_polgrad_formula_diff"] <= 1e-12
    gin.clear_config()


def _polgrad_callables() -> dict[tuple[str, ...], object]:
    """Every function and class of every loaded polgrad module, and every attribute of those classes:
    a patch of any of them (module function, method, class) shows as a different object."""
    import inspect
    import sys

    found = {}
    for modname, mod in list(sys.modules.items()):
        if mod is None or not (modname == "polgrad" or modname.startswith("polgrad.")):
            continue
        for name, value in list(vars(mod).items()):
            if inspect.isfunction(value) or inspect.isclass(value):
                found[(modname, name)] = value
            if inspect.isclass(value) and value.__module__.startswith("polgrad"):
                for attr, member in list(vars(value).items()):
                    found[(modname, name, attr)] = member
    return found


def _replaced(before: dict, now: dict) -> set:
    """Keys whose object changed, except torch's own profiler hook: the first instance of an
    Optimizer subclass wraps its class's `step` (Optimizer._patch_step_function), bench or not."""
    return {
        k
        for k, v in before.items()
        if now.get(k, v) is not v and not (getattr(now[k], "hooked", False) and now[k].__wrapped__ is v)
    }


def test_polgrad_run_times_phases_through_hooks_without_patching(tmp_path):
    """run_polgrad's per-step phases come from polgrad.hooks: every measured step has non-zero time in
    each phase the GRPO step runs, while no function, class or method of polgrad is replaced
    (checked from inside the run, at every step and at every phase the bench times)."""
    import polgrad.distributed
    import polgrad.trainer  # noqa: F401  (loads the modules the run uses before the baseline)
    from benchmarks.polgrad_run import HOOK_PHASES, run_polgrad
    from polgrad import hooks
    from polgrad.algorithm import Algorithm
    from polgrad.rollout import hf

    w = Workload(
        prompts=2, group_size=2, max_new_tokens=4, steps=2, warmup=1, threads=1,
        hidden=64, heads=2, kv_heads=1, layers=1, intermediate=64,
    )  # fmt: skip
    info = make_model(str(tmp_path / "m"), w)
    named = {
        "hf.generate": (hf, "generate"),
        "hf._decode": (hf, "_decode"),
        "hf.response_logprobs": (hf, "response_logprobs"),
        "Algorithm.loss": (Algorithm, "loss"),
        "distributed.backward": (polgrad.distributed, "backward"),
        "distributed.step": (polgrad.distributed, "step"),
    }
    before_named = {k: id(getattr(o, a)) for k, (o, a) in named.items()}
    before = _polgrad_callables()
    seen: list[str] = []
    changed: set[tuple[str, ...]] = set()

    def check(where: str) -> None:
        seen.append(where)
        now = _polgrad_callables()
        changed.update(_replaced(before, now))
        changed.update((k,) for k, (o, a) in named.items() if id(getattr(o, a)) != before_named[k])

    threads = torch.get_num_threads()
    try:
        with hooks.listen(
            on_phase=lambda path, _: check(path) if path in HOOK_PHASES else None, on_event=check
        ):
            res = run_polgrad(w, info["model_dir"], str(tmp_path / "work"))
    finally:
        torch.set_num_threads(threads)
        gin.clear_config()
    assert seen.count("step") == w.warmup + w.steps + 1 and "sample/decode" in seen
    assert not changed, f"polgrad attributes replaced during the run: {sorted(changed)}"
    assert {k: id(getattr(o, a)) for k, (o, a) in named.items()} == before_named
    assert len(res["step_phases"]) == w.steps
    for step in res["step_phases"]:
        for phase in ("gen", "sample", "reward", "ref", "policy_fwd", "loss", "backward", "optim"):
            assert step[phase] > 0, (phase, step)
        assert step["gen"] >= step["sample"]  # the decode loop is inside the rollout call
    assert res["tokens_per_completion"] == w.max_new_tokens


def test_worker_env_drops_launcher_variables(monkeypatch):
    """polgrad.distributed.setup() leaves LOCAL_RANK=0 behind; a TRL worker that inherits it waits for
    an env:// rendezvous (accelerate) and dies on the missing MASTER_ADDR. This failed CI once."""
    from benchmarks.workers import worker_env

    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "0")
    monkeypatch.setenv("POLGRAD_KEEP_ME", "1")
    env = worker_env(Workload())
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} & set(env)
    assert env["POLGRAD_KEEP_ME"] == "1"


def test_cli_lora_smoke(tmp_path):
    """--only lora: one interleaved round of PPO with full copies vs shared LoRA (fresh processes, one
    measured step each) writes lora.csv and adds its section to an existing summary.md, keeping the rest
    (a re-run replaces its section: test_merge_section_replaces_or_appends)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.md").write_text("# polgrad bench\n\n## Roofline\n\nkept\n")
    argv = ["--only", "lora", "--lora-pairs", "1", "--steps", "1", "--warmup", "1", "-G", "2", "-L", "4",
            "--prompts", "2", "--threads", "1", *TINY, "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    rows = list(csv.DictReader(open(out / "lora.csv")))
    assert len(rows) == 1
    for arm in ("ppo_full", "ppo_lora"):
        assert float(rows[0][f"{arm}_s_per_step"]) > 0 and float(rows[0][f"{arm}_peak_rss_mb"]) > 0
    # LoRA trains the adapter (r 4 on q and v of 1 layer: 4 (64 + 64) + 4 (64 + 32)) and the head (65)
    assert int(rows[0]["ppo_lora_trainable_params"]) == 4 * (64 + 64) + 4 * (64 + 32) + 65
    assert int(rows[0]["ppo_full_trainable_params"]) > 10 * int(rows[0]["ppo_lora_trainable_params"])
    summary = open(out / "summary.md").read()
    assert (
        "## Roofline\n\nkept" in summary
        and "## LoRA: PPO with full copies vs PPO with a shared LoRA" in summary
    )


def test_merge_section_replaces_or_appends():
    s = "# t\n\n## A\n\na\n\n## B\n\nb\n"
    assert bench.merge_section(s, ["## A", "", "new"]) == ["# t", "", "## A", "", "new", "", "## B", "", "b"]
    assert bench.merge_section(s, ["## C", "c"])[-2:] == ["## C", "c"]


def test_cli_metrics_smoke(tmp_path):
    """`--only metrics`: each per-step metric's cost beside polgrad's step, in summary.md and a JSON."""
    out = tmp_path / "out"
    argv = ["--only", "metrics", "--frameworks", "polgrad", "--steps", "1", "--warmup", "1"]
    argv += ["-G", "2", "-L", "4", "--prompts", "2", "--threads", "1", *TINY, "--out", str(out)]
    assert bench.main(argv) == 0
    res = json.load(open(out / "metric_cost.json"))
    names = ["kl_exact", "kl_exact, before (policy forward)", "entropy", "the row (step_row)"]
    assert sorted(res["costs"]) == sorted(names) and res["s_per_step"] > 0
    for c in res["costs"].values():
        assert c["min"] <= c["median"] <= c["max"]
    summary = open(out / "summary.md").read()
    assert "## What each metric costs (2 prompts x G=2 x 4 tokens, fp32" in summary
    assert all(f"| {n} |" in summary for n in names)


def test_compile_rows_overhead_and_break_even_by_hand():
    """Eager 0.20 s/step, compiled 0.15; start-up (build, step-0 eval, 2 warm-up steps) 1.0 s eager
    and 31.1 s compiled: overhead = 30.1 - 2 x (0.15 - 0.20) = 30.2 s, break-even 30.2 / 0.05 = 604."""
    from benchmarks.compile_bench import compile_rows

    e = {"s_per_step": 0.20, "startup_s": 1.0}
    c = {"s_per_step": 0.15, "startup_s": 31.1}
    slower = {"s_per_step": 0.25, "startup_s": 31.1}
    pairs = [
        {"pair": 1, "order": "a", "load_before": 0.1, "polgrad": e, "polgrad_compiled": c},
        {"pair": 2, "order": "b", "load_before": 0.1, "polgrad": e, "polgrad_compiled": slower},
    ]
    cold, warm = compile_rows(pairs, warmup=2)
    assert cold["cache"] == "cold" and warm["cache"] == "warm"
    assert cold["compile_overhead_s"] == pytest.approx(30.2, abs=1e-9)
    assert cold["break_even_steps"] == pytest.approx(604.0, abs=1e-6)
    assert cold["speedup"] == pytest.approx(0.20 / 0.15)
    assert warm["break_even_steps"] == float("inf")  # slower when compiled: never breaks even
    from benchmarks.compile_bench import compile_report

    assert "warm (median of 1)" in compile_report([cold, warm], "x")[-1]
    assert "; warm" not in compile_report([cold], "x")[-1]  # one round: nothing called warm


def _small_sizes_argv(monkeypatch, out, frameworks: str, batch_prompts: str) -> list[str]:
    """`--only sizes` on the 0.6m model and a batch axis on a one-layer stand-in for "6m", 1 round
    of 1 step each: seconds, not minutes."""
    from benchmarks import sizes

    monkeypatch.setitem(sizes.SIZES, "6m", dict(hidden=64, layers=1, heads=2, kv_heads=1, intermediate=64))
    argv = ["--only", "sizes", "--frameworks", frameworks, "--sizes", "0.6m"]
    argv += ["--sizes-batch-prompts", batch_prompts, "--sizes-pairs", "1", "--sizes-steps", "1"]
    argv += ["--sizes-warmup", "1", "-G", "2", "-L", "4", "--prompts", "2", "--threads", "1"]
    return argv + ["--peak-sizes", "256", "--out", str(out)]


def test_cli_sizes_smoke(tmp_path, monkeypatch):
    """`--only sizes` with two small models and a batch axis: a row per point and round, the summary
    table with every arm and the TRL/polgrad ratio where TRL ran, and the figure."""
    out = tmp_path / "out"
    fws = "polgrad,trl" if HAS_TRL else "polgrad"
    # one batch-axis point: each point costs a fresh process per framework (~20 s each); `points`
    # and its batch axis of several are test_sizes_points' claim
    assert bench.main(_small_sizes_argv(monkeypatch, out, fws, "1")) == 0
    rows = list(csv.DictReader(open(out / "sizes.csv")))
    # size axis: 0.6m at 2 x G 2 = 4 rows; batch axis on the "6m" model: 1 x 2 rows
    got = [(r["point"], r["axis"], r["batch"]) for r in rows]
    assert got == [("0.6m x 4", "size", "4"), ("6m x 2", "batch", "2")]
    for r in rows:
        assert 0 < float(r["polgrad_roofline"]) < 1 and float(r["polgrad_s_per_step"]) > 0
    summary = open(out / "summary.md").read()
    assert "## Scaling with the model and the batch" in summary and "| 0.6m x 4 |" in summary
    assert ("TRL/polgrad fp32" in summary) == HAS_TRL
    assert os.path.getsize(out / "sizes.png") > 0


def test_sizes_points():
    """The size axis at the workload's batch, then the batch axis on BATCH_MODEL, without the point
    the size axis already has (BATCH_MODEL at the workload's own batch)."""
    from benchmarks import sizes
    from benchmarks.workload import Workload

    w = Workload(prompts=2, group_size=2)
    got = [(label, axis, wp.batch) for label, axis, wp in sizes.points(w, ["0.6m", "6m"], [1, 2, 4])]
    assert got == [
        ("0.6m x 4", "size", 4),
        ("6m x 4", "size", 4),
        ("6m x 2", "batch", 2),
        ("6m x 8", "batch", 8),
    ]
    assert [wp.prompts for _, _, wp in sizes.points(w, ["0.6m"], [1, 2])] == [2, 1, 2]


def test_cli_sizes_keeps_finished_points_when_a_later_point_dies(tmp_path, monkeypatch):
    """sizes.csv is rewritten after every point: a run that dies at its second point (here a disk
    that fills up, as the 96M point once did after 15 minutes of measuring) keeps the first point's
    rows instead of losing them all."""
    from benchmarks import sizes

    calls = []
    real = sizes.interleaved

    def dies_at_the_second_point(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(sizes, "interleaved", dies_at_the_second_point)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="No space left"):
        bench.main(_small_sizes_argv(monkeypatch, out, "polgrad", "1"))
    assert len(calls) == 2
    rows = list(csv.DictReader(open(out / "sizes.csv")))
    assert [(r["point"], r["axis"]) for r in rows] == [("0.6m x 4", "size")]
    assert float(rows[0]["polgrad_s_per_step"]) > 0


def test_phase_memory_table_known_value():
    """RSS samples at t = 0..4 s of 100, 150, 120, 300, 90 MiB; phase a over [0.5, 2.5] starts at the
    sample before it (100), peaks at 150 and ends at 120; phase b over [2.5, 4] peaks at 300, ends at 90."""
    from benchmarks.phase_memory import phase_table

    samples = [(0.0, 100.0), (1.0, 150.0), (2.0, 120.0), (3.0, 300.0), (4.0, 90.0)]
    a, b = phase_table(samples, [(1, "a", 0.5, 2.5), (1, "b", 2.5, 4.0)])
    assert a.split()[3:9] == ["start", "100", "max", "150", "end", "120"]
    assert b.split()[3:9] == ["start", "120", "max", "300", "end", "90"]


def test_phase_memory_profiles_polgrads_phases(capsys):
    from benchmarks import phase_memory, timing

    add = timing.PhaseClock.add
    assert phase_memory.main(["polgrad", "tiny", "--steps", "1"]) == 0
    assert timing.PhaseClock.add is add  # the clock is given back
    out = capsys.readouterr().out
    for phase in ("gen", "ref", "policy_fwd", "backward", "optim"):
        assert f" {phase} " in out, phase
    peak = float(out.rsplit("peak ", 1)[1].split()[0])
    assert peak > 100  # a Python process with torch and a model holds more than 100 MiB
