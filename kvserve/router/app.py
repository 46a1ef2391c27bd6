"""The router's FastAPI app: its own /health, /metrics and /admin, and every other route proxied.

    app = build_router_app(RouterSettings(replicas=("http://10.0.0.1:8000", "http://10.0.0.2:8000")))

/v1/* (completions, chat, Anthropic's messages, models, anything a replica serves), Ollama's /api/*,
/tokenize and /detokenize go to a replica (kvserve/router/proxy.py); `/` is a live page of the replicas and the routing decisions
(kvserve/router/page.py); any other path is the router's own 404, in the same OpenAI
error body a kvserve server sends.

The proxied paths skip FastAPI: RouterApp, the ASGI entry, hands them to proxy.handle directly,
since FastAPI's routing and its middleware's wrappers around every send() cost more than the
rest of the router on a streamed token. The router's own pages stay on FastAPI.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.router.admin import add_admin_routes
from kvserve.router.page import add_page_routes
from kvserve.router.proxy import handle
from kvserve.router.settings import RouterSettings
from kvserve.router.state import RouterState
from kvserve.server import routes
from kvserve.web.body import FramingCheck
from kvserve.web.draining import DrainingServer
from kvserve.web.errors import APIError, install_handlers
from kvserve.web.hosts import host_error

log = logging.getLogger("kvserve.router")
PROXIED_METHODS = ["GET", "POST", "DELETE"]
# Beside everything under /v1/ and /api/: the API routes of the server's table outside them (POST /tokenize, ...).
PROXIED_PATHS = routes.FORWARDED_PATHS


class HeaderLimit:
    """431 for a request with more than max_headers headers (uvicorn bounds their total size)."""

    def __init__(self, app: ASGIApp, max_headers: int) -> None:
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and len(scope["headers"]) > self.max_headers:
            error = APIError(431, f"the request has {len(scope['headers'])} headers, more than the router's "
                             f"limit of {self.max_headers}", code="headers_too_large")
            await error.response(scope["path"])(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RouterApp:
    """The ASGI entry: proxied requests straight to the proxy, everything else to FastAPI."""

    def __init__(self, api: FastAPI, state: RouterState) -> None:
        self.api = api
        self.state = state
        self.allowed_hosts = state.settings.allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allowed_hosts and (error := host_error(scope, self.allowed_hosts)) is not None:
            await error.response(scope["path"])(scope, receive, send)  # --allowed-hosts: before any route
            return
        if scope["type"] == "http":
            path, method = scope["path"], scope["method"]
            if (method in PROXIED_METHODS and path.startswith(("/v1/", "/api/"))) or (method == "POST" and path in PROXIED_PATHS):
                await handle(scope, receive, send, self.state)
                return
        await self.api(scope, receive, send)


def build_router_app(settings: RouterSettings) -> RouterApp:
    state = RouterState(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        up = len(state.replicas.up())
        log.info("kvserve route: %s at %s, policy %s, %d of %d replica(s) healthy", settings.policy.name,
                 settings.url, settings.policy.name, up, len(state.replicas))
        yield
        await state.stop()

    app = FastAPI(title="kvserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state
    install_handlers(app)
    app.add_middleware(HeaderLimit, max_headers=settings.max_headers)
    app.add_middleware(FramingCheck)

    @app.get("/health")
    async def health() -> Response:
        healthy = len(state.replicas.up())
        if state.draining:
            return JSONResponse({"status": "draining", "healthy_replicas": healthy}, status_code=503)
        return JSONResponse({"status": "ready" if healthy else "no_replica", "healthy_replicas": healthy},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    add_admin_routes(app, state)
    add_page_routes(app, state)  # / : replicas, loads and routing decisions, live

    async def forward(request: Request) -> Response:  # RouterApp sends these past FastAPI
        raise AssertionError("proxied paths are handled by RouterApp")

    # Declared so that FastAPI answers a proxied path's other methods 405, not 404.
    app.add_api_route("/v1/{path:path}", forward, methods=PROXIED_METHODS, include_in_schema=False)
    app.add_api_route("/api/{path:path}", forward, methods=PROXIED_METHODS, include_in_schema=False)
    for path in PROXIED_PATHS:
        app.add_api_route(path, forward, methods=["POST"], include_in_schema=False)
    return RouterApp(app, state)


class RouterServer(DrainingServer):
    """The router's uvicorn: a drain lets the requests in flight finish, up to the drain timeout
    (kvserve/web/draining.py)."""

    def __init__(self, config: uvicorn.Config, state: RouterState) -> None:
        super().__init__(config)
        self.router = state

    async def drain(self, signal_name: str) -> None:
        self.router.draining = True
        log.info("%s: draining, %d request(s) in flight, up to %g s", signal_name, self.router.active,
                 self.router.settings.drain_timeout)
        if not await self.router.wait_idle(self.router.settings.drain_timeout):
            log.warning("drain timeout: %d request(s) still in flight are cut off", self.router.active)
            return
        self._draining = True
        if self._loop is not None:  # (set when the server started, before any signal)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        self.router.draining = True
        log.info("draining: %d request(s) in flight, up to %g s", self.router.active, self.router.settings.drain_timeout)
        if not await self.router.wait_idle(self.router.settings.drain_timeout):
            log.warning("drain timeout: %d request(s) still in flight are cut off", self.router.active)
        self.should_exit = True


def make_server(settings: RouterSettings, access_log: bool = False) -> RouterServer:
    """The router app on uvicorn, with httptools' parser and a draining shutdown; `.run()` serves."""
    from kvserve.web.protocols import httptools_options

    app = build_router_app(settings)
    # The protocol's connection cap (a JSON 503) is a backstop past the router's 503 (max_concurrent_requests).
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_config=None, access_log=access_log,
                            timeout_graceful_shutdown=2, server_header=False,
                            **httptools_options(settings.header_timeout, settings.max_connections))
    return RouterServer(config, app.state)
