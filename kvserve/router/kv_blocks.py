"""What the router knows of one replica's KV cache: the block hashes it holds (from its events,
over HTTP or ZMQ) and those it is about to hold (prompts routed there, in flight)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class ReplicaBlocks:
    model: str
    block_size: int
    instance: str = ""
    renderer: str = ""  # the replica's renderer fingerprint ("model:PATH" for one that names none)
    seq: int = 0
    held: set[bytes] = field(default_factory=set)
    pending: dict[bytes, list] = field(default_factory=dict)  # hash -> [requests in flight, expiry]
    stream: tuple[str, str | None, str, int] | None = None  # ZMQ (endpoint, replay, topic, seq) it advertised

    def has(self, h: bytes, now: float) -> bool:
        if h in self.held:
            return True
        p = self.pending.get(h)
        return p is not None and (p[0] > 0 or p[1] > now)

    def mark_pending(self, hashes: list[bytes]) -> None:
        """Blocks a request routed here will store: held as far as routing knows, while it runs."""
        for h in hashes:
            self.pending.setdefault(h, [0, 0.0])[0] += 1

    def unmark_pending(self, hashes: list[bytes], expiry: float) -> None:
        """The request ended: its blocks stay held until `expiry` (time.monotonic()), by when the
        replica's own report says whether it kept them."""
        for h in hashes:
            p = self.pending.get(h)
            if p is not None:
                p[0] -= 1
                p[1] = expiry

    def prune_pending(self) -> None:
        now = time.monotonic()
        for h in [h for h, (n, expiry) in self.pending.items() if n <= 0 and expiry <= now]:
            del self.pending[h]

    def match(self, hashes: list[bytes]) -> int:
        now = time.monotonic()
        n = 0
        for h in hashes:
            if not self.has(h, now):
                break
            n += 1
        return n * self.block_size
