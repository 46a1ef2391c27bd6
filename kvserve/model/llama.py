"""The Llama-family decoder: Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, Mixtral, Qwen3-MoE, gpt-oss.

Pre-norm transformer blocks with RMSNorm, grouped-query attention with rotary position
embeddings (rotate-half convention, optional llama3 or linear frequency scaling, Qwen2's q/k/v
bias, Qwen3's RMSNorm of each query and key head before the rotation) and a SwiGLU MLP; the LM
head is tied to the embedding or separate. Gemma 2 and 3 add a scaled embedding, norms of the
attention's and the MLP's outputs, GeGLU, and windowed layers between the global ones (Gemma 3's
with their own RoPE base; Gemma 2's attention scores and logits soft-capped); Mixtral, Qwen3-MoE and
gpt-oss replace the MLP with a router over SwiGLU experts (Experts); gpt-oss adds attention sinks,
biases everywhere, YaRN RoPE and a clamped SwiGLU (model/gpt_oss.py). ModelConfig says which. References: "LLaMA" (Touvron et al. 2023), "GQA"
(Ainslie et al. 2023), "RoFormer" (Su et al. 2021), "GLU Variants Improve Transformer" (Shazeer
2020), Qwen3 Technical Report (2025), Gemma 2 and Gemma 3 Technical Reports (2024, 2025), "Mixtral of
Experts" (Jiang et al. 2024).

The forward works on one packed step: a flat [T] list of tokens from many sequences, with K/V
kept in the paged pool (see attention.py). Weights arrive under Hugging Face names and are fused
at load time (q/k/v into qkv, gate/up into gate_up) so each layer runs four matmuls; the
elementwise steps between them are model/ops.py's (fused kernels where they compiled).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve import hugepages
from kvserve.config import ModelConfig, RopeScaling, rope_scaling_unsupported
from kvserve.errors import ModelFormatError
from kvserve.kernels import layer_ops
from kvserve.model.attention import AttentionBackend, AttentionMetadata, default_backend
from kvserve.model.linear import LinearLayer
from kvserve.model.ops import LayerOps
from kvserve.model.quant import ConcatLinear, QuantizedLinear, QuantizedWeight, Weight, embedding, make_linear, nbytes


def rope_inv_freq(config: ModelConfig, context: int | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] (float32), with llama3, linear or longrope scaling applied (longrope:
    the long divisors where the served `context` passes the original one, as llama.cpp chooses; the
    attention factor is in the q, k weights: loader.scale_rotary). Under partial rotary
    (rotary_dim < D) the frequencies are the rotary dims' and the rest 0: cos 1, sin 0 turn
    nothing, and the loader has put each head's dims in that order (loader.rotary_dims_first)."""
    inv_freq = _inv_freq(config, config.rotary_dim or config.head_dim, context or config.max_position_embeddings)
    return torch.cat([inv_freq, torch.zeros(config.head_dim // 2 - inv_freq.numel())])


def sliding_inv_freq(config: ModelConfig) -> torch.Tensor | None:
    """Gemma 3's windowed layers' inverse frequencies [D/2]: base sliding_rope_theta, unscaled; None
    where every layer turns as rope_inv_freq says."""
    if config.sliding_rope_theta is None:
        return None
    d = config.head_dim
    return 1.0 / (config.sliding_rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))


def _inv_freq(config: ModelConfig, d: int, context: int) -> torch.Tensor:
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = config.rope_scaling
    if rs.kind == "longrope":
        factors = rs.long_factor if context > rs.original_max_position_embeddings else rs.short_factor
        if len(factors) != d // 2:
            raise ModelFormatError(f"longrope lists {len(factors)} factors for {d // 2} frequencies")
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta ** (
            torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    elif rs.kind == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        old = rs.original_max_position_embeddings
        low_wavelen, high_wavelen = old / rs.low_freq_factor, old / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, blended, scaled)
    elif rs.kind == "yarn":
        inv_freq = _yarn_inv_freq(config.rope_theta, d, rs)
    elif rs.kind != "none":
        raise ModelFormatError(rope_scaling_unsupported(rs.kind))
    return inv_freq


def _yarn_inv_freq(theta: float, d: int, rs: RopeScaling) -> torch.Tensor:
    """YaRN ("YaRN: Efficient Context Window Extension", Peng et al. 2023) as transformers'
    _compute_yarn_parameters computes it: frequencies that turn more than beta_fast times over the
    original context are kept, those that turn fewer than beta_slow times are divided by factor, and
    the dims between blend linearly. (Its attention factor scales cos and sin: loader.scale_rotary.)"""
    orig = rs.original_max_position_embeddings

    def dim_of(turns: float) -> float:  # the dim whose frequency turns `turns` times over the original context
        return d * math.log(orig / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # [D/2]: 1 where a frequency is kept
    pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)  # (as transformers rounds them)
    return 1.0 / (rs.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation


@dataclass
class Experts:
    """A mixture of experts (Mixtral, Qwen3-MoE, gpt-oss): each token's top_k experts by the router,
    their outputs weighted by its softmax, as transformers computes them. Mixtral and Qwen3-MoE take
    the top k of the softmax over all experts (renormalized over the chosen where `renormalize`);
    gpt-oss (`softmax_of_top`) the softmax of the top k logits, its router and experts biased. Each
    chosen expert multiplies its rows at once, so its weights are read once per step however many
    rows chose it."""

    router: torch.Tensor  # [E, hidden]
    gate_up: list[LinearLayer]  # per expert: hidden -> 2 * ffn (gate rows, then up)
    down: list[LinearLayer]  # per expert: ffn -> hidden
    top_k: int
    renormalize: bool
    router_bias: torch.Tensor | None = None  # [E] (gpt-oss)
    softmax_of_top: bool = False
    # Routed by layer_ops.c's route_row, the native decode step's arithmetic (a model of quantized
    # weights: LlamaModel sets it), so that either path picks a row's experts with the same bits.
    native_route: bool = False
    # The experts each row of the last step through this layer chose [T, k] (the native step writes it
    # where asked: NativeDecode.trace); `kvserve explain` shows them.
    last_chosen: torch.Tensor | None = None

    @property
    def how(self) -> int:
        """How the router weighs the chosen experts (layer_ops.ROUTE_*)."""
        if self.softmax_of_top:
            return layer_ops.ROUTE_TOP_LOGITS
        return layer_ops.ROUTE_RENORM if self.renormalize else layer_ops.ROUTE_SOFTMAX

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts and their weights, both [T, k]."""
        if self.native_route and h.dtype == torch.float32:
            return layer_ops.route(h, self.router, self.top_k, self.how, self.router_bias)
        logits = torch.nn.functional.linear(h, self.router, self.router_bias).float()  # [T, E]
        if self.softmax_of_top:
            top, chosen = logits.topk(self.top_k, dim=-1)
            return chosen, torch.softmax(top, dim=-1)
        weights, chosen = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
        return chosen, weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights

    def __call__(self, h: torch.Tensor, glu: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        chosen, weights = self.route(h)
        self.last_chosen = chosen
        weights = weights.to(h.dtype)
        out = torch.zeros_like(h)
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.down[e](glu(self.gate_up[e](h[rows])))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out

    def linears(self) -> list[LinearLayer]:
        return [*self.gate_up, *self.down]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # Linear layers (model/linear.py, or model/quant.py's for weights kept quantized)
    qkv: LinearLayer  # hidden -> (H + 2 Hkv) * D, with Qwen2's q/k/v bias
    o: LinearLayer  # H * D -> hidden, with Llama's attention_bias
    post_norm: torch.Tensor  # [hidden]
    gate_up: LinearLayer | None  # hidden -> 2 * ffn: gate rows then up rows
    down: LinearLayer | None  # ffn -> hidden (both None in a mixture of experts' layer)
    q_norm: torch.Tensor | None = None  # [D]: Qwen3's norm of each query head, before RoPE
    k_norm: torch.Tensor | None = None  # [D]: and of each key head
    attn_out_norm: torch.Tensor | None = None  # [hidden]: Gemma's norm of the attention output, before its add
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: and of the MLP's
    experts: Experts | None = None  # the MLP of a mixture of experts' sparse layer
    window: int = 0  # keys each query sees (0: the whole context)
    sliding_rope: bool = False  # turned at the windowed layers' RoPE base (Gemma 3)
    sinks: torch.Tensor | None = None  # [H]: gpt-oss's sink logit of each head (model/gpt_oss.py)


class StepModel(Protocol):
    """What runs an engine step (engine/runner.py) and what LLM asks of it: a LlamaModel, or under
    tensor parallelism rank 0's TensorParallelModel (parallel/model.py) in its place."""

    config: ModelConfig
    dtype: torch.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def set_batch_invariant(self, on: bool) -> None: ...

    @property
    def nbytes(self) -> int: ...


class LlamaModel:
    """Weights and the packed forward. Call under torch.inference_mode()."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, Weight],
        dtype: torch.dtype,
        attention: AttentionBackend | None = None,
        native_ops: bool | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.attention = attention or default_backend()
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.act_levels = 1  # int8 levels per activation row in quantized layers (set_activation_levels)
        self.inv_freq = rope_inv_freq(config)
        self.sliding_inv_freq = sliding_inv_freq(config)

        def take(name: str) -> Weight:
            try:
                w = tensors.pop(name)
            except KeyError:
                raise ModelFormatError(f"model weights lack tensor {name!r}") from None
            return w if isinstance(w, QuantizedWeight) else w.to(dtype).contiguous()

        def take_opt(name: str) -> Weight | None:
            return take(name) if name in tensors else None

        def dense(name: str) -> torch.Tensor:  # norms, biases, the router: float, however the file stores them
            w = take(name)
            return w.dequantize().to(dtype) if isinstance(w, QuantizedWeight) else w

        def dense_opt(name: str) -> torch.Tensor | None:
            return dense(name) if name in tensors else None

        # The repacked weights, one after another on huge pages where the OS gives them (hugepages.py):
        # a decode step streams through them all.
        arena = hugepages.Arena()

        def linear(names: list[str], bias: torch.Tensor | None = None) -> LinearLayer:
            return make_linear([take(n) for n in names], bias, dtype, arena)

        def biases(names: list[str]) -> torch.Tensor | None:  # all of them, fused, or none (gpt-oss's experts have them)
            found = [b for n in names if (b := dense_opt(n)) is not None]
            return torch.cat(found) if found and len(found) == len(names) else None

        def experts(m: str) -> Experts:  # m: "model.layers.{i}.mlp."
            gate_up = [[m + f"experts.{e}.gate_proj.", m + f"experts.{e}.up_proj."] for e in range(config.num_experts)]
            down = [m + f"experts.{e}.down_proj." for e in range(config.num_experts)]
            return Experts(
                dense(m + "gate.weight"),  # the router (llama.cpp: F32)
                [linear([n + "weight" for n in names], biases([n + "bias" for n in names])) for names in gate_up],
                [linear([n + "weight"], dense_opt(n + "bias")) for n in down],
                config.num_experts_per_tok, config.norm_topk_prob, dense_opt(m + "gate.bias"),
                softmax_of_top=config.architecture == "gpt-oss")

        self.embed = take("model.embed_tokens.weight")  # [V, hidden] (or its blocks)
        self.layers: list[LayerWeights] = []
        sandwich = config.sandwich_norms
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            window = config.window(i)
            self.layers.append(
                LayerWeights(
                    input_norm=dense(p + "input_layernorm.weight"),
                    qkv=linear([a + f"{n}_proj.weight" for n in "qkv"], biases([a + f"{n}_proj.bias" for n in "qkv"])),
                    o=linear([a + "o_proj.weight"], dense_opt(a + "o_proj.bias")),
                    # the norm before the MLP: Gemma names it pre_feedforward, its post_attention is after attention
                    post_norm=dense(p + ("pre_feedforward_layernorm.weight" if sandwich else "post_attention_layernorm.weight")),
                    gate_up=None if config.sparse(i) else linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                    down=None if config.sparse(i) else linear([p + "mlp.down_proj.weight"]),
                    experts=experts(p + "mlp.") if config.sparse(i) else None,
                    q_norm=dense(a + "q_norm.weight") if config.qk_norm else None,
                    k_norm=dense(a + "k_norm.weight") if config.qk_norm else None,
                    attn_out_norm=dense(p + "post_attention_layernorm.weight") if sandwich else None,
                    mlp_out_norm=dense(p + "post_feedforward_layernorm.weight") if sandwich else None,
                    window=window,
                    sliding_rope=bool(window) and self.sliding_inv_freq is not None,
                    sinks=dense(a + "sinks") if config.attention_sinks else None,
                )
            )
        self.norm = dense("model.norm.weight")
        lm_head = take_opt("lm_head.weight")
        self.tied = config.tie_word_embeddings or lm_head is None
        if self.tied and isinstance(self.embed, QuantizedWeight):
            # One table for the lookup and the LM head: the kernels' layout serves both (a lookup
            # unpacks its few rows; the head is the step's largest matmul).
            self.embed = self.embed.packed(arena)
        self.lm_head = make_linear([self.embed if self.tied or lm_head is None else lm_head], None, dtype, arena)
        # Fused CPU kernels for the elementwise steps where they compiled (None: if available); for
        # quantized layers with the native decode step's SiLU and RoPE tables (model/ops.py).
        quantized = any(isinstance(lin, (QuantizedLinear, ConcatLinear)) for lin in (self.layers[0].qkv, self.layers[0].o))
        self.ops = LayerOps(layer_ops.available() if native_ops is None else native_ops, native_step_arith=quantized)
        for lw in self.layers:
            if lw.experts and self.ops.native_step_arith and lw.experts.router.dtype == torch.float32 and \
                    (lw.experts.router_bias is None or lw.experts.router_bias.dtype == torch.float32):
                lw.experts.native_route = True

    @property
    def nbytes(self) -> int:
        """Bytes of the parameters (a tied LM head's shared weight counted once; a copy it keeps, as
        the packed bfloat16 one without batch invariance, counted)."""
        n = nbytes(self.embed) + nbytes(self.norm)
        n += self.lm_head.nbytes - (nbytes(self.embed) if self.tied else 0)
        for lw in self.layers:
            n += sum(t.numel() * t.element_size() for t in (lw.input_norm, lw.post_norm, lw.q_norm, lw.k_norm,
                                                             lw.attn_out_norm, lw.mlp_out_norm, lw.sinks) if t is not None)
            n += sum(lin.nbytes for lin in (lw.qkv, lw.o, *self._mlp(lw)))
            n += sum(nbytes(t) for t in (lw.experts.router, lw.experts.router_bias) if t is not None) if lw.experts else 0
        return n

    @property
    def active_nbytes(self) -> int:
        """Bytes a one-sequence decode step reads: nbytes less the experts a token does not choose."""
        c = self.config
        idle = sum(sum(lin.nbytes for lin in lw.experts.linears()) for lw in self.layers if lw.experts)
        return self.nbytes - (idle * (c.num_experts - c.num_experts_per_tok) // c.num_experts if c.num_experts else 0)

    @staticmethod
    def _mlp(lw: LayerWeights) -> list[LinearLayer]:
        return lw.experts.linears() if lw.experts else [lin for lin in (lw.gate_up, lw.down) if lin is not None]

    def _linears(self) -> list[LinearLayer]:
        return [self.lm_head, *(lin for layer in self.layers for lin in (layer.qkv, layer.o, *self._mlp(layer)))]

    def set_batch_invariant(self, on: bool) -> None:
        """Quantized layers multiply with the integer kernel at every batch size (see
        QuantizedLinear.set_batch_invariant); float layers are unaffected."""
        for lin in self._linears():
            if isinstance(lin, (QuantizedLinear, ConcatLinear)):
                lin.set_batch_invariant(on)

    def set_activation_levels(self, levels: int) -> None:
        """The int8 levels quantized layers quantize activations at (QuantizedLinear.set_activation_levels;
        a layer wrapped by tensor parallelism passes it on); float layers are unaffected."""
        for lin in self._linears():
            if hasattr(lin, "set_activation_levels"):
                lin.set_activation_levels(levels)
        self.act_levels = levels

    def set_context(self, context: int) -> None:
        """The context the model is served at: longrope's frequencies depend on it (rope_inv_freq)."""
        self.inv_freq = rope_inv_freq(self.config, context)

    def rope(self, positions: torch.Tensor, sliding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] each, in the model dtype (sliding: the windowed layers' own, Gemma 3)."""
        inv_freq = self.sliding_inv_freq if sliding else self.inv_freq
        if inv_freq is None:
            raise ValueError(f"{self.config.architecture}: no sliding-window layers of their own RoPE")
        return self.ops.rope_tables(positions, inv_freq, self.dtype)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden]: the rows, times Gemma's sqrt(hidden) (a float32 scalar in the model
        dtype, as transformers multiplies)."""
        x = embedding(input_ids, self.embed, self.dtype)
        m = self.config.embedding_multiplier
        return x if m == 1.0 else x * torch.tensor(m, dtype=torch.float32).to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, Hkv, num_blocks, block_size, D]
        meta: AttentionMetadata,
        kv_scales: list[torch.Tensor] | None = None,  # an int8 pool's per layer [2, Hkv, num_blocks, block_size]
    ) -> torch.Tensor:  # [T, hidden]
        c = self.config
        T, H, D, eps = input_ids.shape[0], c.num_attention_heads, c.head_dim, c.rms_norm_eps
        softcap = c.attn_logit_softcapping or 0.0
        tables = {False: self.rope(positions)}
        if self.sliding_inv_freq is not None:
            tables[True] = self.rope(positions, sliding=True)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        ops = self.ops.for_step(x, kv_caches[0])  # kernel checks once per step, not per layer
        # Step buffers, written anew by every layer (each is read before the next write): the
        # normed activations [T, hidden] and the rotated q [T, H, D], k [T, Hkv, D].
        h_buf = torch.empty_like(x)
        qk_buf = (torch.empty(T, H, D, dtype=x.dtype), torch.empty(T, c.num_key_value_heads, D, dtype=x.dtype))
        delta = None  # the previous layer's MLP output, added to x with the next norm
        scales: list[torch.Tensor | None] = [*kv_scales] if kv_scales else [None] * len(kv_caches)
        for lw, kv_cache, kv_scale in zip(self.layers, kv_caches, scales):
            x, h = ops.add_rms_norm(x, delta, lw.input_norm, eps, h_buf)
            qkv = lw.qkv(h)
            if lw.q_norm is not None and lw.k_norm is not None:  # (both or neither)
                ops.head_norms(qkv, lw.q_norm, lw.k_norm, H, c.num_key_value_heads, eps)
            cos, sin = tables[lw.sliding_rope]
            q, k, v = ops.rope_and_store(qkv, cos, sin, kv_cache, meta.slot_mapping, H, qk_buf, kv_scale)
            o = self.attention.forward(q, k, v, kv_cache, meta, self.scale, lw.window, kv_scale, softcap,
                                       lw.sinks)  # [T, H, D]
            o = lw.o(o.reshape(T, H * D))
            if lw.attn_out_norm is not None:
                o = ops.add_rms_norm(o, None, lw.attn_out_norm, eps)[1]
            x, h = ops.add_rms_norm(x, o, lw.post_norm, eps, h_buf)
            if lw.experts:
                delta = lw.experts(h, self._expert_glu(ops))
            else:
                assert lw.gate_up is not None and lw.down is not None  # a dense layer has both
                delta = lw.down(ops.glu(lw.gate_up(h), c.hidden_act))
            if lw.mlp_out_norm is not None:
                delta = ops.add_rms_norm(delta, None, lw.mlp_out_norm, eps)[1]
        return ops.add_rms_norm(x, delta, self.norm, eps)[1]  # a new tensor: it outlives the step

    def _expert_glu(self, ops: LayerOps) -> Callable[[torch.Tensor], torch.Tensor]:
        """An expert's [T, 2F] -> [T, F]: gpt-oss's clamped SwiGLU, else the model's act(gate) * up."""
        c = self.config
        if c.swiglu_limit is not None:
            return functools.partial(ops.clamped_swiglu, alpha=c.swiglu_alpha, limit=c.swiglu_limit)
        return functools.partial(ops.glu, act=c.hidden_act)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on the given positions only: [N, hidden] -> [N, V] float32 (Gemma 2's soft-capped)."""
        return self.softcap_logits(self.lm_head(hidden).float())

    def softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """cap * tanh(logits / cap), in place, where the model caps its logits (as transformers computes it)."""
        cap = self.config.final_logit_softcapping
        return logits if not cap else logits.div_(cap).tanh_().mul_(cap)
