"""The precise source of the cache-aware policy under Ray Serve: the KV blocks each replica's
routing stats say it holds (replica.py), and the renderers to hash a prompt as each replica will.

The same contract as the HTTP router's KVIndex (kvserve/router/kv_index.py): the policy's
BlockIndex (kvserve/router/policies.py: `prepare`, `usable`, `hashes`, `prompt_tokens`,
`mark_pending`, `unmark_pending`). Prompts are rendered with the
server's own ChatPrompt and hashed with the KV manager's own walk, once the router's rendering has
the replica's fingerprint. Stats arrive every `request_routing_stats_period_s` or so; a prompt
routed meanwhile counts as pending on its replica (kvserve/router/kv_blocks.py) so a burst
sharing a new prefix follows the first one.
"""
from __future__ import annotations

import asyncio
import logging
import time

from kvserve.ray_serve.replica import HASH_BYTES
from kvserve.router.kv_blocks import ReplicaBlocks
from kvserve.router.kv_index import Renderer, prepare_hashes
from kvserve.router.replicas import Replica
from kvserve.router.request import RoutedRequest
from kvserve.tokenizer import Tokenizer

log = logging.getLogger("kvserve.ray_serve")


class StatsIndex:
    def __init__(self, pending_grace: float = 2.0) -> None:
        self.pending_grace = pending_grace  # seconds a finished prompt's blocks still count (stats lag)
        self.blocks: dict[Replica, ReplicaBlocks] = {}
        self._held_raw: dict[Replica, bytes] = {}
        self._renderers: dict[str, Renderer | None] = {}  # per fingerprint; None: cannot render as it does
        self._loading: dict[str, asyncio.Task] = {}

    def update(self, replica: Replica, stats: dict) -> None:
        """Take in a replica's latest routing stats (cheap when they did not change)."""
        if not stats or not stats.get("caching", False):
            self.forget(replica)
            return
        b = self.blocks.get(replica)
        if b is None or (b.instance, b.model, b.renderer) != (stats["instance"], stats["model"], stats["renderer"]):
            b = self.blocks[replica] = ReplicaBlocks(stats["model"], stats["block_size"], stats["instance"],
                                                     stats["renderer"])
            self._held_raw.pop(replica, None)
        raw = stats["held"]
        if self._held_raw.get(replica) is not raw:
            self._held_raw[replica] = raw
            b.held = {raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)}
        b.prune_pending()
        if b.renderer not in self._renderers and b.renderer not in self._loading:
            self._loading[b.renderer] = asyncio.get_running_loop().create_task(self._load_renderer(b.model, b.renderer))

    def forget(self, replica: Replica) -> None:
        self.blocks.pop(replica, None)
        self._held_raw.pop(replica, None)

    async def _load_renderer(self, model: str, fingerprint: str) -> None:
        try:
            tok = await asyncio.to_thread(Tokenizer.load, model)
            for special in (False, True):
                if await asyncio.to_thread(tok.fingerprint, special) == fingerprint:
                    self._renderers[fingerprint] = Renderer(tok, special)
                    log.info("cache_aware: hashing prompts as the replicas of %s do", model)
                    return
            self._renderers[fingerprint] = None
            log.warning("cache_aware: replicas of %s render chats with a template of their own: routed by text", model)
        except Exception as e:  # noqa: BLE001 - the model file is not on this node: route by text
            self._renderers[fingerprint] = None
            log.warning("cache_aware: cannot load the tokenizer of %s here (%s): routed by text", model, e)
        finally:
            self._loading.pop(fingerprint, None)

    # -- what the policy asks ---------------------------------------------------------------
    def usable(self, replica: Replica) -> ReplicaBlocks | None:
        b = self.blocks.get(replica)
        return b if b is not None and self._renderers.get(b.renderer) is not None else None

    async def prepare(self, req: RoutedRequest) -> None:
        keys = {(b.renderer, b.block_size) for b in self.blocks.values() if self._renderers.get(b.renderer)}
        if keys and req.routable:
            renderers = {name: r for name, _ in keys if (r := self._renderers[name]) is not None}
            await asyncio.to_thread(prepare_hashes, req, renderers, keys)

    def hashes(self, req: RoutedRequest, b: ReplicaBlocks) -> list[bytes] | None:
        full = req.hashes.get((b.renderer, b.block_size))
        return None if full is None else [h[:HASH_BYTES] for h in full]

    def prompt_tokens(self, req: RoutedRequest) -> int | None:
        return len(next(iter(req.token_ids.values()))) if req.token_ids else None

    def mark_pending(self, replica: Replica, hashes: list[bytes]) -> None:
        if (b := self.blocks.get(replica)) is not None:
            b.mark_pending(hashes)

    def unmark_pending(self, replica: Replica, hashes: list[bytes]) -> None:
        if (b := self.blocks.get(replica)) is not None:
            b.unmark_pending(hashes, time.monotonic() + self.pending_grace)
