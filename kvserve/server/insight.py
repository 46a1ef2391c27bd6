"""Routes that show what the engine does: a request's timeline, the engine's state, the page.

    GET /v1/requests/{id}/timeline   the engine's record of a recent request (id as returned
                                     in the response: chatcmpl-…, cmpl-…)
    GET /v1/engine/state             block pool map, queues, recent steps, latency histograms,
                                     prefix-cache hits (engine/snapshot.py); at most one snapshot
                                     per STATE_MIN_INTERVAL however many pages poll it
    GET /  and /static/…             the live page (server/static/), no external resources

A generation request may also ask for its timeline in its final chunk (streamed) or in its body
(not streamed) with the extension field `"kvserve": {"timeline": true}`; see docs/server.md.
"""
from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response

from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.timeline import KEEP_FINISHED
from kvserve.errors import shown
from kvserve.server.errors import APIError

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.generation import Job


def timeline(ctx: ServerContext, request_id: str) -> dict[str, Any] | None:
    """Every prompt's timeline of one HTTP request (engine ids are `<id>-<prompt index>`)."""
    prompts: list[dict] = []
    while (tl := ctx.client.timeline(f"{request_id}-{len(prompts)}")) is not None:
        prompts.append(tl)
    return {"id": request_id, "object": "kvserve.timeline", "prompts": prompts} if prompts else None


def timeline_extension(ctx: ServerContext, job: Job, wanted: Any) -> dict[str, Any]:
    """The `kvserve` field of a final chunk or body: {} unless the request asked for it."""
    if wanted is None or not wanted.timeline:
        return {}
    return {"kvserve": {"timeline": timeline(ctx, job.request_id)}}


STATIC_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
STATIC_FILES = ("index.html", "app.js", "app.css")


def static_file(package: str, name: str) -> Response:
    """A file of the page shipped in `package`'s static/ folder (the server's or the router's)."""
    if name not in STATIC_FILES:
        raise APIError(404, f"no static file {shown(name)}", code="not_found")
    data = resources.files(package).joinpath("static", name).read_bytes()
    return Response(data, media_type=STATIC_TYPES[name[name.rfind("."):]], headers={"Cache-Control": "no-cache"})


async def page(request: Request, ctx: ServerContext) -> Response:
    return static_file("kvserve.server", "index.html")


async def static(request: Request, ctx: ServerContext) -> Response:
    return static_file("kvserve.server", request.path_params["name"])


async def engine_state(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    try:
        state = await ctx.engine_states.get(ctx)
    except (EngineDeadError, TimeoutError):
        raise APIError(503, "the engine is not answering: see /health", code="dead") from None
    return {"model": ctx.settings.model_name, "max_model_len": ctx.client.max_model_len, **state}


async def request_timeline(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    request_id = request.path_params["request_id"]
    body = timeline(ctx, request_id)
    if body is None:
        raise APIError(404, f"no timeline for request {shown(request_id)}: the server keeps the last {KEEP_FINISHED} "
                       "finished requests; use the id of a response from this server", param="request_id",
                       code="not_found")
    return body
