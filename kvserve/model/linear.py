"""Linear layers whose weights are laid out once for the CPU's matmul library.

torch's bfloat16 matmul on the CPU goes through oneDNN, which reorders the weight into its
blocked layout on every call. Reordering once at load time (`mkldnn._reorder_linear_weight`)
gives the same product bit for bit and is 30-50% faster at batch 1-64 (AMD EPYC, 2 threads,
2026-11-29). Other dtypes and devices, or a torch without the op, use F.linear:
float32 stays on torch's default sgemm so that its results match the reference exactly.

oneDNN packs bfloat16 only where the CPU computes it natively (AVX-512 BF16, AMX, or
AVX-NE-CONVERT); elsewhere, or under `KVSERVE_ISA` below avx512, the weight stays bfloat16 in
memory (half the bytes of float32) and is read by kernels/quant_matmul.c's GEMV, which widens
it to float32 in registers and accumulates in float32 (torch would emulate bfloat16 math, ~4x
slower than float32 at batch 16). From BF16_BLAS_FROM_ROWS rows on, the weight is widened to
float32 for the call and sgemm does the work, as arithmetic then outweighs bytes.
"""
from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from kvserve import cpu
from kvserve.kernels import quant_matmul

# The batch size oneDNN is told to expect; it serves 1 to thousands of rows well.
PACK_FOR_ROWS = 64
BF16_BLAS_FROM_ROWS = 16


class LinearLayer(Protocol):
    """What a model's linear layers are to the model: y = layer(x) for x [T, in], and the bytes they
    keep. Linear, model/quant.py's QuantizedLinear and ConcatLinear, and parallel/model.py's
    AllReduced; those with integer kernels also take set_batch_invariant and set_activation_levels."""

    @property
    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def bf16_packing_available() -> bool:
    """Whether this CPU (at the KVSERVE_ISA cap) gets oneDNN's packed bfloat16 linear."""
    return cpu.has_native_bf16() and torch.backends.mkldnn.is_available()


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or not bf16_packing_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
        torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
        return packed
    except (AttributeError, RuntimeError):  # a torch build without the op or without oneDNN bf16
        return None


class Linear:
    """y = x W^T + b for x [T, in]; W [out, in] as loaded (Hugging Face layout)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = bias
        self.packed = _pack(weight)
        # The plain weight is only kept where it is used.
        self.weight = weight if self.packed is None else None
        # bfloat16 weights on a CPU without bfloat16 arithmetic: converted inside the kernel.
        self.widen_bf16 = (
            self.packed is None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and not cpu.has_native_bf16() and quant_matmul.available()
        )
        self.numel = weight.numel()
        self.element_size = weight.element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if weight is None:  # packed (the plain weight was not kept)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.widen_bf16:
            if x.shape[0] < BF16_BLAS_FROM_ROWS:
                y = quant_matmul.bf16_matmul(weight, x)
            else:
                y = F.linear(x.float(), weight.float())
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        return F.linear(x, weight, self.bias)
