"""Paged attention: store each new token's K/V into its block slot, attend through block tables.

The KV pool of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; a
sequence owns a list of block ids (its block table) and token i of it lives in block
table[i // block_size] at offset i % block_size. A step's tokens from many sequences are packed
into one flat batch; AttentionMetadata says which tokens belong to which sequence.

AttentionBackend is the swap point: TorchAttention is the reference path (any device, used on
the CPU); a GPU kernel backend only has to implement the same forward().
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where a packed step's tokens come from and where their K/V go."""

    slot_mapping: torch.Tensor  # [T] long: flat slot (block * block_size + offset) of each new token
    query_lens: list[int]  # per sequence: tokens computed this step
    seq_lens: list[int]  # per sequence: context length after this step (cached + new)
    block_tables: list[list[int]]  # per sequence: block ids covering seq_len tokens
    block_size: int

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
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        ...


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write the new tokens' K/V into their slots of the pool."""
    _, nb, bs, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, nb * bs, hkv, d)
    flat[0].index_copy_(0, slots, k.to(flat.dtype))
    flat[1].index_copy_(0, slots, v.to(flat.dtype))


class TorchAttention(AttentionBackend):
    """Reference backend on torch's scaled_dot_product_attention.

    Single-token (decode) sequences are gathered into one padded batch and attended in one call;
    each multi-token (prefill chunk) sequence gets its own causal call. The gather copies the
    context out of the pool, which a fused paged kernel would avoid.
    """

    def forward(self, q, k, v, kv_cache, meta, scale):
        store_kv(k, v, kv_cache, meta.slot_mapping)
        if all(n == 1 for n in meta.query_lens):  # a pure decode step: one batched call
            return self._decode(q, kv_cache, meta, list(range(meta.num_seqs)), scale)
        out = torch.empty_like(q)
        decode = [i for i, n in enumerate(meta.query_lens) if n == 1]
        starts = [0]
        for n in meta.query_lens:
            starts.append(starts[-1] + n)
        if decode:
            rows = torch.tensor([starts[i] for i in decode], dtype=torch.long)
            out[rows] = self._decode(q[rows], kv_cache, meta, decode, scale)
        for i, n in enumerate(meta.query_lens):
            if n > 1:
                s = starts[i]
                out[s : s + n] = self._prefill(q[s : s + n], kv_cache, meta, i, scale)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, blocks: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, bs, hkv, d = kv_cache.shape
        idx = torch.tensor(blocks, dtype=torch.long)
        kv = kv_cache[:, idx].reshape(2, len(blocks) * bs, hkv, d)[:, :length]  # [2, L, Hkv, D]
        return kv[0], kv[1]

    def _prefill(self, q, kv_cache, meta, i, scale):
        n, L = meta.query_lens[i], meta.seq_lens[i]
        k, v = self._gather(kv_cache, meta.block_tables[i], L)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        k = k.transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, L, D]
        v = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
        if n == L:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at position L - n + j and sees keys 0 .. L - n + j.
            qpos = torch.arange(L - n, L).unsqueeze(1)
            mask = torch.arange(L).unsqueeze(0) <= qpos  # [n, L]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)  # [n, H, D]

    def _decode(self, q, kv_cache, meta, seqs, scale):
        _, _, bs, hkv, d = kv_cache.shape
        B = len(seqs)
        lens = [meta.seq_lens[i] for i in seqs]
        max_blocks = (max(lens) + bs - 1) // bs
        rows = []
        for i in seqs:  # pad each table with its own first block: written, so finite
            blocks = meta.block_tables[i][: max_blocks]
            rows.append(blocks + [blocks[0]] * (max_blocks - len(blocks)))
        table = torch.tensor(rows, dtype=torch.long)
        L = max_blocks * bs
        kv = kv_cache[:, table].reshape(2, B, L, hkv, d)  # [2, B, L, Hkv, D]
        k = kv[0].permute(0, 2, 3, 1).float()  # [B, Hkv, D, L]
        v = kv[1].transpose(1, 2).float()  # [B, Hkv, L, D]
        # Grouped-query attention without repeating K/V: a KV head's G query heads are rows.
        qg = q.float().view(B, hkv, -1, d)  # [B, Hkv, G, D]
        scores = torch.matmul(qg, k) * scale  # [B, Hkv, G, L]
        pad = torch.arange(L).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)  # [B, L]
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))
        o = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, Hkv, G, D]
        return o.reshape(B, -1, d).to(q.dtype)  # [B, H, D]
