"""How big the KV pool is: bytes per token, blocks for a memory budget, the startup log line."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvserve.config import CacheConfig, ModelConfig
from kvserve.model.kv_int8 import SCALE_DTYPE, scales_shape

DEFAULT_BUDGET_FRACTION = 0.2  # of available RAM, when no budget is given
DEFAULT_BUDGET_CAP = 4 << 30  # the pool's pages are touched lazily, but stay modest by default


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: float,
                       scale_bytes: int = 0) -> int:
    """One key and one value vector per layer and KV head: what each token adds to the cache;
    scale_bytes per vector where the pool is quantized (int8: one float16 scale, 2 bytes)."""
    return int(2 * num_layers * num_kv_heads * (head_dim * element_bytes + scale_bytes))


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of scale each K or V row carries in a pool of `dtype`: 2 for int8, else 0."""
    return torch.empty((), dtype=SCALE_DTYPE).element_size() if dtype == torch.int8 else 0


@dataclass(frozen=True)
class KVSizing:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, elem, scale_bytes(self.dtype))

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        elem, sb = torch.empty((), dtype=self.dtype).element_size(), scale_bytes(self.dtype)
        row = f"({self.head_dim} dims x {elem} byte + {sb} bytes of scale)" if sb else f"{self.head_dim} dims x {elem} bytes"
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
            f"{self.bytes_per_token / 1024:.1f} KiB/token (2 x {self.num_layers} layers x "
            f"{self.num_kv_heads} kv-heads x {row})"
        )


def auto_kv_dtype(model_dtype: torch.dtype, quantized: bool) -> torch.dtype:
    """The pool's element type for CacheConfig.dtype "auto" (a named one is parse_dtype's).

    float16 where the weights are quantized and the activations float32 — the weights are
    already an approximation, and half the bytes per cached token is half the resident memory
    and half the reads of long-context decode (llama.cpp's default is float16 too); else the
    model's own dtype, so a float checkpoint stays exact against transformers. float16 rather
    than bfloat16: three more mantissa bits, and K/V values are far inside its range."""
    return torch.float16 if quantized and model_dtype == torch.float32 else model_dtype


def size_kv_pool(model: ModelConfig, cache: CacheConfig, dtype: torch.dtype) -> KVSizing:
    probe = KVSizing(1, cache.block_size, model.num_hidden_layers, model.num_key_value_heads, model.head_dim, dtype)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        budget = cache.memory_bytes
        if budget is None:
            budget = min(int(available_memory() * DEFAULT_BUDGET_FRACTION), DEFAULT_BUDGET_CAP)
        num_blocks = budget // probe.block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block of {probe.block_bytes} bytes: "
            "raise CacheConfig.memory_bytes or num_blocks"
        )
    return KVSizing(num_blocks, cache.block_size, model.num_hidden_layers, model.num_key_value_heads, model.head_dim, dtype)


def allocate_kv_pool(s: KVSizing) -> list[torch.Tensor]:
    """One [2, Hkv, num_blocks, block_size, D] tensor per layer. torch.empty leaves pages
    untouched until written, so a large budget costs RAM only as it fills."""
    shape = (2, s.num_kv_heads, s.num_blocks, s.block_size, s.head_dim)
    return [torch.empty(shape, dtype=s.dtype) for _ in range(s.num_layers)]


def allocate_kv_scales(s: KVSizing) -> list[torch.Tensor] | None:
    """An int8 pool's row scales (model/kv_int8.py): one [2, Hkv, num_blocks, block_size] float16
    tensor per layer, block b at [:, :, b] as in the pool; None for a float pool."""
    if s.dtype != torch.int8:
        return None
    shape = scales_shape((2, s.num_kv_heads, s.num_blocks, s.block_size, s.head_dim))
    return [torch.empty(shape, dtype=SCALE_DTYPE) for _ in range(s.num_layers)]
