"""gpt-oss's clamped SwiGLU, its one departure from the Llama-family layer besides attention sinks.

Everything else gpt-oss has fits the shared decoder (model/llama.py): q/k/v/o biases, windowed
layers between full ones (ModelConfig.layer_windows), YaRN RoPE (llama.rope_inv_freq, with its
attention factor folded into q and k by loader.scale_rotary), a biased router over biased experts
(llama.Experts), and the sinks, which the attention backends take (model/attention.py). Written as
transformers' GptOssForCausalLM computes them (transformers/models/gpt_oss/modeling_gpt_oss.py);
reference: "gpt-oss-120b & gpt-oss-20b Model Card" (OpenAI 2025).
"""
from __future__ import annotations

import torch


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[T, 2F] (gate, then up) -> [T, F]: gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate), in transformers' order of operations. (The checkpoint
    interleaves gate and up columns; the loaders have split them into gate rows, then up rows.)"""
    f = gate_up.shape[-1] // 2
    gate = gate_up.narrow(-1, 0, f).clamp(max=limit)
    up = gate_up.narrow(-1, f, f).clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
