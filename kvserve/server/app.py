"""The FastAPI app: its settings, the context every route shares, the API key check, the routes.

    app = build_app(ServerSettings(model_name="smollm2-135m"), load=lambda: LLM("smollm2-135m"))

With `load`, the model loads on a thread when the app starts and /health answers 503 until it
is ready; with `llm`, the app is ready at once (tests, embedding in another program).
"""
from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve import __version__
from kvserve.engine.engine import EngineStats
from kvserve.generation_defaults import MAX_TOKENS_DEFAULT, SamplingDefaults
from kvserve.sampling_params import MAX_LOGPROBS
from kvserve.server.errors import APIError, from_invalid, install_handlers
from kvserve.server.grammar_pool import GrammarPool
from kvserve.server.hosts import HostAllowList
from kvserve.server import insight
from kvserve.server.generation import EngineClient
from kvserve.server.kv_events import add_kv_event_routes
from kvserve.server.lifecycle import ServerState
from kvserve.server.logprobs import TokenTexts
from kvserve.server.metrics import ServerMetrics
from kvserve.server.parsing import parse
from kvserve.server.protocol import DetokenizeRequest, TokenizeRequest
from kvserve.server.request_id import RequestIdMiddleware

if TYPE_CHECKING:
    from kvserve.llm import LLM

log = logging.getLogger("kvserve.server")


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs to know (the engine has its own config)."""

    model_name: str  # the name clients pass as "model" (and /v1/models lists)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # Bearer token for every route but /health and /metrics
    allowed_origins: tuple[str, ...] = ()  # CORS stays off while empty
    allowed_hosts: tuple[str, ...] = ()  # Host header names answered (kvserve/server/hosts.py); empty: any
    # Sequences that may wait beyond the engine's max_num_seqs running ones; more get 429.
    max_queued_requests: int = 256
    max_n: int = 8  # completions per request
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_request_share: float = 0.25  # of running + queued capacity, the most one request may hold
    max_logprobs: int = MAX_LOGPROBS  # top alternatives per token
    max_body_bytes: int = 4 << 20  # 4 MiB: far more than any context's worth of text
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    stall_timeout: float = 60.0  # an engine step running longer turns /health 503 "stalled"
    stream_stall_timeout: float = 60.0  # a stream whose client reads nothing this long is aborted
    request_timeout: float | None = None  # whole-request limit in seconds; None: none
    header_timeout: float = 10.0  # seconds a client has to send a request's headers
    max_connections: int = 1024  # open HTTP connections; more are answered 503 and closed
    special_tokens_in_messages: bool = False  # let chat content spell control tokens
    grammar_compile_timeout: float = 10.0  # seconds a request waits for its grammar (kvserve/server/grammar_pool.py)
    # For sampling fields a request leaves out: the model's recommendation or the server's
    # (kvserve/generation_defaults.py); None: SamplingParams' own (OpenAI's) defaults.
    sampling_defaults: SamplingDefaults | None = None
    max_tokens_default: int = MAX_TOKENS_DEFAULT  # chat requests without max_tokens

    @property
    def defaults(self) -> dict:
        return self.sampling_defaults.given() if self.sampling_defaults is not None else {}

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class ServerContext:
    """What every route handler needs, in one object the app holds."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.state = ServerState(settings)
        self.grammars = GrammarPool(timeout=settings.grammar_compile_timeout)
        self.metrics = ServerMetrics(self._stats, lambda: self.state.num_admitted_requests, self._grammar_stats)
        self.client = EngineClient(self.state, self.metrics, self.grammars)

    def _stats(self) -> EngineStats | None:
        return self.state.engine.stats() if self.state.engine is not None else None

    def _grammar_stats(self) -> dict[str, float] | None:
        if self.state.llm is None:
            return None
        cache = self.state.llm.engine.grammars.cache
        return {"hits": cache.hits, "misses": cache.misses, "evictions": cache.evictions, "bytes": cache.bytes,
                "entries": len(cache), "pending": self.grammars.pending, "compile_timeouts": self.grammars.timeouts}

    async def parse(self, request: Request, model: type) -> object:
        return await parse(request, model, self.settings.max_body_bytes, self.settings.model_name)

    @functools.cached_property
    def texts(self) -> TokenTexts:
        """Token texts for logprobs (made once the model is loaded)."""
        return TokenTexts(self.state.llm.tokenizer)

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: changes when kvserve's version or the model served does."""
        llm = self.state.llm
        model = f"{self.settings.model_name}|{getattr(llm, 'model_path', '')}|{llm.config.vocab_size}"
        return "fp_" + hashlib.sha256(f"kvserve {__version__}|{model}".encode()).hexdigest()[:12]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self.state.llm.tokenizer.special_token_ids


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but the open ones. A plain ASGI middleware (it
    must not buffer streamed responses); the comparison is constant-time so the key cannot be
    guessed byte by byte from response times."""

    # The live page and its files hold nothing secret; the page sends the key on its API calls.
    OPEN_PATHS = frozenset({"/health", "/metrics", "/ping", "/version", "/", "/static/index.html", "/static/app.js",
                            "/static/app.css"})

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)  # OPTIONS: CORS preflights carry no credentials
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send Authorization: Bearer <key>" if not given else "invalid API key"
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


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
            app.state.loader = ctx.state.load_in_background(load, load_failed)
        yield
        ctx.state.shutdown()
        ctx.grammars.shutdown()

    # /docs and /openapi.json list the routes; request bodies are read by parsing.py, not FastAPI.
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.ctx = ctx
    app.state.loader = None
    install_handlers(app)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    if settings.allowed_origins:  # outermost, so even a 401 carries the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    if settings.allowed_hosts:  # outermost of all: a rebound domain's request gets nothing else
        app.add_middleware(HostAllowList, allowed=settings.allowed_hosts)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer, even a refused Host, has its id
    _add_routes(app, ctx)
    add_kv_event_routes(app, ctx)  # for a cache-aware router (kvserve route)
    insight.add_routes(app, ctx)
    return app


def _add_routes(app: FastAPI, ctx: ServerContext) -> None:
    from kvserve.server.chat_completions import create_chat_completion
    from kvserve.server.completions import create_completion
    from kvserve.server.embeddings import create_embedding

    settings, state = ctx.settings, ctx.state

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, ctx)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, ctx)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embedding(request, ctx)

    def card() -> dict:
        state.require_ready()
        return {"id": settings.model_name, "object": "model", "created": state.started, "owned_by": "kvserve",
                "max_model_len": state.llm.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != settings.model_name:
            raise APIError(404, f"the model {model_id!r} is not served here: GET /v1/models lists the one that is",
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
        limit = state.llm.max_model_len
        try:
            if req.messages is not None:
                msgs = [m.for_template() for m in req.messages]
                ids = await ctx.client.encode_chat(msgs, req.add_generation_prompt)
            else:
                ids = await ctx.client.encode(req.prompt, req.add_special_tokens)
        except ValueError as e:
            raise from_invalid(e, {"prompt": "messages"} if req.messages is not None else None) from None
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        state.require_ready()
        req = await ctx.parse(request, DetokenizeRequest)
        vocab, limit = state.llm.config.vocab_size, state.llm.max_model_len
        if len(req.tokens) > limit:
            raise APIError(400, f"tokens: at most {limit} ids (the context length), got {len(req.tokens)}",
                           param="tokens")
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await asyncio.to_thread(state.llm.tokenizer.decode, req.tokens)}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        status, what = state.health()
        headers = {"Connection": "close"} if what == "draining" else None
        return JSONResponse({"status": what}, status_code=status, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = ctx.metrics.render()
        return Response(body, media_type=content_type)
