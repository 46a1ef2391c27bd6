"""`GET /kv/events?since=N`: which prefix blocks this server holds, for a cache-aware router.

The answer names the model file and the block size, so a router can tokenize and hash prompts
exactly as this server does (kvserve/router/kv_index.py), then either the events after N
(`[seq, "+" stored | "-" evicted, hex hash]`) or, for a reader that is new or fell behind the
bounded log, `held`: every hash held now. It also carries `renderer`, the fingerprint of what
turns a chat into prompt ids here (tokenizer, chat template, special-token rule); a router whose
own rendering differs fetches `GET /kv/renderer` (the template and the rule) to render as this
server does, and routes by text where it still cannot. A server that publishes the same events
over ZMQ (`--kv-events-endpoint`, kvserve/server/kv_publisher.py) names its endpoints, topic and
`kv_events_seq`, the last batch sent before this answer's events were read: a router takes this
answer as its starting state and follows the ZMQ stream from the next batch (kvserve/router/kv_zmq.py);
`?head=true` gives the fields alone, for a router checking every few seconds that the stream reaches it.
Behind the API key like every route but /health.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from kvserve.errors import shown
from kvserve.kv.events import EventsPage
from kvserve.server.errors import APIError

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext


def _query(request: Request, name: str, kind: str) -> int | bool:
    """Query parameter `name` as a whole number ≥ 0 (kind "count", default 0) or true/false (kind
    "bool", default false), or a 400 saying which it must be."""
    given = request.query_params.get(name)
    if given is None:
        return False if kind == "bool" else 0
    if kind == "bool" and given.lower() in ("true", "false", "1", "0"):
        return given.lower() in ("true", "1")
    if kind == "count" and given.isascii() and given.isdigit() and len(given) <= 18:
        return int(given)
    must = "true or false" if kind == "bool" else "a whole number ≥ 0"
    raise APIError(400, f"{name} must be {must}, got {shown(given)}", param=name)


async def kv_events(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    since, head = int(_query(request, "since", "count")), _query(request, "head", "bool")
    publisher = ctx.kv_publisher
    zmq_seq = publisher.last_seq() if publisher is not None else None  # read before the log: see above
    log, cache = ctx.client.kv_events(), ctx.client.cache_info()
    if log is None or cache is None:  # (the model is loaded once ready)
        raise RuntimeError("the model is not loaded yet")
    page = EventsPage(log.seq, None, None) if head else log.since(since)  # head: the fields only
    out = {"model": ctx.client.model_path, "block_size": cache.block_size,
           "caching": cache.prefix_caching, "instance": log.instance,
           "seq": page.seq, "renderer": await ctx.renderer_fingerprint()}
    if publisher is not None and publisher.bound:
        out.update(kv_events_endpoint=publisher.endpoint, kv_events_topic=publisher.topic, kv_events_seq=zmq_seq)
        if publisher.replay_endpoint is not None:
            out["kv_events_replay_endpoint"] = publisher.replay_endpoint
    if page.held is not None:
        out["held"] = [h.hex() for h in page.held]
    elif page.events is not None:
        out["events"] = [[seq, kind, h.hex()] for seq, kind, h in page.events]
    return out


async def kv_renderer(request: Request, ctx: ServerContext) -> dict:
    """What a router needs to render chats into this server's prompt ids, besides the model file."""
    ctx.state.require_ready()
    return {"fingerprint": await ctx.renderer_fingerprint(), "chat_template": ctx.client.tokenizer.chat_template.source,
            "special_tokens_in_messages": ctx.settings.special_tokens_in_messages}
