"""One Serve replica: a kvserve engine and kvserve's own app, configured by `kvserve serve`'s own
arguments, answering requests forwarded by the ingress (forwarding.py).

Its routing stats (Serve asks every `request_routing_stats_period_s`) are what the cache-aware
router needs to know about its KV cache: the model file and block size (to tokenize and hash a
prompt as this replica does), the renderer's fingerprint (the router hashes chats only where its
own rendering gives the same ids), and the blocks held, each as the first HASH_BYTES bytes of its
chained hash (a collision costs one cache miss, never a wrong answer: the engine verifies a
prefix hit against the stored tokens).
"""
from __future__ import annotations

import argparse
import logging
import shlex
from collections.abc import AsyncIterator, Sequence

from kvserve.ray_serve.forwarding import ForwardedRequest, ResponseHead, call_app

log = logging.getLogger("kvserve.ray_serve")

HASH_BYTES = 8
REPLICA_HEADER = b"x-kvserve-replica"  # on every answer: the Serve replica that gave it
# `kvserve serve` flags that have no meaning here: Serve's proxy is the HTTP server, Serve places
# the replicas, and a ZMQ endpoint would be bound by every replica of a node at once.
REFUSED_FLAGS = ("--host", "--port", "--join", "--advertise-url", "--join-key", "--kv-events-endpoint",
                 "--kv-events-replay-endpoint", "--kv-events-format", "--max-connections", "--header-timeout", "--tensor-parallel-size",
                 "-tp")


def parse_serve_args(serve_args: str | Sequence[str]) -> argparse.Namespace:
    """`kvserve serve`'s arguments (a string or a list) as its parser reads them."""
    from kvserve.commands import build_parser

    argv = shlex.split(serve_args) if isinstance(serve_args, str) else [str(a) for a in serve_args]
    refused = [a for a in argv if a.split("=", 1)[0] in REFUSED_FLAGS]
    if refused:
        raise ValueError(f"serve_args: {', '.join(refused)} do not apply under Ray Serve (its proxy serves HTTP and "
                         "places replicas); leave them out")
    return build_parser().parse_args(["serve", *argv])


class KvserveReplica:
    def __init__(self, serve_args: str | Sequence[str] = ()) -> None:
        from ray import serve

        from kvserve.commands.serve import load_llm, settings_from_args
        from kvserve.server.app import build_app

        args = parse_serve_args(serve_args)
        settings = settings_from_args(args)  # (sets torch's threads from --threads)
        llm = load_llm(args)
        self.app = build_app(settings, llm=llm)
        self.ctx = self.app.state.ctx
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._events = llm.manager.pool.events
        self._stats = {"model": str(llm.model_path), "block_size": llm.manager.block_size,
                       "renderer": llm.tokenizer.fingerprint(settings.special_tokens_in_messages),
                       "instance": self._events.instance, "caching": llm.manager.pool.enable_caching}
        log.info("kvserve replica %s: %s ready", self.replica_id, settings.model_name)

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
        """The answer of kvserve's app to request: its head (naming this replica), then its body."""
        async for item in call_app(self.app, request):
            if isinstance(item, ResponseHead):
                item = ResponseHead(item.status, (*item.headers, (REPLICA_HEADER, self.replica_id.encode())))
            yield item

    def record_routing_stats(self) -> dict:
        held = self._events.held() if self._stats["caching"] else []
        return {**self._stats, "held": b"".join(h[:HASH_BYTES] for h in held)}

    def check_health(self) -> None:
        """Serve restarts a replica whose engine died or stalled."""
        status, what = self.ctx.state.health()
        if status != 200:
            raise RuntimeError(f"kvserve replica {self.replica_id}: the engine is {what}")

    def __del__(self) -> None:  # Serve stopping the replica: the engine's thread ends
        ctx = getattr(self, "ctx", None)
        if ctx is not None:
            ctx.state.shutdown()
            ctx.grammars.shutdown()
