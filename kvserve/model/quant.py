"""Quantized weights kept quantized: GGML blocks in memory, multiplied as they are.

Decoding one token reads every weight once, so its speed is the weights' bytes: the default
model is ~540 MB as float32 and ~95 MB as its GGUF's own Q4_1/Q8_0 blocks. A QuantizedWeight
holds a tensor's blocks exactly as the file stores them (uint8 [out, bytes per row]; rows are
independent, so q/k rows can be reordered and q/k/v fused by moving bytes). QuantizedLinear
multiplies with them through kernels/quant_matmul.c (activations quantized to int8 per 32
values, integer dot products) for small batches, and for large ones dequantizes row tiles to
float32 and uses BLAS, which is faster once the weight is reused by enough rows. Where the switch
lies was measured per shape and per integer dot (`blas_from_rows`): dequantizing is a fixed cost
per call that sgemm's cheaper rows must repay, so it comes late for 4-bit blocks (slow to expand,
fast integer dot: ~128 rows for the model's Q4_1 layers on AVX2, ~256 with AVX-512 VNNI) and
early for the Q8_0 LM head (cheap to expand, a dearer integer dot: ~40 rows on AVX2, ~192 with
VNNI). The embedding table dequantizes only the rows it looks up, and a tied LM head multiplies
with the same blocks.

make_linear repacks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, Q4_K, Q5_K and Q6_K weights into the kernels' x8 layout (8 blocks of
a row, or a K-quant super-block's 8 sub-blocks, interleaved by 32-bit word, kernels/quant_x8.h; the Q4 / Q5 / K types'
rows, and Q8_0's on AVX-512 builds,
in slabs of four interleaved group by group, their blocks past the last group two at a time as one more group of
the four rows, so a 4-row tile reads one stream of memory) where the build multiplies it: the same
bytes, about 2x less arithmetic per block (on the plain C build every type but Q8_0, whose stored rows are one
contiguous dot there). A tied LM head and the embedding share one packed copy (a lookup
unpacks the rows it reads).

`quantize()` makes Q8_0 / Q4_0 blocks from float weights (checkpoints quantized on load), with
the rounding of ggml's reference quantizers (tests check it against gguf.quants.quantize).
Where the C kernels are unavailable, weights are dequantized once to float (correct, not lean).
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from kvserve import hugepages
from kvserve.config import ModelConfig, env_switch
from kvserve.kernels import quant_matmul
from kvserve.model.dequant import dequantize
from kvserve.model.linear import Linear, bf16_packing_available

log = logging.getLogger("kvserve.model")

# The GGML types the kernels multiply directly; others are dequantized on load.
KERNEL_TYPES: frozenset[Q] = frozenset({Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4, Q.Q4_K, Q.Q5_K, Q.Q6_K})
# Types a float checkpoint can be quantized to on load (quantization="q8_0" | "q4_0").
ON_LOAD_TYPES = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
QUANTIZATION_CHOICES = ("auto", "none", *ON_LOAD_TYPES)
# From this many activation rows on, QuantizedLinear dequantizes row tiles to float32 and uses
# sgemm instead of the integer kernel: the crossover is where dequantizing the whole weight once
# (a fixed cost) is repaid by sgemm's lower cost per activation row. It depends on the integer
# dot the kernel was built with, so it was measured on each (`python -m benchmarks.quant`,
# 2026-11-30, on the two CPUs named below):
# - AVX2 (maddubs + madd), Zen 3, one thread: the Q4_1 layers (576→1536, 1536→576, 576→960)
#   stay ahead up to ~128 rows (B=64: 1.2-1.4x faster), 4-bit blocks being slow to expand; the
#   Q8_0 LM head (49152 rows) expands cheaply and its dot needs sign fix-ups, so sgemm wins from
#   ~40 rows (B=32: integer 1.1x faster; B=48: sgemm 1.06x). K-quants expand like Q4_1.
# - AVX-512 VNNI (one dpbusd per block and row pair), Zen 4, two threads: the Q4_1 layers stay
#   ahead to ~256 rows (B=128: 1.3-1.5x, B=256: 1.0-1.6x, B=512: even), the LM head to ~192
#   (B=128: 1.5x faster; B=256: sgemm 1.1x).
# The portable C path uses the AVX2 table (not measured on a CPU without AVX2).
BLAS_FROM_ROWS: dict[Q, int] = {Q.Q8_0: 40}
BLAS_FROM_ROWS_OTHERWISE = 128
BLAS_FROM_ROWS_VNNI: dict[Q, int] = {Q.Q8_0: 192}
BLAS_FROM_ROWS_VNNI_OTHERWISE = 256
# Without batch invariance, on a CPU with bfloat16 arithmetic: from this many rows a call runs on a
# packed bfloat16 copy of the weight (oneDNN) instead. Measured on the default model's layers
# (benchmarks.quant --library, AVX-512 BF16 Xeon, 2 threads): even at ~16 rows, 1.2-2.7x faster
# at 32, and prompts prefill ~2.4x faster than on the integer kernel.
BF16_FROM_ROWS = 32
BLAS_TILE_BYTES = 16 << 20  # weight rows dequantized at a time: at most this much float copy


def blas_from_rows(qtype: Q) -> int:
    """Activation rows from which QuantizedLinear uses sgemm over dequantized tiles."""
    if quant_matmul.integer_dot() == "avx512_vnni":
        return BLAS_FROM_ROWS_VNNI.get(qtype, BLAS_FROM_ROWS_VNNI_OTHERWISE)
    return BLAS_FROM_ROWS.get(qtype, BLAS_FROM_ROWS_OTHERWISE)


def batch_invariant_by_default() -> bool:
    """Whether quantized layers keep the integer kernel at every batch size unless told otherwise.
    On the SIMD builds (AVX-512 VNNI, AVX2) it matches or beats dequantize + sgemm on long prefills
    (time to first token at 128-1024 prompt tokens: 0.95-1.07x with VNNI; 0.64-0.83x with the AVX2
    kernel against AVX2 sgemm, docs/benchmarks.md), so batch invariance costs nothing there; the
    plain C build's dot is far slower than sgemm and keeps sgemm past the crossover."""
    return quant_matmul.integer_dot() in ("avx512_vnni", "avx2")


# How the integer kernels quantize activations, by name → int8 levels per value (kernels/quant_acts.h's
# quantize_input; docs/quality.md has the figures). "int8x2": int8 per 32 values, then what that left
# quantized again; the two products add up to the exact float path's to within ~2e-6 KL divergence, for
# twice the integer dots: ~1.1x a one-sequence step, ~1.3x at 4 sequences, ~1.7-2x in large batches and
# prompts. "int8": one level, as llama.cpp's q8_1, a slightly different model: on the default model's
# Q4_1 file KL ~7e-3 from the exact path, top-1 agreement ~95%, and greedy answers that leave it where
# two tokens are near a tie ("What is the capital of France?"). "auto" takes int8x2 for models under
# AUTO_X2_BELOW parameters, where one level was measured to cost answers and the work is small, and
# int8 for larger ones, whose speed it keeps (their one-level error is not measured here: no real
# checkpoint of that size ships offline).
ACTIVATIONS = {"int8x2": 2, "int8": 1}
ACTIVATION_CHOICES = ("auto", *ACTIVATIONS)
AUTO_X2_BELOW = 1_000_000_000


def parameter_count(config: ModelConfig) -> int:
    """The matrices' weights: embedding, LM head (unless tied), each layer's q/k/v/o and MLP."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    return c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_hidden_layers * layer


def activation_levels(activations: str, config: ModelConfig) -> int:
    """int8 levels per activation row for an `activations` choice on this model."""
    if activations == "auto":
        activations = "int8x2" if parameter_count(config) < AUTO_X2_BELOW else "int8"
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATION_CHOICES)}, got {activations!r}")
    return ACTIVATIONS[activations]


def check_quantization(quantization: str) -> str:
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    return quantization


@dataclass
class QuantizedWeight:
    """A [out, in] weight as GGML blocks: `blocks` is uint8 [out, in / block values * block bytes].
    `x8`: the rows are in the kernels' x8 layout (kernels/quant_x8.h: each row's blocks 8 at a time, and
    rows in fours interleaved group by group; same bytes per row, but rows no longer slice: unpack
    first, as `rows` does)."""

    blocks: torch.Tensor
    qtype: Q
    shape: tuple[int, int]
    x8: bool = False

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def kernel_type(self) -> int:
        """The type id the C kernels take for these blocks."""
        return int(self.qtype) + (quant_matmul.X8 if self.x8 else 0)

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [n, in] of the given rows (all if None)."""
        out, cols = self.shape
        if quant_matmul.available() and self.qtype in KERNEL_TYPES:
            return quant_matmul.dequantize_rows(self.blocks.reshape(-1), self.kernel_type, out, cols, rows)
        blocks = self.blocks if rows is None else self.blocks[rows]
        return dequantize(blocks.numpy(), self.qtype, (blocks.shape[0], cols))

    def dequantize_range(self, start: int, stop: int) -> torch.Tensor:
        """float32 [stop - start, in] of rows start..stop-1."""
        if self.x8:  # (an x8 slab's rows are interleaved: the kernel finds each)
            return self.dequantize(torch.arange(start, stop))
        return QuantizedWeight(self.blocks[start:stop], self.qtype, (stop - start, self.shape[1])).dequantize()

    def rows(self, start: int, stop: int) -> QuantizedWeight:
        """Rows start..stop-1 as a weight of their own, in this one's layout."""
        if not self.x8:
            return QuantizedWeight(self.blocks[start:stop].contiguous(), self.qtype, (stop - start, self.shape[1]))
        return self.unpacked().rows(start, stop).packed()

    def packed(self, arena: hugepages.Arena | None = None) -> QuantizedWeight:
        """The same weight in the x8 layout where the kernels multiply it faster (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4 and the
        K-quants on the SIMD builds, all but Q8_0 on plain C; KVSERVE_X8=0 keeps the stored layout), else itself. The new blocks are cut from
        `arena` where one is given (a model's weights on huge pages)."""
        if self.x8 or not quant_matmul.x8_available(int(self.qtype)) or not x8_enabled():
            return self
        out, cols = self.shape
        into = None if arena is None else arena.empty((self.blocks.numel(),))
        flat = quant_matmul.pack_x8(self.blocks.contiguous().reshape(-1), int(self.qtype), out, cols, out=into)
        return QuantizedWeight(flat.reshape(self.blocks.shape), self.qtype, self.shape, x8=True)


    def unpacked(self) -> QuantizedWeight:
        """The same weight in the stored GGML layout (itself if it is)."""
        if not self.x8:
            return self
        out, cols = self.shape
        flat = quant_matmul.pack_x8(self.blocks.contiguous().reshape(-1), self.kernel_type, out, cols, unpack=True)
        return QuantizedWeight(flat.reshape(self.blocks.shape), self.qtype, self.shape)


def x8_enabled() -> bool:
    return env_switch("KVSERVE_X8")


def from_gguf(raw: torch.Tensor, qtype: Q, shape: tuple[int, int]) -> QuantizedWeight:
    """Blocks as GGUFReader exposes them (any uint8 view of the tensor's bytes) → QuantizedWeight."""
    per, size = GGML_QUANT_SIZES[qtype]
    return QuantizedWeight(raw.reshape(shape[0], shape[1] // per * size), qtype, shape)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (half away from zero), as ggml rounds; torch.round rounds half to even."""
    return torch.sign(v) * torch.floor(v.abs() + 0.5)


def quantize(w: torch.Tensor, qtype: Q) -> QuantizedWeight:
    """float [out, in] (in a multiple of 32) → Q8_0 or Q4_0 blocks, rounded as ggml's reference."""
    out, cols = w.shape
    if cols % 32:
        raise ValueError(f"{qtype.name} needs rows of whole 32-value blocks, got {cols} columns")
    x = w.detach().float().reshape(-1, 32)  # [blocks, 32]
    if qtype == Q.Q8_0:
        d = x.abs().amax(1, keepdim=True) / 127
        q = _roundf(x * torch.where(d == 0, 0.0, 1.0 / d)).to(torch.int8).view(torch.uint8)
    elif qtype == Q.Q4_0:
        peak = x.gather(1, x.abs().argmax(1, keepdim=True))  # the signed value of largest magnitude
        d = peak / -8
        codes = torch.trunc(x * torch.where(d == 0, 0.0, 1.0 / d) + 8.5).clamp(0, 15).to(torch.uint8)
        q = codes[:, :16] | (codes[:, 16:] << 4)
    else:
        raise ValueError(f"kvserve quantizes to {', '.join(ON_LOAD_TYPES)}, not {qtype.name}")
    scale = d.to(torch.float16).view(torch.uint8)  # [blocks, 2]
    return QuantizedWeight(torch.cat([scale, q], 1).reshape(out, -1).contiguous(), qtype, (out, cols))


class QuantizedLinear:
    """y = x W^T + b with W kept as GGML blocks; x [T, in] of any float dtype, y in x's dtype."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        self.weight = weight
        self.bias = bias
        self._flat = weight.blocks.contiguous().reshape(-1)
        self._qtype = weight.kernel_type
        # blas_from: the row count from which a call dequantizes tiles for BLAS instead of running
        # the integer kernel (the native decode step and the kernel benchmark read or set it).
        # Without the kernels (make_linear dequantizes on load then; this is for direct use) every
        # call takes the dequantize + BLAS path.
        kernels = quant_matmul.available()
        self.blas_from = blas_from_rows(weight.qtype) if kernels else 0
        self.levels = 1  # int8 levels per activation row (set_activation_levels)
        self._matmul = quant_matmul.prepare(self._flat, self._qtype, *weight.shape) if kernels else None
        self._bf16: Linear | None = None  # the packed bfloat16 copy, without batch invariance only

    @property
    def nbytes(self) -> int:
        copy = 0 if self._bf16 is None else self._bf16.nbytes
        return self.weight.nbytes + copy + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def set_batch_invariant(self, on: bool) -> None:
        """On: the integer kernel for any number of rows. Each row's result is then the same bits
        whatever else is in the batch (the kernel's arithmetic per row does not depend on the
        batch), so a greedy request's tokens do not depend on its neighbours; long prefills give
        up sgemm's speed past the crossover. Off: where the CPU has bfloat16 arithmetic, a packed
        bfloat16 copy of the weight (2 bytes a weight more) from BF16_FROM_ROWS rows on; elsewhere
        sgemm over dequantized tiles from `blas_from_rows` on. A row's result then differs in its
        last bits (bfloat16: in more than its last bits) with the batch it came in."""
        if self._matmul is None:
            return
        self._bf16 = None
        if on:
            self.blas_from = sys.maxsize
            return
        if bf16_packing_available():
            lin = Linear(self.weight.dequantize().to(torch.bfloat16))
            self._bf16 = lin if lin.packed is not None else None
        self.blas_from = BF16_FROM_ROWS if self._bf16 is not None else blas_from_rows(self.weight.qtype)

    def set_activation_levels(self, levels: int) -> None:
        """The integer kernel quantizes each activation row at `levels` int8 levels per 32 values
        (quant_matmul.LEVELS): 1, int8 as llama.cpp's q8_1; 2, int8 and what it left quantized again."""
        if self._matmul is not None:
            self._matmul = quant_matmul.prepare(self._flat, self._qtype, *self.weight.shape, levels)
        self.levels = levels

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out, cols = self.weight.shape
        xf = x if x.dtype is torch.float32 else x.float()
        if self._matmul is not None and x.shape[0] < self.blas_from:  # (blas_from is 0 without the kernels)
            y = self._matmul(xf)
        elif self._bf16 is not None:
            y = self._bf16(x.to(torch.bfloat16)).float()
        else:
            y = torch.empty(x.shape[0], out)
            tile = max(1, BLAS_TILE_BYTES // (4 * cols))  # one tile for the model's layers; the LM head takes several
            for r0 in range(0, out, tile):
                r1 = min(r0 + tile, out)
                torch.mm(xf, self.weight.dequantize_range(r0, r1).t(), out=y if r1 - r0 == out else y[:, r0:r1])
        if self.bias is not None:
            y += self.bias
        return y if x.dtype is torch.float32 else y.to(x.dtype)


class ConcatLinear:
    """Fused projections whose parts differ in type (e.g. a Q4_K_M file's Q6_K attn_v beside Q4_K
    attn_q/k): each part runs on its own, outputs side by side."""

    def __init__(self, parts: list[Linear | QuantizedLinear]) -> None:
        self.parts = parts

    def set_batch_invariant(self, on: bool) -> None:
        for p in self.parts:
            if isinstance(p, QuantizedLinear):
                p.set_batch_invariant(on)

    def set_activation_levels(self, levels: int) -> None:
        for p in self.parts:
            if isinstance(p, QuantizedLinear):
                p.set_activation_levels(levels)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=1)


Weight = torch.Tensor | QuantizedWeight


@cache
def _warn_dequantizing(dtype: torch.dtype) -> None:
    """Once a process (a model makes ~200 linears)."""
    log.warning("quantized weights are dequantized to %s: the native kernels are unavailable", dtype)


def make_linear(weights: list[Weight], bias: torch.Tensor | None, dtype: torch.dtype,
                arena: hugepages.Arena | None = None) -> Linear | QuantizedLinear | ConcatLinear:
    """One linear layer from the row-wise concatenation of `weights` (float tensors in the model
    dtype, or GGML blocks), keeping blocks quantized where the kernels can multiply them, in the
    kernels' x8 layout where they have one (its blocks cut from `arena` where one is given)."""
    kernels = quant_matmul.available()
    if not kernels and any(isinstance(w, QuantizedWeight) for w in weights):
        _warn_dequantizing(dtype)
    weights = [w.dequantize().to(dtype) if isinstance(w, QuantizedWeight) and not kernels else w for w in weights]
    tensors = [w for w in weights if isinstance(w, torch.Tensor)]
    if len(tensors) == len(weights):
        return Linear(torch.cat(tensors) if len(tensors) > 1 else tensors[0], bias)
    quantized = [w for w in weights if isinstance(w, QuantizedWeight)]
    if len(quantized) == len(weights) and len({w.qtype for w in quantized}) == 1:
        if len(quantized) == 1:
            return QuantizedLinear(quantized[0].packed(arena), bias)
        shape = (sum(w.shape[0] for w in quantized), quantized[0].shape[1])
        fused = QuantizedWeight(torch.cat([w.blocks for w in quantized]), quantized[0].qtype, shape)
        return QuantizedLinear(fused.packed(arena), bias)
    parts: list[Linear | QuantizedLinear] = []
    start = 0
    for w in weights:  # each part alone: make_linear([w], ...)
        b = None if bias is None else bias[start : start + w.shape[0]]
        parts.append(Linear(w, b) if isinstance(w, torch.Tensor) else QuantizedLinear(w.packed(arena), b))
        start += w.shape[0]
    return ConcatLinear(parts)


def embedding(ids: torch.Tensor, weight: Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the embedding table [V, hidden] in `dtype`; only those rows are dequantized."""
    if isinstance(weight, QuantizedWeight):
        return weight.dequantize(ids).to(dtype)
    return F.embedding(ids, weight)


def nbytes(weight: Weight) -> int:
    return weight.nbytes if isinstance(weight, QuantizedWeight) else weight.numel() * weight.element_size()
