"""The FastAPI app: the API key check, the middleware stack and the route table mounted (the
routes are in server/routes.py, its settings in server/settings.py, the context every route
shares in server/context.py).

    app = build_app(ServerSettings(model_name="smollm2-135m"), load=lambda: LLM("smollm2-135m"))

With `load`, the model loads on a thread when the app starts and /health answers 503 until it
is ready; with `llm`, the app is ready at once (tests, embedding in another program).
"""
from __future__ import annotations

import hmac
import inspect
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve import __version__
from kvserve.server import api_docs
from kvserve.server.context import ServerContext
from kvserve.server.errors import APIError
from kvserve.server.request_id import RequestIdMiddleware
from kvserve.server.routes import ROUTES, Endpoint
from kvserve.server.settings import ServerSettings
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

    # The table's open routes (server/routes.py): health probes, the page, the docs, Ollama's version probe.
    OPEN = tuple(compile_path(r.path)[0] for r in ROUTES if r.open)

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._bearer = f"Bearer {api_key}".encode()
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or any(p.match(scope["path"]) for p in self.OPEN):
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

    # /docs (served offline) and /openapi.json with each route's body model are routes of the table
    # (kvserve/server/api_docs.py).
    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
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
    _mount(app, ctx)
    return app


def _mount(app: FastAPI, ctx: ServerContext) -> None:
    """Every route of the table (server/routes.py), bound to the context, and its bodies in the docs."""
    for route in ROUTES:
        own = getattr(route.endpoint, "__self__", route.endpoint)  # a route class (its handle), or a function
        for method in route.methods.split():  # one operation each: their ids differ
            app.add_api_route(route.path, _bound(route.endpoint, ctx), methods=[method], tags=[route.api],
                              name=own.__name__, description=inspect.getdoc(own) or "",
                              include_in_schema=route.documented, openapi_extra=_path_parameters(route.path))
    bodies = {r.path: r.body for r in ROUTES if r.body is not None and r.methods == "POST"}
    app.openapi = lambda: api_docs.openapi(app, bodies)  # type: ignore[method-assign]


def _bound(endpoint: Endpoint, ctx: ServerContext) -> Callable[[Request], Awaitable[Any]]:
    async def bound(request: Request) -> Any:
        return await endpoint(request, ctx)

    return bound


def _path_parameters(path: str) -> dict[str, Any] | None:
    """The OpenAPI parameters of a path's {placeholders} (endpoints read them from the request)."""
    names = [p.split(":")[0] for p in re.findall(r"{([^}]+)}", path)]
    return {"parameters": [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                           for n in names]} if names else None
