"""Responses that stop their work when the client goes away, or when the server cuts it off.

Both kinds watch the connection for http.disconnect while the engine works. When the client
leaves, the work is cancelled; the engine iterator's cleanup then aborts the request, and the
engine frees its KV blocks before its next step. The work is also registered in `tracked`, so
that a drain past its timeout can cancel it; the client then gets a 503 (or, mid-stream, a
final error event) instead of a dropped connection. An `on_close` callback runs in every case,
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

from kvserve.server.errors import OPENAI, APIError, Dialect

log = logging.getLogger("kvserve.server")
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


def cut_off() -> APIError:
    return APIError(503, "the server shut down before this request finished (drain timeout)", code="shutdown")


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_of(work: asyncio.Future, receive: Receive, tracked: set[asyncio.Future]) -> bool:
    """Wait for work or a disconnect; True if the client left. Nothing is left running after."""
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    tracked.add(work)
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        return watch.done() and not work.done()
    finally:
        tracked.discard(work)
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def run_until_disconnect(request: Request, work: Awaitable[T], tracked: set[asyncio.Future]) -> T:
    """The result of work; ClientDisconnected if the client left first, a 503 if it was cut off."""
    task = asyncio.ensure_future(work)
    if await _first_of(task, request.receive, tracked):
        raise ClientDisconnected
    if task.cancelled():
        raise cut_off()
    return task.result()


def sse(data: dict | str) -> bytes:
    """One Server-Sent Event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class EventStream(Response):
    """A stream of ready-made events (SSE, or NDJSON for Ollama's API); a failure after the head
    was sent ends it with the dialect's error event."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None], tracked: set[asyncio.Future],
                 dialect: Dialect = OPENAI) -> None:
        self.events = events
        self.on_close = on_close
        self.tracked = tracked
        self.dialect = dialect
        self.media_type = dialect.stream_media_type
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        try:
            if await _first_of(pump, receive, self.tracked):
                return  # the client left; nobody to tell
            if pump.cancelled():  # cut off by the server (drain timeout, or a client that reads nothing)
                if self._started:
                    last = {"type": "http.response.body", "body": self.dialect.stream_error(cut_off()), "more_body": False}
                    try:  # bounded: a client that reads nothing cannot hold this task
                        await asyncio.wait_for(send(last), 1.0)
                    except (asyncio.TimeoutError, OSError):
                        log.info("a stream was cut off without its last event: its client is not reading")
                else:
                    await cut_off().response(scope["path"])(scope, receive, send)
            elif pump.exception() is not None:
                log.error("a stream failed", exc_info=pump.exception())
                if self._started:
                    error = APIError(500, "internal server error (see the server log)")
                    await send({"type": "http.response.body", "body": self.dialect.stream_error(error),
                                "more_body": False})
        finally:
            self.on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._started = True
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
