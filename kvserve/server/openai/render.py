"""POST /v1/chat/completions/render: a chat request's prompt ids, without generating.

Gateways that route on the replicas' published KV blocks (vllm-router's kv_aware policy, the
inference extension's endpoint picker with a precise prefix-cache scorer) ask the model server
to render a request before choosing a replica, so the ids they hash are the ones the replica will
look up. The body is a chat completion's; the answer is `{"model", "token_ids"}`, rendered by the
chat route's own `to_chat`, so render and generation cannot disagree.
"""
from __future__ import annotations

from fastapi import Request

from kvserve.server.context import ServerContext
from kvserve.server.errors import from_invalid
from kvserve.server.openai.protocol import ChatCompletionRequest, log_ignored, to_chat
from kvserve.server.parsing import reject_unsupported_extras


async def render_chat(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    req = await ctx.parse(request, ChatCompletionRequest)
    log_ignored(req)
    reject_unsupported_extras(req)
    try:
        ids = await ctx.client.encode_chat(to_chat(req).prompt)  # the chat route's own reading
    except ValueError as e:
        raise from_invalid(e, {"prompt": "messages"}) from None
    return {"model": ctx.settings.model_name, "token_ids": ids}
