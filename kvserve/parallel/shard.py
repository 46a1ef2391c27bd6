"""Which slice of each weight a tensor-parallel rank holds, and the slicing itself.

Megatron's split of a Llama layer: q/k/v rows by attention head (each rank keeps whole KV heads
and the query heads that attend to them), gate/up rows by FFN unit; o_proj and down_proj by
input columns, so each rank's matmul yields a partial sum of the layer's output and one
all-reduce after each completes it. The KV pool follows the heads: a rank caches only its own
KV heads. Embedding, norms and LM head are replicated.

Quantized matrices are split on GGML block boundaries: rows are independent, but a block packs
`per` consecutive input columns (32, or 256 for K-quants), so every input-column boundary (of
o_proj: head boundaries; of down_proj: FFN boundaries) must fall on a multiple of `per`. A split
that cannot is refused with the reason. Heads and FFN units that do not divide evenly are dealt
as evenly as possible, larger shares first (3 KV heads over 2 ranks: 2 and 1); the rank with the
larger share sets the step's pace, and rank 0 holds the largest KV share, so the pool sized for
rank 0 fits every rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES

from kvserve.config import ModelConfig
from kvserve.model.quant import QuantizedWeight, Weight


class TensorParallelError(ValueError):
    """A tensor-parallel size this model cannot be split into; the message says why and what fits."""


def _deal(n: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) of `parts` contiguous shares of n, as even as possible, larger ones first."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for r in range(parts):
        stop = start + base + (r < extra)
        out.append((start, stop))
        start = stop
    return out


def _block_values(w: Weight) -> int:
    """Input columns per stored block (1 for a float matrix)."""
    return GGML_QUANT_SIZES[w.qtype][0] if isinstance(w, QuantizedWeight) else 1


@dataclass(frozen=True)
class ShardPlan:
    """Every rank's share: KV heads and FFN columns as [start, stop) ranges, one per rank."""

    size: int
    kv_heads: tuple[tuple[int, int], ...]
    ffn: tuple[tuple[int, int], ...]
    group: int  # query heads per KV head

    def local_config(self, config: ModelConfig, rank: int) -> ModelConfig:
        """The model as rank `rank` runs it: its heads and FFN width."""
        k0, k1 = self.kv_heads[rank]
        f0, f1 = self.ffn[rank]
        return dataclasses.replace(config, num_attention_heads=(k1 - k0) * self.group,
                                   num_key_value_heads=k1 - k0, intermediate_size=f1 - f0)


def plan(config: ModelConfig, tensors: dict[str, Weight], size: int) -> ShardPlan:
    """The split of this checkpoint over `size` ranks, or TensorParallelError saying why none fits."""
    if size < 1:
        raise TensorParallelError(f"the tensor parallel size must be at least 1, got {size}")
    # output norms; experts and gpt-oss's per-head sinks not sharded yet
    if (config.sandwich_norms or config.num_experts or config.attention_sinks) and size > 1:
        raise TensorParallelError(f"tensor parallel does not run {config.architecture} models yet; serve it on one rank")
    H, Hkv, D, F = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size
    if size > Hkv:
        raise TensorParallelError(
            f"tensor parallel size {size} exceeds the model's {Hkv} KV heads: each rank holds whole KV heads, "
            f"so use a size of at most {Hkv}")
    group = H // Hkv
    kv_heads = _deal(Hkv, size)
    # o_proj's input columns are the query heads': each boundary must fall on a block boundary.
    o_per = max(_block_values(tensors[f"model.layers.{i}.self_attn.o_proj.weight"]) for i in range(config.num_hidden_layers))
    for k0, _ in kv_heads[1:]:
        col = k0 * group * D
        if col % o_per:
            raise TensorParallelError(
                f"tensor parallel size {size} splits o_proj at column {col} ({k0 * group} heads of {D}), inside one "
                f"of its {o_per}-column quantized blocks: choose a size whose head split falls on {o_per} columns")
    # down_proj's input columns are the FFN's: dealt in units of the widest block among the layers.
    unit = max(_block_values(tensors[f"model.layers.{i}.mlp.down_proj.weight"]) for i in range(config.num_hidden_layers))
    if F % unit or F // unit < size:
        raise TensorParallelError(
            f"tensor parallel size {size} cannot split the FFN's {F} columns into whole {unit}-column quantized "
            f"blocks per rank: use a size of at most {F // unit}")
    ffn = tuple((a * unit, b * unit) for a, b in _deal(F // unit, size))
    return ShardPlan(size, tuple(kv_heads), ffn, group)


def _rows(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, QuantizedWeight):
        return w.rows(start, stop)
    return w[start:stop].contiguous()


def _cols(w: Weight, start: int, stop: int) -> Weight:
    if isinstance(w, QuantizedWeight):
        per, size = GGML_QUANT_SIZES[w.qtype]
        if w.x8:  # its columns are interleaved 8 blocks at a time: shards are cut before packing
            raise ValueError("x8 blocks cannot be split by columns; shard the stored blocks")
        return QuantizedWeight(w.blocks[:, start // per * size : stop // per * size].contiguous(), w.qtype,
                               (w.shape[0], stop - start))
    return w[:, start:stop].contiguous()


def shard_tensors(tensors: dict[str, Weight], config: ModelConfig, p: ShardPlan, rank: int,
                  keep_lm_head: bool) -> dict[str, Weight]:
    """Rank `rank`'s tensors under the same Hugging Face names (consumes `tensors`). Biases of the
    column-split layers stay on rank 0 only: the all-reduce adds every rank's part once."""
    k0, k1 = p.kv_heads[rank]
    f0, f1 = p.ffn[rank]
    D, g = config.head_dim, p.group
    q_rows, kv_rows, o_cols = (k0 * g * D, k1 * g * D), (k0 * D, k1 * D), (k0 * g * D, k1 * g * D)
    out: dict[str, Weight] = {}
    for name in list(tensors):
        w = tensors.pop(name)
        leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
        part = leaf[0]
        if part == "q_proj":
            w = _rows(w, *q_rows)
        elif part in ("k_proj", "v_proj"):
            w = _rows(w, *kv_rows)
        elif part in ("gate_proj", "up_proj"):
            w = _rows(w, f0, f1)
        elif part == "o_proj":
            if leaf[1] == "bias":
                if rank:
                    continue
            else:
                w = _cols(w, *o_cols)
        elif part == "down_proj":
            if leaf[1] == "bias":
                if rank:
                    continue
            else:
                w = _cols(w, f0, f1)
        elif name == "lm_head.weight" and not keep_lm_head:
            continue
        out[name] = w
    return out

