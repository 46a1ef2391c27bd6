"""Per-sequence block tables over the BlockPool: prefix hits, allocation, caching, freeing.

Speaks in check/act pairs for the scheduler: find_prefix() then allocate() (which refuses,
allocating nothing, when the pool cannot cover the step); cache_computed() after a step
publishes blocks that became full; free() returns a sequence's blocks tail-first.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.block_pool import BlockPool, KVBlock, hash_block, prefix_block_hashes


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # chained hashes of each table's full blocks
        self.prefix_stats = PrefixStats()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def find_prefix(self, token_ids: Sequence[int]) -> list[KVBlock]:
        """The longest run of cached full blocks that starts the sequence.

        At most len - 1 tokens are taken from the cache: the last prompt token is always
        computed, since its logits choose the first output token.
        """
        hits: list[KVBlock] = []
        if self.pool.enable_caching:
            for h, ids in prefix_block_hashes(token_ids, self.block_size):
                block = self.pool.lookup(h, ids)
                if block is None:
                    break
                hits.append(block)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission (a refused admission looks up again later)."""
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def can_allocate(self, seq_id: str, num_tokens: int, prefix: Sequence[KVBlock] = ()) -> bool:
        held = len(self.tables.get(seq_id, ()))
        revived = sum(1 for b in prefix if b.ref_cnt == 0)  # leave the free queue when taken
        need = self.blocks_needed(num_tokens) - held - len(prefix)
        return need <= self.pool.num_free_blocks - revived

    def allocate(self, seq_id: str, num_tokens: int, prefix: Sequence[KVBlock] = ()) -> bool:
        """Grow seq_id's table to cover num_tokens tokens, starting with the prefix blocks if
        new. Returns False and changes nothing if the pool cannot cover it."""
        if not self.can_allocate(seq_id, num_tokens, prefix):
            return False
        table = self.tables.setdefault(seq_id, [])
        if prefix:
            assert not table, "a prefix can only start a new table"
            self.pool.touch(prefix)
            table.extend(prefix)
        need = self.blocks_needed(num_tokens) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def cache_computed(self, seq_id: str, token_ids: Sequence[int], num_computed: int) -> None:
        """Publish the blocks of seq_id whose tokens are all computed."""
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        table = self.tables[seq_id]
        hashes = self._hashes.setdefault(seq_id, [])
        for i in range(len(hashes), min(num_computed // bs, len(table))):
            ids = token_ids[i * bs : (i + 1) * bs]
            parent = hashes[-1] if hashes else None
            h = hash_block(parent, ids)
            hashes.append(h)
            self.pool.cache(table[i], h, ids, parent)

    def free(self, seq_id: str) -> None:
        table = self.tables.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        self.pool.free(reversed(table))
