"""gpt-oss's two departures from the Llama-family layer: attention sinks and the clamped SwiGLU.

Everything else gpt-oss has fits the shared decoder (model/llama.py): q/k/v/o biases, windowed
layers between full ones (ModelConfig.layer_windows), YaRN RoPE (llama.rope_inv_freq, with its
attention factor folded into q and k by loader.scale_rotary) and a biased router over biased
experts (llama.Experts). Written as transformers' GptOssForCausalLM computes them
(transformers/models/gpt_oss/modeling_gpt_oss.py); reference: "gpt-oss-120b & gpt-oss-20b Model
Card" (OpenAI 2025), "Efficient Streaming Language Models with Attention Sinks" (Xiao et al. 2023).

The attention here is the reference path in plain torch ops: the fused paged decode kernel
(kernels/paged_attention.c) has no sinks, so a layer with sinks never reaches an AttentionBackend.
"""
from __future__ import annotations

import torch

from kvserve.model import kv_int8
from kvserve.model.attention import AttentionMetadata, first_key


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2F] (gate, then up) -> [T, F]: gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), in transformers' order of operations. (The checkpoint
    interleaves gate and up columns; the loaders have split them into gate rows, then up rows.)"""
    f = gate_up.shape[-1] // 2
    gate = gate_up.narrow(-1, 0, f).clamp(max=limit)
    up = gate_up.narrow(-1, f, f).clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def attend_with_sinks(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D], the step's k and v already stored
    meta: AttentionMetadata,
    scale: float,
    window: int,  # keys per query (0: the whole context)
    kv_scale: torch.Tensor | None,  # an int8 pool's row scales [2, Hkv, num_blocks, block_size]
    sinks: torch.Tensor,  # [H]: each head's sink logit
) -> torch.Tensor:  # [T, H, D]
    """Each new token attends to its sequence's context in the pool, each head's softmax over its
    scores and its sink logit, the sink's share dropped. Prefill chunks and decode tokens alike read
    their keys out of the pool (as stored, so a prefix-cache hit changes nothing)."""
    out = torch.empty_like(q)
    _, hkv, _, bs, d = kv_cache.shape
    start = 0
    for i, (n, L) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        first = first_key(L - n, window) // bs  # the first block any query of the sequence sees
        blocks = meta.block_tables[i][first: -(-L // bs)]
        base = first * bs  # position of the gathered keys' first row
        kv = kv_cache[:, :, blocks].view(2, hkv, len(blocks) * bs, d)[:, :, : L - base]  # [2, Hkv, L', D]
        if kv_scale is None:
            kv = kv.to(q.dtype)
        else:
            sc = kv_scale[:, :, blocks].view(2, hkv, len(blocks) * bs)[:, :, : L - base]
            kv = kv_int8.dequantize(kv, sc, q.dtype)
        # Query j sits at position L - n + j and sees keys 0 (or, in a window, L - n + j - window + 1) .. L - n + j.
        qpos = torch.arange(L - n, L).unsqueeze(1)
        kpos = torch.arange(base, L).unsqueeze(0)
        mask = kpos <= qpos  # [n, L']
        if window:
            mask &= kpos > qpos - window
        out[start: start + n] = _attend(q[start: start + n], kv[0], kv[1], mask, scale, sinks)
        start += n
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            sinks: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] over k, v [Hkv, L, D] under mask [n, L] -> [n, H, D], as transformers' eager
    gpt-oss attention: the sink appended to each row of scores, the row's max subtracted, softmax,
    the sink's column dropped."""
    n, H, _ = q.shape
    g = H // k.shape[0]
    k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)  # [H, L, D]
    scores = torch.matmul(q.transpose(0, 1), k.transpose(-1, -2)) * scale  # [H, n, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.to(scores.dtype).view(H, 1, 1).expand(H, n, 1)], dim=-1)  # [H, n, L + 1]
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # [H, n, L]: the sink takes no value
    return torch.matmul(probs.to(v.dtype), v).transpose(0, 1)  # [n, H, D]
