"""Per-sequence block tables over the BlockPool: prefix hits, allocation, caching, freeing.

Speaks in check/act pairs for the scheduler: find_prefix() then allocate() (which refuses,
allocating nothing, when the pool cannot cover the step); cache_computed() after a step
publishes blocks that became full; free() returns a sequence's blocks tail-first.

Under sliding-window attention (`sliding_window`), slide() frees a sequence's blocks that fell
wholly out of its window as it advances: their table entries become holes (None; -1 in
block_ids), so token i still maps to table[i // block_size]. A slid-out block was published
before it is freed (it is full and computed), and freeing keeps its hash: its K/V stay valid
until the pool hands the block out again, which drops the hash (BlockPool._evict). So a later
prefix hit on it reads what it stored, and a prefix lookup, which walks the chain from block 0,
stops at the first block already reused.

With a disk tier (kv/disk_tier.py), a cached block the pool reuses is saved to disk first, and a
lookup that misses in RAM continues the chain on disk: those blocks are read into newly allocated
pool blocks and published, so they are hits like any other (counted per tier).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, takewhile
from typing import TYPE_CHECKING

from kvserve.kv.block_pool import BlockPool, KVBlock, hash_block, prefix_block_hashes

if TYPE_CHECKING:
    from kvserve.kv.disk_tier import DiskTier


def peak_blocks(sliding_window: int | None, block_size: int, step_tokens: int) -> int | None:
    """The most blocks a sequence holds at once under a sliding window, whatever its length: a
    step's tokens and the window - 1 before them, unaligned (one block more). None: no window."""
    if not sliding_window:
        return None
    return -(-(sliding_window - 1 + step_tokens) // block_size) + 1


@dataclass
class PrefixStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache (either tier)
    disk_hits: int = 0  # of which read from the disk tier


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int | None = None,
                 step_tokens: int = 512, disk: DiskTier | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window  # keys each query sees; None: the whole context
        self.step_tokens = step_tokens  # the most tokens a sequence computes in one step
        self.tables: dict[str, list[KVBlock | None]] = {}  # None: a block slid out of the window
        self._hashes: dict[str, list[bytes]] = {}  # chained hashes of each table's full blocks
        self.prefix_stats = PrefixStats()
        self.disk = disk
        if disk is not None:
            pool.on_evict = lambda b: disk.save(b.block_id, b.block_hash, b.token_ids)  # type: ignore[arg-type]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_held_at_most(self, num_tokens: int) -> int:
        """The most blocks a sequence of num_tokens tokens holds at once: all of them, or under a
        sliding window those of its window and a step (slide() frees the rest as it goes)."""
        peak = peak_blocks(self.sliding_window, self.block_size, self.step_tokens)
        return self.blocks_needed(num_tokens) if peak is None else min(peak, self.blocks_needed(num_tokens))

    def block_ids(self, seq_id: str) -> list[int]:
        """The table as block ids; -1 where a block slid out of the window (never read again)."""
        return [-1 if b is None else b.block_id for b in self.tables.get(seq_id, ())]

    def num_held_blocks(self, seq_id: str) -> int:
        """Blocks the sequence holds now (slid-out ones excluded)."""
        return sum(1 for b in self.tables.get(seq_id, ()) if b is not None)

    def find_prefix(self, token_ids: Sequence[int]) -> list[KVBlock]:
        """The longest run of cached full blocks that starts the sequence.

        At most len - 1 tokens are taken from the cache: the last prompt token is always
        computed, since its logits choose the first output token.
        """
        hits: list[KVBlock] = []
        if not self.pool.enable_caching:
            return hits
        walk = prefix_block_hashes(token_ids, self.block_size)
        for h, ids in walk:
            block = self.pool.lookup(h, ids)
            if block is None:
                if self.disk is not None:
                    hits += self._load_from_disk(hits, chain([(h, ids)], walk))
                break
            hits.append(block)
        return hits

    def _load_from_disk(self, hits: list[KVBlock], rest: Iterable[tuple[bytes, Sequence[int]]]) -> list[KVBlock]:
        """The chain's next blocks from disk, read into new pool blocks and published (ref 0, as
        any cached block a lookup returns). Stops at a block RAM holds after all."""
        assert self.disk is not None
        self.pool.touch(hits)  # held meanwhile: the allocation below must not reuse them
        try:
            room = self.pool.num_free_blocks - 1  # one left for the block of the last prompt token
            run = self.disk.read_run(takewhile(lambda item: self.pool.lookup(*item) is None, rest), room)
            if not run:
                return []
            blocks = self.pool.allocate(len(run))
            self.disk.copy_in([b.block_id for b in blocks], [payload for _, _, payload in run])
            parent = hits[-1].block_hash if hits else None
            for b, (h, ids, _) in zip(blocks, run):
                self.pool.cache(b, h, ids, parent)
                b.from_disk = True
                parent = h
            self.pool.free(reversed(blocks))
            return blocks
        finally:
            self.pool.free(reversed(hits))

    def record_prefix_query(self, num_tokens: int, hits: Sequence[KVBlock]) -> None:
        """Counted once per admission (a refused admission looks up again later): a block loaded
        from disk counts as a disk hit the first time a lookup's result is taken."""
        stats = self.prefix_stats
        stats.queries += num_tokens
        stats.hits += len(hits) * self.block_size
        from_disk = sum(1 for b in hits if b.from_disk)
        for b in hits:
            b.from_disk = False
        stats.disk_hits += from_disk * self.block_size
        if self.disk is not None:
            self.disk.hit_blocks += from_disk
            self.disk.hit_tokens += from_disk * self.block_size

    def offload_cached(self) -> int:
        """Save every cached block no sequence holds to the disk tier and drop it from RAM, waiting
        for the writes (a restart or test hook). Returns how many blocks were saved or on disk."""
        blocks = self.pool.cached_free_blocks()
        if self.disk is not None:
            for b in blocks:
                self.disk.save(b.block_id, b.block_hash, b.token_ids, wait=True)  # type: ignore[arg-type]
            self.disk.flush()
        self.pool.reset_prefix_cache()
        return len(blocks) if self.disk is not None else 0

    def _behind_window(self, num_computed: int, num_blocks: int) -> int:
        """How many of the first num_blocks blocks no query from num_computed on can see."""
        if not self.sliding_window:
            return 0
        return min(num_blocks, max(0, num_computed - self.sliding_window + 1) // self.block_size)

    def can_allocate(self, seq_id: str, num_tokens: int, prefix: Sequence[KVBlock] = ()) -> bool:
        held = len(self.tables.get(seq_id, ()))
        skip = self._behind_window(len(prefix) * self.block_size, len(prefix))  # hits not taken: holes
        revived = sum(1 for b in prefix[skip:] if b.ref_cnt == 0)  # leave the free queue when taken
        need = self.blocks_needed(num_tokens) - held - len(prefix)
        return need <= self.pool.num_free_blocks - revived

    def allocate(self, seq_id: str, num_tokens: int, prefix: Sequence[KVBlock] = ()) -> bool:
        """Grow seq_id's table to cover num_tokens tokens, starting with the prefix blocks if
        new (under a sliding window, those already behind it are holes: never read, not taken).
        Returns False and changes nothing if the pool cannot cover it."""
        if not self.can_allocate(seq_id, num_tokens, prefix):
            return False
        table = self.tables.setdefault(seq_id, [])
        if prefix:
            assert not table, "a prefix can only start a new table"
            skip = self._behind_window(len(prefix) * self.block_size, len(prefix))
            self.pool.touch(prefix[skip:])
            table.extend([None] * skip + list(prefix[skip:]))
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
            if (block := table[i]) is not None:
                self.pool.cache(block, h, ids, parent)

    def slide(self, seq_id: str, num_computed: int) -> int:
        """Under a sliding window, free seq_id's blocks that no later query can see: the next
        query sits at num_computed and sees keys from num_computed - window + 1 on. Call it after
        cache_computed (so the blocks are published first). Returns how many blocks it freed."""
        if not self.sliding_window:
            return 0
        table = self.tables.get(seq_id)
        if not table:
            return 0
        gone = self._behind_window(num_computed, len(table))
        freed = [b for b in table[:gone] if b is not None]
        if freed:
            table[:gone] = [None] * gone
            self.pool.free(reversed(freed))  # tail-first, as free() does: the chain's start is evicted last
        return len(freed)

    def trim(self, seq_id: str, num_tokens: int) -> int:
        """Give back seq_id's blocks past those num_tokens tokens need (the slots of rejected draft
        tokens), tail-first. None of them is published: cache_computed() only publishes blocks
        whose tokens are all computed and verified. Returns how many blocks it freed."""
        table = self.tables.get(seq_id)
        keep = self.blocks_needed(num_tokens)
        if not table or len(table) <= keep:
            return 0
        gone = table[keep:]
        del table[keep:]
        assert all(b is None or b.block_hash is None for b in gone), "a trimmed block was published"
        self.pool.free(b for b in reversed(gone) if b is not None)
        return len(gone)

    def free(self, seq_id: str) -> None:
        table = self.tables.pop(seq_id, [])
        self._hashes.pop(seq_id, None)
        self.pool.free(b for b in reversed(table) if b is not None)
