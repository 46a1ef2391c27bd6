"""The pool of KV blocks: reference counts, a free queue in eviction order, a prefix-hash map.

A block is in exactly one of three states:
  in use        ref_cnt > 0 (some sequence's block table holds it)
  cached, free  ref_cnt == 0, holds a hash: its K/V can be reused until it is evicted
  free          ref_cnt == 0, no hash
Blocks never used yet wait in `fresh`; every freed block (ref_cnt back to 0) sits in the free
queue. Freed blocks without a hash go to its head, with one to its tail (least recently used is
evicted first). Allocation takes, in order: a freed uncached block (the most recently freed, whose
memory is warm); the least recently used cached block while more than `cache_reserve` are
cached; a fresh block; any cached block. Memory the pool has never touched stays untouched, so
the process's resident memory follows what is used plus at most `cache_reserve` blocks of
prefix cache, not the traffic it has ever seen.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvserve.errors import OutOfBlocksError
from kvserve.kv.events import REMOVED, STORED, BlockEventLog


def hash_block(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained SHA-256: a block's key covers every token before it, not just its own."""
    h = hashlib.sha256(parent or b"kvserve-root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def prefix_block_hashes(token_ids: Sequence[int], block_size: int) -> Iterator[tuple[bytes, Sequence[int]]]:
    """(hash, tokens) of each full block a prompt may take from the cache, in order: the chain a
    prefix lookup walks. Never the block holding the last token, which is always computed (its
    logits choose the first output token). The one walk for the KV manager and the router."""
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        ids = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(parent, ids)
        yield parent, ids


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # kept with the hash so a hit is verified, not trusted
    from_disk: bool = False  # loaded by a prefix lookup and not yet counted as a hit


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, cache_reserve: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Cached blocks kept before fresh memory is touched: a quarter of the pool by default.
        self.cache_reserve = max(1, num_blocks // 4) if cache_reserve is None else cache_reserve
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._fresh: deque[int] = deque(range(num_blocks))
        self._free: OrderedDict[int, None] = OrderedDict()
        self._num_cached_free = 0
        self._cached: dict[bytes, KVBlock] = {}
        self.events = BlockEventLog()  # what a router follows to know which prefixes are here
        # Called with a cached block about to be reused, while its K/V are still valid (the disk tier).
        self.on_evict: Callable[[KVBlock], None] | None = None

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take now (free ones and evictable cached ones)."""
        return len(self._free) + len(self._fresh)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever used: the pool's share of resident memory."""
        return self.num_blocks - len(self._fresh)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def check_invariant(self) -> None:
        """free + cached-unreferenced + in use == total, and the queue holds exactly ref 0."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        cached_free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is not None)
        free = sum(1 for b in self.blocks if b.ref_cnt == 0 and b.block_hash is None)
        assert free + cached_free + in_use == self.num_blocks
        assert all(b.ref_cnt >= 0 for b in self.blocks)
        assert set(self._free) | set(self._fresh) == {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert not set(self._free) & set(self._fresh)
        assert self._num_cached_free == cached_free
        assert all(self._cached[b.block_hash] is b for b in self.blocks if b.block_hash is not None)
        assert len(self._cached) == sum(1 for b in self.blocks if b.block_hash is not None)

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise OutOfBlocksError(f"need {n} KV blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self._take()
            if block.block_hash is not None:
                self._num_cached_free -= 1
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _take(self) -> KVBlock:
        if self._free:
            head = self.blocks[next(iter(self._free))]
            if head.block_hash is None or self._num_cached_free > self.cache_reserve or not self._fresh:
                return self.blocks[self._free.popitem(last=False)[0]]
        return self.blocks[self._fresh.popleft()]

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take another reference (a prefix hit or a shared block); revives cached free blocks."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
                self._num_cached_free -= b.block_hash is not None
            b.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each. Pass a table tail-first: its tail is evicted first."""
        for b in blocks:
            assert b.ref_cnt > 0, f"block {b.block_id} freed twice"
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self._free[b.block_id] = None
                if b.block_hash is None:
                    self._free.move_to_end(b.block_id, last=False)
                else:
                    self._num_cached_free += 1

    # -- prefix cache ---------------------------------------------------------------------
    def lookup(self, block_hash: bytes, token_ids: Sequence[int]) -> KVBlock | None:
        b = self._cached.get(block_hash)
        if b is None or b.token_ids != tuple(token_ids):
            return None
        return b

    def cache(self, block: KVBlock, block_hash: bytes, token_ids: Sequence[int], parent: bytes | None = None) -> None:
        """Publish a full, computed block under its hash (a duplicate stays unpublished); `parent`
        is the previous block's hash in its chain, for the event log."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block
        self.events.record(STORED, block_hash, parent, block.token_ids)

    def _evict(self, block: KVBlock, offload: bool = True) -> None:
        if block.block_hash is not None:
            if offload and self.on_evict is not None:
                self.on_evict(block)
            del self._cached[block.block_hash]
            self.events.record(REMOVED, block.block_hash)
            block.block_hash = block.token_ids = None
            block.from_disk = False

    def cached_free_blocks(self) -> list[KVBlock]:
        """Cached blocks no sequence holds, least recently used first."""
        return [self.blocks[i] for i in self._free if self.blocks[i].block_hash is not None]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence holds (the disk tier is not told)."""
        for i in self._free:
            self._evict(self.blocks[i], offload=False)
        self._num_cached_free = 0
