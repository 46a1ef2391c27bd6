"""Routes that show what the engine does: a request's timeline (and, with web.py, the live page).

    GET /v1/requests/{id}/timeline   the engine's record of a recent request (id as returned
                                     in the response: chatcmpl-…, cmpl-…)

A generation request may also ask for its timeline in its final chunk (streamed) or in its body
(not streamed) with the extension field `"kvserve": {"timeline": true}`; see docs/server.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from kvserve.server.errors import APIError

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.generation import Job


def timeline(ctx: ServerContext, request_id: str) -> dict[str, Any] | None:
    """Every prompt's timeline of one HTTP request (engine ids are `<id>-<prompt index>`)."""
    engine = ctx.state.engine
    if engine is None:
        return None
    prompts = []
    while (tl := engine.timeline(f"{request_id}-{len(prompts)}")) is not None:
        prompts.append(tl)
    return {"id": request_id, "object": "kvserve.timeline", "prompts": prompts} if prompts else None


def timeline_extension(ctx: ServerContext, job: Job, wanted: Any) -> dict[str, Any]:
    """The `kvserve` field of a final chunk or body: {} unless the request asked for it."""
    if wanted is None or not wanted.timeline:
        return {}
    return {"kvserve": {"timeline": timeline(ctx, job.request_id)}}


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> dict:
        ctx.state.require_ready()
        body = timeline(ctx, request_id)
        if body is None:
            keep = ctx.state.llm.engine.timeline.keep
            raise APIError(404, f"no timeline for request {request_id!r}: the server keeps the last {keep} "
                           "finished requests; use the id of a response from this server", param="request_id",
                           code="not_found")
        return body
