"""Compiled grammars kept for reuse, least recently used dropped first, bounded by their bytes.

A compiled grammar holds its token masks (~50 KB to several MB); kept forever, one per distinct
schema, they grow without end (258 schemas: +38 MB). Here the total is bounded by `max_bytes`
(`kvserve serve --grammar-cache-mib`); a grammar larger than the whole budget is not kept. A
request's own grammar stays with the request however the cache evicts (kvserve/structured/
grammar.py pins it on the request's Constraint). Thread-safe: compiles run on worker threads.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

DEFAULT_BYTES = 64 << 20


class GrammarCache:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, str], tuple[Any, int]] = OrderedDict()  # oldest first
        self._lock = threading.Lock()
        self.bytes = 0
        self.hits = self.misses = self.evictions = 0

    def get(self, key: tuple[str, str]) -> Any | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: tuple[str, str], grammar: Any, size: int) -> None:
        with self._lock:
            if key in self._entries or size > self.max_bytes:
                return
            self._entries[key] = (grammar, size)
            self.bytes += size
            self._evict()

    def resize(self, max_bytes: int) -> None:
        with self._lock:
            self.max_bytes = max_bytes
            self._evict()

    def _evict(self) -> None:
        while self.bytes > self.max_bytes and self._entries:
            _, (_, size) = self._entries.popitem(last=False)
            self.bytes -= size
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)
