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
from safetensors import SafetensorError, safe_open

from kvserve.config import ModelConfig, RopeScaling, rope_scaling_unsupported
from kvserve.errors import ModelFormatError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gemma3", "mixtral",
                         "qwen3_moe")
_ARCHITECTURES = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe"}  # model_type → kvserve's (llama.cpp's) name
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
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    raise ModelFormatError(f"{path}: {rope_scaling_unsupported(kind)}")


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
    windows = _layer_windows(cfg) if gemma else ()
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
            sliding_window=None if gemma else _sliding_window(cfg, path),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
            **_experts(cfg, model_type),
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
    if model_type == "mixtral":
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


def _layer_windows(cfg: dict) -> tuple[int, ...]:
    """Gemma's window per layer: layer_types where listed, else every sliding_window_pattern-th
    layer global (transformers 4's older configs: 6 for Gemma 3, every other for Gemma 2), 0 for a
    global layer."""
    n, window = cfg["num_hidden_layers"], int(cfg.get("sliding_window") or 0)
    pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or (
        2 if cfg["model_type"] == "gemma2" else 6)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    return tuple(window if t == "sliding_attention" else 0 for t in types)


def _sliding_rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or {}
    return float((params.get("sliding_attention") or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))


def _sliding_window(cfg: dict, path: Path) -> int | None:
    """The window where the config turns it on (Qwen2 lists one with use_sliding_window false).

    Qwen2 and Qwen3 slide only in layers listed as "sliding_attention" in layer_types, which transformers
    derives from max_window_layers (layers from that index on slide): none sliding means no window;
    a mix of windowed and full layers is refused (kvserve frees a block only when every layer's
    window has passed it, and applies one window to all layers)."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return None
    if cfg.get("model_type") in ("qwen2", "qwen3"):
        n = cfg["num_hidden_layers"]
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= cfg.get("max_window_layers", 28) else "full_attention" for i in range(n)
        ]
        sliding = sum(t == "sliding_attention" for t in types)
        if sliding == 0:
            return None
        if sliding != len(types):
            raise ModelFormatError(
                f"{path}: sliding-window attention in {sliding} of {len(types)} layers is not supported "
                "(kvserve runs a window in every layer or in none)"
            )
    return int(window)


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


def read_tensors(
    directory: Path, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
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
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding is the head
                    tensors[name] = f.get_tensor(stored).to(dtype)
        except (OSError, SafetensorError) as e:
            msg = f"{file}: unreadable or corrupt safetensors file ({e})"
            raise ModelFormatError(msg) from None
    return tensors
