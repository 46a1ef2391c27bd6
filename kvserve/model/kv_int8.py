"""The int8 KV cache's format, in torch: the reference the C kernels store and read bit for bit.

A pool of dtype int8 holds each K or V row (head_dim values of one token, one KV head) as int8
with one float16 scale, symmetric: s = absmax / 127 rounded to float16, q = round(x / s)
clamped to ±127 (round half to even), and the row reads back as q * s. A row keeps its own
scale, so one outlier token costs only its own precision, and a row is written once, when its
token is stored: no scale is ever revised. float16 scales, not float32: 2 bytes per 64-value row
instead of 4, which keeps the pool at 1.94x float16's tokens for the default model's head_dim
64 instead of 1.88x.

Scales live beside the pool, one tensor per layer, laid out like the pool without head_dim:
[2, Hkv, num_blocks, block_size] float16. Block b of a layer is pool[:, :, b] and its scales
scales[:, :, b]; the flat index of a pool row is the flat index of its scale.
"""
from __future__ import annotations

import torch

SCALE_DTYPE = torch.float16


def scales_shape(pool_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
    """[2, Hkv, num_blocks, block_size] for a pool [2, Hkv, num_blocks, block_size, D]."""
    return tuple(pool_shape[:-1])


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] int8, scale [...] float16), as stored."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / 127).to(SCALE_DTYPE)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, (xf / s).clamp(-127, 127).round(), torch.zeros((), dtype=torch.float32))
    return q.to(torch.int8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., D] int8 and scale [...] -> q * scale in `dtype` (computed in float32)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """x as an int8 pool would give it back: a prefill attending to its own fresh K/V reads the
    values a later decode reads from the pool."""
    return dequantize(*quantize(x), x.dtype)
