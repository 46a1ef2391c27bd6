"""A request's body, for the server and the router alike: framed one way, and read under a size
limit.

Framing: a request with both Content-Length and Transfer-Encoding can be read two ways; a proxy
in front that reads it the other way lets a client smuggle a second request inside the body
(RFC 9112 §6.3: such a message is to be treated as an error, the connection closed). uvicorn's
h11 protocol reads the chunked body and keeps the connection; the router's httptools parser
refuses it before the app runs. `FramingCheck` answers 400 with `Connection: close` in both.

Size: the limit is enforced from Content-Length before anything is read, and again while
reading (a chunked body declares no length). A client that disconnects mid-body raises
starlette's ClientDisconnect, which both apps answer with one log line, not a traceback.
"""
from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.web.errors import APIError


class FramingCheck:
    """ASGI middleware: 400 and a closed connection for a body framed two ways."""

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


def _too_large(limit: int, who: str) -> APIError:
    return APIError(413, f"the request body is larger than the {who}'s limit of {limit} bytes",
                    code="request_too_large")


async def read_body(scope: Scope, receive: Receive, limit: int, who: str) -> bytes:
    """The whole body: 413 past `limit` bytes (`who`, "server" or "router", names whose limit),
    400 for a Content-Length that is not a number."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise APIError(400, "the Content-Length header is not a number")
            if len(value) > 18 or int(value) > limit:
                raise _too_large(limit, who)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, who)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
