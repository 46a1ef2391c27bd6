"""A decode step in one native call, where the model's weights allow it.

`LlamaModel.forward` runs ~10 operations per layer from Python; at one token each costs about as
much in dispatch as in arithmetic (the default model's step spent ~5 ms of ~12 outside the
kernels). `NativeDecode` hands the whole decode forward — embedding, every layer, the final norm
and the LM head — to kernels/decode_step.c in one call, over work buffers allocated once and
grown only when a larger batch or a longer context arrives. Python keeps the scheduling, the
batch's index tables and the sampling.

It takes a model whose matrices are all GGML blocks the kernels multiply (the quantized
default, Q4_0/Q4_1/Q8_0/K-quant GGUFs, checkpoints quantized on load; Mixtral's, Qwen3-MoE's and
gpt-oss's experts too, each row routed by layer_ops.c's router as the per-op path routes it; gpt-oss's
sinks in the fused attention, as the per-op decode applies them), float32 activations and
a CPU KV pool (an int8 one with its row scales); any other model keeps the per-op path (`build()` returns None and says why at
debug level). Prompt chunks take it too while the per-op forward would multiply them with the same integer
kernels (every chunk where batches are invariant; below the BLAS crossover otherwise), each row a query of its own
(engine/runner.py's `_native_prompt_rows`). The matmuls and attention are the per-op path's own kernels, so the two agree
to float rounding (SiLU's exp and RoPE's cos/sin are computed in C; tests/test_native_decode.py
compares them). `KVSERVE_NATIVE_DECODE=0` turns the step off.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

from kvserve import kernels
from kvserve.config import env_switch
from kvserve.kernels import KV_DTYPES, decode_step
from kvserve.model.attention import CpuPagedAttention
from kvserve.model.linear import LinearLayer
from kvserve.model.llama import Experts, LlamaModel, StepModel
from kvserve.model.quant import KERNEL_TYPES, ConcatLinear, QuantizedLinear, QuantizedWeight

Best = tuple[list[int], list[float]]  # each row's argmax (its token id) and the logit there

log = logging.getLogger("kvserve.model")

_FIELDS = ("x", "h", "qkv", "q", "k", "att", "o", "gu", "act", "delta", "cs", "sn", "cs2", "sn2")


def enabled() -> bool:
    return env_switch("KVSERVE_NATIVE_DECODE")


class Unsupported(Exception):
    """Why a model keeps the per-op decode path."""


def _parts(lin: LinearLayer | None) -> list[LinearLayer | None]:
    return [*lin.parts] if isinstance(lin, ConcatLinear) else [lin]


def _linear(lin: LinearLayer | None, keep: list[torch.Tensor]) -> decode_step.Linear:
    parts = [p for p in _parts(lin) if isinstance(p, QuantizedLinear)]
    if len(parts) < len(_parts(lin)):
        raise Unsupported("a linear layer holds float weights")
    if len(parts) > decode_step.MAX_PARTS:
        raise Unsupported(f"a linear layer of {len(parts)} parts")
    out = decode_step.Linear()
    out.nparts = len(parts)
    biases = []
    for i, p in enumerate(parts):
        if p.weight.qtype not in KERNEL_TYPES:
            raise Unsupported(f"GGML type {p.weight.qtype.name} has no kernel")
        rows, cols = p.weight.shape
        if i < len(parts) - 1 and rows % 16:
            raise Unsupported("a part's rows are not a multiple of 16")
        out.type[i], out.w[i], out.rows[i] = p.weight.kernel_type, p._flat.data_ptr(), rows
        keep.append(p._flat)
        biases.append(p.bias)
    out.cols = parts[0].weight.shape[1]
    out.total_rows = sum(p.weight.shape[0] for p in parts)
    if any(b is not None for b in biases):
        bias = torch.cat([torch.zeros(p.weight.shape[0]) if b is None else b.float() for p, b in zip(parts, biases)])
        keep.append(bias.contiguous())
        out.bias = keep[-1].data_ptr()
    return out


def _f32(t: torch.Tensor, keep: list[torch.Tensor]) -> int:
    if t.dtype != torch.float32:
        raise Unsupported(f"{t.dtype} norm weights")
    keep.append(t.contiguous())
    return keep[-1].data_ptr()


class NativeDecode:
    """The decode forward of `model` over `kv_caches` in one call; see the module docstring."""

    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int,
                 kv_scales: list[torch.Tensor] | None = None) -> None:
        lib = decode_step.library() if enabled() else None
        if lib is None:
            raise Unsupported("the native kernels are off or did not build")
        if getattr(model, "tensor_parallel_size", 1) > 1:
            raise Unsupported("tensor parallel: the step has no all-reduce between layers")
        c = model.config
        if model.dtype != torch.float32:
            raise Unsupported(f"activations in {model.dtype} (the step computes in float32)")
        if not isinstance(model.attention, CpuPagedAttention) or not model.ops.native:
            raise Unsupported("the model runs another attention backend or the torch elementwise ops")
        pool = kv_caches[0]
        if pool.device.type != "cpu" or pool.dtype not in KV_DTYPES or \
                any(kv.shape != pool.shape or kv.dtype != pool.dtype or not kv.is_contiguous() for kv in kv_caches):
            raise Unsupported("the KV pool is not a contiguous CPU pool of one format")
        scales: list[torch.Tensor | None] = [*kv_scales] if kv_scales else [None] * len(kv_caches)
        if pool.dtype == torch.int8 and kv_scales is None:
            raise Unsupported("an int8 KV pool without its row scales")
        self._lib = lib
        self._keep: list[torch.Tensor] = []  # every tensor the structs point into
        self._structs: list[ctypes.Array] = []  # and the experts' arrays of linears
        self._trace = False
        self.model, self.kv_caches, self.kv_scales = model, kv_caches, kv_scales
        m = decode_step.Model()
        m.n_layers, m.hidden, m.H, m.Hkv, m.D, m.ffn = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                                                        c.num_key_value_heads, c.head_dim, c.intermediate_size)
        m.kv_fmt, m.block_size, m.num_blocks = KV_DTYPES[pool.dtype], block_size, pool.shape[2]
        # m.window: the every-layer window, under which block tables may hold freed blocks; each layer has its own
        m.eps, m.scale, m.window, m.act_levels = c.rms_norm_eps, model.scale, c.sliding_window or 0, model.act_levels
        m.inv_freq = _f32(model.inv_freq.float(), self._keep)
        if model.sliding_inv_freq is not None:
            m.sliding_inv_freq = _f32(model.sliding_inv_freq.float(), self._keep)
        m.embed_scale, m.gelu = c.embedding_multiplier, {"silu": 0, "gelu_tanh": 1}[c.hidden_act]
        m.attn_softcap = c.attn_logit_softcapping or 0.0
        if c.swiglu_limit is not None:  # gpt-oss's clamped SwiGLU experts
            m.swiglu_alpha, m.swiglu_limit = c.swiglu_alpha, c.swiglu_limit
        embed = model.embed
        if isinstance(embed, QuantizedWeight):
            if embed.qtype not in KERNEL_TYPES:
                raise Unsupported(f"embedding in {embed.qtype.name}")
            flat = embed.blocks.contiguous()
            m.embed_type, m.embed = embed.kernel_type, flat.data_ptr()
            self._keep.append(flat)
        else:
            m.embed_type, m.embed = 0, _f32(embed, self._keep)
        m.vocab = c.vocab_size
        m.final_norm = _f32(model.norm, self._keep)
        # The LM head runs in the step while the batch is below the row count from which the
        # per-op path switches it to dequantize + BLAS (the same arithmetic either way below it).
        self.head_rows = 0
        if isinstance(model.lm_head, QuantizedLinear) and model.lm_head.weight.qtype in KERNEL_TYPES:
            m.lm_head = _linear(model.lm_head, self._keep)
            self.head_rows = model.lm_head.blas_from
        layers = (decode_step.Layer * c.num_hidden_layers)()
        for lw, kv, sc, out in zip(model.layers, kv_caches, scales, layers):
            out.input_norm, out.post_norm = _f32(lw.input_norm, self._keep), _f32(lw.post_norm, self._keep)
            out.qkv, out.o = _linear(lw.qkv, self._keep), _linear(lw.o, self._keep)
            out.kv = kv.data_ptr()
            out.kv_scale = kernels.scales_ptr(kv, sc)  # None for a float pool
            if lw.q_norm is not None and lw.k_norm is not None:  # (both or neither)
                out.q_norm, out.k_norm = _f32(lw.q_norm, self._keep), _f32(lw.k_norm, self._keep)
            if lw.attn_out_norm is not None and lw.mlp_out_norm is not None:  # (both or neither)
                out.attn_out_norm, out.mlp_out_norm = _f32(lw.attn_out_norm, self._keep), _f32(lw.mlp_out_norm, self._keep)
            out.window, out.sliding_rope = lw.window, lw.sliding_rope
            if lw.sinks is not None:
                out.sinks = _f32(lw.sinks, self._keep)
            if lw.experts:
                out.experts = self._experts(lw.experts)
            else:
                out.gate_up, out.down = _linear(lw.gate_up, self._keep), _linear(lw.down, self._keep)
        m.layers = layers
        self._layers, self._model = layers, m
        self._linears = [p for lw in model.layers for lin in (lw.qkv, lw.o, *model._mlp(lw))
                         for p in _parts(lin) if isinstance(p, QuantizedLinear)]  # (all are: _linear checked)
        if lib.kvserve_decode_check(ctypes.byref(m)) != 0:
            raise Unsupported("shapes the native step does not take")
        self._block_size = block_size
        self._work = decode_step.Work()
        self._buffers: dict[str, torch.Tensor] = {}
        self._grow(1, 256, torch.get_num_threads())

    def _experts(self, x: Experts) -> decode_step.Experts:
        """A sparse layer's router and experts for the step (decode_step.c's kv_experts)."""
        if not x.native_route:
            raise Unsupported("a router the step does not compute (not float32)")
        out = decode_step.Experts()
        out.n, out.top_k, out.how = len(x.gate_up), x.top_k, x.how
        out.ffn = self.model.config.moe_intermediate_size
        out.router = _f32(x.router, self._keep)
        if x.router_bias is not None:
            out.router_bias = _f32(x.router_bias, self._keep)
        gate_up, down = (decode_step.Linear * out.n)(), (decode_step.Linear * out.n)()
        for e in range(out.n):
            gate_up[e], down[e] = _linear(x.gate_up[e], self._keep), _linear(x.down[e], self._keep)
        self._structs += [gate_up, down]  # what out points into
        out.gate_up, out.down = gate_up, down
        return out

    @classmethod
    def build(cls, model: StepModel, kv_caches: list[torch.Tensor], block_size: int,
              kv_scales: list[torch.Tensor] | None = None) -> NativeDecode | None:
        """The native step for this model, or None (with the reason logged) where it does not apply."""
        try:
            if not isinstance(model, LlamaModel):  # tensor parallel's rank 0 (parallel/model.py)
                raise Unsupported("tensor parallel: the step has no all-reduce between layers")
            return cls(model, kv_caches, block_size, kv_scales)
        except Unsupported as e:
            log.debug("decode keeps the per-op path: %s", e)
            return None

    def _grow(self, batch: int, context: int, threads: int) -> None:
        """(Re)allocate the work buffers for at least this batch, context and thread count."""
        c, w = self.model.config, self._work
        batch, context = max(batch, w.max_batch * 2 if w.max_batch else 1), max(context, 2 * w.max_context)
        H, Hkv, D, N, F = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size
        widths = {"x": N, "h": N, "qkv": (H + 2 * Hkv) * D, "q": H * D, "k": Hkv * D, "att": H * D, "o": N,
                  "gu": 2 * F, "act": F, "delta": N, "cs": D, "sn": D, "cs2": D, "sn2": D}
        b = self._buffers
        for name in _FIELDS:
            b[name] = torch.zeros(batch, widths[name])
            setattr(w, name, b[name].data_ptr())
        b["scores"] = torch.zeros(threads, H // Hkv * context)
        w.scores = b["scores"].data_ptr()
        # Quantized activations: 84 bytes per 32 values of the widest input (kernels/quant_acts.h's ACT_BYTES) for
        # levels x batch + 1 rows (an odd count's last row is stored twice, act_rows), 32-byte aligned; with two
        # levels, each thread's products of both for a 16-row chunk (rows_out).
        levels = self.model.act_levels
        cols = max(N, H * D, F, c.moe_intermediate_size)
        size = (levels * batch + 1) * cols // 32 * 84 + 64
        E, k = c.num_experts, c.num_experts_per_tok
        if E:  # decode_step.c's kv_work: a mixture of experts' buffers; each chosen expert's activations apart
            R, F_e, groups = batch * k, c.moe_intermediate_size, min(E, batch * k)
            size = max(size, (levels * R + groups) * cols // 32 * 84 + 64 * groups + 64)
            moe = {"moe_chosen": torch.zeros(R, dtype=torch.int64), "moe_weight": torch.zeros(R),
                   "moe_row": torch.zeros(R, dtype=torch.int32), "moe_at": torch.zeros(R, dtype=torch.int32),
                   **{n: torch.zeros(E + 1, dtype=torch.int64) for n in decode_step.MOE_FIELDS[4:9]},
                   "moe_gu": torch.zeros(R, 2 * F_e), "moe_act": torch.zeros(R, F_e), "moe_y": torch.zeros(R, N),
                   "moe_logits": torch.zeros(threads, E),
                   "moe_trace": torch.zeros(c.num_hidden_layers, batch, k, dtype=torch.int64)}
            for name, t in moe.items():
                b[name] = t
                setattr(w, name, t.data_ptr())
            w.moe_trace = b["moe_trace"].data_ptr() if self.trace else None
        acts = torch.zeros(size, dtype=torch.uint8)
        b["acts"] = acts
        w.acts = acts.data_ptr() + (-acts.data_ptr()) % 32
        b["part"] = torch.zeros(threads, 2 * batch * 16)
        w.part = b["part"].data_ptr()
        # AMX tiles (quant_matmul_amx.h): each thread's decoded weight tiles, then the activations as tiles.
        amx = self._lib.kvserve_amx_work_bytes(levels * batch, cols, threads)
        b["amx"] = torch.empty(amx + 64 if amx > 0 else 0, dtype=torch.uint8)
        w.amx = b["amx"].data_ptr() + (-b["amx"].data_ptr()) % 64 if amx > 0 else None
        w.amx_cols = cols if amx > 0 else 0
        # Each row's argmax over the logits (a greedy step's sampling, done while they are in cache):
        # the threads' partial bests, then the rows' ids and values.
        b["best_val"], b["best_idx"] = torch.zeros(threads, batch), torch.zeros(threads, batch, dtype=torch.int64)
        w.best_val, w.best_idx = b["best_val"].data_ptr(), b["best_idx"].data_ptr()
        b["argmax"], b["argmax_val"] = torch.zeros(batch, dtype=torch.int64), torch.zeros(batch)
        b["hidden"] = torch.zeros(batch, N)
        b["logits"] = torch.zeros(batch, c.vocab_size) if self.head_rows else torch.zeros(0)
        # The step's index arrays, written in place each step: ids, positions, slots (int64), and
        # the block tables then the context lengths (int32).
        b["index"] = torch.zeros(3, batch, dtype=torch.int64)
        self._max_width = context // self._block_size + 1
        b["tables"] = torch.zeros(batch * self._max_width + batch, dtype=torch.int32)
        self._index_np, self._tables_np = b["index"].numpy(), b["tables"].numpy()
        w.max_batch, w.max_context, w.max_threads = batch, context, threads

    @property
    def trace(self) -> bool:
        """Whether each step leaves the experts its rows chose in each sparse layer's Experts.last_chosen, as
        the per-op path does (for `kvserve explain`; off, the step copies nothing out)."""
        return self._trace

    @trace.setter
    def trace(self, on: bool) -> None:
        self._trace = on
        if "moe_trace" in self._buffers:
            self._work.moe_trace = self._buffers["moe_trace"].data_ptr() if on else None

    def use_library(self, lib: ctypes.CDLL) -> ctypes.CDLL:
        """Run the step with another build of decode_step.c (its profiling build, decode_step.library(phases=True),
        whose results are the same bits); returns the one it replaces."""
        old, self._lib = self._lib, lib
        return old

    def integer_rows(self) -> int:
        """The rows from which some linear of the per-op forward leaves the integer kernel (dequantize +
        BLAS, or bf16); a step of fewer rows computes in the native step what the per-op one would."""
        return min(p.blas_from for p in self._linears)

    @torch.inference_mode()
    def __call__(self, ids: list[int], positions: list[int], slots: list[int], block_tables: list[list[int]],
                 logits: bool = True, rows_per_seq: list[int] | None = None,
                 argmax_cols: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, Best | None]:
        """One token per row → (hidden [B, hidden], logits [B, V] or None where the caller must run
        the LM head, and with argmax_cols each row's argmax over its first argmax_cols logits and the
        logit there, or None). The tensors are views of work buffers: valid until the next call. Each row attends to
        its sequence's keys up to its own position; block_tables has one table per row, or, with
        rows_per_seq, one per sequence whose rows follow one another (a prompt chunk's)."""
        B = len(ids)
        threads = torch.get_num_threads()
        width = max(len(t) for t in block_tables)
        seq_lens = [p + 1 for p in positions]
        w = self._work
        if B > w.max_batch or max(seq_lens) > w.max_context or threads > w.max_threads or width > self._max_width:
            self._grow(B, max(max(seq_lens), width * self._block_size), threads)
        index, tables = self._index_np, self._tables_np  # no tensor is allocated per decode step
        index[0, :B], index[1, :B], index[2, :B] = ids, positions, slots
        if rows_per_seq is None:
            tables[: B * width] = [b for t in block_tables for b in (t + [0] * (width - len(t)) if len(t) < width else t)]
        else:
            per_seq = np.zeros((len(block_tables), width), dtype=np.int32)
            for i, t in enumerate(block_tables):
                per_seq[i, : len(t)] = t
            tables[: B * width].reshape(B, width)[:] = np.repeat(per_seq, rows_per_seq, axis=0)
        tables[B * width : B * width + B] = seq_lens
        hidden = self._buffers["hidden"]
        head = logits and B < self.head_rows
        out = self._buffers["logits"] if head else None
        # Soft-capped logits (Gemma 2) are capped here, after the step: its argmax would be of the uncapped ones
        capped = bool(self.model.config.final_logit_softcapping)
        best = head and 0 < argmax_cols and not capped
        ip, tp = self._buffers["index"].data_ptr(), self._buffers["tables"].data_ptr()
        ids_out, vals_out = self._buffers["argmax"], self._buffers["argmax_val"]
        rc = self._lib.kvserve_decode_step(
            ctypes.byref(self._model), ctypes.byref(w), B, ip, ip + 8 * w.max_batch, ip + 16 * w.max_batch,
            tp, width, tp + 4 * B * width, hidden.data_ptr(), None if out is None else out.data_ptr(),
            ids_out.data_ptr() if best else None, vals_out.data_ptr() if best else None, argmax_cols if best else 0,
            threads)
        if rc != 0:
            raise RuntimeError(f"native decode step failed (code {rc}) for {B} sequences: ids, slots or block tables "
                               "outside the model's vocabulary or the KV pool")
        if self._trace and "moe_trace" in self._buffers:
            for lw, chosen in zip(self.model.layers, self._buffers["moe_trace"]):
                if lw.experts:
                    lw.experts.last_chosen = chosen[:B].clone()
        picked = (ids_out[:B].tolist(), vals_out[:B].tolist()) if best else None
        return hidden[:B], (self.model.softcap_logits(out[:B]) if out is not None else None), picked
