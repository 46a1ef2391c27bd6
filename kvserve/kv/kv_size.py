"""How much KV cache a model needs, worked out from its architecture alone (no weights loaded).

Every token a model has read leaves one key and one value vector per layer and per KV head:

    bytes per token = 2 (K and V) x layers x kv-heads x head-dim x bytes per element

(kvserve's int8 cache adds a 2-byte float16 scale to each K or V row of head-dim values)

so the cache grows linearly with context, and grouped-query attention (fewer KV heads than
query heads) shrinks it by heads / kv-heads against the same model with full multi-head
attention. `kvserve kv-size MODEL` prints these figures for a built-in preset, a Hugging Face
config.json (or its directory), or a GGUF file's metadata; kv_size() returns them.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.kv.disk_store import block_file_bytes
from kvserve.kv.sizing import available_memory, kv_bytes_per_token, scale_bytes

# Bytes per element of the names --dtype accepts (fp8: vLLM-style 8-bit KV caches).
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5,
}
KV_DTYPES = ("float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "fp8", "int8")


@dataclass(frozen=True)
class StoredWeights:
    """A GGUF's tensors as stored, which is how kvserve keeps them (their quantized types): all of them, and what
    one sequence's decode step reads (of a mixture of experts' tensors, the chosen experts' share)."""

    nbytes: int
    active_bytes: int
    params: int
    active_params: int
    types: str  # the matrices' GGML types, e.g. "Q4_0 + Q6_K"


def stored_weights(path: Path, experts: int = 0, chosen: int = 0) -> StoredWeights:
    """The GGUF at `path`, `chosen` of `experts` experts read per token (0: a dense model). A token reads the
    embedding table whole only where it is also the LM head (tied); beside an LM head of its own, one row."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)

    def total(n: Callable[[Any], int]) -> tuple[int, int]:  # all, and what one token reads
        idle = sum(n(t) for t in tensors if experts and "_exps." in t.name) * (experts - chosen) // max(experts, 1)
        idle += sum(n(t) - n(t) // int(t.shape[-1]) for t in tensors if untied and t.name == "token_embd.weight")
        return sum(n(t) for t in tensors), sum(n(t) for t in tensors) - idle

    nbytes, active_bytes = total(lambda t: int(t.n_bytes))
    params, active_params = total(lambda t: int(t.n_elements))
    types = " + ".join(sorted({t.tensor_type.name for t in tensors if len(t.shape) > 1}))
    return StoredWeights(nbytes, active_bytes, params, active_params, types)


@dataclass(frozen=True)
class Architecture:
    """What the cache and weight sizes depend on (Hugging Face config names)."""

    name: str
    source: str  # "preset", "config.json" or "gguf"
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_parameters: int | None = None  # exact when the source lists its tensors (GGUF)
    # A mixture of experts (ModelConfig's fields): num_experts experts of moe_intermediate_size in each
    # sparse layer (all but dense_layers), num_experts_per_tok of them read per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    dense_layers: int = 0
    qk_norm: bool = False  # Qwen3's, Gemma 3's norms of each query and key head
    sandwich_norms: bool = False  # Gemma's norms of the attention's and the MLP's outputs
    stored: StoredWeights | None = None  # a GGUF's tensors as the file stores them

    @property
    def parameters(self) -> int:
        """The parameter count: the source's own, or a Llama-family decoder's from the shapes."""
        if self.num_parameters is not None:
            return self.num_parameters
        return self._count(self.num_experts)

    @property
    def active_parameters(self) -> int:
        """Parameters a decode step reads for one token: all but the experts it does not choose
        (a dense model's every one)."""
        return self._count(self.num_experts_per_tok) if self.num_experts else self.parameters

    def _count(self, experts: int) -> int:
        """Parameters with `experts` experts in each sparse layer (the embedding counted once as the LM head:
        a step reads its few rows besides)."""
        h, d, ffn = self.hidden_size, self.head_dim, self.intermediate_size
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        attention = h * (q + 2 * kv) + q * h + (4 if self.sandwich_norms else 2) * h + (2 * d if self.qk_norm else 0)
        if self.attention_bias:
            attention += q + 2 * kv
        sparse = self.num_hidden_layers - self.dense_layers if self.num_experts else 0
        mlp = (self.num_hidden_layers - sparse) * 3 * h * ffn + sparse * (experts * 3 * h * self.moe_intermediate_size
                                                                          + self.num_experts * h)  # + the router
        heads = 1 if self.tie_word_embeddings else 2
        return self.num_hidden_layers * attention + mlp + heads * self.vocab_size * h + h


def _preset(name: str, layers: int, heads: int, kv_heads: int, hidden: int, ffn: int, vocab: int, ctx: int,
            head_dim: int = 128, tied: bool = False, bias: bool = False) -> Architecture:
    return Architecture(name, "preset", layers, heads, kv_heads, head_dim, hidden, ffn, vocab, ctx, tied, bias)


# The published config.json numbers of each model (the Hugging Face repository in the comment).
PRESETS: dict[str, Architecture] = {p.name: p for p in (
    _preset("llama-2-7b", 32, 32, 32, 4096, 11008, 32000, 4096),  # meta-llama/Llama-2-7b-hf
    _preset("llama-2-70b", 80, 64, 8, 8192, 28672, 32000, 4096),  # meta-llama/Llama-2-70b-hf
    _preset("llama-3-8b", 32, 32, 8, 4096, 14336, 128256, 8192),  # meta-llama/Meta-Llama-3-8B
    _preset("llama-3-70b", 80, 64, 8, 8192, 28672, 128256, 8192),  # meta-llama/Meta-Llama-3-70B
    _preset("mistral-7b", 32, 32, 8, 4096, 14336, 32000, 32768),  # mistralai/Mistral-7B-v0.1
    _preset("qwen2.5-7b", 28, 28, 4, 3584, 18944, 152064, 32768, bias=True),  # Qwen/Qwen2.5-7B-Instruct
    _preset("smollm2-135m", 30, 9, 3, 576, 1536, 49152, 8192, head_dim=64, tied=True),  # HuggingFaceTB/SmolLM2-135M
)}


def parse_bytes(text: str) -> int:
    """'16GiB', '16 GB', '512MiB', '1e9' → bytes (GiB/MiB/KiB are powers of 2, GB/MB/KB of 10)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?i?b?)\s*", text.lower())
    if m is None:
        raise ValueError(f"memory must be a size like 16GiB, 512MiB or 24GB, got {text!r}")
    unit = m.group(2).rstrip("b")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
    if unit not in scale:
        raise ValueError(f"memory must be a size like 16GiB, 512MiB or 24GB, got {text!r}")
    return int(float(m.group(1)) * scale[unit])


def _from_model(model: str | Path) -> Architecture:
    """A model kvserve can load (a config.json's directory or a .gguf file), read by the loader's
    own reader: kv-size and the server see one architecture."""
    from kvserve.model.loader import read_model_config

    config = read_model_config(model)
    path = Path(model)
    stored = stored_weights(path, config.num_experts, config.num_experts_per_tok) if path.is_file() else None
    return Architecture(
        name=config.name or path.stem, source="gguf" if path.is_file() else "config.json",
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
        num_experts=config.num_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_intermediate_size=config.moe_intermediate_size,
        dense_layers=len(config.dense_layers) if config.num_experts else 0,
        qk_norm=config.qk_norm,
        sandwich_norms=config.sandwich_norms,
        stored=stored,
    )


def read_architecture(model: str | Path) -> Architecture:
    """A preset name, a model directory (or its config.json), a .gguf file, a Hugging Face repository or an
    Ollama model → Architecture."""
    if isinstance(model, str) and model.lower() in PRESETS:
        return PRESETS[model.lower()]
    path = Path(model).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir() or path.is_file():
        return _from_model(path)
    from kvserve import stores

    if isinstance(model, str) and (model.startswith(stores.OLLAMA_PREFIX) or stores.is_hf_repo(model)):
        return _from_model(model)  # the loader finds it (kvserve/stores.py) or says why not
    raise ValueError(
        f"{str(model)!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json, model "
        "directory or .gguf file, a Hugging Face repository (owner/name) or an Ollama model (ollama:name:tag): "
        "name one of those"
    )


@dataclass(frozen=True)
class KVSize:
    """The figures `kvserve kv-size` prints (all sizes in bytes)."""

    model: str
    source: str
    dtype: str
    dtype_bytes: float
    scale_bytes: int  # per K or V row (int8: a float16 scale), 0 for the float formats
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_token: int
    context: int
    cache_bytes: int  # at `context` tokens
    mha_bytes_per_token: int  # the same model with one KV head per query head
    gqa_saving: float  # mha_bytes_per_token / bytes_per_token
    num_parameters: int
    weight_dtype: str
    weight_bytes: int
    memory_bytes: int
    free_for_cache_bytes: int  # memory left after the weights
    max_tokens_in_memory: int
    disk_bytes: int | None = None  # the disk tier's bound (kvserve serve --kv-disk-gib)
    disk_block_file_bytes: int | None = None  # one block's file: its K/V, token ids and header
    disk_tokens: int | None = None  # tokens the disk tier holds (whole blocks)
    num_experts: int = 0  # a mixture of experts': experts per sparse layer, and chosen per token
    num_experts_per_tok: int = 0
    active_parameters: int = 0  # read per token by a one-sequence decode step
    active_bytes: int = 0  # the same in weight_dtype: a decode step's bytes, whose ceiling is bandwidth / this
    weight_format: str = ""  # a GGUF's types when the weights are counted as the file stores them
    bandwidth: float | None = None  # memory read bytes/s the roofline is stated at

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def kv_size(
    model: str | Path | Architecture,
    *,
    context: int | None = None,
    dtype: str = "float16",
    memory: int | str | None = None,
    weight_dtype: str | None = None,
    disk: int | str | None = None,
    block_size: int = 16,
    bandwidth: float | None = None,
) -> KVSize:
    """The KV cache of `model`: per token, at `context` tokens (default: the model's context),
    against full multi-head attention, and how many tokens fit in `memory` bytes (default: this
    machine's available RAM) after the weights (a GGUF's as the file stores them, else stored as
    `weight_dtype`, default `dtype`), with `disk` bytes how many tokens the KV disk tier holds in files
    of `block_size` tokens, and at `bandwidth` bytes/s of memory read a one-sequence decode's ceiling."""
    arch = model if isinstance(model, Architecture) else read_architecture(model)
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(KV_DTYPES)}, got {dtype!r}")
    stored = arch.stored if weight_dtype is None else None
    weight_dtype = weight_dtype or dtype
    if weight_dtype not in DTYPE_BYTES:
        raise ValueError(f"weight dtype must be one of {', '.join(DTYPE_BYTES)}, got {weight_dtype!r}")
    context = arch.max_position_embeddings if context is None else context
    if context < 0:
        raise ValueError(f"context must be a number of tokens >= 0, got {context}")
    if memory is None:
        memory = available_memory()
    elif isinstance(memory, str):
        memory = parse_bytes(memory)
    elem = DTYPE_BYTES[dtype]
    scale = scale_bytes(torch.int8) if dtype == "int8" else 0  # kvserve's int8 pool: one scale per row
    per_token = kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, elem, scale)
    mha = kv_bytes_per_token(arch.num_hidden_layers, arch.num_attention_heads, arch.head_dim, elem, scale)
    weights = int(arch.parameters * DTYPE_BYTES[weight_dtype])
    active = int(arch.active_parameters * DTYPE_BYTES[weight_dtype])
    if stored is not None:
        weights, active = stored.nbytes, stored.active_bytes
    free = max(0, memory - weights)
    disk_fields = {}
    if disk is not None:
        disk = parse_bytes(disk) if isinstance(disk, str) else disk
        if block_size < 1:
            raise ValueError(f"block size must be at least 1 token, got {block_size}")
        file_bytes = block_file_bytes(per_token * block_size, block_size)
        disk_fields = dict(disk_bytes=disk, disk_block_file_bytes=file_bytes,
                           disk_tokens=disk // file_bytes * block_size)
    return KVSize(
        model=arch.name, source=arch.source, dtype=dtype, dtype_bytes=elem, scale_bytes=scale,
        num_layers=arch.num_hidden_layers, num_attention_heads=arch.num_attention_heads,
        num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
        bytes_per_token=per_token, context=context, cache_bytes=per_token * context,
        mha_bytes_per_token=mha, gqa_saving=mha / per_token,
        num_parameters=arch.parameters, weight_dtype=weight_dtype, weight_bytes=weights,
        memory_bytes=memory, free_for_cache_bytes=free, max_tokens_in_memory=free // per_token, **disk_fields,
        num_experts=arch.num_experts, num_experts_per_tok=arch.num_experts_per_tok,
        active_parameters=arch.active_parameters, active_bytes=active,
        weight_format=stored.types if stored is not None else "", bandwidth=bandwidth,
    )


def read_bandwidth(seconds: float = 0.15) -> float:
    """This machine's memory read, bytes/s: the best of several sums of 256 MiB (past any cache) in `seconds`
    (a quick probe, noisy on a shared machine)."""
    import time

    big = torch.ones(64 << 20, dtype=torch.float32)
    best, deadline = float("inf"), time.perf_counter() + seconds
    for i in range(50):
        t0 = time.perf_counter()
        big.sum()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if i >= 3 and t1 > deadline:
            break
    return big.numel() * big.element_size() / best


def human(n: float) -> str:
    """Bytes in binary units: 524288 → '512 KiB', 2147483648 → '2 GiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def _elem(x: float) -> str:
    return f"{x:g}"


def format_report(s: KVSize) -> str:
    """The text `kvserve kv-size` prints."""
    attn = "multi-head attention" if s.num_kv_heads == s.num_attention_heads else (
        f"grouped-query attention, {s.num_attention_heads // s.num_kv_heads} query heads per KV head"
        if s.num_attention_heads % s.num_kv_heads == 0 else "grouped-query attention")
    lines = [
        f"{s.model} ({s.source}): {s.num_layers} layers, {s.num_attention_heads} query heads, "
        f"{s.num_kv_heads} KV heads ({attn}), head dim {s.head_dim}",
        "",
        f"KV cache per token ({s.dtype}):",
        f"  2 (K and V) x {s.num_layers} layers x {s.num_kv_heads} kv-heads x "
        + (f"({s.head_dim} head-dim x {_elem(s.dtype_bytes)} bytes + {s.scale_bytes} bytes of scale)" if s.scale_bytes
           else f"{s.head_dim} head-dim x {_elem(s.dtype_bytes)} bytes")
        + f" = {s.bytes_per_token:,} bytes = {human(s.bytes_per_token)}",
        f"At {s.context:,} tokens: {s.cache_bytes:,} bytes = {human(s.cache_bytes)} per sequence",
    ]
    if s.num_kv_heads == s.num_attention_heads:
        lines.append("Full multi-head attention: this model already has one KV head per query head (no GQA saving)")
    else:
        lines.append(
            f"With full multi-head attention ({s.num_attention_heads} kv-heads): {s.mha_bytes_per_token:,} bytes "
            f"= {human(s.mha_bytes_per_token)} per token; GQA saves {s.gqa_saving:g}x "
            f"({human(s.mha_bytes_per_token * s.context)} at {s.context:,} tokens)"
        )
    stored = (f"as the file stores them ({s.weight_format})" if s.weight_format else
              f"x {_elem(DTYPE_BYTES[s.weight_dtype])} bytes ({s.weight_dtype})")
    lines += ["", f"Weights: {s.num_parameters / 1e9:.3g} B parameters {stored} = {human(s.weight_bytes)}"]
    if s.num_experts:
        lines.append(
            f"Mixture of experts: {s.num_experts_per_tok} of {s.num_experts} experts per token, so a one-sequence decode "
            f"step reads {s.active_parameters / 1e9:.3g} B parameters = {human(s.active_bytes)} "
            f"({s.active_bytes / s.weight_bytes:.0%} of the weights)")
    if s.bandwidth:
        lines.append(f"Bytes roofline: at {s.bandwidth / 1e9:.3g} GB/s of memory read, one sequence decodes at most "
                     f"{s.bandwidth / s.active_bytes:,.1f} tokens/s (each step reads {human(s.active_bytes)} of weights)")
    if s.free_for_cache_bytes == 0:
        lines.append(f"In {human(s.memory_bytes)}: the weights alone do not fit; no room for any KV cache")
    else:
        lines.append(
            f"In {human(s.memory_bytes)}: {human(s.free_for_cache_bytes)} left after the weights holds "
            f"{s.max_tokens_in_memory:,} tokens of KV cache"
            + (f" ({s.max_tokens_in_memory / s.context:.3g} sequences of {s.context:,})" if s.context else "")
        )
    if s.disk_bytes is not None and s.disk_block_file_bytes is not None:  # (set together)
        lines += [
            "",
            f"Disk tier (kvserve serve --kv-disk-gib): {human(s.disk_bytes)} holds {s.disk_tokens:,} tokens of KV cache "
            f"in block files of {human(s.disk_block_file_bytes)} ({s.disk_bytes // s.disk_block_file_bytes:,} blocks)",
        ]
    return "\n".join(lines)
