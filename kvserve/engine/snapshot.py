"""A picture of the engine as JSON-able data: the KV block pool, the queues, recent steps.

engine_state() reads the engine's insides, so it must run on the engine's own thread, between
steps (AsyncEngine.state() arranges that); what it returns is a copy any thread may use. Its
cost is bounded: the block map has at most MAX_CELLS cells (a cell stands for several blocks in
a larger pool) and at most MAX_REQUESTS requests are listed.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.engine.engine import LLMEngine
    from kvserve.engine.request import Sequence
    from kvserve.kv.disk_tier import DiskStats

MAX_CELLS = 8192
MAX_REQUESTS = 64
FREE, CACHED = 0, 1  # map codes; code k >= 2 is requests[k - 2]


def _seq_row(seq: Sequence, state: str, blocks: int) -> dict[str, Any]:
    return {"id": seq.request.request_id, "index": seq.index, "state": state,
            "prompt_tokens": seq.num_prompt_tokens, "output_tokens": seq.num_output_tokens,
            "computed_tokens": seq.num_computed_tokens, "cached_tokens": seq.num_cached_tokens,
            "preemptions": seq.num_preemptions, "blocks": blocks}


def _disk(d: DiskStats | None) -> dict[str, Any] | None:
    """The KV disk tier beside the pool (None: no tier)."""
    if d is None:
        return None
    return {"blocks": d.blocks, "bytes_used": d.bytes_used, "capacity_bytes": d.capacity_bytes,
            "blocks_written": d.blocks_written, "writes_dropped": d.writes_dropped, "hit_blocks": d.hit_blocks,
            "hit_tokens": d.hit_tokens, "load_errors": d.load_errors}


def engine_state(engine: LLMEngine) -> dict[str, Any]:
    manager, scheduler = engine.manager, engine.scheduler
    pool = manager.pool
    requests: list[dict[str, Any]] = []
    code_of: dict[str, int] = {}  # request id → map code
    for state, seqs in (("running", scheduler.running), ("waiting", scheduler.waiting)):
        for seq in seqs:
            rid = seq.request.request_id
            blocks = manager.num_held_blocks(seq.seq_id)
            if len(requests) < MAX_REQUESTS:
                requests.append(_seq_row(seq, state, blocks))
            if rid not in code_of and len(code_of) < MAX_REQUESTS:
                code_of[rid] = len(code_of) + 2
    # Only the requests that own a code are named in the map; their ids lead the list.
    owners = [FREE] * pool.num_blocks
    for b in pool.blocks:
        if b.ref_cnt == 0 and b.block_hash is not None:
            owners[b.block_id] = CACHED
    for seq_id, table in manager.tables.items():
        code = code_of.get(seq_id.rsplit("#", 1)[0], 2 + MAX_REQUESTS)  # beyond the list: "other"
        for block in table:
            if block is not None and owners[block.block_id] < 2:  # a shared prefix block shows its first holder
                owners[block.block_id] = code
    cell = -(-pool.num_blocks // MAX_CELLS)
    cells = owners if cell == 1 else [max(owners[i : i + cell]) for i in range(0, pool.num_blocks, cell)]
    stats = engine.stats()
    return {
        "time": time.monotonic(),
        "pool": {
            "num_blocks": pool.num_blocks, "block_size": manager.block_size, "blocks_per_cell": cell,
            "used": pool.num_used_blocks, "cached": pool.num_cached_free_blocks,
            "free": pool.num_free_blocks - pool.num_cached_free_blocks,
            "map": cells, "owners": sorted(code_of, key=code_of.__getitem__),
        },
        "requests": requests,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "disk": _disk(stats.disk),
        "prefix_cache": {"queries": stats.prefix_cache_queries, "hits": stats.prefix_cache_hits,
                         "hits_by_tier": {"ram": stats.prefix_cache_hits - stats.prefix_cache_disk_hits,
                                          "disk": stats.prefix_cache_disk_hits},
                         "hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0},
        "totals": {"prompt_tokens": stats.prompt_tokens, "generation_tokens": stats.generation_tokens,
                   "preemptions": stats.num_preemptions},
        "speculative": {"enabled": engine.speculator is not None, "drafted_tokens": stats.spec_draft_tokens,
                        "accepted_tokens": stats.spec_accepted_tokens,
                        "acceptance_rate": stats.spec_acceptance_rate},
        **engine.timeline.activity(),
    }
