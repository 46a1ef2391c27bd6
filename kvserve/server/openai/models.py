"""GET /v1/models and /v1/models/{model_id}: the one model served here, as OpenAI's model cards."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvserve.errors import shown
from kvserve.server.errors import APIError

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext


def _card(ctx: ServerContext) -> dict[str, Any]:
    ctx.state.require_ready()
    return {"id": ctx.settings.model_name, "object": "model", "created": ctx.state.started, "owned_by": "kvserve",
            "max_model_len": ctx.client.max_model_len}


async def list_models(request: Request, ctx: ServerContext) -> dict[str, Any]:
    return {"object": "list", "data": [_card(ctx)]}


async def model(request: Request, ctx: ServerContext) -> dict[str, Any]:
    model_id = request.path_params["model_id"]
    if model_id != ctx.settings.model_name:
        raise APIError(404, f"the model {shown(model_id)} is not served here: GET /v1/models lists the one that is",
                       param="model", code="model_not_found")
    return _card(ctx)
