"""Paged attention: K/V live in block slots of a pool; each token attends through its block table.

The KV pool of one layer is a tensor [2, num_kv_heads, num_blocks, block_size, head_dim]; a
sequence owns a list of block ids (its block table) and token i of it lives in block
table[i // block_size] at offset i % block_size. Heads come first so that gathering a
sequence's blocks yields [Hkv, L, D] rows ready for batched matmuls, with no transposing copy.
A step's tokens from many sequences are packed into one flat batch; AttentionMetadata says
which tokens belong to which sequence. The pool's dtype may be narrower than the activations'
(float16 under float32): K/V are rounded when stored and widened when read, and a prefill that
attends to its own fresh K/V rounds them alike, so a prefix-cache hit changes no result. An int8
pool comes with a second per-layer tensor of row scales, `kv_scale` [2, Hkv, num_blocks,
block_size] float16 (model/kv_int8.py): rows are quantized when stored and dequantized when read.

Sliding-window attention (Mistral, Qwen2/Qwen3 with use_sliding_window, Gemma's and gpt-oss's
windowed layers): with `window` > 0 the query at position p sees keys p - window + 1 .. p only
(transformers' mask: key > query - window). Where every layer slides, blocks wholly before a
sequence's window are never read, so the KV manager may free them: their entries in a block table
are then -1 (kv/manager.py).

AttentionBackend is the swap point: TorchAttention is the reference path (any device);
CpuPagedAttention replaces its decode with kvserve's fused C kernel, which reads each context
straight out of its blocks; a GPU kernel backend only has to implement the same forward().
`default_backend()` picks the fastest one that runs here.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.kernels import paged_attention
from kvserve.model import kv_int8


@dataclass
class AttentionMetadata:
    """Where a packed step's tokens come from and where their K/V go."""

    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) of each new token
    query_lens: list[int]  # per sequence: tokens computed this step
    seq_lens: list[int]  # per sequence: context length after this step (cached + new)
    block_tables: list[list[int]]  # per sequence: block ids covering seq_len tokens
    block_size: int
    # Values a backend derives once per step and reuses in every layer (e.g. table tensors).
    scratch: dict[str, Any] = field(default_factory=dict)
    decode_only: bool = field(init=False)  # every sequence computes one token this step

    def __post_init__(self) -> None:
        self.decode_only = all(n == 1 for n in self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D], the step's k and v already stored
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,  # sliding window: keys per query (0: the whole context)
        kv_scale: torch.Tensor | None = None,  # an int8 pool's row scales [2, Hkv, num_blocks, block_size]
        softcap: float = 0.0,  # > 0: each scaled score soft-capped to softcap * tanh(score / softcap) (Gemma 2)
        sinks: torch.Tensor | None = None,  # [H] float32: each head's sink logit (gpt-oss: attend_with_sinks)
    ) -> torch.Tensor:  # [T, H, D]
        """Each new token attends to its sequence's context (itself included) in the pool."""


def first_key(pos: int, window: int) -> int:
    """The first key position a query at `pos` sees: 0, or pos - window + 1 under a window."""
    return max(0, pos - window + 1) if window else 0


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Write the new tokens' K/V ([T, Hkv, D]) into their slots of the pool (an int8 pool:
    quantized, each row's scale into kv_scale)."""
    _, hkv, nb, bs, d = kv_cache.shape
    flat = kv_cache.view(2, hkv, nb * bs, d)
    if kv_cache.dtype == torch.int8:
        if kv_scale is None:
            raise ValueError("an int8 KV pool needs its row scales (kv_scale)")
        flat_scale = kv_scale.view(2, hkv, nb * bs)
        for i, x in enumerate((k, v)):
            q, s = kv_int8.quantize(x.transpose(0, 1))  # [Hkv, T, D], [Hkv, T]
            flat[i].index_copy_(1, slots, q)
            flat_scale[i].index_copy_(1, slots, s)
        return
    flat[0].index_copy_(1, slots, k.transpose(0, 1).to(flat.dtype))
    flat[1].index_copy_(1, slots, v.transpose(0, 1).to(flat.dtype))


def _as_stored(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """x rounded to the pool's dtype and back: what attention over the pool would read."""
    if kv_cache.dtype == torch.int8:
        return kv_int8.round_trip(x)
    return x.to(kv_cache.dtype).to(x.dtype)


def _widened(kv: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows [..., D] (and, for int8, their scales [...]) in the activations' dtype."""
    return kv.to(dtype) if scale is None else kv_int8.dequantize(kv, scale, dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float) -> torch.Tensor:
    """q [1, H, n, D] over k, v [1, Hkv, L, D] (mask [n, L]; None: causal, n == L) -> [1, H, n, D]. Soft-capped
    scores (Gemma 2) are written out as transformers' eager attention computes them: sdpa has no cap."""
    if not softcap:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [1, H, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


class TorchAttention(AttentionBackend):
    """Reference backend in plain torch ops.

    Decode sequences (one new token) are gathered into one padded batch and attended with two
    batched matmuls; each prefill chunk gets its own causal scaled_dot_product_attention call.
    The gather copies the context out of the pool; CpuPagedAttention's kernel reads it in place.
    """

    def forward(self, q, k, v, kv_cache, meta, scale, window=0, kv_scale=None, softcap=0.0, sinks=None):
        if sinks is not None and not (meta.decode_only and self._decodes_sinks(q, kv_cache)):
            return attend_with_sinks(q, kv_cache, meta, scale, window, kv_scale, sinks)
        if meta.decode_only:  # a pure decode step: one batched call
            return self._decode(q, kv_cache, meta, range(meta.num_seqs), scale, window, kv_scale, softcap, sinks)
        out = torch.empty_like(q)
        decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        if decode:
            rows = torch.tensor([starts[i] for i in decode], dtype=torch.long)
            out[rows] = self._decode(q[rows], kv_cache, meta, decode, scale, window, kv_scale, softcap)
        for i, n in enumerate(meta.query_lens):
            if n > 1:
                s = starts[i]
                out[s : s + n] = self._prefill(q[s : s + n], k[s : s + n], v[s : s + n], kv_cache, meta, i, scale,
                                               window, kv_scale, softcap)
        return out

    def _decodes_sinks(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        """Whether _decode applies sinks (else attend_with_sinks takes every step that has them)."""
        return False

    def _prefill(self, q, k, v, kv_cache, meta, i, scale, window=0, kv_scale=None, softcap=0.0):
        n, L = meta.query_lens[i], meta.seq_lens[i]
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if n == L and not (window and L > window):  # the whole context, causal: its own K/V, no gather
            if kv_cache.dtype != q.dtype:  # as stored: the same values a later chunk reads from the pool
                k, v = _as_stored(k, kv_cache), _as_stored(v, kv_cache)
            k = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
            v = v.transpose(0, 1).unsqueeze(0)
            o = _attend(q, k, v, None, scale, softcap)
        else:
            _, hkv, _, bs, d = kv_cache.shape
            first = first_key(L - n, window) // bs  # the first block any query of the chunk sees
            blocks = meta.block_tables[i][first : -(-L // bs)]
            base = first * bs  # position of the gathered keys' first row
            kv = kv_cache[:, :, blocks].view(2, hkv, len(blocks) * bs, d)[:, :, : L - base]  # [2, Hkv, L', D]
            sc = None if kv_scale is None else kv_scale[:, :, blocks].view(2, hkv, len(blocks) * bs)[:, :, : L - base]
            kv = _widened(kv, sc, q.dtype)
            # Query j sits at position L - n + j and sees keys 0 (or, in a window, L - n + j - window + 1) .. L - n + j.
            qpos = torch.arange(L - n, L).unsqueeze(1)
            kpos = torch.arange(base, L).unsqueeze(0)
            mask = kpos <= qpos  # [n, L']
            if window:
                mask &= kpos > qpos - window
            o = _attend(q, kv[0].unsqueeze(0), kv[1].unsqueeze(0), mask, scale, softcap)
        return o.squeeze(0).transpose(0, 1)  # [n, H, D]

    def _gather(self, kv_cache, meta, seqs, firsts=None, kv_scale=None, dtype=None) -> torch.Tensor:
        """The sequences' contexts out of the pool (from block firsts[b] on, under a window),
        padded, in `dtype`: [2, Hkv, B, max_blocks * bs, D]."""
        _, hkv, _, bs, d = kv_cache.shape
        firsts = firsts or [0] * len(seqs)
        max_blocks = max(-(-meta.seq_lens[i] // bs) - f for i, f in zip(seqs, firsts))
        rows = []
        for i, f in zip(seqs, firsts):  # pad each table with its own first block: written, so finite
            blocks = meta.block_tables[i][f : f + max_blocks]
            rows.append(blocks + [blocks[0]] * (max_blocks - len(blocks)))
        table = torch.tensor(rows, dtype=torch.long).flatten()
        pool = kv_cache.view(2 * hkv, -1, bs * d)  # [2 Hkv, num_blocks, bs * D]
        kv = pool.index_select(1, table).view(2, hkv, len(seqs), max_blocks * bs, d)
        sc = None if kv_scale is None else \
            kv_scale.view(2 * hkv, -1, bs).index_select(1, table).view(2, hkv, len(seqs), max_blocks * bs)
        return _widened(kv, sc, dtype or kv.dtype)

    def _decode(self, q, kv_cache, meta, seqs, scale, window=0, kv_scale=None, softcap=0.0, sinks=None):
        assert sinks is None  # (forward sends them to attend_with_sinks)
        B = len(seqs)
        lens = [meta.seq_lens[i] for i in seqs]
        starts = firsts = None
        if window and max(lens) > window:  # each query's first key, and its block: gathered rows begin there
            starts = [first_key(n - 1, window) for n in lens]
            firsts = [s // kv_cache.shape[3] for s in starts]
        kv = self._gather(kv_cache, meta, seqs, firsts, kv_scale, q.dtype)  # [2, Hkv, B, L, D]
        hkv, L, d = kv.shape[1], kv.shape[3], kv.shape[4]
        # Grouped-query attention without repeating K/V: a KV head's G query heads are rows.
        qg = q.view(B, hkv, -1, d).transpose(0, 1)  # [Hkv, B, G, D]
        # K @ q^T keeps the large operand untransposed (several times faster than q @ K^T).
        scores = torch.matmul(kv[0], qg.transpose(-1, -2)).transpose(-1, -2).float() * scale  # [Hkv, B, G, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if starts:  # row j of sequence b is position firsts[b] * bs + j
            kpos = torch.arange(L).unsqueeze(0) + torch.tensor(firsts).unsqueeze(1) * kv_cache.shape[3]  # [B, L]
            outside = (kpos >= torch.tensor(lens).unsqueeze(1)) | (kpos < torch.tensor(starts).unsqueeze(1))
            scores.masked_fill_(outside[None, :, None, :], float("-inf"))
        elif min(lens) < L:
            pad = torch.arange(L).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)  # [B, L]
            scores.masked_fill_(pad[None, :, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        o = torch.matmul(probs, kv[1])  # [Hkv, B, G, D]
        return o.transpose(0, 1).reshape(B, -1, d)  # [B, H, D]


class CpuPagedAttention(TorchAttention):
    """TorchAttention with decode done by kvserve's fused paged kernel (kernels/paged_attention.c).

    The kernel walks each sequence's block table and attends in float32 straight from the pool:
    no gathered copy, no padding to the longest context, and each sequence's result does not
    depend on what else is in the batch. Shapes or dtypes it does not take fall back to torch. It
    applies attention sinks too (gpt-oss's decode steps, as the native decode step does).
    """

    def _decodes_sinks(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return paged_attention.supports(q, kv_cache)

    def _decode(self, q, kv_cache, meta, seqs, scale, window=0, kv_scale=None, softcap=0.0, sinks=None):
        # Everything but the kernel call is worked out once per step (the same in every layer).
        key = ("paged_decode", seqs if isinstance(seqs, range) else tuple(seqs))
        step = meta.scratch.get(key)
        if step is None:
            if paged_attention.supports(q, kv_cache):
                width = max(len(meta.block_tables[i]) for i in seqs)
                rows = [meta.block_tables[i] + [0] * (width - len(meta.block_tables[i])) for i in seqs]
                step = (
                    torch.tensor(rows, dtype=torch.int32),
                    torch.tensor([meta.seq_lens[i] for i in seqs], dtype=torch.int32),
                )
            else:
                step = False
            meta.scratch[key] = step
        if step is False:
            return super()._decode(q, kv_cache, meta, list(seqs), scale, window, kv_scale, softcap)
        tables, lens = step
        return paged_attention.paged_decode(q, kv_cache, tables, lens, scale, checked=True, window=window,
                                            kv_scale=kv_scale, softcap=softcap, sinks=sinks)


SINK_SCORES_BYTES = 64 << 20  # attend_with_sinks' scores per slice of queries


def attend_with_sinks(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, Hkv, num_blocks, block_size, D], the step's k and v already stored
    meta: AttentionMetadata,
    scale: float,
    window: int,  # keys per query (0: the whole context)
    kv_scale: torch.Tensor | None,  # an int8 pool's row scales [2, Hkv, num_blocks, block_size]
    sinks: torch.Tensor,  # [H]: each head's sink logit
) -> torch.Tensor:  # [T, H, D]
    """Each new token attends to its sequence's context in the pool, each head's softmax over its
    scores and its sink logit, the sink's share dropped (gpt-oss; "Efficient Streaming Language Models
    with Attention Sinks", Xiao et al. 2023). Prefill chunks and decode tokens alike read their keys
    out of the pool (as stored, so a prefix-cache hit changes nothing): the reference path."""
    out = torch.empty_like(q)
    _, hkv, _, bs, d = kv_cache.shape
    start = 0
    for i, (n, L) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        first = first_key(L - n, window) // bs  # the first block any query of the sequence sees
        blocks = meta.block_tables[i][first: -(-L // bs)]
        base = first * bs  # position of the gathered keys' first row
        kv = kv_cache[:, :, blocks].view(2, hkv, len(blocks) * bs, d)[:, :, : L - base]  # [2, Hkv, L', D]
        if kv_scale is None:
            kv = kv.to(q.dtype)
        else:
            sc = kv_scale[:, :, blocks].view(2, hkv, len(blocks) * bs)[:, :, : L - base]
            kv = kv_int8.dequantize(kv, sc, q.dtype)
        # Query j sits at position L - n + j and sees keys 0 (or, in a window, L - n + j - window + 1) .. L - n + j.
        qpos = torch.arange(L - n, L).unsqueeze(1)
        kpos = torch.arange(base, L).unsqueeze(0)
        mask = kpos <= qpos  # [n, L']
        if window:
            mask &= kpos > qpos - window
        # Queries in slices, so that a long prompt's scores stay within SINK_SCORES_BYTES (each temporary
        # [H, rows, L'] float32): the whole chunk at once was H x n x L' (64 x 2048 x 8192 x 4 B = 4 GiB).
        rows = max(1, SINK_SCORES_BYTES // (4 * q.shape[1] * kv.shape[2]))
        for j in range(0, n, rows):
            s, e = start + j, start + min(j + rows, n)
            out[s:e] = _attend_sinks(q[s:e], kv[0], kv[1], mask[j: j + rows], scale, sinks)
        start += n
    return out


def _attend_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                  sinks: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] over k, v [Hkv, L, D] under mask [n, L] -> [n, H, D], as transformers' eager
    gpt-oss attention: the sink appended to each row of scores, the row's max subtracted, softmax,
    the sink's column dropped."""
    n, H, _ = q.shape
    g = H // k.shape[0]
    k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)  # [H, L, D]
    scores = torch.matmul(q.transpose(0, 1), k.transpose(-1, -2)) * scale  # [H, n, L]
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.to(scores.dtype).view(H, 1, 1).expand(H, n, 1)], dim=-1)  # [H, n, L + 1]
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # [H, n, L]: the sink takes no value
    return torch.matmul(probs.to(v.dtype), v).transpose(0, 1)  # [n, H, D]


def default_backend(device: torch.device | str = "cpu") -> AttentionBackend:
    """The fused CPU kernel where it compiled and loads, else the torch reference."""
    if torch.device(device).type == "cpu" and paged_attention.available():
        return CpuPagedAttention()
    return TorchAttention()
