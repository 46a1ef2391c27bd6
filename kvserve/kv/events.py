"""A bounded, thread-safe log of the prefix hashes a block pool stores and evicts.

A router that knows which chained block hashes a server holds can send a request to the server
that already has its prompt's prefix in KV cache (kvserve/router/kv_index.py). The engine thread
records; the server's event loop reads (`GET /kv/events`). Each event has a sequence number; a
reader that fell further behind than the log keeps gets the whole set of held hashes instead.
"""
from __future__ import annotations

import itertools
import threading
import uuid
from collections import deque
from dataclasses import dataclass

STORED, REMOVED = "+", "-"


@dataclass(frozen=True)
class EventsPage:
    seq: int  # the newest event's number (0 before any)
    events: list[tuple[int, str, bytes]] | None  # (seq, STORED|REMOVED, hash) after `since`; None → snapshot
    held: list[bytes] | None  # every hash held now, when the reader fell behind


class BlockEventLog:
    def __init__(self, capacity: int = 8192) -> None:
        self._lock = threading.Lock()
        self._events: deque[tuple[int, str, bytes]] = deque(maxlen=capacity)
        self._held: set[bytes] = set()
        self.seq = 0
        self.instance = uuid.uuid4().hex  # a reader sees a restarted server start over

    def record(self, kind: str, block_hash: bytes) -> None:
        with self._lock:
            self.seq += 1
            self._events.append((self.seq, kind, block_hash))
            if kind == STORED:
                self._held.add(block_hash)
            else:
                self._held.discard(block_hash)

    def since(self, seq: int) -> EventsPage:
        """Events numbered above seq, or a snapshot when some of them were already dropped."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self.seq + 1
            if seq > self.seq or seq + 1 < oldest:  # unknown position, or fell behind
                return EventsPage(self.seq, None, list(self._held))
            skip = seq + 1 - oldest
            return EventsPage(self.seq, list(itertools.islice(self._events, skip, None)), None)

    def __len__(self) -> int:
        return len(self._held)
