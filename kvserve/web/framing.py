"""Ambiguous message framing refused, for the server and the router.

A request with both Content-Length and Transfer-Encoding can be read two ways; a proxy in front
that reads it the other way lets a client smuggle a second request inside the body (RFC 9112
§6.3: such a message is to be treated as an error, the connection closed). uvicorn's h11
protocol reads the chunked body and keeps the connection; the router's httptools parser refuses
it before the app runs. This middleware answers 400 with `Connection: close` in both.
"""
from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.web.errors import APIError


class FramingCheck:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            names = {k for k, _ in scope["headers"] if k in (b"content-length", b"transfer-encoding")}
            if len(names) == 2:
                error = APIError(400, "the request has both Content-Length and Transfer-Encoding, which frame its "
                                      "body two ways: send one of them", headers={"Connection": "close"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
