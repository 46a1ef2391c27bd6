"""GGUF checkpoints → ModelConfig and Hugging Face-named tensors (float, or blocks kept quantized).

Files are read with gguf's GGUFReader (memory-mapped, so tensor bytes are paged in only while
they are decoded). Two quirks of llama.cpp's converter are undone here:
- `llama` files store q_proj/k_proj rows interleaved per head (pairs (0, d/2), (1, d/2+1), …
  become neighbours) for llama.cpp's interleaved RoPE; kvserve uses rotate-half RoPE, so the
  rows are put back in Hugging Face order. `qwen2`, `qwen3`, `phi3` and Gemma files are stored unpermuted.
- Llama 3.1-style RoPE scaling is stored as a `rope_freqs` tensor of per-frequency divisors,
  not as metadata; it is recognised and turned back into RopeScaling("llama3").
gpt-oss files say less than its config.json: the windowed layers' pattern, the SwiGLU clamp and
YaRN's unrounded ramp are gpt-oss's own (as llama.cpp hard-codes them); its MXFP4 experts are
kept as stored (model/mxfp4.py), or decoded to float where nothing is kept.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, Keys
from gguf.gguf_reader import ReaderTensor

from kvserve.config import ModelConfig, RopeScaling, rope_scaling_unsupported, yarn_mscale
from kvserve.errors import ModelFormatError
from kvserve.model.dequant import SUPPORTED_TYPES, dequantize, single_threaded
from kvserve.model.quant import KERNEL_TYPES, QuantizedWeight, from_gguf

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3moe", "gpt-oss")  # llama: Mixtral too
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {  # blk.{i}.<key> → model.layers.{i}.<value>
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused projection (loader._unfuse splits it)
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "attn_sinks": "self_attn.sinks",  # gpt-oss's (a parameter, no ".weight" in Hugging Face's name)
}
# A mixture of experts' weights: one 3-D tensor [experts, rows, cols] each, split into each expert's
# model.layers.{i}.mlp.experts.{j}.<name> (rows stay whole, so quantized blocks split alike).
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Where an architecture's files name a tensor otherwise: Phi-3's ffn_up holds gate and up, fused;
# Gemma's norms around attention and MLP (ffn_norm is its pre-MLP norm).
_ARCH_LAYER_NAMES = {
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
    "gpt-oss": {"post_attention_norm": "post_attention_layernorm"},
    **{arch: {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"} for arch in ("gemma2", "gemma3")},
}
# As llama.cpp reads Gemma files: the window pattern (every n-th layer global, the others windowed)
# when the file gives none; the layer counts of the 27B models, whose attention it scales by
# (hidden / heads) ** -0.5 rather than head_dim's; Gemma 2's window and soft caps when absent.
# gpt-oss's too: llama.cpp hard-codes its alternation (even layers windowed), as transformers' default.
_WINDOW_PATTERN = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GEMMA2_DEFAULTS = {"window": 4096, "attn_softcap": 50.0, "final_softcap": 30.0}
# gpt-oss's SwiGLU clamp, which its files do not say (llama.cpp fixes it in its graph, with alpha
# 1.702: ModelConfig's default)
_GPT_OSS_SWIGLU_LIMIT = 7.0
_ROPE_FREQS = "rope_freqs.weight"
_LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's, as llama.cpp writes them


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _required(reader: GGUFReader, path: Path, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ModelFormatError(f"{path}: GGUF metadata lacks {key!r}, which kvserve needs")
    return value


def _f32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 → 1e-05)."""
    return float(str(np.float32(value)))


def _torch_shape(t: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists dims innermost first


def _llama3_divisors(
    head_dim: int, theta: float, factor: float, low: float, high: float, orig_ctx: int
) -> torch.Tensor:
    """llama.cpp's rope_freqs for Llama 3.1 scaling: how much each frequency is divided by."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (orig_ctx / wavelen - low) / (high - low)
    middle = 1.0 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < orig_ctx / high, 1.0, middle)
    return torch.where(wavelen > orig_ctx / low, factor, out)


def _rope_scaling(
    reader: GGUFReader, path: Path, arch: str, head_dim: int, theta: float
) -> RopeScaling:
    kind = _field(reader, Keys.Rope.SCALING_TYPE.format(arch=arch), "none")
    factor = _f32(_field(reader, Keys.Rope.SCALING_FACTOR.format(arch=arch), 1.0))
    if kind == "linear" and factor != 1.0:
        return RopeScaling("linear", factor)
    if kind == "yarn":
        orig = int(_field(reader, Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch))  # (llama.cpp's default: the context)
                   or _required(reader, path, Keys.LLM.CONTEXT_LENGTH.format(arch=arch)))
        attention = _field(reader, Keys.Rope.SCALING_ATTN_FACTOR.format(arch=arch))
        return RopeScaling("yarn", factor, original_max_position_embeddings=orig,
                           attention_factor=_f32(attention) if attention is not None else yarn_mscale(factor),
                           beta_fast=_f32(_field(reader, Keys.Rope.SCALING_YARN_BETA_FAST.format(arch=arch), 32.0)),
                           beta_slow=_f32(_field(reader, Keys.Rope.SCALING_YARN_BETA_SLOW.format(arch=arch), 1.0)),
                           truncate=arch != "gpt-oss")  # gpt-oss's config.json: truncate false; others: transformers' default
    if kind == "longrope":  # read from its rope_factors tensors (_longrope), which this file lacks
        raise ModelFormatError(f"{path}: LongRoPE scaling without its rope_factors_short/long tensors")
    if kind not in ("none", "linear"):  # llama3 comes as a rope_freqs tensor, below
        raise ModelFormatError(f"{path}: {rope_scaling_unsupported(kind)}")
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        return RopeScaling()
    divisors = dequantize(freqs.data, freqs.tensor_type, _torch_shape(freqs)).double().flatten()
    # Every published Llama 3.x uses low 1, high 4, original context 8192; only factor varies.
    # Recompute the table from those and accept the file only if it matches.
    scaling = RopeScaling("llama3", float(divisors.max()), 1.0, 4.0, 8192)
    expected = _llama3_divisors(head_dim, theta, scaling.factor, 1.0, 4.0, 8192)
    if divisors.shape != expected.shape or not torch.allclose(divisors, expected, rtol=1e-4):
        raise ModelFormatError(
            f"{path}: its rope_freqs tensor is not Llama 3 RoPE scaling, "
            "the only per-frequency scaling kvserve supports"
        )
    return scaling


def _longrope(reader: GGUFReader, path: Path, arch: str, names: dict[str, ReaderTensor]) -> RopeScaling | None:
    """Phi-3's LongRoPE: its two factor tensors, the attention factor and the original context."""
    if not any(n in names for n in _LONGROPE):
        return None
    short, long = (tuple(dequantize(names[n].data, names[n].tensor_type, _torch_shape(names[n])).flatten().tolist())
                   if n in names else () for n in _LONGROPE)
    orig = _field(reader, Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch))
    if not short or not long or orig is None:
        raise ModelFormatError(f"{path}: LongRoPE needs both rope_factors tensors and "
                               f"{Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch)}")
    attention = _f32(_field(reader, Keys.Rope.SCALING_ATTN_FACTOR.format(arch=arch), 1.0))
    context = int(_required(reader, path, Keys.LLM.CONTEXT_LENGTH.format(arch=arch)))
    return RopeScaling("longrope", context / int(orig), original_max_position_embeddings=int(orig),
                       short_factor=short, long_factor=long, attention_factor=attention)


def read_config(reader: GGUFReader, path: Path) -> ModelConfig:
    """ModelConfig from GGUF metadata; checks architecture and tensor types before any decoding."""
    arch = _required(reader, path, Keys.General.ARCHITECTURE)
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(
            f"{path}: architecture {arch!r} is not supported "
            f"(kvserve runs {', '.join(SUPPORTED_ARCHS)} GGUFs)"
        )
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise ModelFormatError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}, a type kvserve cannot decode "
                f"(supported: {supported}); use a file quantized to one of these"
            )

    def key(template: str, default: Any = None) -> Any:
        k = template.format(arch=arch)
        return _required(reader, path, k) if default is None else _field(reader, k, default)

    hidden = int(key(Keys.LLM.EMBEDDING_LENGTH))
    heads = int(key(Keys.Attention.HEAD_COUNT))
    head_dim = int(key(Keys.Attention.KEY_LENGTH, hidden // heads))
    rotary = int(key(Keys.Rope.DIMENSION_COUNT, head_dim))
    if rotary > head_dim or rotary % 2 or (head_dim - rotary) % 2:
        raise ModelFormatError(f"{path}: RoPE over {rotary} of {head_dim} dims; kvserve needs an even count of "
                               "turned and of unturned dims")
    theta = _f32(key(Keys.Rope.FREQ_BASE, 10000.0))
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelFormatError(f"{path}: no token_embd.weight tensor; not a complete {arch} model")
    vocab = key(Keys.LLM.VOCAB_SIZE, -1)
    layers = int(key(Keys.LLM.BLOCK_COUNT))
    gemma = arch in ("gemma2", "gemma3")
    gemma2 = arch == "gemma2"
    gpt_oss = arch == "gpt-oss"
    sliding_window, windows = _windows(reader, arch, layers)
    experts = int(key("{arch}.expert_count", 0))
    eos_keys = (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
    eos = [_field(reader, k) for k in eos_keys]
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab) if vocab >= 0 else _torch_shape(names["token_embd.weight"])[0],
        hidden_size=hidden,
        intermediate_size=int(key(Keys.LLM.FEED_FORWARD_LENGTH)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(key(Keys.Attention.HEAD_COUNT_KV, heads)),
        head_dim=head_dim,
        rotary_dim=rotary if rotary < head_dim else 0,
        max_position_embeddings=int(key(Keys.LLM.CONTEXT_LENGTH)),
        rms_norm_eps=_f32(key(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
        rope_theta=theta,
        rope_scaling=_longrope(reader, path, arch, names) or _rope_scaling(reader, path, arch, head_dim, theta),
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        # llama.cpp renormalizes the chosen experts' weights unless the file says otherwise; a block
        # without a router keeps a dense MLP
        num_experts=experts,
        num_experts_per_tok=int(key("{arch}.expert_used_count", 0)),
        moe_intermediate_size=(int(key("{arch}.expert_feed_forward_length", 0)) or int(key(Keys.LLM.FEED_FORWARD_LENGTH))
                               if experts else 0),
        norm_topk_prob=bool(key("{arch}.expert_weights_norm", True)),
        dense_layers=tuple(i for i in range(layers) if experts and f"blk.{i}.ffn_gate_inp.weight" not in names),
        attention_sinks="blk.0.attn_sinks.weight" in names,
        swiglu_limit=_GPT_OSS_SWIGLU_LIMIT if gpt_oss else None,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, Keys.Tokenizer.BOS_ID),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=path.stem,
        sliding_window=sliding_window,
        layer_windows=windows,
        sliding_rope_theta=_f32(key("{arch}.rope.freq_base_swa", 10000.0)) if any(windows) and arch == "gemma3" else None,
        embedding_multiplier=math.sqrt(hidden) if gemma else 1.0,
        sandwich_norms=gemma,
        hidden_act="gelu_tanh" if gemma else "silu",
        attention_scale=(hidden / heads if layers == _GEMMA_27B_LAYERS.get(arch) else head_dim) ** -0.5 if gemma else None,
        attn_logit_softcapping=_f32(key("{arch}.attn_logit_softcapping", _GEMMA2_DEFAULTS["attn_softcap"])) if gemma2 else None,
        final_logit_softcapping=_f32(key("{arch}.final_logit_softcapping", _GEMMA2_DEFAULTS["final_softcap"])) if gemma2
        else _f32(key("{arch}.final_logit_softcapping", 0.0)) or None,
    )


def _windows(reader: GGUFReader, arch: str, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(ModelConfig.sliding_window, .layer_windows) as llama.cpp reads them: no window without
    sliding_window (Gemma 2's is 4096 then); else the layers sliding_window_pattern names (a list of
    flags, or n: every n-th layer global), by default Gemma's and gpt-oss's own pattern and every layer
    for the others. Gemma and gpt-oss keep a window per layer; the others' window in every layer is
    the every-layer one (its blocks leave the pool), a mix a window per layer. llama.cpp's converter
    writes the pattern where windowed and full layers mix (DFlash's Qwen3 drafts, EXAONE 4) but no
    window at all for Qwen2 and Qwen3: their files say a mix only where written with the pattern."""
    default = _GEMMA2_DEFAULTS["window"] if arch == "gemma2" else 0
    window = int(_field(reader, Keys.Attention.SLIDING_WINDOW.format(arch=arch), default))
    if not window:
        return None, ()
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", _WINDOW_PATTERN.get(arch))  # a key newer than gguf 0.16
    if pattern is None:
        windows = (window,) * layers
    elif isinstance(pattern, list):
        windows = tuple(window if flag else 0 for flag in pattern[:layers])
    else:
        n = int(pattern)
        windows = tuple(window if n == 0 or i % n < n - 1 else 0 for i in range(layers))
    if arch in _WINDOW_PATTERN:
        return None, windows
    if not any(windows):
        return None, ()
    return (window, ()) if all(windows) else (None, windows)


def hf_name(path: Path, gguf_name: str, arch: str = "llama") -> str:
    """blk.3.attn_q.weight → model.layers.3.self_attn.q_proj.weight."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # ["blk", i, key, "weight"|"bias"]
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {}), **{k: f"mlp.experts.{{}}.{v}" for k, v in _EXPERT_NAMES.items()}}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        base = f"model.layers.{parts[1]}.{names[parts[2]]}"
        return base if parts[2] == "attn_sinks" else f"{base}.{parts[3]}"  # sinks: a parameter, no .weight
    raise ModelFormatError(
        f"{path}: unexpected tensor {gguf_name!r}; not a plain {'/'.join(SUPPORTED_ARCHS)} model"
    )


def _kept(t: ReaderTensor, shape: tuple[int, int]) -> QuantizedWeight | None:
    """A matrix's blocks as the kernels keep them, or None where it is decoded to float (a type no kernel
    takes)."""
    return from_gguf(torch.from_numpy(t.data), t.tensor_type, shape) if t.tensor_type in KERNEL_TYPES else None


def _experts(t: ReaderTensor, name: str, shape: tuple[int, ...], dtype: torch.dtype, keep_quantized: bool
             ) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A 3-D expert tensor as each expert's matrix (a 2-D one: each expert's bias), named by `name`'s
    "{}" (the expert's index)."""
    experts, rows = shape[:2]
    out: dict[str, torch.Tensor | QuantizedWeight] = {}
    whole = _kept(t, (experts * rows, shape[2])) if keep_quantized and len(shape) == 3 else None
    if whole:
        for e in range(experts):
            out[name.format(e)] = QuantizedWeight(whole.blocks[e * rows:(e + 1) * rows].contiguous(), whole.qtype,
                                                  (rows, shape[2]))
        return out
    w = dequantize(t.data, t.tensor_type, shape)
    return {name.format(e): w[e].to(dtype).contiguous() for e in range(experts)}


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of q_proj/k_proj (weights or biases)."""
    rest = w.shape[1:]
    w = w.reshape(n_head, -1, 2, *rest)  # [heads, head_dim/2, 2, (in)]: row pairs (j, j + d/2)
    return w.transpose(1, 2).reshape(-1, *rest)  # [heads * head_dim, (in)]


def read_tensors(
    reader: GGUFReader, path: Path, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = False
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor under its Hugging Face name, in `dtype`; with keep_quantized, matrices of a
    type the quantized kernels multiply stay as their GGML blocks (QuantizedWeight)."""
    tensors: dict[str, torch.Tensor | QuantizedWeight] = {}
    with single_threaded():
        for t in reader.tensors:
            if t.name == _ROPE_FREQS or t.name in _LONGROPE:
                continue  # folded into config.rope_scaling
            name = hf_name(path, t.name, config.architecture)
            shape = _torch_shape(t)
            if "_exps." in t.name:  # a mixture of experts' weights [experts, rows, cols] (or biases [experts, rows])
                tensors.update(_experts(t, name, shape, dtype, keep_quantized))
                continue
            # A matrix the kernels multiply stays quantized: its [rows, cols]
            q = _kept(t, (shape[0], shape[1])) if keep_quantized and len(shape) == 2 else None
            # Rows stay whole in either form, so the q/k row order is undone the same way.
            w = q.blocks if q else dequantize(t.data, t.tensor_type, shape)
            if config.architecture == "llama" and ".attn_q." in t.name:
                w = _unpermute(w, config.num_attention_heads)
            elif config.architecture == "llama" and ".attn_k." in t.name:
                w = _unpermute(w, config.num_key_value_heads)
            tensors[name] = QuantizedWeight(w.contiguous(), q.qtype, q.shape) if q else w.to(dtype)
    return tensors
