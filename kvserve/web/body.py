"""Reading a request body under a size limit, for the server and the router alike.

The limit is enforced from Content-Length before anything is read, and again while reading (a
chunked body declares no length). A client that disconnects mid-body raises starlette's
ClientDisconnect, which both apps answer with one log line, not a traceback.
"""
from __future__ import annotations

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope

from kvserve.web.errors import APIError


async def read_body(scope: Scope, receive: Receive, limit: int, who: str) -> bytes:
    """The whole body: 413 past `limit` bytes (`who`, "server" or "router", names whose limit),
    400 for a Content-Length that is not a number."""
    too_large = APIError(413, f"the request body is larger than the {who}'s limit of {limit} bytes",
                         code="request_too_large")
    for name, value in scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise APIError(400, "the Content-Length header is not a number")
            if len(value) > 18 or int(value) > limit:
                raise too_large
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
