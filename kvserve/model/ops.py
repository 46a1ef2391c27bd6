"""The decoder layer's elementwise steps, each one call.

`LayerOps(native=True)` runs kvserve's fused CPU kernels (kernels/layer_ops.c): one pass over
memory per step instead of several torch ops. `LayerOps(native=False)` is the plain-torch
reference, written as the Hugging Face implementation computes (RMSNorm statistics in float32,
rotate-half RoPE). Tensors the kernels do not take fall back to the reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels import layer_ops
from kvserve.model import gpt_oss
from kvserve.model.attention import store_kv


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the compute dtype, as the reference does.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def head_norms(qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, H: int, Hkv: int, eps: float) -> None:
    """Qwen3's RMSNorm of each query head and each key head, in place in qkv [T, (H + 2 Hkv) * D]."""
    heads = qkv.view(qkv.shape[0], H + 2 * Hkv, -1)
    heads[:, :H] = rms_norm(heads[:, :H], q_norm, eps)
    heads[:, H:H + Hkv] = rms_norm(heads[:, H:H + Hkv], k_norm, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _like(t: torch.Tensor, ref: torch.Tensor) -> bool:
    """What the kernels need of a tensor made during the step (a linear's output), once the step's
    device and dtype are known to suit them."""
    return t.dtype == ref.dtype and t.is_contiguous()


class LayerOps:
    def __init__(self, native: bool, checked: bool = False, native_step_arith: bool = False) -> None:
        self.native = native
        # checked: for_step() found the step's tensors fit the kernels (CPU, dtype, layout), so
        # each call only checks what a linear produced. The same for every layer of a step.
        self.checked = checked
        # SiLU * up and the RoPE tables through the kernels, the native decode step's own arithmetic
        # (model/native_decode.py), so that a prefill and a decode agree with it bit for bit: for
        # quantized weights. A float checkpoint keeps torch's ops, which transformers runs too.
        self.native_step_arith = native and native_step_arith
        self._checked = LayerOps(True, True, native_step_arith) if native and not checked else None

    def for_step(self, x: torch.Tensor, kv_cache: torch.Tensor) -> LayerOps:
        """The ops to use for one forward whose activations look like x and whose KV pools look
        like kv_cache: the kernels' full checks run here once instead of in every call."""
        if self._checked is not None and layer_ops.supports(x) and layer_ops.supports_pool(kv_cache):
            return self._checked
        return self

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, weight * rms_norm(x + delta)); delta None means no residual add.

        The sum may be written into x itself, and the norm into out (a buffer the caller reuses):
        use the returned tensors, not x, afterwards."""
        if self.checked:
            fits = weight.dtype == x.dtype and (delta is None or _like(delta, x))
        else:
            fits = self.native and layer_ops.supports(x, weight, *([] if delta is None else [delta]))
        if fits:
            return x, layer_ops.add_rms_norm(x, delta, weight, eps, out)
        if delta is not None:
            x = x + delta
        return x, rms_norm(x, weight, eps)

    def rope_and_store(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D]
        cos: torch.Tensor,  # [T, D] in the model dtype
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D]
        slots: torch.Tensor,  # [T]
        num_heads: int,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_scale: torch.Tensor | None = None,  # an int8 pool's row scales [2, Hkv, num_blocks, block_size]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated ([T, H, D], [T, Hkv, D], into out's buffers where the kernel runs) and v;
        the new tokens' k and v stored in the pool."""
        T = qkv.shape[0]
        _, hkv, _, _, d = kv_cache.shape
        v = qkv[:, (num_heads + hkv) * d :].view(T, hkv, d)
        if self.checked and _like(qkv, cos) or \
                self.native and layer_ops.supports(qkv, cos, sin) and layer_ops.supports_pool(kv_cache):
            q, k = layer_ops.rope_store(qkv, cos, sin, kv_cache, slots, num_heads, out, kv_scale)
            return q, k, v
        q, k, _ = qkv.split([num_heads * d, hkv * d, hkv * d], dim=-1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        q = q.view(T, num_heads, d)
        k = k.view(T, hkv, d)
        q = q * c + rotate_half(q) * s
        k = k * c + rotate_half(k) * s
        store_kv(k, v, kv_cache, slots, kv_scale)
        return q, k, v

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] in `dtype` (rotate-half layout): the kernel's (the native decode step's
        cos/sin) under native_step_arith, else torch's ops."""
        if self.native_step_arith and dtype in (torch.float32, torch.bfloat16) and layer_ops.available():
            return layer_ops.rope_table(positions, inv_freq, dtype)
        freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def head_norms(self, qkv: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, H: int, Hkv: int,
                   eps: float) -> None:
        """Qwen3's norm of each query and key head, in place in qkv: float32 under native_step_arith through the
        kernel (the native decode step's arithmetic), else torch's (head_norms)."""
        if self.native_step_arith and qkv.dtype == q_norm.dtype == torch.float32 and layer_ops.supports(qkv, q_norm, k_norm):
            layer_ops.head_norms(qkv, q_norm, k_norm, H, Hkv, eps)
        else:
            head_norms(qkv, q_norm, k_norm, H, Hkv, eps)

    def glu(self, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
        """[T, 2F] (gate, then up) -> act(gate) * up [T, F]: act "silu" (SwiGLU) or "gelu_tanh" (Gemma's
        GeGLU). SiLU's in place in gate_up's first half (the caller's temporary). float32 under
        native_step_arith through the kernel (the native decode step's arithmetic), else torch's own ops."""
        if self.native_step_arith and gate_up.dtype == torch.float32 and (self.checked or layer_ops.supports(gate_up)):
            return layer_ops.silu_mul(gate_up) if act == "silu" else layer_ops.gelu_mul(gate_up)
        f = gate_up.shape[-1] // 2
        gate, up = gate_up.narrow(-1, 0, f), gate_up.narrow(-1, f, f)  # narrow: one dispatch, chunk: five
        return (F.silu(gate, inplace=True) if act == "silu" else F.gelu(gate, approximate="tanh")).mul_(up)

    def clamped_swiglu(self, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        """gpt-oss's experts' [T, 2F] -> [T, F] (model/gpt_oss.py), through the kernel as glu goes."""
        if self.native_step_arith and gate_up.dtype == torch.float32 and (self.checked or layer_ops.supports(gate_up)):
            return layer_ops.clamped_swiglu(gate_up, alpha, limit)
        return gpt_oss.clamped_swiglu(gate_up, alpha, limit)
