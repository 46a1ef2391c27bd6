"""ctypes binding of layer_ops.c: fused residual-add + RMSNorm, RoPE + KV store; float32 SiLU * up,
GELU * up, RoPE tables, Qwen3's head norms and a mixture of experts' router."""
from __future__ import annotations

import ctypes

import torch

from kvserve import kernels
from kvserve.kernels import DTYPES as _DTYPES
from kvserve.kernels import KV_DTYPES as _KV_DTYPES

_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float
_SIGNATURES = {
    "kvserve_add_rms_norm": [_p, _p, _p, _p, _i, _i, _f, _i, _i],
    "kvserve_rope_store": [_p, _p, _p, _p, _p, _p, _p, _p, _i, _i, _i, _i, _l, _i, _i, _i],
    "kvserve_silu_mul": [_p, _p, _i, _i, _l, _i],
    "kvserve_gelu_mul": [_p, _p, _i, _i, _l, _i],
    "kvserve_rope_table": [_p, _p, _i, _i, _p, _p, _i],
    "kvserve_route": [_p, _p, _p, _i, _i, _i, _i, _i, _p, _p],
    "kvserve_clamped_swiglu": [_p, _p, _i, _i, _l, _f, _f, _i],
    "kvserve_head_norms": [_p, _p, _p, _i, _i, _i, _i, _f],
}


_bound: list[ctypes.CDLL | None] = []  # the library once bound (or None): several calls per layer ask


def _lib() -> ctypes.CDLL | None:
    if not _bound:
        _bound.append(kernels.bind("layer_ops", _SIGNATURES))
    return _bound[0]


def available() -> bool:
    return _lib() is not None


def _need() -> ctypes.CDLL:
    """The library, for callers that checked supports() or available() first."""
    return kernels.loaded(_lib(), "layer_ops")


def supports(*tensors: torch.Tensor) -> bool:
    """CPU tensors of one dtype (float32 or bfloat16), contiguous, with the library loaded."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES or not available():
        return False
    for t in tensors:  # noqa: SIM110 - a plain loop: this runs several times per layer
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous():
            return False
    return True


def supports_pool(kv_cache: torch.Tensor) -> bool:
    """A KV pool rope_store writes into: CPU, contiguous, float32, bfloat16, float16 or int8
    (head_dim <= 256; its scales are checked by rope_store)."""
    return kv_cache.dtype in _KV_DTYPES and kv_cache.device.type == "cpu" and kv_cache.is_contiguous() and (
        kv_cache.dtype != torch.int8 or kv_cache.shape[-1] <= 256)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x += delta in place (if given); returns weight * rms_norm(x), written into out if given
    (a step's buffer, reused by every layer). x, delta, out: [T, N]; weight: [N]."""
    T, N = x.shape
    if weight.shape != (N,) or (delta is not None and delta.shape != x.shape) or (
        out is not None and (out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous())
    ):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, delta {None if delta is None else tuple(delta.shape)}, "
                         f"weight {tuple(weight.shape)}, out {None if out is None else tuple(out.shape)} do not fit")
    h = torch.empty_like(x) if out is None else out
    _need().kvserve_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                 h.data_ptr(), T, N, eps, _DTYPES[x.dtype], torch.get_num_threads())
    return h


def rope_store(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
    num_heads: int, out: tuple[torch.Tensor, torch.Tensor] | None = None, kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [T, H, D] and k [T, Hkv, D] (into out's two tensors if given); k and v written
    into their slots of the pool, converted to the pool's dtype (an int8 pool: quantized, each
    row's scale into kv_scale [2, Hkv, num_blocks, block_size] float16)."""
    T = qkv.shape[0]
    _, hkv, nb, bs, d = kv_cache.shape
    if qkv.shape[1] != (num_heads + 2 * hkv) * d or cos.shape != (T, d) or sin.shape != (T, d) or slots.shape != (T,):
        raise ValueError(f"rope_store: qkv {tuple(qkv.shape)}, cos/sin {tuple(cos.shape)}, slots {tuple(slots.shape)} "
                         f"do not fit {num_heads} heads and a pool {tuple(kv_cache.shape)}")
    if out is None:
        q = torch.empty(T, num_heads, d, dtype=qkv.dtype)
        k = torch.empty(T, hkv, d, dtype=qkv.dtype)
    else:
        q, k = out
        if q.shape != (T, num_heads, d) or k.shape != (T, hkv, d) or q.dtype != qkv.dtype or k.dtype != qkv.dtype \
                or not (q.is_contiguous() and k.is_contiguous()):
            raise ValueError(f"rope_store: out {tuple(q.shape)}, {tuple(k.shape)} do not fit {T} tokens")
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    scale_ptr = kernels.scales_ptr(kv_cache, kv_scale)
    rc = _need().kvserve_rope_store(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
                                    kv_cache.data_ptr(), scale_ptr, slots.data_ptr(), T, num_heads, hkv, d, nb * bs,
                                    _DTYPES[qkv.dtype], _KV_DTYPES[kv_cache.dtype], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"KV slots outside the pool of {nb * bs} slots: {slots.min().item()}..{slots.max().item()}")
    return q, k


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2F] float32 (gate, then up) -> silu(gate) * up, written into gu's first half."""
    return _glu(gu, "silu")


def gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2F] float32 (gate, then up) -> gelu_tanh(gate) * up, written into gu's first half."""
    return _glu(gu, "gelu")


def clamped_swiglu(gu: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gu [T, 2F] float32 (gate, then up) -> gpt-oss's clamped SwiGLU (model/gpt_oss.py), written into gu's first half."""
    return _glu(gu, "clamped_swiglu", alpha, limit)


def _glu(gu: torch.Tensor, act: str, *args: float) -> torch.Tensor:
    T, two_f = gu.shape
    if gu.dtype != torch.float32 or not gu.is_contiguous() or two_f % 2:
        raise ValueError(f"{act}_mul: gu must be contiguous float32 [T, 2F], got {gu.dtype} {tuple(gu.shape)}")
    f = two_f // 2
    name = f"kvserve_{act}" if args else f"kvserve_{act}_mul"
    getattr(_need(), name)(gu.data_ptr(), gu.data_ptr(), T, f, two_f, *args, torch.get_num_threads())
    return gu.narrow(-1, 0, f)


def head_norms(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, H: int, Hkv: int, eps: float) -> None:
    """Qwen3's RMSNorm of each query and key head, in place in qkv [T, (H + 2 Hkv) * D] float32 (contiguous,
    as the norms): the native decode step's rms_norm_head."""
    T, width = qkv.shape
    D = width // (H + 2 * Hkv)
    if not supports(qkv, q_norm, k_norm) or qkv.dtype != torch.float32 or q_norm.shape != (D,) or k_norm.shape != (D,):
        raise ValueError(f"head_norms: qkv {qkv.dtype} {tuple(qkv.shape)}, norms {tuple(q_norm.shape)} do not fit")
    _need().kvserve_head_norms(qkv.data_ptr(), q_norm.data_ptr(), k_norm.data_ptr(), T, H, Hkv, D, eps)


# How a router weighs its chosen experts (layer_ops.c's ROUTE_*)
ROUTE_SOFTMAX, ROUTE_RENORM, ROUTE_TOP_LOGITS = 0, 1, 2


def route(h: torch.Tensor, router: torch.Tensor, k: int, how: int,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture of experts' choice for rows h [T, N] float32 over router [E, N] float32 (+ bias [E]): each
    row's k experts [T, k] int64 and weights [T, k] float32 (`how`: softmax over all and the top k of it,
    renormalized over them, or softmax over the top k logits), the native decode step's own arithmetic
    (layer_ops.c's route_row)."""
    T, N = h.shape
    E = router.shape[0]
    if h.dtype != torch.float32 or router.dtype != torch.float32 or router.shape[1] != N or not 1 <= k <= E or \
            (bias is not None and (bias.dtype != torch.float32 or bias.shape != (E,))):
        raise ValueError(f"route: h {h.dtype} {tuple(h.shape)}, router {router.dtype} {tuple(router.shape)}, k {k}")
    h, router = h.contiguous(), router.contiguous()
    bias = None if bias is None else bias.contiguous()
    chosen, weights = torch.empty(T, k, dtype=torch.int64), torch.empty(T, k)
    if _need().kvserve_route(h.data_ptr(), router.data_ptr(), None if bias is None else bias.data_ptr(), T, N, E, k,
                             how, chosen.data_ptr(), weights.data_ptr()):
        raise ValueError(f"route: how {how!r}")
    return chosen, weights


def rope_table(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] in `dtype` (float32 or bfloat16) for positions [T] and inv_freq [D/2] float32."""
    positions = positions.to(torch.int64).contiguous()
    inv_freq = inv_freq.to(torch.float32).contiguous()
    T, d = positions.shape[0], 2 * inv_freq.shape[0]
    cos, sin = torch.empty(T, d, dtype=dtype), torch.empty(T, d, dtype=dtype)
    _need().kvserve_rope_table(positions.data_ptr(), inv_freq.data_ptr(), T, d, cos.data_ptr(), sin.data_ptr(),
                               _DTYPES[dtype])
    return cos, sin
