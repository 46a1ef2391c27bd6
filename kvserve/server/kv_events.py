"""`GET /kv/events?since=N`: which prefix blocks this server holds, for a cache-aware router.

The answer names the model file and the block size, so a router can tokenize and hash prompts
exactly as this server does (kvserve/router/kv_index.py), then either the events after N
(`[seq, "+" stored | "-" evicted, hex hash]`) or, for a reader that is new or fell behind the
bounded log, `held`: every hash held now. Behind the API key like every route but /health.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI, Query

if TYPE_CHECKING:
    from kvserve.server.app import ServerContext


def add_kv_event_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/kv/events")
    async def kv_events(since: int = Query(0, ge=0)) -> dict:
        ctx.state.require_ready()
        llm = ctx.state.llm
        page = llm.manager.pool.events.since(since)
        out = {"model": str(llm.model_path), "block_size": llm.manager.block_size,
               "caching": llm.manager.pool.enable_caching, "instance": llm.manager.pool.events.instance,
               "seq": page.seq}
        if page.held is not None:
            out["held"] = [h.hex() for h in page.held]
        else:
            out["events"] = [[seq, kind, h.hex()] for seq, kind, h in page.events]
        return out
