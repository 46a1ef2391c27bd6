"""The FastAPI app: routes, middleware, and the model load behind /health.

    app = build_app(ServerSettings(model_name="smollm2-135m"), load=lambda: LLM("smollm2-135m"))

With `load`, the model loads on a thread when the app starts and /health answers 503 until it
is ready; with `llm`, the app is ready at once (tests, embedding in another program).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from kvserve.server.auth import APIKeyMiddleware
from kvserve.server.chat_completions import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.context import ServerContext
from kvserve.server import insight
from kvserve.server.errors import APIError, from_value_error, install_handlers
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.server.settings import ServerSettings
from kvserve.server.validation import parse

if TYPE_CHECKING:
    from kvserve.llm import LLM

log = logging.getLogger("kvserve.server")


def build_app(
    settings: ServerSettings,
    *,
    llm: LLM | None = None,
    load: Callable[[], LLM] | None = None,
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    if (llm is None) == (load is None):
        raise ValueError("pass either llm (a loaded LLM) or load (a function that loads one)")
    ctx = ServerContext(settings)
    if llm is not None:
        ctx.state.set_ready(llm)

    def load_failed(e: BaseException) -> None:
        log.error("the model failed to load: %s", e)
        if on_load_failure is not None:
            on_load_failure(e)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load is not None:
            ctx.state.load_in_background(load, load_failed)
        yield
        ctx.state.shutdown()

    app = FastAPI(title="kvserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ctx = ctx
    install_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:  # outermost, so even a 401 carries the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    _add_routes(app, ctx)
    insight.add_routes(app, ctx)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    settings, state = ctx.settings, ctx.state

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, ctx)

    @app.get("/v1/models")
    async def models() -> dict:
        state.require_ready()
        card = {"id": settings.model_name, "object": "model", "created": state.started, "owned_by": "kvserve",
                "max_model_len": state.llm.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        state.require_ready()
        req = await parse(request, TokenizeRequest, settings)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        tok = state.llm.tokenizer
        try:
            if req.messages is not None:
                msgs = [m.for_template() for m in req.messages]
                ids = await asyncio.to_thread(state.llm.encode_chat, msgs, req.add_generation_prompt)
            else:
                ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        except ValueError as e:
            raise from_value_error(e, {"prompt": "messages"} if req.messages is not None else None) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": state.llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        state.require_ready()
        req = await parse(request, DetokenizeRequest, settings)
        vocab = state.llm.config.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(state.llm.tokenizer.decode, req.tokens)}

    @app.get("/health")
    async def health() -> Response:
        status, what = state.health()
        return JSONResponse({"status": what}, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)
