"""ModelRunner: packs a step's sequence chunks into one flat batch and runs the model.

Prefill chunks and single decode tokens travel together, without padding; each chunk brings
its block table. Logits are computed only for chunks that end at their sequence's last known
token (those are the ones that sample).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.model.llama import LlamaModel


@dataclass
class SeqChunk:
    token_ids: list[int]  # tokens to compute this step
    start_pos: int  # position of token_ids[0] (the sequence's num_computed_tokens)
    block_ids: list[int]  # the sequence's block table, covering start_pos + len(token_ids)
    need_logits: bool  # True when this chunk's last token is the sequence's newest


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        # The pool comes from torch.empty: a block's memory may hold NaN until first written,
        # and masked attention over padding still multiplies it (0 * NaN = NaN). Zero each
        # block the first time it is written; later its stale contents are finite, and masked.
        self._never_written = bytearray(b"\x01") * kv_caches[0].shape[2]

    @torch.inference_mode()
    def run(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """Logits [number of chunks with need_logits, V] float32, in chunk order."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        fresh: list[int] = []  # blocks written for the first time this step
        for c in chunks:
            n = len(c.token_ids)
            ids.extend(c.token_ids)
            for p in range(c.start_pos, c.start_pos + n):
                positions.append(p)
                slots.append(c.block_ids[p // bs] * bs + p % bs)
            if c.need_logits:
                last_rows.append(len(ids) - 1)
            for b in c.block_ids[c.start_pos // bs : (c.start_pos + n - 1) // bs + 1]:
                if self._never_written[b]:
                    self._never_written[b] = 0
                    fresh.append(b)
        if fresh:
            idx = torch.tensor(fresh, dtype=torch.long)
            for kv in self.kv_caches:
                kv.index_fill_(2, idx, 0)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            query_lens=[len(c.token_ids) for c in chunks],
            seq_lens=[c.start_pos + len(c.token_ids) for c in chunks],
            block_tables=[c.block_ids for c in chunks],
            block_size=bs,
        )
        hidden = self.model.forward(
            torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), self.kv_caches, meta
        )
        return self.model.logits(hidden[torch.tensor(last_rows, dtype=torch.long)])
