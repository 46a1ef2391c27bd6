"""The server's own status routes: /health (and /ping, SageMaker's name), /version, /metrics."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from kvserve import __version__

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext


async def health(request: Request, ctx: ServerContext) -> Response:
    status, what = ctx.state.health()
    headers = {"Connection": "close"} if what == "draining" else None
    return JSONResponse({"status": what}, status_code=status, headers=headers)


async def ping(request: Request, ctx: ServerContext) -> Response:
    status, what = ctx.state.health()
    return JSONResponse({"status": what}, status_code=status)


async def version(request: Request, ctx: ServerContext) -> dict[str, Any]:
    return {"version": __version__}


async def metrics(request: Request, ctx: ServerContext) -> Response:
    body, content_type = ctx.metrics.render()
    return Response(body, media_type=content_type)
