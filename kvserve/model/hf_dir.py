"""Hugging Face model directories (config.json + safetensors) → ModelConfig and tensors.

Weights are memory-mapped through safetensors' safe_open and copied out one tensor at a time,
from a single model.safetensors or the shards listed in model.safetensors.index.json.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType as Q
from safetensors import SafetensorError, safe_open

from kvserve.config import ModelConfig, RopeScaling, rope_scaling_unsupported, yarn_mscale
from kvserve.errors import ModelFormatError
from kvserve.model import mxfp4
from kvserve.model.quant import QuantizedWeight, Weight

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3", "mixtral",
                         "qwen3_moe", "gpt_oss")
# model_type → kvserve's (llama.cpp's) name
_ARCHITECTURES = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
# Mixtral's expert tensors under Qwen3-MoE's names, the ones kvserve's model takes.
_MIXTRAL_NAMES = {"block_sparse_moe.gate.": "mlp.gate.", "block_sparse_moe.experts.": "mlp.experts.",
                  ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed
# Gemma 3's image-and-text checkpoints (model_type "gemma3"): the language model's tensors under a
# prefix (transformers 5's, then 4.x's), the vision tower and projector skipped.
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                  "language_model.lm_head.": "lm_head."}
_VISION_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: unreadable JSON ({e})") from None


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        ids += [] if v is None else [v] if isinstance(v, int) else list(v)
    return tuple(dict.fromkeys(ids))


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, RopeScaling]:
    # transformers 5 writes rope_parameters (theta inside; per layer type where they differ, as
    # Gemma 3's: the global layers' here, the windowed ones' in _sliding_rope_theta); 4.x wrote
    # rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    params = params.get("full_attention", params)
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", "none"):
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind in ("longrope", "su"):  # Phi-3 128k, Phi-4-mini (transformers' _compute_longrope_parameters)
        max_pos = cfg["max_position_embeddings"]
        orig = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings") or max_pos
        factor = params.get("factor") or max_pos / orig
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0
        return theta, RopeScaling("longrope", float(factor), original_max_position_embeddings=int(orig),
                                  short_factor=tuple(map(float, params["short_factor"])),
                                  long_factor=tuple(map(float, params["long_factor"])), attention_factor=float(attention))
    if kind == "yarn":
        return theta, _yarn(cfg, params)
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    raise ModelFormatError(f"{path}: {rope_scaling_unsupported(kind)}")


def _yarn(cfg: dict[str, Any], params: dict[str, Any]) -> RopeScaling:
    """YaRN's parameters with transformers' defaults (_compute_yarn_parameters): the factor from the
    context lengths where absent, the attention factor from the factor (and DeepSeek's mscale pair)."""
    orig = int(params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
               or cfg["max_position_embeddings"])
    factor = float(params.get("factor") or cfg["max_position_embeddings"] / orig)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else yarn_mscale(factor))
    return RopeScaling("yarn", factor, original_max_position_embeddings=orig, attention_factor=float(attention),
                       beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                       truncate=bool(params.get("truncate", True)))


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    cfg = _read_json(path)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelFormatError(
            f"{path}: model_type {model_type!r} is not supported "
            f"(kvserve runs {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if model_type == "gemma3":  # image and text: kvserve serves its language model
        cfg = {"model_type": "gemma3_text", **cfg.get("text_config", {}),
               **{k: cfg[k] for k in ("eos_token_id", "bos_token_id") if k in cfg}}
        model_type = "gemma3_text"
    if cfg.get("mlp_bias"):
        raise ModelFormatError(f"{path}: mlp_bias=true is not supported")
    gemma = model_type in ("gemma2", "gemma3_text")
    gpt_oss = model_type == "gpt_oss"
    if gemma and cfg.get("use_bidirectional_attention"):
        raise ModelFormatError(f"{path}: bidirectional attention (an embedding model) is not supported")
    generation = directory / "generation_config.json"
    gen_eos = _read_json(generation).get("eos_token_id") if generation.exists() else None
    theta, scaling = _rope(cfg, path)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    # Phi-3's partial_rotary_factor: top-level in its config.json, inside rope_parameters in transformers 5's
    partial = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    rotary = int(head_dim * partial) if partial < 1 else 0
    if rotary % 2 or (head_dim - rotary) % 2:
        raise ModelFormatError(f"{path}: partial_rotary_factor {partial} turns {rotary} of {head_dim} dims; kvserve "
                               "needs an even count of turned and of unturned dims")
    sliding_window, windows = _windows(cfg, model_type, path)
    try:
        return ModelConfig(
            architecture=_ARCHITECTURES.get(model_type, model_type),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rotary_dim=rotary,
            max_position_embeddings=cfg["max_position_embeddings"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            sliding_window=sliding_window,
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", gpt_oss)),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            **_experts(cfg, model_type),
            attention_sinks=gpt_oss,
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)) if gpt_oss else None,
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            # absent from a config: transformers' defaults, Gemma 2's 50 and 30 (Gemma 3's attention has no cap)
            attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0) if model_type == "gemma2" else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if model_type == "gemma2" else None)
            if gemma else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            layer_windows=windows,
            sliding_rope_theta=_sliding_rope_theta(cfg) if any(windows) and model_type == "gemma3_text" else None,
            embedding_multiplier=math.sqrt(cfg["hidden_size"]) if gemma else 1.0,
            sandwich_norms=gemma,
            hidden_act=_activation(cfg, path),
            attention_scale=float(cfg.get("query_pre_attn_scalar", head_dim)) ** -0.5 if gemma else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), gen_eos),
            name=directory.name,
        )
    except KeyError as e:
        raise ModelFormatError(f"{path}: missing {e.args[0]!r}, which kvserve needs") from None


def _experts(cfg: dict, model_type: str) -> dict[str, Any]:
    """ModelConfig's mixture-of-experts fields (none for a dense model)."""
    if model_type in ("mixtral", "gpt_oss"):  # (gpt-oss's softmax over the top k is a renormalized one)
        return dict(num_experts=cfg["num_local_experts"], num_experts_per_tok=cfg["num_experts_per_tok"],
                    moe_intermediate_size=cfg["intermediate_size"])
    if model_type != "qwen3_moe":
        return {}
    n, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step") or 1
    only = set(cfg.get("mlp_only_layers") or ())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]  # transformers 4's name, then 5's
    return dict(num_experts=experts, num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                dense_layers=tuple(i for i in range(n) if i in only or (i + 1) % step))


def _activation(cfg: dict, path: Path) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act in ("silu", "swish"):
        return "silu"
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ModelFormatError(f"{path}: activation {act!r} is not supported (kvserve runs silu and gelu_pytorch_tanh)")


def _windows(cfg: dict, model_type: str, path: Path) -> tuple[int | None, tuple[int, ...]]:
    """(ModelConfig.sliding_window, .layer_windows): the every-layer window, or each layer's where
    windowed and full layers mix; (None, ()) where no layer slides."""
    if model_type in ("gemma2", "gemma3_text", "gpt_oss"):
        return None, _layer_windows(cfg)
    if model_type in ("qwen2", "qwen3"):
        return _qwen_windows(cfg, path)
    # Mistral's window wherever listed; Qwen3-MoE's (every layer) only under use_sliding_window, whose
    # default is false (its configs list a window all the same)
    window = cfg.get("sliding_window")
    if not window or not cfg.get("use_sliding_window", model_type != "qwen3_moe"):
        return None, ()
    return int(window), ()


def _layer_windows(cfg: dict) -> tuple[int, ...]:
    """Gemma's and gpt-oss's window per layer: layer_types where listed, else every
    sliding_window_pattern-th layer global (transformers 4's older configs: 6 for Gemma 3, every other
    for Gemma 2 and gpt-oss), 0 for a global layer."""
    n, window = cfg["num_hidden_layers"], int(cfg.get("sliding_window") or 0)
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or (
        2 if cfg["model_type"] in ("gemma2", "gpt_oss") else 6)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _sliding_rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float((params.get("sliding_attention") or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))


def _qwen_windows(cfg: dict, path: Path) -> tuple[int | None, tuple[int, ...]]:
    """Qwen2's and Qwen3's windows as transformers (5) decides them (Qwen2Config.__post_init__, Qwen2Attention):
    the window only under use_sliding_window (default false); a layer slides where layer_types says
    "sliding_attention", which, where absent, is every layer from max_window_layers (default 28) on.
    Every layer sliding: the every-layer window, whose blocks leave the pool as they leave it; a mix:
    each layer's, and every block stays (the full layers read it)."""
    n, window = cfg["num_hidden_layers"], int(cfg.get("sliding_window") or 0)
    if not window or not cfg.get("use_sliding_window"):
        return None, ()
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention" for i in range(n)]
    if len(types) != n:
        raise ModelFormatError(f"{path}: layer_types lists {len(types)} layers, num_hidden_layers is {n}")
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    if not any(windows):
        return None, ()
    return (window, ()) if all(windows) else (None, windows)


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map", {})
        return [directory / f for f in dict.fromkeys(weight_map.values())]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    raise ModelFormatError(
        f"{directory}: no model.safetensors or model.safetensors.index.json "
        "(kvserve reads safetensors weights only)"
    )


def _text_name(name: str) -> str | None:
    """A tensor's name in a language-model checkpoint; None for an image-and-text one's vision parts."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, to in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return name


_E2M1 = mxfp4.E2M1_DOUBLED / 2  # MXFP4's e2m1 values by 4-bit code (transformers' FP4_VALUES)


def _mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's published expert weights: [E, out, in/32, 16] bytes of e2m1 codes (value 2j in the
    low nibble of byte j, 2j + 1 in the high one) and [E, out, in/32] e8m0 scales (2^(s - 127)) ->
    [E, in, out] float32, as transformers' convert_moe_packed_tensors decodes them."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [E, out, in/32, 32]
    w = torch.ldexp(_E2M1[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return w.flatten(-2).transpose(1, 2)  # [E, in, out]


def _gpt_oss_mxfp4(f: Any, stored: str, name: str, file: Path, keep: bool
                   ) -> tuple[str, torch.Tensor | QuantizedWeight] | None:
    """An MXFP4 expert tensor's name without the suffix and its weights, read when its `_blocks` half
    comes (None for the `_scales` half, read then): kept as ggml's MXFP4 blocks [E, out, in] (model/mxfp4.py)
    where `keep`, else decoded to float [E, in, out]."""
    if name.endswith("_scales"):
        return None
    scales = stored.removesuffix("_blocks") + "_scales"
    if scales not in f.keys():  # noqa: SIM118 - safe_open's handle is not a dict: keys() is all it has
        raise ModelFormatError(f"{file}: {stored} without {scales} beside it in the same file")
    blocks, e = f.get_tensor(stored), f.get_tensor(scales)
    name = name.removesuffix("_blocks")
    if keep:
        experts, rows, n, _ = blocks.shape
        return name, QuantizedWeight(mxfp4.hf_blocks(blocks, e).reshape(experts * rows, -1), Q.MXFP4,
                                     (experts * rows, 32 * n))
    return name, _mxfp4_experts(blocks, e)


def has_mxfp4(directory: Path) -> bool:
    """Whether the checkpoint holds MXFP4 tensors (gpt-oss's experts, as published), from the
    safetensors headers alone."""
    for file in _weight_files(directory):
        try:
            with safe_open(file, framework="pt") as f:
                if any(k.endswith("_blocks") for k in f.keys()):  # noqa: SIM118 - see read_tensors
                    return True
        except (OSError, SafetensorError):
            return False  # read_tensors says what is wrong with it
    return False


def _gpt_oss_kept(prefix: str, leaf: str, w: QuantizedWeight, experts: int) -> dict[str, QuantizedWeight]:
    """gpt-oss's kept expert matrices (all experts' rows [E * out, in], gate and up rows interleaved in
    gate_up_proj) as each expert's gate_proj, up_proj and down_proj."""
    rows, cols = w.shape[0] // experts, w.shape[1]
    blocks = w.blocks.reshape(experts, rows, -1)
    out: dict[str, QuantizedWeight] = {}
    for e in range(experts):
        x = f"{prefix}mlp.experts.{e}."
        parts = {"gate_proj": blocks[e, ::2], "up_proj": blocks[e, 1::2]} if leaf == "gate_up_proj" else {"down_proj": blocks[e]}
        out |= {x + p + ".weight": QuantizedWeight(b.contiguous(), w.qtype, (b.shape[0], cols)) for p, b in parts.items()}
    return out


def _gpt_oss_tensors(file: Path, name: str, t: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A gpt-oss tensor under the names kvserve's model takes: the router as mlp.gate, and each
    layer's expert tensors ([E, in, out], gate and up columns interleaved in gate_up_proj) as each
    expert's gate_proj, up_proj and down_proj ([out, in]) and their biases."""
    name = name.replace("mlp.router.", "mlp.gate.")
    prefix, _, leaf = name.rpartition("mlp.experts.")
    if not prefix:
        return {name: t.to(dtype)}
    out: dict[str, torch.Tensor] = {}
    for e in range(t.shape[0]):
        x = f"{prefix}mlp.experts.{e}."
        if leaf == "gate_up_proj":  # [E, hidden, 2F]
            out |= {x + "gate_proj.weight": t[e, :, ::2].T, x + "up_proj.weight": t[e, :, 1::2].T}
        elif leaf == "gate_up_proj_bias":  # [E, 2F]
            out |= {x + "gate_proj.bias": t[e, ::2], x + "up_proj.bias": t[e, 1::2]}
        elif leaf == "down_proj":  # [E, F, hidden]
            out[x + "down_proj.weight"] = t[e].T
        elif leaf == "down_proj_bias":  # [E, hidden]
            out[x + "down_proj.bias"] = t[e]
        else:
            raise ModelFormatError(f"{file}: unexpected gpt-oss tensor {name!r}")
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def read_tensors(
    directory: Path, config: ModelConfig, dtype: torch.dtype, keep_quantized: bool = False
) -> dict[str, Weight]:
    """Every tensor under the name kvserve's model takes, in `dtype`; with keep_quantized, MXFP4 experts
    stay quantized (has_mxfp4)."""
    tensors: dict[str, Weight] = {}
    for file in _weight_files(directory):
        try:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118 - safe_open's handle is not a dict: keys() is all it has
                    name = _text_name(stored)
                    if name is not None and config.architecture == "mixtral":
                        for old, new in _MIXTRAL_NAMES.items():
                            name = name.replace(old, new)
                    if name is None or name.endswith(_SKIPPED_SUFFIXES):
                        continue
                    if config.architecture == "gpt-oss":
                        if not name.endswith(("_blocks", "_scales")):
                            tensors.update(_gpt_oss_tensors(file, name, f.get_tensor(stored), dtype))
                        elif (read := _gpt_oss_mxfp4(f, stored, name, file, keep_quantized)) is not None:
                            kept_name, w = read
                            prefix, _, leaf = kept_name.rpartition("mlp.experts.")
                            tensors.update(_gpt_oss_kept(prefix, leaf, w, config.num_experts) if isinstance(w, QuantizedWeight)
                                           else _gpt_oss_tensors(file, kept_name, w, dtype))
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding is the head
                    tensors[name] = f.get_tensor(stored).to(dtype)
        except (OSError, SafetensorError) as e:
            msg = f"{file}: unreadable or corrupt safetensors file ({e})"
            raise ModelFormatError(msg) from None
    return tensors
