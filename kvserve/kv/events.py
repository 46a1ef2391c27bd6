"""A bounded, thread-safe log of the prefix hashes a block pool stores and evicts.

A router that knows which chained block hashes a server holds can send a request to the server
that already has its prompt's prefix in KV cache (kvserve/router/kv_index.py). The engine thread
records; readers on other threads follow: the server's event loop (`GET /kv/events`) and the ZMQ
publisher's thread (kvserve/server/kv_publisher.py), which waits on the log instead of polling.
Each event has a sequence number; a reader that fell further behind than the log keeps gets the
whole set of held blocks instead. A stored block keeps its parent's hash and its token ids (the
pool's own tuple, not a copy): vLLM's `BlockStored` event carries both.
"""
from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

STORED, REMOVED = "+", "-"


class BlockEvent(NamedTuple):
    seq: int
    kind: str  # STORED | REMOVED
    block_hash: bytes
    parent: bytes | None = None  # STORED: the previous block's hash in the chain (None: the first block)
    token_ids: Sequence[int] = ()  # STORED: the block's tokens


@dataclass(frozen=True)
class EventsPage:
    seq: int  # the newest event's number (0 before any)
    events: list[tuple[int, str, bytes]] | None  # (seq, STORED|REMOVED, hash) after `since`; None → snapshot
    held: list[bytes] | None  # every hash held now, when the reader fell behind


@dataclass(frozen=True)
class BlocksPage:
    """What `BlockEventLog.blocks_since` gives: events with their chains and tokens, or a snapshot."""
    seq: int
    events: list[BlockEvent] | None  # after `since`; None → snapshot
    held: list[BlockEvent] | None  # every held block as a STORED event, parents before children


class BlockEventLog:
    def __init__(self, capacity: int = 8192) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._events: deque[BlockEvent] = deque(maxlen=capacity)
        self._held: dict[bytes, BlockEvent] = {}  # hash -> the event that stored it
        self.seq = 0
        self.instance = uuid.uuid4().hex  # a reader sees a restarted server start over

    def record(self, kind: str, block_hash: bytes, parent: bytes | None = None,
               token_ids: Sequence[int] = ()) -> None:
        with self._lock:
            self.seq += 1
            event = BlockEvent(self.seq, kind, block_hash, parent, token_ids)
            self._events.append(event)
            if kind == STORED:
                self._held[block_hash] = event
            else:
                self._held.pop(block_hash, None)
            self._changed.notify_all()

    def since(self, seq: int) -> EventsPage:
        """Events numbered above seq, or a snapshot when some of them were already dropped."""
        page = self.blocks_since(seq, snapshot_order=False)
        if page.events is not None:
            return EventsPage(page.seq, [(e.seq, e.kind, e.block_hash) for e in page.events], None)
        return EventsPage(page.seq, None, [e.block_hash for e in page.held or ()])

    def blocks_since(self, seq: int, snapshot_order: bool = True) -> BlocksPage:
        """since(), with each stored block's parent and tokens; a snapshot lists parents first
        (a consumer such as llm-d resolves a block's parent from the blocks it was told of)."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self.seq + 1
            if seq > self.seq or seq + 1 < oldest:  # unknown position, or fell behind
                held = list(self._held.values())
                return BlocksPage(self.seq, None, _parents_first(held, self._held) if snapshot_order else held)
            skip = seq + 1 - oldest
            return BlocksPage(self.seq, list(itertools.islice(self._events, skip, None)), None)

    def wait_beyond(self, seq: int, timeout: float) -> bool:
        """Block until an event numbered above seq exists (True) or timeout seconds pass (False)."""
        with self._lock:
            return self._changed.wait_for(lambda: self.seq > seq, timeout)

    def held(self) -> list[bytes]:
        """Every hash held now."""
        with self._lock:
            return list(self._held)

    def __len__(self) -> int:
        return len(self._held)


def _parents_first(blocks: list[BlockEvent], held: dict[bytes, BlockEvent]) -> list[BlockEvent]:
    """Held blocks ordered so a held parent comes before its child (a parent evicted and stored
    again is newer than its child in the log)."""
    out: list[BlockEvent] = []
    done: set[bytes] = set()
    for first in blocks:
        chain = []
        block: BlockEvent | None = first
        while block is not None and block.block_hash not in done:
            chain.append(block)
            done.add(block.block_hash)
            block = held.get(block.parent) if block.parent is not None else None
        out.extend(reversed(chain))
    return out
