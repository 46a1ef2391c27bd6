"""GGML block formats → float32 torch tensors.

The types real checkpoints are made of (F32/F16/BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, MXFP4) are decoded
here with vectorised torch ops: gguf's numpy decoder takes ~1.3 s for the default 98 MB model
on two cores, these take a fraction of that. Rarer types fall back to gguf.quants.dequantize.
Block layouts follow ggml's `block_q*` structs (little-endian, f16 scales first unless noted).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as np_dequantize

from kvserve.model.mxfp4 import E2M1_DOUBLED

QK_K = 256  # elements in one K-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 scale stored at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, ..., b] bytes → [n, ..., 2b]: the low nibbles of all b bytes, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # d: f16, qs: int8[32]
    return _f16(b, 0) * b[:, 2:].view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # d: f16, qs: 4-bit[32] stored with offset 8
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # d, m: f16, qs: 4-bit[32]; x = d*q + m
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _k_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack Q4_K's 12 bytes into eight 6-bit scales and eight 6-bit mins, each [n, 8]."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale.float(), mins.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    # d, dmin: f16; scales: 12 bytes; qs: 128 bytes = 4 chunks of 32 bytes, each chunk holding
    # sub-block 2j in its low nibbles and sub-block 2j+1 in its high nibbles.
    n = b.shape[0]
    scale, mins = _k_scale_min(b[:, 4:16])
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()  # [n, sub-block, 32]
    d = (_f16(b, 0) * scale).unsqueeze(-1)
    dm = (_f16(b, 2) * mins).unsqueeze(-1)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    # ql: 128 bytes (low 4 bits), qh: 64 bytes (high 2 bits), scales: int8[16], d: f16 (last).
    n = b.shape[0]
    ql = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)  # [n, 2 halves × 4, 32]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    qh = ((qh >> shifts) & 0x03).reshape(n, 8, 32)
    q = ((ql | (qh << 4)).float() - 32.0).reshape(n, 16, 16)  # [n, sub-block, 16]
    d = _f16(b, 208) * b[:, 192:208].view(torch.int8).float()  # [n, 16]
    return (d.unsqueeze(-1) * q).reshape(n, QK_K)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    # e: e8m0 (a power of two, 2^(e - 127)), qs: 4-bit e2m1 codes[32], values 0-15 in the low
    # nibbles, 16-31 in the high ones (gpt-oss's experts, as llama.cpp's converter repacks them)
    e = b[:, :1].to(torch.int32) - 127  # [n, 1]
    half_scale = torch.ldexp(torch.full(e.shape, 0.5), e)
    return half_scale * E2M1_DOUBLED[_nibbles(b[:, 1:]).long()]


_BLOCK_DECODERS = {Q.Q8_0: _q8_0, Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k, Q.MXFP4: _mxfp4}
# Decoded by gguf's numpy code: correct but slower, and rare in the files kvserve targets.
_NUMPY_TYPES = {Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q5_K}
SUPPORTED_TYPES: frozenset[Q] = frozenset(
    {Q.F32, Q.F16, Q.BF16, *_BLOCK_DECODERS, *_NUMPY_TYPES}
)


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch on one thread: these element-wise passes are memory-bound, and on a 2-core
    machine whose other core is busy, two threads measured ~20x slower (11 s vs 0.6 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one tensor's stored data (as GGUFReader exposes it) into float32 of `shape`.

    `shape` is in torch order (ggml's dims reversed), e.g. [out_features, in_features].
    The result never aliases `raw`, so it outlives the memory map.
    """
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported tensor type {qtype.name}")
    if qtype in _NUMPY_TYPES:
        return torch.from_numpy(np.ascontiguousarray(np_dequantize(raw, qtype))).reshape(shape)
    data = torch.from_numpy(np.ascontiguousarray(raw))
    if qtype == Q.F32:
        return data.view(torch.float32).reshape(shape).clone()
    if qtype == Q.F16:
        return data.view(torch.float16).reshape(shape).float()
    if qtype == Q.BF16:
        return data.view(torch.uint8).view(torch.bfloat16).reshape(shape).float()
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = data.view(torch.uint8).reshape(-1, type_size)  # [n_blocks, bytes per block]
    return _BLOCK_DECODERS[qtype](blocks).reshape(shape)
