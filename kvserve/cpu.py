"""What this CPU can do, decided at run time (never from the machine kvserve was built on).

Machines differ between a developer's laptop, CI and a user's server: one has AVX-512 with
native bfloat16 (Zen 4, Sapphire Rapids), another only AVX2 (Zen 3, older Intel), an ARM box
NEON. Every fast path asks `cpu.features()` or `cpu.isa()` before it runs, and each has a
portable fallback.

`KVSERVE_ISA` caps the level used, so one machine can exercise the paths others take:
`KVSERVE_ISA=avx2` on an AVX-512 machine runs the AVX2 code, `KVSERVE_ISA=portable` the plain
C / torch code. It can only lower the level, never claim what the CPU lacks.
"""
from __future__ import annotations

import os
import platform
from functools import lru_cache

# Ordered from least to most capable (x86-64). ARM machines report "neon" (or "portable").
LEVELS = ("portable", "avx2", "avx512")


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The flags the kernel reports for this CPU (x86 `flags`, ARM `Features`), lower case."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].lower().split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def native_isa() -> str:
    """The best level this CPU supports, ignoring KVSERVE_ISA."""
    flags = cpu_flags()
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "neon" if ("asimd" in flags or "neon" in flags or not flags) else "portable"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "portable"


def isa() -> str:
    """The level kvserve's kernels use: the CPU's own, lowered by KVSERVE_ISA if that is set."""
    have = native_isa()
    want = os.environ.get("KVSERVE_ISA", "").strip().lower()
    if not want or want == "native":
        return have
    if want == "portable":
        return "portable"
    if have == "neon" or want not in LEVELS:
        return have if want == have else "portable"
    return LEVELS[min(LEVELS.index(want), LEVELS.index(have))]


def has_native_bf16() -> bool:
    """True where bfloat16 arithmetic runs in hardware (AVX-512 BF16 or AMX), at the current ISA cap."""
    flags = cpu_flags()
    return isa() == "avx512" and ("avx512_bf16" in flags or "amx_bf16" in flags)


def describe() -> str:
    """One line for logs and benchmark tables: model, the vector flags that matter, the level used."""
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
              "avx_vnni", "amx_bf16", "asimd", "asimddp")
    shown = [f for f in wanted if f in cpu_flags()]
    return f"{cpu_model()} [{' '.join(shown) or 'no vector flags read'}] kernels: {isa()}"

