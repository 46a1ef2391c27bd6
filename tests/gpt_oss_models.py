"""Tiny random-weight gpt-oss checkpoints for tests/test_gpt_oss.py: a Hugging Face directory made
with transformers, and the same weights as a GGUF named as llama.cpp's converter names them (the
converter in the llama.cpp sources tests can unpack predates gpt-oss, so this writes the file with
the gguf library: arch `gpt-oss`, `attn_sinks`, `post_attention_norm`, a biased `ffn_gate_inp`,
`ffn_{gate,up,down}_exps` with biases, gate and up de-interleaved, experts in MXFP4 or F32)."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from tiny_models import DEFAULT_VOCAB, _add_default_vocab, add_shape, default_tokenizer

SMALL = dict(vocab_size=DEFAULT_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=8, max_position_embeddings=4096, initializer_range=0.1, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2)


def make_gpt_oss(directory: Path, seed: int = 0, **overrides: Any) -> tuple[Any, Path]:
    """transformers' GptOssForCausalLM (float32, eval, eager attention) with SMALL's sizes, saved with the
    default tokenizer. The experts' weights are MXFP4 values (write_gpt_oss_gguf's MXFP4 file is then
    this very model). Biases, norms and sinks are randomised (transformers zeroes some), the sinks
    large enough to matter, and gate_up_proj scaled up so that gpt-oss's clamp at 7 cuts some values
    (at this size it would cut none: llama.cpp's files do not say the limit, so it stays gpt-oss's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gpt_oss", **{**SMALL, **overrides}, dtype="float32")
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.copy_(2.0 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("gate_up_proj"):
                p.mul_(5.0)
            if name.endswith(("gate_up_proj", "down_proj")):  # MXFP4's values, so a MXFP4 GGUF is this model exactly
                p.copy_(_mxfp4_rounded(p))
    model.eval()
    model.save_pretrained(directory)
    default_tokenizer().save_pretrained(directory)
    return model, Path(directory)


def _mxfp4_rounded(w: torch.Tensor) -> torch.Tensor:
    """HF's expert weights [E, in, out] rounded to MXFP4 in blocks of 32 inputs, as a GGUF stores them."""
    rows = w.transpose(1, 2).reshape(-1, w.shape[1]).numpy()  # [E * out, in]
    rounded = gguf.quants.dequantize(gguf.quants.quantize(rows, Q.MXFP4), Q.MXFP4)
    return torch.from_numpy(rounded).reshape(w.shape[0], w.shape[2], w.shape[1]).transpose(1, 2)


_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias", **{f"self_attn.{x}_proj.{k}": f"attn_{y}.{k}" for x, y in
                                                       (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
                                                       for k in ("weight", "bias")}}


def _expert_tensors(layer: str, name: str, t: np.ndarray) -> dict[str, np.ndarray]:
    """HF's [E, in, out] expert tensors (gate and up interleaved) as llama.cpp's [E, out, in] ones."""
    if name == "gate_up_proj":
        t = t.transpose(0, 2, 1)  # [E, 2F, hidden]
        return {f"{layer}.ffn_gate_exps.weight": t[:, ::2], f"{layer}.ffn_up_exps.weight": t[:, 1::2]}
    if name == "gate_up_proj_bias":
        return {f"{layer}.ffn_gate_exps.bias": t[:, ::2], f"{layer}.ffn_up_exps.bias": t[:, 1::2]}
    if name == "down_proj":
        return {f"{layer}.ffn_down_exps.weight": t.transpose(0, 2, 1)}
    return {f"{layer}.ffn_down_exps.bias": t}


def write_gpt_oss_gguf(path: Path, model: Any, experts: Q = Q.MXFP4, attention: Q = Q.F32) -> Path:
    """The model as llama.cpp's converter writes gpt-oss: experts' matrices as `experts` (MXFP4 or F32), the
    attention's as `attention` (F32, or Q8_0 as llama.cpp's MXFP4_MOE files have them), everything else F32;
    YaRN as rope.scaling metadata; the window and the expert sizes."""
    c = model.config
    rope = c.rope_parameters
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    add_shape(w, c)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_local_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.intermediate_size)
    w.add_sliding_window(c.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    _add_default_vocab(w)
    tensors: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy()
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            tensors[{"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]] = a
            continue
        _, _, i, rest = name.split(".", 3)
        if rest.startswith("mlp.experts."):
            tensors |= _expert_tensors(f"blk.{i}", rest.removeprefix("mlp.experts."), a)
        else:
            tensors[f"blk.{i}.{_NAMES[rest]}"] = a
    for name, a in tensors.items():
        kind = experts if name.endswith("_exps.weight") else attention if ".attn_" in name and name.endswith(
            ("_q.weight", "_k.weight", "_v.weight", "_output.weight")) else Q.F32
        if kind != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), kind), raw_dtype=kind)
        else:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_mxfp4_directory(source: Path, directory: Path) -> Path:
    """`source`'s checkpoint with its experts' weights as gpt-oss publishes them (transformers' MXFP4
    layout): gate_up_proj and down_proj as `_blocks` [E, out, in/32, 16] (value 2j in byte j's low
    nibble, 2j + 1 in its high one) and `_scales` [E, out, in/32] (e8m0). The weights are MXFP4
    values already (make_gpt_oss), so this loses nothing."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    state = load_file(directory / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = state.pop(name).transpose(1, 2).contiguous()  # [E, out, in]
        ggml = gguf.quants.quantize(w.reshape(-1, w.shape[2]).numpy(), Q.MXFP4).reshape(-1, 17)  # [blocks, e + 16 bytes]
        qs = torch.from_numpy(ggml[:, 1:].copy())
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=1)  # [blocks, 32]: ggml keeps values 16-31 in the high nibbles
        packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # transformers keeps odd values there
        groups = (*w.shape[:2], w.shape[2] // 32)
        state[name + "_blocks"] = packed.reshape(*groups, 16)
        state[name + "_scales"] = torch.from_numpy(ggml[:, 0].copy()).reshape(groups)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
