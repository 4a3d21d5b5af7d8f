"""What CPU a run or a measurement ran on, and whether bf16 is native on it.

CPUs differ in what they do fast: with AMX or AVX512-BF16, oneDNN runs bf16 matmuls natively (here,
AVX-512 with avx512_bf16: a 256x256 bf16 matmul in 0.2x the fp32 time); on an AVX2-only CPU it
emulates them (the same matmul 41x slower than fp32, measured here under ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2), so `train.bf16 = True` there makes training tens of times slower, silently.

    cpu_info()         {"model", "torch_capability", "isa"}: the CPU's model name, torch's CPU
                       capability (AVX2 / AVX512 / ...; ATEN_CPU_CAPABILITY lowers it), and which of
                       avx2, avx512f, avx512_bf16, amx_bf16, amx_tile it reports
    cpu_label()        one line of it, e.g. "AMD EPYC · AVX512 · avx2 avx512f avx512_bf16"
    bf16_slowdown()    a 256x256 bf16 matmul's time over fp32's on one thread, best of 7: measured,
                       not inferred from flags (a flag does not say what oneDNN will use)
    warn_if_bf16_slow(enabled)   one warning line with that ratio when it is above `BF16_SLOW`
    peak_rss_mib()     this process's own peak resident memory (VmHWM; not ru_maxrss, which Linux
                       carries across exec from the parent)

Imports nothing of polgrad; torch is imported inside the functions that need it.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path
from typing import Any

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
BF16_SLOW = 3.0  # bf16/fp32 matmul time above this: bf16 is emulated (41x on AVX2, 0.2x with AVX512-BF16)


def _cpuinfo() -> tuple[str, set[str]]:
    """(model name, flags) from /proc/cpuinfo's first processor; ("", set()) where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "", set()
    model, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def cpu_info() -> dict[str, Any]:
    """The CPU model, torch's CPU capability and the bf16-relevant ISA flags the CPU reports."""
    import torch

    model, flags = _cpuinfo()
    return {
        "model": model or platform.machine(),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
        "isa": [f for f in ISA_FLAGS if f in flags],
    }


def cpu_label() -> str:
    """cpu_info on one line: model · torch capability · ISA flags."""
    info = cpu_info()
    return " · ".join([info["model"], info["torch_capability"], " ".join(info["isa"]) or "-"])


def bf16_slowdown(size: int = 256, reps: int = 7) -> float:
    """A size x size bf16 matmul's best time over fp32's (one thread, best of `reps`)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        times = []
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(size, size, generator=gen).to(dtype)
            b = torch.randn(size, size, generator=gen).to(dtype)
            a @ b  # the first call pays for kernel selection
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t0)
            times.append(best)
    finally:
        torch.set_num_threads(old)
    return times[1] / max(times[0], 1e-12)


def warn_if_bf16_slow(enabled: bool) -> float | None:
    """With bf16 on a CPU: the measured bf16/fp32 matmul ratio, and one warning line on stderr when it
    is above BF16_SLOW (bf16 emulated); None when bf16 is off or the run is on a GPU."""
    import torch

    if not enabled or torch.cuda.is_available():
        return None
    ratio = bf16_slowdown()
    if ratio > BF16_SLOW:
        print(
            f"warning: train.bf16 = True on a CPU without native bf16 matmuls ({cpu_label()}): a 256x256 "
            f"bf16 matmul took {ratio:.0f}x the fp32 time here, so training will be many times slower; "
            "bind train.bf16 = False, or run on a CPU with AVX512-BF16 or AMX",
            file=sys.stderr,
            flush=True,
        )
    return ratio


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB: the kernel's high-water mark of its current
    address space (VmHWM in /proc/self/status), so a process started by a large one (a trainer from a
    sweep, a bench worker, a test's subprocess) reports its own peak. `ru_maxrss` is not that: Linux
    carries it across execve, so it starts at the RSS of the process that forked it (measured: a
    subprocess of a 780 MiB pytest worker reported a 776 MiB peak for work that took 157 MiB).
    Elsewhere (macOS) `ru_maxrss`, in bytes there."""
    import resource

    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
