"""The FastAPI app: the API key check, the middleware stack and the routes (its settings are in
server/settings.py, the context every route shares in server/context.py).

    app = build_app(ServerSettings(model_name="smollm2-135m"), load=lambda: LLM("smollm2-135m"))

With `load`, the model loads on a thread when the app starts and /health answers 503 until it
is ready; with `llm`, the app is ready at once (tests, embedding in another program).
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve import __version__
from kvserve.errors import shown
from kvserve.server import (
    anthropic_messages,
    anthropic_protocol,
    api_docs,
    insight,
    ollama_api,
    ollama_protocol,
    responses,
)
from kvserve.server.chat_completions import ChatCompletion
from kvserve.server.completions import Completion
from kvserve.server.context import ServerContext
from kvserve.server.embeddings import Embedding
from kvserve.server.errors import APIError, from_invalid
from kvserve.server.kv_events import add_kv_event_routes
from kvserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ResponsesRequest,
    TokenizeRequest,
)
from kvserve.server.render import add_render_routes
from kvserve.server.request_id import RequestIdMiddleware
from kvserve.server.settings import ServerSettings
from kvserve.tokenizer.chat_template import ChatPrompt
from kvserve.web.body import FramingCheck
from kvserve.web.errors import install_handlers
from kvserve.web.hosts import HostAllowList

if TYPE_CHECKING:
    from kvserve.llm import LLM

log = logging.getLogger("kvserve.server")


class APIKeyMiddleware:
    """The API key on every route but the open ones: `Authorization: Bearer <key>`, or Anthropic's
    `x-api-key: <key>`. A plain ASGI middleware (it must not buffer streamed responses); the
    comparison is constant-time so the key cannot be guessed byte by byte from response times."""

    # The live page and its files hold nothing secret; the page sends the key on its API calls.
    # /api/version: Ollama's clients probe it to find the server.
    OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/version", "/api/version", "/", "/static/index.html",
                            "/static/app.js", "/static/app.css", *api_docs.OPEN_PATHS})

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)  # OPTIONS: CORS preflights carry no credentials
            return
        bearer = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
        # Both compared, always: which header was sent must not change the time taken.
        ok = hmac.compare_digest(bearer or b"", self._bearer) | hmac.compare_digest(key or b"", self._key)
        if ok:
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)"
                   if bearer is None and key is None else "invalid API key")
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response(scope["path"])(scope, receive, send)


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
        ctx.grammars.start(llm.engine.grammars)  # (not waited for: a structured request waits instead)
        ctx.state.set_ready(llm)

    def load_failed(e: BaseException) -> None:
        log.error("the model failed to load: %s", e)
        if on_load_failure is not None:
            on_load_failure(e)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.grammars.start()  # the compile processes' import (~3 s) runs while the model loads
        if load is not None:
            app.state.loader = ctx.state.load_in_background(load, load_failed)
        yield
        ctx.state.shutdown()
        ctx.grammars.shutdown()
        if ctx.kv_publisher is not None:
            ctx.kv_publisher.close()

    # /docs (served offline) and /openapi.json with each route's body model: kvserve/server/api_docs.py.
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.ctx = ctx
    app.state.loader = None
    install_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:  # outermost, so even a 401 carries the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST", "DELETE"],
                           allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version",
                                          "anthropic-beta"])
    if settings.allowed_hosts:  # outermost of all: a rebound domain's request gets nothing else
        app.add_middleware(HostAllowList, allowed=settings.allowed_hosts)
    app.add_middleware(FramingCheck)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, even a refused Host, has its id
    api_docs.add_routes(app)
    _add_routes(app, ctx)
    add_kv_event_routes(app, ctx)  # for a cache-aware router (kvserve route)
    insight.add_routes(app, ctx)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    settings, state = ctx.settings, ctx.state

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await Completion.handle(request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await ChatCompletion.handle(request, ctx)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses.ModelResponse.handle(request, ctx)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict:
        return responses.get_response(ctx, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict:
        return responses.delete_response(ctx, response_id)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await anthropic_messages.Message.handle(request, ctx)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        return await anthropic_messages.count_tokens(request, ctx)

    ollama_api.add_routes(app, ctx)
    add_render_routes(app, ctx)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await Embedding.handle(request, ctx)

    def card() -> dict:
        state.require_ready()
        return {"id": settings.model_name, "object": "model", "created": state.started, "owned_by": "kvserve",
                "max_model_len": ctx.client.max_model_len}

    for path, body_model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest),
                             ("/v1/chat/completions/render", ChatCompletionRequest),
                             ("/v1/responses", ResponsesRequest), ("/v1/embeddings", EmbeddingRequest), ("/v1/messages", anthropic_protocol.MessagesRequest),
                             ("/v1/messages/count_tokens", anthropic_protocol.CountTokensRequest),
                             ("/api/chat", ollama_protocol.ChatRequest), ("/api/generate", ollama_protocol.GenerateRequest),
                             ("/api/show", ollama_protocol.ShowRequest), ("/api/embed", ollama_protocol.EmbedRequest),
                             ("/api/embeddings", ollama_protocol.EmbeddingsRequest),
                             ("/tokenize", TokenizeRequest), ("/detokenize", DetokenizeRequest)):
        api_docs.document_body(app, path, body_model)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != settings.model_name:
            raise APIError(404, f"the model {shown(model_id)} is not served here: GET /v1/models lists the one that is",
                           param="model", code="model_not_found")
        return card()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/ping")
    async def ping() -> Response:
        status, what = state.health()
        return JSONResponse({"status": what}, status_code=status)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        state.require_ready()
        req = await ctx.parse(request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        limit = ctx.client.max_model_len
        try:
            if req.messages is not None:
                ids = await ctx.client.encode_chat(
                    ChatPrompt([m.for_template() for m in req.messages], req.add_generation_prompt))
            else:
                ids = await ctx.client.encode(req.prompt or "", req.add_special_tokens)  # (given: checked above)
        except ValueError as e:
            raise from_invalid(e, {"prompt": "messages"} if req.messages is not None else None) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        state.require_ready()
        req = await ctx.parse(request, DetokenizeRequest)
        vocab, limit = ctx.client.model_config.vocab_size, ctx.client.max_model_len
        if len(req.tokens) > limit:
            raise APIError(400, f"tokens: at most {limit} ids (the context length), got {len(req.tokens)}",
                           param="tokens")
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(ctx.client.tokenizer.decode, req.tokens)}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        status, what = state.health()
        headers = {"Connection": "close"} if what == "draining" else None
        return JSONResponse({"status": what}, status_code=status, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)
