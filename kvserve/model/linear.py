"""Linear layers whose weights are laid out once for the CPU's matmul library.

torch's bfloat16 matmul on the CPU goes through oneDNN, which reorders the weight into its
blocked layout on every call. Reordering once at load time (`mkldnn._reorder_linear_weight`)
gives the same product bit for bit and is markedly faster at decode batch sizes (see
docs/benchmarks.md). Other dtypes and devices, or a torch without the op, use F.linear:
float32 stays on torch's default sgemm so that its results match the reference exactly.

oneDNN packs bfloat16 only where the CPU computes it natively (AVX-512 BF16, AMX, or
AVX-NE-CONVERT); elsewhere, or under `KVSERVE_ISA` below avx512, the weight stays plain.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve import cpu

# The batch size oneDNN is told to expect; it serves 1 to thousands of rows well.
PACK_FOR_ROWS = 64


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
        self.numel = weight.numel()
        self.element_size = weight.element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
