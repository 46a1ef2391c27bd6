"""The approximate source of cache_aware: a bounded prefix tree of the text sent to a replica.

When a replica does not say which blocks it holds, the router guesses from what it sent there
(as SGLang's router does). The tree's edges are fixed-size chunks of text; a node is addressed
by the hash of its whole path (a chained hash, like the KV blocks), so a lookup walks the
prompt's chunks until one is missing. Nodes are dropped least recently used first, which also
roughly follows the replica's own LRU eviction.
"""
from __future__ import annotations

from collections import OrderedDict


class PrefixTree:
    def __init__(self, chunk_chars: int = 64, max_chunks: int = 16384) -> None:
        if chunk_chars < 1 or max_chunks < 1:
            raise ValueError("chunk_chars and max_chunks must be at least 1")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self._nodes: OrderedDict[int, None] = OrderedDict()

    def _path(self, text: str):
        parent = 0
        for start in range(0, len(text) - self.chunk_chars + 1, self.chunk_chars):
            parent = hash((parent, text[start : start + self.chunk_chars]))
            yield parent

    def match(self, text: str) -> int:
        """Characters of text's start that were sent here (whole chunks); refreshes them."""
        n = 0
        for node in self._path(text):
            if node not in self._nodes:
                break
            self._nodes.move_to_end(node)
            n += self.chunk_chars
        return n

    def insert(self, text: str) -> None:
        for node in self._path(text):
            self._nodes[node] = None
            self._nodes.move_to_end(node)
        while len(self._nodes) > self.max_chunks:
            self._nodes.popitem(last=False)

    def clear(self) -> None:
        self._nodes.clear()

    def __len__(self) -> int:
        return len(self._nodes)
