"""POST /v1/chat/completions/render: a chat request's prompt ids, without generating.

Gateways that route on the replicas' published KV blocks (vllm-router's kv_aware policy, the
inference extension's endpoint picker with a precise prefix-cache scorer) ask the model server
to render a request before choosing a replica, so the ids they hash are the ones the replica will
look up. The body is a chat completion's; the answer is `{"model", "token_ids"}`, rendered by the
same `ChatPrompt` rule the chat route uses, so render and generation cannot disagree.
"""
from __future__ import annotations

from fastapi import FastAPI, Request

from kvserve.server import openai_compat
from kvserve.server.context import ServerContext
from kvserve.server.errors import from_invalid
from kvserve.server.parsing import reject, reject_unsupported_extras
from kvserve.server.protocol import ChatCompletionRequest


def add_render_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> dict:
        ctx.state.require_ready()
        req = await ctx.parse(request, ChatCompletionRequest)
        openai_compat.log_ignored(req)
        reject_unsupported_extras(req)
        openai_compat.apply_legacy_functions(req)
        reject(not req.messages, "messages", "must not be empty")
        try:
            ids = await ctx.client.encode_chat(req.chat_prompt())
        except ValueError as e:
            raise from_invalid(e, {"prompt": "messages"}) from None
        return {"model": ctx.settings.model_name, "token_ids": ids}
