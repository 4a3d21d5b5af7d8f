"""The result as a model: a run's `final/` folder, and `python -m polgrad.export` for any checkpoint.

Every run ends with `<out_dir>/final/`:

    final/                  the policy: `save_pretrained` (config.json, model.safetensors,
                            generation_config.json) + its tokenizer. Loads with
                            `transformers.AutoModelForCausalLM.from_pretrained(final)` and with
                            `polgrad.rollout.vllm.VLLMRollout(final)`.
    final/critic/           the critic, where the run has one: `ScalarHeadModel.save_pretrained`
                            (backbone + value_head.safetensors, the reward model's format); loads
                            with `polgrad.models.ScalarHeadModel.from_pretrained(final/critic)`.
    final/adapter/policy/   with LoRA (train.lora_r > 0): the adapter in peft's format; final/ itself
                            is then the adapter merged into the weights, W + (alpha/r) B A (peft's
                            merge_and_unload on a copy), still a plain causal LM, and a LoRA critic's
                            final/critic/ is its adapter merged into a backbone copy + its head.
    final/README.md         model card: the spec's name and source (`Algorithm.name`,
                            `Algorithm.source`), the step, the metrics (summary.json), the
                            operative gin config.

Under ZeRO-3 each rank holds a slice of every parameter: `write_final` gathers them
(`deepspeed.zero.GatheredParameters` over the module's parameters, on every rank: it is
collective) and only rank 0 writes.

    python -m polgrad.export RUN_DIR [--step N] [--out DIR]

builds the same folder (default RUN_DIR/export-step<N>/) from a saved checkpoint,
RUN_DIR/checkpoints/policy/step<N> (the `latest` one without --step), and the critic's beside it.
The checkpoint is checked first with resume's check (`polgrad.checkpoints.damage`): a damaged one is
one line naming the file and the newest intact step to export instead.

Every output folder (final/, an export, RUN_DIR/model/) is written all or nothing
(`polgrad.io.atomic_dir`): into `<name>.tmp-<pid>-<random>` beside it, renamed into place once
complete (an existing folder is renamed aside first and removed after). A kill at any moment leaves
no half-written folder under the destination's name; the next write removes such leftovers.
The weights come from DeepSpeed's own files: at ZeRO stage 0 the module state in
`mp_rank_00_model_states.pt`; at stages 1-3 DeepSpeed's consolidation of the optimizer's fp32
partitions (`deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`), which in
fp32 training are the module's weights (with train.bf16 they are the fp32 master weights).

What the export needs besides the weights (architecture, tokenizer, spec name) is written into
the run at its start, `RUN_DIR/model/` (`save_run_model_files`): `policy/` (config.json,
generation_config.json and the tokenizer), `critic/config.json` (the critic's backbone) and
`spec.json` (name, source). That makes a run directory self-contained: it does not depend on
the model cache or on re-parsing config.gin (the warm-start path is a cache entry that may be gone).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from polgrad import checkpoints, collective, run_folder
from polgrad.errors import DataError, PolgradError
from polgrad.io import atomic_dir, atomic_write_text
from polgrad.layout import export_saved
from polgrad.run_folder import RunFolder

MODEL_DIR = run_folder.MODEL  # RUN_DIR/model/: architecture, tokenizer and spec name for the export
FINAL_DIR = run_folder.FINAL


# --------------------------------------------------------------------------- in the run
def save_run_model_files(m: Any, out_dir: str, name: str, source: str) -> None:
    """RUN_DIR/model/{policy/, critic/config.json, spec.json}: what an export needs but weights (rank 0)."""
    if collective.rank() != 0:
        return
    with atomic_dir(Path(out_dir) / MODEL_DIR) as root:
        _write_run_model_files(m, root, name, source)


def _write_run_model_files(m: Any, root: Path, name: str, source: str) -> None:
    policy = m.engine.module
    policy.config.save_pretrained(root / "policy")
    if getattr(policy, "generation_config", None) is not None:
        policy.generation_config.save_pretrained(root / "policy")
    m.tokenizer.save_pretrained(root / "policy")
    m.critic.write_model_files(root)
    m.layout.write_model_files(policy, m.critic.model, root)  # LoRA: the adapters' configs
    atomic_write_text(str(root / "spec.json"), json.dumps({"name": name, "source": source}, indent=2))


def write_final(m: Any, out_dir: str, *, name: str, source: str, config: str, summary: dict) -> Path:
    """`out_dir/final/`: the engine's current policy (+ critic) and tokenizer, and the model card.

    Collective: every rank calls it (ZeRO-3 gathers the parameters); rank 0 writes."""
    final = Path(out_dir) / FINAL_DIR
    # All or nothing: rank 0 writes into a temp folder beside final/ and renames it into place.
    with atomic_dir(final) if collective.rank() == 0 else contextlib.nullcontext(final) as tmp:
        m.layout.save_final(m.engine.module, m.critic.model, tmp)  # LoRA: merged, with its critic
        m.critic.save_final(tmp)  # a critic of its own (a LoRA critic is written with the policy)
        if collective.rank() == 0:
            m.tokenizer.save_pretrained(tmp)
            card = model_card(name, source, summary.get("steps"), config, summary)
            atomic_write_text(str(tmp / "README.md"), card)
    return final


def model_card(name: str, source: str, step: int | None, config: str, metrics: dict) -> str:
    """The README.md of an exported model: spec, source, step, metrics (scalars) and gin config."""
    rows = [f"| {k} | {v} |" for k, v in sorted(metrics.items()) if not isinstance(v, (dict, list))]
    table5 = metrics.get("table5")
    lines = [
        f"{CARD_TITLE}{name}",
        "",
        f"- spec: `{name}`",
        f"- source: {source or '(Algorithm.source not set)'}",
        f"- step: {step}",
        "",
        "Load with `transformers.AutoModelForCausalLM.from_pretrained(<this folder>)` (tokenizer:",
        "`AutoTokenizer.from_pretrained(<this folder>)`); a `critic/` subfolder, where present, loads",
        "with `polgrad.models.ScalarHeadModel.from_pretrained`.",
        "",
        "## Metrics",
        "",
        "| metric | value |",
        "|---|---|",
        *rows,
    ]
    if table5:
        lines += ["", "Table-5 row: `" + json.dumps(table5, sort_keys=True) + "`"]
    lines += ["", "## Operative config (gin)", "", "```", config.rstrip(), "```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------- from a checkpoint
def checkpoint_tag(run_dir: str | os.PathLike, step: int | None) -> str:
    """The tag of RUN_DIR's policy checkpoint at `step` ('step<N>'), or the `latest` one."""
    ckpt = RunFolder(run_dir).checkpoints_of("policy")
    steps = sorted(int(m.group(1)) for p in ckpt.glob("step*") if (m := re.fullmatch(r"step(\d+)", p.name)))
    if not steps:
        raise DataError(f"{ckpt}: no checkpoints; train with train.checkpoint_every = N to save some")
    if step is None:
        latest = ckpt / "latest"
        if not latest.is_file():
            raise DataError(f"{latest}: missing; pass --step N, one of {', '.join(map(str, steps))}")
        return latest.read_text().strip()
    if step not in steps:
        raise DataError(f"{ckpt}: no checkpoint of step {step}; saved steps: {', '.join(map(str, steps))}")
    return f"step{step}"


def check_run_dir(run_dir: str | os.PathLike) -> Path:
    """`run_dir` as a Path if it is a polgrad run folder (it has checkpoints/ or summary.json), else a
    one-line DataError naming it."""
    run = Path(run_dir)
    if not run.is_dir():
        raise DataError(f"{run}: no such folder; pass the --out folder of a python -m polgrad.train run")
    folder = RunFolder(run)
    if not folder.checkpoints.is_dir() and not folder.summary.is_file():
        raise DataError(
            f"{run}: not a polgrad run folder (no checkpoints/ or summary.json); pass the --out folder "
            "of a python -m polgrad.train run"
        )
    return run


def check_tag(run: Path, tag: str) -> None:
    """The checkpoint `tag` of every part of RUN_DIR/checkpoints is intact (polgrad.checkpoints, the
    check resume uses), else a one-line DataError naming the damaged file and the intact step to export."""
    ckpt = RunFolder(run).checkpoints
    parts = ("policy", "critic") if (ckpt / "critic").is_dir() else ("policy",)
    why = checkpoints.damage(ckpt, tag, parts)
    if why is None:
        return
    intact = checkpoints.newest_intact(ckpt, parts)
    fix = (
        f"export the intact {intact} instead: python -m polgrad.export {run} --step {intact[4:]}"
        if intact
        else "no intact checkpoint is left to export"
    )
    raise DataError(f"{why}; {fix}")


def checkpoint_state_dict(ckpt_dir: Path, tag: str) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a DeepSpeed checkpoint (any ZeRO stage), keys as the module's."""
    # DeepSpeed's names: mp_rank_00_model_states.pt, at ZeRO-3 zero_pp_rank_0_mp_rank_00_model_states.pt
    found = [ckpt_dir / tag / f"{p}mp_rank_00_model_states.pt" for p in ("", "zero_pp_rank_0_")]
    model_states = next((f for f in found if f.is_file()), None)
    if model_states is None:
        raise DataError(f"{found[0]}: missing; the checkpoint {tag} is incomplete, export another step")
    saved = torch.load(model_states, map_location="cpu", weights_only=False)
    stage = int(saved.get("ds_config", {}).get("zero_optimization", {}).get("stage", 0))
    if stage == 0:
        return dict(saved["module"])
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag))


def export_checkpoint(run_dir: str | os.PathLike, step: int | None = None, out: str | None = None) -> Path:
    """Build a `final/`-style folder from RUN_DIR's checkpoint at `step` (default: the latest).

    The checkpoint is checked first (`check_tag`); the folder is written all or nothing (`atomic_dir`:
    a temp folder beside the destination, renamed into place once complete)."""
    run = check_run_dir(run_dir)
    files = run / MODEL_DIR
    if not (files / "policy" / "config.json").is_file():
        raise DataError(
            f"{files / 'policy'}: missing; this run predates polgrad.export (re-run it to export)"
        )
    tag = checkpoint_tag(run, step)
    check_tag(run, tag)
    dest = Path(out) if out else run / f"export-{tag}"
    _check_replaceable(dest)
    with atomic_dir(dest) as tmp:
        _export(run, files, tag, tmp)
    return dest


CARD_TITLE = "# polgrad policy: "  # the first line of model_card: what marks a folder as an export


def _check_replaceable(dest: Path) -> None:
    """`dest` may be replaced whole only when it is missing, empty, or an earlier export (a folder
    whose README.md is polgrad's model card): `--out` naming the run folder itself, or any folder
    holding other files, is refused in one line instead of being swapped out and deleted."""
    if not dest.exists():
        return
    if not dest.is_dir():
        raise DataError(f"--out {dest}: a file is there, not a folder; choose another --out")
    if not any(dest.iterdir()):
        return
    card = dest / "README.md"
    try:
        ours = card.is_file() and card.read_text().startswith(CARD_TITLE)
    except (OSError, UnicodeDecodeError):
        ours = False
    if not ours:
        raise DataError(
            f"--out {dest}: the folder exists and is not a polgrad export (no model card README.md "
            "starting with 'polgrad policy'); an export replaces its destination whole, so choose a new "
            "or empty --out"
        )


def _export(run: Path, files: Path, tag: str, dest: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from polgrad.models import ScalarHeadModel

    folder = RunFolder(run)
    generation_config = None
    if (files / "policy" / "generation_config.json").is_file():
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_pretrained(files / "policy")
    policy_ckpt = folder.checkpoints_of("policy")
    state = checkpoint_state_dict(policy_ckpt, tag)
    # in the run's layout: a LoRA run's adapter(s) merged, else the full weights checked on load
    export_saved(files, state, generation_config, dest, lambda model, st: _load(model, st, policy_ckpt))
    AutoTokenizer.from_pretrained(files / "policy").save_pretrained(dest)
    critic_ckpt = folder.checkpoints_of("critic")
    if (critic_ckpt / tag).is_dir():
        critic = ScalarHeadModel.from_config(AutoConfig.from_pretrained(files / "critic"))
        _load(critic, checkpoint_state_dict(critic_ckpt, tag), critic_ckpt)
        critic.save_pretrained(dest / "critic")
    spec = json.loads((files / "spec.json").read_text()) if (files / "spec.json").is_file() else {}
    config = next((p.read_text() for p in (folder.operative_config, folder.config) if p.is_file()), "")
    n = int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None
    atomic_write_text(
        str(dest / "README.md"),
        model_card(spec.get("name", "?"), spec.get("source", ""), n, config, _metrics(run, n)),
    )


def _load(module: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Strict load, except keys tied to another parameter (e.g. lm_head.weight with tied embeddings)."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    after = module.state_dict()
    shared = Counter(v.data_ptr() for v in after.values())
    tied = {k for k in missing if shared[after[k].data_ptr()] > 1}
    if unexpected or set(missing) - tied:
        raise DataError(
            f"{where}: checkpoint does not match RUN_DIR/{MODEL_DIR}'s architecture "
            f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )


def _metrics(run: Path, step: int | None) -> dict:
    """summary.json if it is the run's last step, else that step's metrics.jsonl row (or nothing)."""
    folder = RunFolder(run)
    summary = folder.summary
    if summary.is_file():
        s = json.loads(summary.read_text())
        if step is None or s.get("steps") == step:
            return s
    rows = folder.metrics
    if rows.is_file():
        for line in rows.read_text().splitlines():
            if line.strip() and json.loads(line).get("step") == step:
                return json.loads(line)
    return {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m polgrad.export", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="a run directory (python -m polgrad.train --out)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    ap.add_argument("--out", default=None, help="destination (default RUN_DIR/export-step<N>)")
    args = ap.parse_args(argv)
    try:
        dest = export_checkpoint(args.run_dir, args.step, args.out)
    except PolgradError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported: {dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
