"""Which CPU a run ran on, and a warning where bf16 is emulated (polgrad/machine.py).

torch honours ATEN_CPU_CAPABILITY=avx2 and oneDNN ONEDNN_MAX_CPU_ISA=AVX2: a fresh process under both
runs as an AVX2-only CPU does, bf16 matmuls emulated, whatever CPU runs the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from polgrad import machine

REPO = Path(__file__).resolve().parents[2]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PROBE = """
import json, sys
from polgrad import machine
ratio = machine.warn_if_bf16_slow(True)
off = machine.warn_if_bf16_slow(False)
print(json.dumps({"info": machine.cpu_info(), "ratio": ratio, "off": off}))
"""


def _probe(env_extra: dict[str, str]) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k not in AVX2}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        env={**env, **env_extra},
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


def test_cpu_info_names_the_model_the_capability_and_the_isa():
    info = machine.cpu_info()
    assert set(info) == {"model", "torch_capability", "isa"} and info["model"]
    assert info["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(info["isa"]) <= set(machine.ISA_FLAGS)
    label = machine.cpu_label()
    assert label.startswith(info["model"] + " · " + info["torch_capability"])


def test_bf16_on_an_avx2_only_cpu_warns_in_one_line_with_the_measured_slowdown():
    got, err = _probe(AVX2)
    assert got["info"]["torch_capability"] == "AVX2" and got["off"] is None
    assert got["ratio"] > machine.BF16_SLOW  # measured 41x here
    lines = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("warning: train.bf16 = True on a CPU without native bf16")
    assert f"took {got['ratio']:.0f}x the fp32 time" in lines[0] and "train.bf16 = False" in lines[0]


def test_the_native_capability_is_recorded_and_warns_only_where_bf16_is_slow():
    """On this CPU as it is: the record names torch's own capability; the warning follows the ratio
    measured in the same call (native bf16, e.g. AVX512-BF16 or AMX: no warning; measured here 0.2x)."""
    got, err = _probe({})
    assert got["info"]["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    warned = any(line.startswith("warning: train.bf16") for line in err.splitlines())
    assert warned == (got["ratio"] > machine.BF16_SLOW)


def test_a_sweep_row_records_the_cpu():
    from polgrad.results.provenance import machine as row_machine
    from polgrad.results.store import BACK_COLUMNS

    assert row_machine()["cpu"] == machine.cpu_label() and "cpu" in BACK_COLUMNS


def test_a_subprocess_reports_its_own_peak_memory_not_its_parents():
    """peak_rss_mib is the process's own high-water mark: a child of a process that holds 800 MiB
    reports its own peak (an interpreter importing polgrad, torch included: 223 MiB measured), while its
    ru_maxrss, which Linux carries across exec, starts at the parent's (the premise, checked too)."""
    import subprocess
    import sys

    held = bytearray(800 * 2**20)  # touched: zero-filled pages are resident
    held[::4096] = b"x" * len(held[::4096])
    code = (
        "import resource; from polgrad.machine import peak_rss_mib; "
        "print(peak_rss_mib(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    own, carried = map(float, out.stdout.split())
    del held
    assert carried > 800, carried  # ru_maxrss: the parent's RSS at the fork
    assert own < 400, own
