""".ci/cpu_matrix on a pretended CPU: which legs it runs, under which kernels, from which cache.

The script's interpreter is a stub (PYTHON) that records its arguments and environment and fails
where told, and its CPU flags come from a file (POLGRAD_CPUINFO), so the legs of an AVX2-only, an
AVX-512 and an ARM machine are checked on any machine in well under a second.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STUB = """#!/usr/bin/env python3
import json, os, sys
cache = os.environ["POLGRAD_CACHE"]
calls = os.environ["STUB_CALLS"]
inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
record = {"argv": sys.argv[1:], "cache_empty": os.path.isdir(cache) and not os.listdir(cache),
          "inductor_empty": os.path.isdir(inductor) and not os.listdir(inductor),
          "env": {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                  "MKL_ENABLE_INSTRUCTIONS", "POLGRAD_CACHE",
                                                  "TORCHINDUCTOR_CACHE_DIR")}}
with open(calls, "a") as fh:
    fh.write(json.dumps(record) + "\\n")
fail = os.environ.get("STUB_FAIL") == record["env"]["ATEN_CPU_CAPABILITY"]
print("1 failed in 0.01s" if fail else "83 passed in 0.01s")
sys.exit(1 if fail else 0)
"""
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
AVX512 = {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}
AVX512["MKL_ENABLE_INSTRUCTIONS"] = "AVX512"


def _matrix(tmp_path: Path, flags: str, fail: str = "", args: tuple[str, ...] = (), own: bool = False):
    """Run .ci/cpu_matrix on a CPU with these flags; (exit code, stdout, the stub's calls)."""
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    calls = tmp_path / "calls.jsonl"
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHON=str(stub), POLGRAD_CPUINFO=str(cpuinfo), TMPDIR=str(tmp_path / "tmp"))
    env.update(STUB_CALLS=str(calls), STUB_FAIL=fail, POLGRAD_MATRIX_OWN="1" if own else "0")
    proc = subprocess.run(
        ["bash", str(REPO / ".ci" / "cpu_matrix"), *args], env=env, capture_output=True, text=True, timeout=60
    )
    made = [json.loads(ln) for ln in calls.read_text().splitlines()] if calls.exists() else []
    return proc.returncode, proc.stdout, made


def test_an_avx2_only_cpu_runs_no_leg_again_unless_asked_and_says_why(tmp_path):
    """On an AVX2-only CPU the AVX2 leg is the main test run again (same kernels, same empty cache of
    a fresh clone): skipped and said so; POLGRAD_MATRIX_OWN=1 runs it, e.g. for the matrix alone."""
    rc, out, calls = _matrix(tmp_path, "fpu sse4_2 avx avx2 fma")
    assert (rc, calls) == (0, [])
    assert "AVX2 leg: not run again, AVX2 is this CPU's own best: the main test run used its kernels" in out
    assert "AVX-512 leg: not run, this CPU has no AVX-512" in out
    assert "AMX: not run, it cannot be emulated: it runs only on a host that has it" in out
    (tmp_path / "own").mkdir()
    rc, out, calls = _matrix(tmp_path / "own", "fpu sse4_2 avx avx2 fma", args=("-x",), own=True)
    assert rc == 0, out
    (call,) = calls
    assert {k: call["env"][k] for k in AVX2} == AVX2 and call["cache_empty"]
    argv = call["argv"]
    assert argv[:5] == ["-m", "pytest", "-q", "-m", "cpu_matrix"] and argv[-1] == "-x"
    assert any(a.startswith("--basetemp=") for a in argv)
    assert "AVX2 leg: passed in" in out and "(83 passed in 0.01s)" in out
    assert os.listdir(tmp_path / "own" / "tmp") == []  # a leg that passed leaves no cache or runs behind


def test_an_avx512_cpu_without_amx_runs_the_avx2_leg(tmp_path):
    rc, out, calls = _matrix(tmp_path, "sse4_2 avx2 avx512f avx512bw avx512_bf16")
    assert rc == 0, out
    assert [{k: c["env"][k] for k in AVX2} for c in calls] == [AVX2]
    assert "AVX-512 leg: not run again, AVX-512 without AMX is this CPU's own best" in out


def test_an_amx_cpu_runs_both_legs_each_from_its_own_empty_cache_and_a_failed_leg_fails(tmp_path):
    rc, out, calls = _matrix(
        tmp_path, "sse4_2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile", fail="avx512"
    )
    assert rc == 1, out
    assert [{k: c["env"][k] for k in AVX2} for c in calls] == [AVX2, AVX512]
    assert all(c["cache_empty"] for c in calls)
    assert calls[0]["env"]["POLGRAD_CACHE"] != calls[1]["env"]["POLGRAD_CACHE"]
    # and its own empty torch.compile cache: kernels compiled for another ISA are not reused
    assert all(c["inductor_empty"] for c in calls)
    assert calls[0]["env"]["TORCHINDUCTOR_CACHE_DIR"] != calls[1]["env"]["TORCHINDUCTOR_CACHE_DIR"]
    basetemps = [next(a for a in c["argv"] if a.startswith("--basetemp=")) for c in calls]
    assert basetemps[0] != basetemps[1]
    assert "AVX2 leg: passed in" in out and "AVX-512 leg: FAILED (pytest exit 1)" in out
    assert "AMX: not a leg (it cannot be emulated); this CPU has it, so the main test run used it" in out
    (kept,) = os.listdir(tmp_path / "tmp")  # the failed leg's folder, named in the summary
    assert kept.startswith("polgrad-cpu-matrix-AVX-512.") and kept in out


def test_a_cpu_without_avx2_runs_no_leg_and_says_so(tmp_path):
    rc, out, calls = _matrix(tmp_path, "fp asimd evtstrm aes")  # an ARM CPU's features
    assert (rc, calls) == (0, [])
    assert "AVX2 leg: not run, this CPU has no AVX2" in out
    assert "AVX-512 leg: not run, this CPU has no AVX-512" in out
