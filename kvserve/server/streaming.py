"""Responses that stop their work when the client goes away.

Both kinds watch the connection for http.disconnect while the engine works. When the client
leaves, the work is cancelled; the engine iterator's cleanup then aborts the request, and the
engine frees its KV blocks before its next step. An `on_close` callback runs in every case,
even if the client left before the first byte (it releases the admission).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvserve.server")
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_of(work: asyncio.Future, receive: Receive) -> None:
    """Wait for work or a disconnect; on leaving (either way, or cancelled) nothing is left running."""
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of work, or ClientDisconnected if the client left first (work is then cancelled)."""
    task = asyncio.ensure_future(work)
    await _first_of(task, request.receive)
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


def sse(data: dict | str) -> bytes:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class EventStream(Response):
    """text/event-stream from an async iterator of ready-made events."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await _first_of(asyncio.ensure_future(self._pump(send)), receive)
        finally:
            self.on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
