"""One HTTP request carried from the ingress to a replica, and run there through kvserve's own
app in-process (ASGI, no socket): its answer comes back as a head, then body chunks.

What the ingress sends is a plain dataclass, so the request router can read the body to route by
its prompt. The replica's app sees the client's request (method, path, query, headers less the
hop-by-hop ones, body); a client that leaves (the ingress cancels the call) reaches the app as
`http.disconnect`, so the engine aborts the request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.types import ASGIApp, Message

# Headers of one hop only; the body is whole, so its length is set anew.
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"te", b"trailer", b"transfer-encoding", b"upgrade",
                         b"content-length", b"proxy-connection"})
_QUEUED_MESSAGES = 8  # body chunks the app may run ahead of the reader before its send() waits


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None

    @classmethod
    def from_scope(cls, scope: dict, body: bytes) -> ForwardedRequest:
        headers = tuple((k.lower(), v) for k, v in scope["headers"])
        client = tuple(scope["client"]) if scope.get("client") else None
        return cls(scope["method"], scope["path"], scope.get("query_string", b""), headers, body, client)

    def scope(self) -> dict:
        headers = [(k, v) for k, v in self.headers if k not in _HOP_BY_HOP]
        headers.append((b"content-length", str(len(self.body)).encode()))
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "root_path": "",
                "query_string": self.query_string, "headers": headers, "client": self.client,
                "server": ("127.0.0.1", 0), "state": {}}


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


async def call_app(app: ASGIApp, request: ForwardedRequest) -> AsyncIterator[ResponseHead | bytes]:
    """Run request through app; yields its ResponseHead, then each non-empty body chunk."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue(_QUEUED_MESSAGES)
    left = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(request.scope(), receive, messages.put)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseHead(message["status"], tuple((k, v) for k, v in message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        if task.done() and (error := task.exception()) is not None:
            raise error
    finally:
        left.set()  # the app sees the client gone (a stream is aborted, its blocks freed)
        while not task.done():  # let it finish: drain what it still sends
            try:
                await asyncio.wait_for(messages.get(), 5.0)
            except TimeoutError:
                task.cancel()
        await asyncio.gather(task, return_exceptions=True)
