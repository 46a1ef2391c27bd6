"""POST /tokenize and /detokenize (vLLM's): a prompt or a chat as the model's token ids, and back."""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvserve.server.errors import APIError, from_invalid
from kvserve.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.tokenizer.chat_template import ChatPrompt

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext


async def tokenize(request: Request, ctx: ServerContext) -> dict[str, Any]:
    ctx.state.require_ready()
    req = await ctx.parse(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    try:
        if req.messages is not None:
            ids = await ctx.client.encode_chat(
                ChatPrompt([m.for_template() for m in req.messages], req.add_generation_prompt))
        else:
            ids = await ctx.client.encode(req.prompt or "", req.add_special_tokens)  # (given: checked above)
    except ValueError as e:
        raise from_invalid(e, {"prompt": "messages"} if req.messages is not None else None) from None
    return {"tokens": ids, "count": len(ids), "max_model_len": ctx.client.max_model_len}


async def detokenize(request: Request, ctx: ServerContext) -> dict[str, Any]:
    ctx.state.require_ready()
    req = await ctx.parse(request, DetokenizeRequest)
    vocab, limit = ctx.client.model_config.vocab_size, ctx.client.max_model_len
    if len(req.tokens) > limit:
        raise APIError(400, f"tokens: at most {limit} ids (the context length), got {len(req.tokens)}", param="tokens")
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab})", param="tokens")
    return {"prompt": await asyncio.to_thread(ctx.client.tokenizer.decode, req.tokens)}
