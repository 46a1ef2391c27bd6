"""Block pool and KV cache manager: exact block ids, ref counts, eviction order, invariants."""
from __future__ import annotations

import pytest

from kvserve.errors import OutOfBlocksError
from kvserve.kv.block_pool import BlockPool, hash_block
from kvserve.kv.manager import KVCacheManager

BS = 4


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_allocate_and_free_exact_ids_and_order() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert [x.block_id for x in a] == [0, 1] and [x.block_id for x in b] == [2, 3, 4]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 5
    with pytest.raises(OutOfBlocksError, match="need 2 KV blocks, 1 free"):
        pool.allocate(2)
    pool.free(reversed(b))  # uncached blocks go to the head: reused first, most recent first
    assert [x.block_id for x in pool.allocate(3)] == [2, 3, 4]
    pool.check_invariant()


def test_chained_hash_depends_on_parent() -> None:
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == h1 and len(h1) == 32


def test_prefix_hit_refcounts_and_lru_eviction() -> None:
    m = KVCacheManager(BlockPool(8), BS)
    prompt = ids(10)  # 2 full blocks + 2 tokens
    assert m.find_prefix(prompt) == []
    assert m.allocate("a", 10)
    m.cache_computed("a", prompt, 10)
    assert m.block_ids("a") == [0, 1, 2]
    # b shares the first 8 tokens: both full blocks hit, ref counts go to 2
    hit = m.find_prefix(prompt[:8] + [99, 98, 97])
    assert [b.block_id for b in hit] == [0, 1]
    assert m.allocate("b", 11, hit)
    assert m.block_ids("b") == [0, 1, 3]
    assert [m.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    m.free("a")
    m.free("b")
    pool = m.pool
    pool.check_invariant()
    assert pool.num_used_blocks == 0 and pool.num_cached_free_blocks == 2
    # The cached blocks stay reusable...
    assert [b.block_id for b in m.find_prefix(prompt)] == [0, 1]
    # ...until allocation runs through the uncached ones and evicts cached ones, LRU first.
    taken = pool.allocate(7)
    assert [b.block_id for b in taken][:6] == [3, 2, 4, 5, 6, 7]
    assert taken[6].block_id == 1  # freed tail-first: block 1 was released before block 0
    assert m.find_prefix(prompt) == [pool.blocks[0]]  # block 0 still cached
    pool.check_invariant()


def test_hit_is_verified_not_trusted() -> None:
    pool = BlockPool(2)
    [blk] = pool.allocate(1)
    pool.cache(blk, b"x" * 32, [1, 2, 3, 4])
    assert pool.lookup(b"x" * 32, [1, 2, 3, 5]) is None
    assert pool.lookup(b"x" * 32, [1, 2, 3, 4]) is blk


def test_last_prompt_token_is_always_computed() -> None:
    m = KVCacheManager(BlockPool(4), BS)
    m.allocate("a", 8)
    m.cache_computed("a", ids(8), 8)
    assert len(m.find_prefix(ids(8))) == 1  # 8 tokens: at most 7 from cache -> 1 block
    assert len(m.find_prefix(ids(9))) == 2


def test_refused_allocation_changes_nothing() -> None:
    m = KVCacheManager(BlockPool(3), BS)
    assert m.allocate("a", 8)
    assert not m.allocate("b", 8)
    assert "b" not in m.tables and m.pool.num_free_blocks == 1
    assert not m.allocate("a", 13)
    assert m.block_ids("a") == [0, 1]
    m.free("a")
    m.free("b")  # unknown: harmless
    assert m.pool.num_free_blocks == 3
    m.pool.check_invariant()


def test_revived_cached_blocks_count_against_free() -> None:
    m = KVCacheManager(BlockPool(3), BS)
    m.allocate("a", 8)
    m.cache_computed("a", ids(8), 8)
    m.free("a")
    hit = m.find_prefix(ids(9))
    assert len(hit) == 2 and m.pool.num_free_blocks == 3
    # 9 tokens = 3 blocks: 2 revived from the cache + 1 new == all 3
    assert m.can_allocate("b", 9, hit)
    assert not m.can_allocate("b", 13, hit)
    assert m.allocate("b", 9, hit)
    assert m.pool.num_free_blocks == 0
    m.pool.check_invariant()


def test_memory_touched_follows_usage_not_traffic() -> None:
    """Many short requests, each with its own (cached) prompt: the pool reuses freed blocks and
    keeps at most cache_reserve cached ones before touching fresh memory."""
    pool = BlockPool(400, cache_reserve=10)
    for i in range(1000):
        blocks = pool.allocate(3)
        parent = None
        for j, b in enumerate(blocks):
            parent = hash_block(parent, [i, j])
            pool.cache(b, parent, [i, j])
        pool.free(reversed(blocks))
    pool.check_invariant()
    assert pool.num_touched_blocks <= 3 + 10 + 3
    assert pool.num_cached_free_blocks <= 10 + 3


def test_cached_blocks_are_kept_while_under_the_reserve() -> None:
    pool = BlockPool(8, cache_reserve=2)
    a = pool.allocate(2)
    for k, b in enumerate(a):
        pool.cache(b, hash_block(None, [k]), [k])
    pool.free(reversed(a))
    # Two cached blocks, reserve 2: fresh memory is taken before any cached K/V is lost.
    assert [b.block_id for b in pool.allocate(3)] == [2, 3, 4]
    assert pool.num_cached_free_blocks == 2
    pool.check_invariant()


def test_kv_cache_dtype_auto_halves_quantized_models_and_keeps_float_ones_exact() -> None:
    import torch

    from kvserve.kv.sizing import auto_kv_dtype
    from kvserve.llm import parse_dtype

    assert auto_kv_dtype(torch.float32, quantized=True) == torch.float16
    assert auto_kv_dtype(torch.float32, quantized=False) == torch.float32  # exact vs transformers
    assert auto_kv_dtype(torch.bfloat16, quantized=True) == torch.bfloat16  # already 16-bit
    assert parse_dtype("float32", "KV cache dtype") == torch.float32  # a named one is taken as named
    assert parse_dtype("bf16", "KV cache dtype") == torch.bfloat16
    with pytest.raises(ValueError, match="^KV cache dtype must be one of auto, float32, fp32, bfloat16, bf16, "
                                         "float16, fp16, got 'int8'$"):
        parse_dtype("int8", "KV cache dtype")


def test_a_named_kv_cache_dtype_is_the_pools_and_a_bad_one_is_refused(tiny_llama_dir) -> None:
    import torch

    from kvserve.config import CacheConfig
    from kvserve.llm import LLM

    llm = LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=4, dtype="bfloat16"))
    assert llm.kv_dtype == torch.bfloat16 and llm.runner.kv_caches[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="^KV cache dtype must be one of auto, .*, fp16, int8, got 'fp8'$"):
        LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=4, dtype="fp8"))


def test_sliding_window_frees_blocks_wholly_before_the_window() -> None:
    """Window 6, blocks of 4: after n computed tokens the next query (position n) sees n - 5 .. n,
    so blocks whose last token is before n - 5 go back to the pool, published first."""
    m = KVCacheManager(BlockPool(8, cache_reserve=8), BS, sliding_window=6)
    prompt = ids(14)
    assert m.allocate("a", 14)
    assert m.block_ids("a") == [0, 1, 2, 3]
    m.cache_computed("a", prompt, 14)
    assert m.slide("a", 14) == 2  # keys from 9 on: blocks 0 (0-3) and 1 (4-7) are out, block 2 (8-11) in
    assert m.block_ids("a") == [-1, -1, 2, 3] and m.num_held_blocks("a") == 2
    assert m.pool.num_used_blocks == 2 and m.pool.num_cached_free_blocks == 2  # 0 and 1: free, still published
    assert m.slide("a", 14) == 0  # nothing more until the window moves past block 2
    for n in (15, 16, 17):  # decoding: position 16 needs block 4; the window leaves block 2 at n = 17
        assert m.allocate("a", n + 1)
        m.cache_computed("a", prompt + ids(4, 100), n)
        assert m.slide("a", n) == (n == 17)
    assert m.block_ids("a") == [-1, -1, -1, 3, 4] and m.pool.num_used_blocks == 2
    # A table with holes grows by what it lacks (the holes count as covered) and frees what it holds.
    assert m.can_allocate("a", 24) and not m.can_allocate("a", 48)
    m.pool.check_invariant()
    m.free("a")
    assert m.pool.num_used_blocks == 0 and m.pool.num_cached_free_blocks == 4  # blocks 0-3: full, published
    m.pool.check_invariant()


def test_a_prefix_hit_on_slid_out_blocks_is_valid_until_they_are_reused() -> None:
    """Slid-out blocks keep their hash while free: a new sequence with the same prompt hits them.
    Once one is handed out again its hash is gone and the chain stops there."""
    m = KVCacheManager(BlockPool(6, cache_reserve=0), BS, sliding_window=4)
    prompt = ids(17)
    m.allocate("a", 17)
    m.cache_computed("a", prompt, 17)
    assert m.slide("a", 17) == 3  # keys from 14 on: blocks 0-2 out
    assert [b.block_id for b in m.find_prefix(prompt)] == [0, 1, 2, 3]  # 3 is in use, 0-2 free but valid
    # The free queue holds 2, 1, 0 (freed tail-first: a chain's start is evicted last), and with
    # cache_reserve 0 cached blocks go before fresh ones: another sequence takes 2, then 1.
    m.allocate("b", 8)
    assert m.block_ids("b") == [2, 1]
    assert [b.block_id for b in m.find_prefix(prompt)] == [0]  # block 1 was reused: the walk stops
    m.pool.check_invariant()
    m.free("a")
    m.free("b")
    m.pool.check_invariant()
    assert m.pool.num_used_blocks == 0


def test_no_window_slides_nothing() -> None:
    m = KVCacheManager(BlockPool(8), BS)
    m.allocate("a", 30)
    m.cache_computed("a", ids(30), 30)
    assert m.slide("a", 30) == 0 and m.block_ids("a") == list(range(8))


def test_a_prefix_hit_behind_the_window_leaves_those_blocks_in_the_pool() -> None:
    """A new sequence whose prefix hit reaches past its window takes only the blocks its first
    computed token can see; the ones behind are holes, and stay cached and free."""
    m = KVCacheManager(BlockPool(8, cache_reserve=8), BS, sliding_window=6)
    prompt = ids(25)
    m.allocate("a", 25)
    m.cache_computed("a", prompt, 25)
    m.free("a")
    assert m.pool.num_cached_free_blocks == 6
    hit = m.find_prefix(prompt)
    assert [b.block_id for b in hit] == [0, 1, 2, 3, 4, 5]  # 24 tokens; position 24 sees 19 .. 24
    # only blocks 4 (tokens 16-19) and 5 are taken, and one new
    assert m.can_allocate("b", 25, hit)
    assert m.allocate("b", 25, hit)
    assert m.block_ids("b") == [-1, -1, -1, -1, 4, 5, 6]
    assert [m.pool.blocks[i].ref_cnt for i in range(7)] == [0, 0, 0, 0, 1, 1, 1]
    assert m.pool.num_used_blocks == 3 and m.pool.num_cached_free_blocks == 4
    m.cache_computed("b", prompt, 25)  # the hash chain runs through the holes
    assert m.slide("b", 25) == 1 and m.block_ids("b")[4] == -1  # position 25 sees 20 .. 25: block 4 goes
    m.free("b")
    assert [b.block_id for b in m.find_prefix(prompt)] == [0, 1, 2, 3, 4, 5]
    m.pool.check_invariant()


def test_blocks_held_at_most_under_a_window() -> None:
    m = KVCacheManager(BlockPool(8), BS, sliding_window=6, step_tokens=8)
    # a step of 8 tokens and the 5 before it: 13 tokens over at most 5 blocks of 4
    assert [m.blocks_held_at_most(n) for n in (1, 12, 17, 20, 10_000)] == [1, 3, 5, 5, 5]
    assert KVCacheManager(BlockPool(8), BS).blocks_held_at_most(10_000) == 2500
