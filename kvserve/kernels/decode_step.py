"""ctypes binding of decode_step.c: a batch's whole decode forward in one native call.

The C structs are mirrored here field for field (ctypes lays them out as the C compiler does);
model/native_decode.py fills them once per model and keeps the tensors they point into alive.
"""
from __future__ import annotations

import ctypes
from typing import Any

from kvserve import kernels
from kvserve.kernels import quant_matmul

MAX_PARTS = 3
_p, _i, _l, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


class Linear(ctypes.Structure):
    _fields_ = [
        ("nparts", _i),
        ("type", _i * MAX_PARTS),
        ("w", _p * MAX_PARTS),
        ("rows", _l * MAX_PARTS),
        ("cols", _l),
        ("total_rows", _l),
        ("bias", _p),
    ]


class Experts(ctypes.Structure):
    _fields_ = [("n", _i), ("top_k", _i), ("how", _i), ("ffn", _l), ("router", _p), ("router_bias", _p),
                ("gate_up", ctypes.POINTER(Linear)), ("down", ctypes.POINTER(Linear))]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("kv", _p), ("kv_scale", _p), ("q_norm", _p), ("k_norm", _p),
                ("attn_out_norm", _p), ("mlp_out_norm", _p), ("window", _i), ("sliding_rope", _i),
                ("experts", Experts), ("sinks", _p)]


class Model(ctypes.Structure):
    _fields_ = [
        ("n_layers", _i), ("hidden", _i), ("H", _i), ("Hkv", _i), ("D", _i), ("ffn", _i),
        ("kv_fmt", _i), ("block_size", _i), ("num_blocks", _l), ("eps", _f), ("scale", _f),
        ("window", _i), ("inv_freq", _p), ("embed_type", _i), ("embed", _p), ("vocab", _l), ("final_norm", _p),
        ("lm_head", Linear), ("layers", ctypes.POINTER(Layer)), ("act_levels", _i),
        ("sliding_inv_freq", _p), ("embed_scale", _f), ("gelu", _i), ("attn_softcap", _f),
        ("swiglu_alpha", _f), ("swiglu_limit", _f),
    ]


# A mixture of experts' work buffers (decode_step.c's kv_work), in order.
MOE_FIELDS = ("moe_chosen", "moe_weight", "moe_row", "moe_at", "moe_first", "moe_chunk_gu", "moe_chunk_down",
              "moe_acts_gu", "moe_acts_down", "moe_gu", "moe_act", "moe_y", "moe_logits", "moe_trace")


class Work(ctypes.Structure):
    _fields_ = [
        ("max_batch", _i), ("max_context", _l), ("max_threads", _i),
        *[(name, _p) for name in ("x", "h", "qkv", "q", "k", "att", "o", "gu", "act", "delta", "cs", "sn", "scores")],
        ("acts", _p), ("best_val", _p), ("best_idx", _p), ("part", _p), ("cs2", _p), ("sn2", _p),
        ("amx", _p), ("amx_cols", _l),
        *[(name, _p) for name in MOE_FIELDS],
    ]


_SIGNATURES: dict[str, list[Any]] = {
    "kvserve_decode_check": [ctypes.POINTER(Model)],
    "kvserve_argmax": [_p, _i, _l, _l, _p, _p, _i],
    "kvserve_amx": [_i],
    "kvserve_amx_work_bytes": [_l, _l, _i],
    "kvserve_decode_step": [ctypes.POINTER(Model), ctypes.POINTER(Work), _i, _p, _p, _p, _p, _i, _p, _p, _p, _p, _p,
                            _l, _i],
}


# The phases kvserve_phase_times reports (decode_step.c's PH_*, in order).
PHASES = ("embedding", "norm + quantize for qkv", "qkv", "RoPE + KV store", "attention", "quantize for o", "o",
          "norm + quantize for gate_up", "gate_up", "SiLU + quantize for down", "down", "final norm",
          "quantize for the head", "LM head", "argmax")


_AMX_SET: set[ctypes.CDLL] = set()  # the builds that follow quant_matmul's AMX switch


def library(phases: bool = False) -> ctypes.CDLL | None:
    """The compiled step (None where the kernels are off or did not build). phases: the profiling build, the same
    arithmetic, each thread timing its work and its waits phase by phase (kvserve_phase_times)."""
    if not phases:
        lib = kernels.bind("decode_step", _SIGNATURES)
    else:
        lib = kernels.bind("decode_step", {**_SIGNATURES, "kvserve_phase_times": [_p, _p, _i]}, defines=("KV_PHASES",))
    if lib is not None and lib not in _AMX_SET:
        lib.kvserve_amx_work_bytes.restype = ctypes.c_long
        quant_matmul.follow_amx(lib)  # one switch for every build of the kernels
        _AMX_SET.add(lib)
    return lib
