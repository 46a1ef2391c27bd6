"""Frozen configuration dataclasses: one per layer of the pipeline.

ModelConfig describes a Llama-family architecture (read from GGUF metadata or config.json);
CacheConfig sizes the paged KV pool; SchedulerConfig bounds each engine step.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any


def env_switch(name: str) -> bool:
    """An on/off switch of the environment (KVSERVE_NATIVE, KVSERVE_X8, ...): on unless set to 0, false, no or off."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


# The RoPE scaling kinds kvserve computes. Others that Llama-family checkpoints use -- dynamic NTK --
# change the frequencies with the context in ways kvserve does not model, so both model readers
# refuse them at load with rope_scaling_unsupported()'s message.
SUPPORTED_ROPE_SCALING = ("none", "linear", "llama3", "longrope", "yarn")


def rope_scaling_unsupported(kind: object) -> str:
    """The one refusal of a RoPE scaling kind, for the HF and GGUF readers alike."""
    return (f"RoPE scaling {kind!r} is not supported (kvserve supports {', '.join(SUPPORTED_ROPE_SCALING)}; "
            "not dynamic NTK)")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale (the paper's eq. 21, transformers' yarn_get_mscale): 0.1 * mscale * ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. kind: "none", "linear", "llama3" (Llama 3.1's piecewise rule),
    "longrope" (Phi-3 128k, Phi-4-mini: per-frequency divisors, one set for contexts up to
    original_max_position_embeddings and one past it, and cos, sin multiplied by attention_factor)
    or "yarn" (gpt-oss, and others: frequencies blended between interpolated, divided by factor, and kept, over
    a ramp between the dims that turn beta_fast and beta_slow times in the original context; cos,
    sin multiplied by attention_factor)."""

    kind: str = "none"
    factor: float = 1.0
    # llama3 only: the band between these wavelengths is interpolated smoothly.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # longrope only
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # longrope and yarn
    # yarn only: the ramp's ends, in turns over the original context; truncate rounds them to whole
    # dims (transformers' default; gpt-oss's config turns it off)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3, Mixtral, Qwen3-MoE,
    gpt-oss). Names follow Hugging Face."""

    # "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mixtral", "qwen3moe" or "gpt-oss"
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads means grouped-query attention
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head (weights [head_dim]) before RoPE
    # Phi-3 / Phi-4-mini: RoPE turns only the first rotary_dim dims of each head (partial_rotary_factor); 0: all
    rotary_dim: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    # Sliding-window attention (Mistral v0.1: 4096) in every layer: the token at position p attends
    # to keys p - window + 1 .. p (transformers' mask). Blocks that fall out of a sequence's window
    # go back to the pool (kv/manager.py slide()).
    sliding_window: int | None = None
    # Gemma 2 and 3, gpt-oss, a Qwen2 or Qwen3 that mixes them: windowed and global layers. Each layer's
    # window (0: the whole context); Gemma 3's windowed ones turn RoPE at base `sliding_rope_theta`,
    # unscaled. Every layer's blocks stay in the pool (the global layers read them), so nothing slides
    # out of memory.
    layer_windows: tuple[int, ...] = ()
    sliding_rope_theta: float | None = None
    # Gemma's other differences from Llama: the embedding multiplied by sqrt(hidden); a norm of the
    # attention's and of the MLP's output before each residual add ("sandwich" norms); GeGLU (tanh
    # GELU) instead of SwiGLU; attention scaled by attention_scale (query_pre_attn_scalar ** -0.5)
    # instead of head_dim ** -0.5. RMSNorm weights are stored as used (Gemma's 1 + w folded at load).
    embedding_multiplier: float = 1.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"  # "silu" or "gelu_tanh"
    attention_scale: float | None = None
    # Gemma 2: attention scores and final logits soft-capped, x -> cap * tanh(x / cap); None: not capped
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    # Mixture of experts (Mixtral, Qwen3-MoE): in each sparse layer a router picks num_experts_per_tok of
    # num_experts SwiGLU experts (moe_intermediate_size wide) per token, their outputs weighted by the
    # router's softmax over all experts (renormalized over the chosen where norm_topk_prob). Layers in
    # dense_layers keep a dense MLP (Qwen3-MoE's mlp_only_layers and decoder_sparse_step). 0: dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: each attention head has a learned sink logit, which joins every query's softmax
    # denominator and takes no value (so a head may attend to nothing); its router and experts carry
    # biases, the router's softmax runs over the top-k logits only, and its experts' SwiGLU is clamped:
    # gate <= limit, -limit <= up <= limit, out = (up + 1) * gate * sigmoid(alpha * gate). None: plain SwiGLU.
    attention_sinks: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def window(self, layer: int) -> int:
        """Keys a query of `layer` sees: its own window, the every-layer one, or 0 (the whole context)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window or 0

    def describe(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: fixed-size blocks, as many as the memory budget holds."""

    block_size: int = 16  # tokens per block
    # Bytes for K and V of all layers; None means a fifth of the available RAM, at most 4 GiB
    # (kv/sizing.py: DEFAULT_BUDGET_FRACTION, DEFAULT_BUDGET_CAP).
    memory_bytes: int | None = None
    num_blocks: int | None = None  # overrides memory_bytes when set (tests use tiny pools)
    enable_prefix_caching: bool = True
    # The pool's element type: "auto" (float16 under quantized weights with float32 activations,
    # else the model's dtype), "float32", "bfloat16", "float16" or "int8" (a float16 scale per
    # K/V row beside the pool: ~1.9x float16's tokens in the same bytes). See kv/sizing.py and
    # model/kv_int8.py.
    dtype: str = "auto"
    # The disk tier (kv/disk_tier.py): prefix blocks evicted from RAM are kept in this directory,
    # at most disk_bytes of it, and read back by later lookups, after restarts too. None: off.
    disk_path: str | None = None
    disk_bytes: int = 4 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    """One token budget per engine step (vLLM v1 style: no separate prefill/decode phases)."""

    max_num_batched_tokens: int = 512  # prefill chunks + decode tokens per step
    max_num_seqs: int = 64  # sequences in one step
    policy: str = "fcfs"  # "fcfs" or "priority" (lower priority value runs first)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: drafted tokens verified in the continuous batch (engine/speculative.py).

    On a CPU a forward over a few tokens of one sequence costs little more than over one (the
    weights are read once per step), so each accepted draft token is nearly free."""

    # "ngram": prompt lookup, the tokens that followed the latest n-gram's earlier match;
    # "draft": a draft model's greedy tokens (engine/draft_model.py)
    method: str = "ngram"
    num_speculative_tokens: int = 4  # the most tokens drafted per sequence per step
    prompt_lookup_max: int = 8  # n-gram lengths tried, longest first (a longer match drafts more surely)
    prompt_lookup_min: int = 1
    # Drafts stop once a step's decode rows and drafted rows reach this many: a CPU step over a few
    # rows is bound by reading the weights (extra rows are nearly free), over more by arithmetic
    # (each row costs its share). Measured on a busy 2-core machine: 4 users drafting 4 tokens
    # each (20 rows) were slower than not drafting.
    max_step_rows: int = 8
    # What one more row of a decode step costs, as a share of a one-row step's time; None: measured
    # from the engine's own steps (engine/speculative.py's StepTimes). 0: rows are free (a draft
    # model's forwards too), so sequences draft whenever acceptance allows; a catch-up is still weighed.
    row_cost: float | None = None
    # method "draft": the draft model (an alias, .gguf file or Hugging Face directory, as the target is
    # named) with the target's vocabulary, e.g. the target itself in a quantized format; its weights
    # as LLM's `quantization` says ("auto" keeps a GGUF's quantized blocks).
    draft_model: str | None = None
    draft_quantization: str = "auto"
    # The draft's own KV pool in bytes; None: as many tokens as the target's pool and one block per
    # sequence more (it then runs dry no sooner than the target's; pages are touched as they fill).
    draft_kv_cache_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft', got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative method 'draft' needs draft_model: a model with the target's vocabulary "
                             "(an alias, .gguf file or Hugging Face directory)")
        if self.method != "draft" and self.draft_model is not None:
            raise ValueError(f"draft_model is for speculative method 'draft', not {self.method!r}: set method='draft'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.row_cost is not None and not 0.0 <= self.row_cost <= 10.0:
            raise ValueError(f"row_cost must be None (measured) or in [0, 10], got {self.row_cost}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
