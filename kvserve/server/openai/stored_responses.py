"""GET and DELETE /v1/responses/{response_id}: the responses the server keeps
(kvserve/server/response_store.py), by id."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from kvserve.server.errors import APIError

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext


async def get_response(request: Request, ctx: ServerContext) -> dict[str, Any]:
    response_id = request.path_params["response_id"]
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise _not_found(ctx, response_id)
    return stored.response()


async def delete_response(request: Request, ctx: ServerContext) -> dict[str, Any]:
    response_id = request.path_params["response_id"]
    if not ctx.responses.delete(response_id):
        raise _not_found(ctx, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(ctx: ServerContext, response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r:.80}: {ctx.responses.why_missing(response_id)}",
                    param="response_id", code="response_not_found")
