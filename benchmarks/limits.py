"""This machine's physical limits, measured, and what each contender's figures are against them.

A decode step of one stream reads every weight once, so its ceiling is memory bandwidth divided
by the bytes of weights in the format the engine holds them (float32, bfloat16, Q4_1…). A large
batch is bound by arithmetic: about 2 FLOP per parameter per token against the matmul peak of
the dtype the engine computes in. `roofline_tps` takes the tighter of the two for a batch size,
and a measured tokens/s over it is the utilisation shown beside each figure.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class MachineLimits:
    bandwidth_gbs: float  # a large float32 sum, best of several
    matmul_gflops: dict[str, float]  # dtype → GFLOP/s of an n³ matmul, best of several
    threads: int
    matmul_n: dict[str, int] = field(default_factory=dict)  # dtype → the n measured


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: page in, pack, spin up threads
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    return x.numel() * 4 / _best(lambda: x.sum(), repeats) / 1e9


def measure_matmul(dtype: torch.dtype, n: int = 1024, repeats: int = 3) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best(lambda: a @ b, repeats) / 1e9


def measure(threads: int = 2) -> MachineLimits:
    torch.set_num_threads(threads)
    flops, sizes = {}, {}
    # Half-precision matmul is emulated on CPUs without native support (minutes at n=1024): a smaller n.
    for name, dtype, n in (("float32", torch.float32, 1024), ("bfloat16", torch.bfloat16, 256),
                           ("float16", torch.float16, 256)):
        flops[name], sizes[name] = measure_matmul(dtype, n), n
    return MachineLimits(measure_bandwidth(), flops, threads, sizes)


@dataclass(frozen=True)
class WeightFormat:
    """How one contender holds the model's weights."""

    name: str  # e.g. "float32", "GGUF Q4_1 + Q8_0"
    bytes_per_step: int  # weights one sequence's decode step reads (the tied LM head once; of experts, its chosen ones)
    num_params: int
    compute_dtype: str  # the matmul peak that bounds large batches


def gguf_format(path: Path) -> WeightFormat:
    """The GGUF as one sequence's decode step reads it (of a mixture of experts, its chosen experts) as the file
    stores it: the least any server reads."""
    from kvserve.kv.kv_size import read_architecture, stored_weights

    arch = read_architecture(path)
    s = stored_weights(path, arch.num_experts, arch.num_experts_per_tok)
    return WeightFormat(f"GGUF {s.types}", s.active_bytes, s.active_params, "float32")


def dense_format(num_params: int, dtype: str) -> WeightFormat:
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return WeightFormat(dtype, num_params * size, num_params, dtype)


def roofline_tps(limits: MachineLimits, fmt: WeightFormat, batch: int) -> float:
    """Most output tokens/s a batch of `batch` streams could reach: bytes- or arithmetic-bound."""
    by_bytes = batch * limits.bandwidth_gbs * 1e9 / fmt.bytes_per_step
    by_flops = limits.matmul_gflops.get(fmt.compute_dtype, limits.matmul_gflops["float32"]) * 1e9 / (2 * fmt.num_params)
    return min(by_bytes, by_flops)
