"""ctypes binding of layer_ops.c: fused residual-add + RMSNorm, RoPE + KV store."""
from __future__ import annotations

import ctypes

import torch

from kvserve import kernels
from kvserve.kernels import DTYPES as _DTYPES

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvserve_add_rms_norm": [_p, _p, _p, _p, _i, _i, _f, _i, _i],
    "kvserve_rope_store": [_p, _p, _p, _p, _p, _p, _p, _i, _i, _i, _i, _l, _i, _i],
}


def _lib() -> ctypes.CDLL | None:
    return kernels.bind("layer_ops", _SIGNATURES)


def available() -> bool:
    return _lib() is not None


def supports(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype (float32 or bfloat16), contiguous, with the library loaded."""
    t0 = tensors[0]
    return (
        t0.dtype in _DTYPES
        and all(t.device.type == "cpu" and t.dtype == t0.dtype and t.is_contiguous() for t in tensors)
        and available()
    )


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (if given); returns weight * rms_norm(x). x, delta: [T, N]; weight: [N]."""
    T, N = x.shape
    if weight.shape != (N,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, delta {None if delta is None else tuple(delta.shape)}, "
                         f"weight {tuple(weight.shape)} do not fit")
    h = torch.empty_like(x)
    _lib().kvserve_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                h.data_ptr(), T, N, eps, _DTYPES[x.dtype], torch.get_num_threads())
    return h


def rope_store(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
    num_heads: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [T, H, D] and k [T, Hkv, D]; k and v written into their slots of the pool."""
    T = qkv.shape[0]
    _, hkv, nb, bs, d = kv_cache.shape
    if qkv.shape[1] != (num_heads + 2 * hkv) * d or cos.shape != (T, d) or sin.shape != (T, d) or slots.shape != (T,):
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)}, cos/sin {tuple(cos.shape)}, slots {tuple(slots.shape)} "
                         f"do not fit {num_heads} heads and a pool {tuple(kv_cache.shape)}")
    q = torch.empty(T, num_heads, d, dtype=qkv.dtype)
    k = torch.empty(T, hkv, d, dtype=qkv.dtype)
    slots = slots.to(torch.int64).contiguous()
    rc = _lib().kvserve_rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
                                   kv_cache.data_ptr(), slots.data_ptr(), T, num_heads, hkv, d, nb * bs,
                                   _DTYPES[qkv.dtype], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"KV slots outside the pool of {nb * bs} slots: {slots.min().item()}..{slots.max().item()}")
    return q, k
