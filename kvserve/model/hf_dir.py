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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed


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
    # transformers 5 writes rope_parameters (theta inside); 4.x wrote rope_theta + rope_scaling.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
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
    if cfg.get("mlp_bias"):
        raise ModelFormatError(f"{path}: mlp_bias=true is not supported")
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
    try:
        return ModelConfig(
            architecture=model_type,
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
            sliding_window=_sliding_window(cfg, path),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id"), gen_eos),
            name=directory.name,
        )
    except KeyError as e:
        raise ModelFormatError(f"{path}: missing {e.args[0]!r}, which kvserve needs") from None


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


def read_tensors(
    directory: Path, config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(directory):
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.endswith(_SKIPPED_SUFFIXES):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: the embedding is the head
                    tensors[name] = f.get_tensor(name).to(dtype)
        except (OSError, SafetensorError) as e:
            msg = f"{file}: unreadable or corrupt safetensors file ({e})"
            raise ModelFormatError(msg) from None
    return tensors
