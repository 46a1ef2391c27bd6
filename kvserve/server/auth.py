"""API key check: `Authorization: Bearer <key>` on every route but the open ones.

A plain ASGI middleware (it must not buffer streamed responses). The comparison is constant-time
so the key cannot be guessed byte by byte from response times.
"""
from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError

# The page and its static files hold nothing secret; the page sends the key on its API calls.
OPEN_PATHS = frozenset({"/health", "/metrics", "/", "/static/index.html", "/static/app.js", "/static/app.css"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)  # OPTIONS: CORS preflights carry no credentials
            return
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send Authorization: Bearer <key>" if not given else "invalid API key"
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)
