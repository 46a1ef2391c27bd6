"""ctypes binding of paged_attention.c: decode attention straight out of the paged KV pool."""
from __future__ import annotations

import ctypes

import torch

from kvserve import kernels
from kvserve.kernels import DTYPES as _DTYPES
from kvserve.kernels import KV_DTYPES as _KV_DTYPES

_p, _i = ctypes.c_void_p, ctypes.c_int
_f = ctypes.c_float
_SIGNATURES = {"kvserve_paged_decode": [_p, _p, _p, _p, _p, _i, _p, _i, _i, _i, _i, _i, _i, _f, _f, _p, _i, _i, _i, _i]}


def available() -> bool:
    return _lib() is not None


_bound: list[ctypes.CDLL | None] = []  # the library once bound (or None): every layer asks


def _lib() -> ctypes.CDLL | None:
    if not _bound:
        _bound.append(kernels.bind("paged_attention", _SIGNATURES))
    return _bound[0]


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (CPU, contiguous, head_dim ≤ 256; q float32 or
    bfloat16, the pool float32, bfloat16, float16 or int8 with its row scales)."""
    return (
        q.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and q.dtype in _DTYPES
        and kv_cache.dtype in _KV_DTYPES
        and kv_cache.is_contiguous()
        and q.shape[-1] <= 256
        and available()
    )


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    scale: float,
    checked: bool = False,  # the caller has checked supports(q, kv_cache) for this step
    window: int = 0,  # sliding window: each query sees its last `window` keys (0: all)
    kv_scale: torch.Tensor | None = None,  # an int8 pool's [2, Hkv, num_blocks, block_size] float16
    softcap: float = 0.0,  # > 0: each score soft-capped to softcap * tanh(score / softcap) (Gemma 2)
    sinks: torch.Tensor | None = None,  # [H] float32: each head's sink logit, in its softmax with no value (gpt-oss)
) -> torch.Tensor:  # [B, H, D]
    lib = _lib()
    assert lib is not None and (checked or supports(q, kv_cache))
    if not q.is_contiguous():
        q = q.contiguous()
    B, H, D = q.shape
    _, hkv, nb, bs, _ = kv_cache.shape
    if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
        block_tables = block_tables.to(torch.int32).contiguous()
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        seq_lens = seq_lens.to(torch.int32).contiguous()
    assert block_tables.shape[0] == B and seq_lens.shape == (B,)
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (H,)
        sinks = sinks.contiguous()
    out = torch.empty_like(q)
    rc = lib.kvserve_paged_decode(
        q.data_ptr(), kv_cache.data_ptr(), kernels.scales_ptr(kv_cache, kv_scale), out.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), B, H, hkv, nb, bs, D, scale, softcap, None if sinks is None else sinks.data_ptr(),
        _DTYPES[q.dtype], _KV_DTYPES[kv_cache.dtype],
        window, torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged decode kernel failed (code {rc}) for q {tuple(q.shape)}, pool {tuple(kv_cache.shape)}")
    return out
