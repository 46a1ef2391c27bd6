"""ctypes binding of quant_matmul.c: matmuls over GGML quantized blocks and bfloat16 weights."""
from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import torch

from kvserve import kernels
from kvserve.config import env_switch

_p, _i, _l = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
_SIGNATURES: dict[str, list[Any]] = {
    "kvserve_quant_matmul": [_i, _p, _l, _l, _p, _l, _p, _i, _i],
    "kvserve_dequant_rows": [_i, _p, _l, _l, _p, _l, _p, _i],
    "kvserve_bf16_matmul": [_p, _l, _l, _p, _l, _p, _i],
    "kvserve_quant_dot": [],
    "kvserve_x8": [_i],
    "kvserve_pack_x8": [_i, _p, _p, _l, _l, _i],
    "kvserve_amx": [_i],
}
DOTS = ("portable", "avx2", "avx512_vnni")
LEVELS = (1, 2)  # int8 levels an activation row is quantized at (quant_acts.h's quantize_input)  # kvserve_quant_dot()'s answers, by number
# GGML type id → (values per block, bytes per block) of the types the kernels multiply.
BLOCKS = {8: (32, 34), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 39: (32, 17), 12: (256, 144), 13: (256, 176),
          14: (256, 210)}
# The x8 layout (quant_x8.h): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 rows repacked 8 blocks at a time, Q4_K, Q5_K and Q6_K rows
# a super-block's 8 sub-blocks at a time, for the kernel to advance 8 blocks' dots per instruction; its type
# id is the GGML id + X8.
X8 = 1000
X8_TYPES = (8, 2, 3, 6, 7, 39, 12, 13, 14)
BLOCKS.update({X8 + t: BLOCKS[t] for t in X8_TYPES})


_AMX_SET: set[ctypes.CDLL] = set()  # the library once its AMX switch is set from KVSERVE_AMX


def _lib() -> ctypes.CDLL | None:
    lib = kernels.bind("quant_matmul", _SIGNATURES)
    if lib is not None and lib not in _AMX_SET:
        lib.kvserve_amx(1 if env_switch("KVSERVE_AMX") else 0)
        _AMX_SET.add(lib)
    return lib


def _need() -> ctypes.CDLL:
    """The library, for callers that checked available() first."""
    return kernels.loaded(_lib(), "quant_matmul")


_AMX_FOLLOWERS: list[ctypes.CDLL] = []  # other builds that include this file (decode_step.c): one switch for all


def amx() -> bool:
    """Whether calls of many rows run on AMX-INT8 tiles here (the same bits as the AVX-512 kernels, faster).
    On where the CPU has AMX and Linux grants its tiles, unless KVSERVE_AMX=0."""
    lib = _lib()
    return lib is not None and lib.kvserve_amx(-1) == 1


def follow_amx(lib: ctypes.CDLL) -> None:
    """Have `lib` (a build including quant_matmul.c) follow this switch, now and on set_amx."""
    lib.kvserve_amx(1 if amx() else 0)
    _AMX_FOLLOWERS.append(lib)


def set_amx(on: bool) -> bool:
    """Turn the AMX tiles on (where they run) or off for this process; returns whether they now run."""
    lib = _lib()
    if lib is None:
        return False
    now = lib.kvserve_amx(1 if on else 0) == 1
    for other in _AMX_FOLLOWERS:
        other.kvserve_amx(1 if now else 0)
    return now


def available() -> bool:
    return _lib() is not None


def integer_dot() -> str | None:
    """The integer dot product the loaded kernels were built with (None: no kernels)."""
    lib = _lib()
    return None if lib is None else DOTS[lib.kvserve_quant_dot()]


def _check(blocks: torch.Tensor, qtype: int, rows: int, cols: int) -> None:
    per, size = BLOCKS[qtype]
    if cols % per or blocks.dtype != torch.uint8 or not blocks.is_contiguous() or blocks.numel() != rows * cols // per * size:
        raise ValueError(f"blocks {tuple(blocks.shape)} {blocks.dtype} do not hold {rows} x {cols} values of GGML type {qtype}")


def matmul(blocks: torch.Tensor, qtype: int, rows: int, cols: int, x: torch.Tensor, levels: int = 1) -> torch.Tensor:
    """x [T, cols] float32 · W^T → [T, rows] float32, W as `rows` rows of `qtype` blocks, x quantized at
    `levels` int8 levels per 32 values (1: int8; 2: int8 and its remainder, ~15 bits)."""
    return prepare(blocks, qtype, rows, cols, levels)(x)


def prepare(blocks: torch.Tensor, qtype: int, rows: int, cols: int,
            levels: int = 1) -> Callable[[torch.Tensor], torch.Tensor]:
    """The matmul of one weight, its blocks checked and the kernel bound once: a decode step calls
    each weight's kernel once per layer, and checks and lookups on every call cost as much as a
    small layer's arithmetic. blocks must stay alive and unchanged while the result is used."""
    _check(blocks, qtype, rows, cols)
    if levels not in LEVELS:
        raise ValueError(f"activation levels must be one of {LEVELS}, got {levels!r}")
    fn, wptr = _need().kvserve_quant_matmul, blocks.data_ptr()

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != cols:
            raise ValueError(f"x must be float32 [T, {cols}], got {x.dtype} {tuple(x.shape)}")
        if not x.is_contiguous():
            x = x.contiguous()
        y = torch.empty(x.shape[0], rows, dtype=torch.float32)
        if fn(qtype, wptr, rows, cols, x.data_ptr(), x.shape[0], y.data_ptr(), torch.get_num_threads(), levels) == -2:
            raise MemoryError(f"quant_matmul: no memory for {x.shape[0]} x {cols} quantized activations")
        return y

    return run


def dequantize_rows(blocks: torch.Tensor, qtype: int, rows: int, cols: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `ids` (all rows if None) of W as float32 [n, cols]."""
    _check(blocks, qtype, rows, cols)
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
            raise ValueError(f"row ids must be in [0, {rows})")
    n = rows if ids is None else ids.numel()
    out = torch.empty(n, cols, dtype=torch.float32)
    _need().kvserve_dequant_rows(qtype, blocks.data_ptr(), rows, cols, None if ids is None else ids.data_ptr(), n,
                                 out.data_ptr(), torch.get_num_threads())
    return out


def x8_available(qtype: int) -> bool:
    """Whether the loaded kernels multiply rows of GGML type qtype in the x8 layout, faster than as stored:
    every x8 type on the AVX2 and AVX-512 builds, all but Q8_0 on the plain C one (every build multiplies
    every x8 type correctly; this is what the loader repacks)."""
    lib = _lib()
    return lib is not None and lib.kvserve_x8(qtype) == 1


def pack_x8(blocks: torch.Tensor, qtype: int, rows: int, cols: int, unpack: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """W's rows in the x8 layout (qtype a GGML id of X8_TYPES), or back (unpack: qtype an x8 id): a new
    tensor, or written into `out` (uint8, as many bytes as blocks, contiguous)."""
    _check(blocks, qtype, rows, cols)
    if out is None:
        out = torch.empty_like(blocks)
    elif out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() != blocks.numel():
        raise ValueError(f"out must be {blocks.numel()} contiguous uint8 bytes, got {out.dtype} {tuple(out.shape)}")
    rc = _need().kvserve_pack_x8(qtype, blocks.data_ptr(), out.data_ptr(), rows, cols, int(unpack))
    if rc == -2:
        raise MemoryError(f"no memory for one {cols}-column row while repacking a weight: free memory and load again")
    if rc != 0:
        raise ValueError(f"GGML type {qtype} has no x8 layout")
    return out


def bf16_matmul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [T, in] float32 · W^T for W [out, in] bfloat16, converted in registers → [T, out] float32."""
    rows, cols = weight.shape
    if weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        raise ValueError("weight must be a contiguous bfloat16 matrix")
    x = x.to(torch.float32).contiguous()
    if x.dim() != 2 or x.shape[1] != cols:
        raise ValueError(f"x must be [T, {cols}], got {tuple(x.shape)}")
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    _need().kvserve_bf16_matmul(weight.data_ptr(), rows, cols, x.data_ptr(), x.shape[0], y.data_ptr(),
                                torch.get_num_threads())
    return y
