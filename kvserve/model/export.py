"""`kvserve export GGUF OUTDIR`: a GGUF model as a Hugging Face directory other engines load.

vLLM and transformers want config.json + safetensors + tokenizer files; llama.cpp wants the
GGUF. To run every engine on the same weights, kvserve writes the directory from the GGUF:
tensors dequantized by kvserve's own loader (so the directory is exactly what kvserve computes
with on the float path), the architecture from the GGUF's metadata, the tokenizer rebuilt from
its vocabulary (tokenizer.json, tokenizer_config.json with the chat template), and a
generation_config.json with the end-of-sequence ids.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvserve.config import ModelConfig
from kvserve.errors import ModelFormatError
from kvserve.model.loader import load_checkpoint, resolve_model_path
from kvserve.model.quant import QuantizedWeight
from kvserve.tokenizer import Tokenizer

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def hf_config(config: ModelConfig, dtype: torch.dtype) -> dict:
    if config.architecture not in _ARCHITECTURES or config.rotary_dim:
        raise ModelFormatError(f"export writes {', '.join(_ARCHITECTURES)} models, not {config.architecture}")
    rope = config.rope_scaling
    scaling = None
    if rope.kind == "linear":
        scaling = {"rope_type": "linear", "factor": rope.factor}
    elif rope.kind == "llama3":
        scaling = {"rope_type": "llama3", "factor": rope.factor, "low_freq_factor": rope.low_freq_factor,
                   "high_freq_factor": rope.high_freq_factor,
                   "original_max_position_embeddings": rope.original_max_position_embeddings}
    elif rope.kind == "yarn":  # its attention factor is in the q and k weights written (loader.scale_rotary)
        scaling = {"rope_type": "yarn", "factor": rope.factor, "attention_factor": 1.0,
                   "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow, "truncate": rope.truncate,
                   "original_max_position_embeddings": rope.original_max_position_embeddings}
    eos = list(config.eos_token_ids)
    return {
        "architectures": [_ARCHITECTURES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,  # the 4.x spelling: transformers 5 and vLLM read it too
        "rope_scaling": scaling,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def write_tokenizer_files(tok: Tokenizer, out: Path, max_len: int) -> None:
    """tokenizer.json, tokenizer_config.json (bos, eos, chat template) and special_tokens_map.json
    in `out`: what transformers' AutoTokenizer loads (lm-evaluation-harness's tokenizer, too)."""
    tok.backend.save(str(out / "tokenizer.json"))
    name = lambda i: tok.id_to_token(i) if i is not None else None  # noqa: E731
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(tok.bos_token_id),
        "eos_token": name(tok.eos_token_id),
        "add_bos_token": tok.adds_bos,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    if tok.has_chat_template:
        config["chat_template"] = tok.chat_template.source
        (out / "chat_template.jinja").write_text(tok.chat_template.source, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {k: v for k, v in (("bos_token", config["bos_token"]), ("eos_token", config["eos_token"])) if v}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def export_hf(model: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write `model` (an alias or a .gguf) as a Hugging Face directory at `out`; returns `out`."""
    path = resolve_model_path(model)
    if path.is_dir():
        raise ValueError(f"{path} is already a Hugging Face directory; export reads a .gguf file or an alias")
    ckpt = load_checkpoint(model, dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    # safetensors refuses tensors that share memory; the loader hands out views of mapped data.
    # (loaded with quantization "none": every tensor is dense)
    tensors = {k: (v.dequantize().to(dtype) if isinstance(v, QuantizedWeight) else v).contiguous().clone()
               for k, v in ckpt.tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    (out / "config.json").write_text(json.dumps(hf_config(ckpt.config, dtype), indent=2) + "\n")
    eos = list(ckpt.config.eos_token_ids)
    generation = {"bos_token_id": ckpt.config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer_files(Tokenizer.from_gguf(path), out, ckpt.config.max_position_embeddings)
    return out
