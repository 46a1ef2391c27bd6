"""vLLM's KV cache events on the wire: msgpack `KVEventBatch`es of `BlockStored`, `BlockRemoved`
and `AllBlocksCleared`, so a consumer built for vLLM (llm-d's KV cache indexer, a vLLM
subscriber) reads kvserve's events unchanged.

vLLM encodes these with msgspec, `array_like=True` and `tag=True`: a batch is the array
`[ts, events, data_parallel_rank]` and each event the array `[tag, field, ...]` (the tag is the
class name), fields in declaration order. The same library and settings here give the same
bytes. `BlockStored` carries vLLM's seven fields (block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name): vLLM's newer decoders require all seven (msgspec skips
trailing elements a struct does not declare, so a five-field decoder would read them too), and
llm-d reads them by position. Fields vLLM added later
with defaults (extra_keys, group_idx, ...) are left out, which its decoders allow.

Hashes are kvserve's own: the whole 32-byte chained SHA-256 as msgpack bytes. vLLM's decoders
since `ExternalBlockHash` (bytes | int) accept it, as vLLM itself sends with
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; llm-d folds bytes to their low 64 bits, as it does vLLM's.
(vLLM's decoders from before ExternalBlockHash take ints only, and so not these.)
`medium` is "CPU": kvserve's KV cache lives in main memory. No LoRA: lora_id and lora_name are nil.

Two forms of the same events (`kvserve serve --kv-events-format`): `array`, the positional form
above, which llm-d reads; and `map`, vLLM's newer encoding, which vllm-router's kv_aware policy
reads: the batch stays the array `[ts, events, data_parallel_rank]`, but each event is a map,
`{"type": "BlockStored", "block_hashes": ..., ...}` (msgspec `tag=True` without `array_like`:
the tag first under "type", then the fields in declaration order; the seven required ones even
when nil). Both decode here (`decode`), so kvserve's router follows a replica in either form.
"""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Literal

import msgspec

from kvserve.kv.events import STORED, BlockEvent

MEDIUM = "CPU"
MAX_BLOCKS_PER_BATCH = 1024  # a batch's messages stay well under a megabyte
FORMATS = ("array", "map")
Format = Literal["array", "map"]


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """One KV cache event; the subclass's name is its tag on the wire."""


class BlockStored(_Event):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]  # every block's tokens, in order: len == len(block_hashes) * block_size
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when published
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


# The map form's structs: the array form's tags (class names), fields and defaults, as maps.
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[bytes]
    medium: str | None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _MapBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_MapBlockStored | _MapBlockRemoved | _MapAllBlocksCleared]
    data_parallel_rank: int | None = None


_TO_MAP = {BlockStored: _MapBlockStored, BlockRemoved: _MapBlockRemoved, AllBlocksCleared: _MapAllBlocksCleared}
_FROM_MAP = {v: k for k, v in _TO_MAP.items()}

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_map_decoder = msgspec.msgpack.Decoder(_MapBatch)


def encode(batch: KVEventBatch, form: Format = "array") -> bytes:
    if form == "array":
        return _encoder.encode(batch)
    events = [_TO_MAP[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
    return _encoder.encode(_MapBatch(batch.ts, events, batch.data_parallel_rank))


def decode(payload: bytes) -> KVEventBatch:
    """A batch from its bytes, in either form; msgspec.DecodeError or ValidationError (both
    ValueErrors) if it is not one."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError:  # a map-form event where the array form wants an array
        batch = _map_decoder.decode(payload)
    events = [_FROM_MAP[type(e)](*msgspec.structs.astuple(e)) for e in batch.events]
    return KVEventBatch(batch.ts, events, batch.data_parallel_rank)


def to_vllm(events: Sequence[BlockEvent], block_size: int, snapshot: bool = False) -> list[Event]:
    """The log's events as vLLM's: runs of stored blocks that chain one onto the next become one
    BlockStored, runs of evictions one BlockRemoved. A snapshot starts with AllBlocksCleared."""
    out: list[Event] = [AllBlocksCleared()] if snapshot else []
    for e in events:
        last = out[-1] if out else None
        if e.kind == STORED:
            if (isinstance(last, BlockStored) and last.block_hashes[-1] == e.parent
                    and len(last.block_hashes) < MAX_BLOCKS_PER_BATCH):
                last.block_hashes.append(e.block_hash)
                last.token_ids.extend(e.token_ids)
            else:
                out.append(BlockStored([e.block_hash], e.parent, list(e.token_ids), block_size, None, MEDIUM, None))
        elif isinstance(last, BlockRemoved) and len(last.block_hashes) < MAX_BLOCKS_PER_BATCH:
            last.block_hashes.append(e.block_hash)
        else:
            out.append(BlockRemoved([e.block_hash], MEDIUM))
    return out


def batches(events: list[Event], rank: int = 0) -> Iterator[KVEventBatch]:
    """Events split into batches of at most MAX_BLOCKS_PER_BATCH blocks (vLLM sends one per step)."""
    chunk: list[Event] = []
    blocks = 0
    for e in events:
        n = len(getattr(e, "block_hashes", ()))
        if chunk and blocks + n > MAX_BLOCKS_PER_BATCH:
            yield KVEventBatch(time.time(), chunk, rank)
            chunk, blocks = [], 0
        chunk.append(e)
        blocks += n
    if chunk:
        yield KVEventBatch(time.time(), chunk, rank)
