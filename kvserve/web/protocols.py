"""uvicorn's HTTP/1.1 protocols with kvserve's connection guards, for the server (h11) and the
router (httptools). Each says what only its parser can tell: when a request head is complete.

The router runs httptools (C parser): uvicorn's send() per streamed chunk is then a few bytes of
Python where h11's is a state machine in Python (about a sixth of the router's CPU per token); its
client to replicas parses with it too (kvserve/router/upstream.py), so it is a dependency.

uvicorn keeps a connection open for as long as its client takes to send the headers, so a
client that sends half a request line and waits ("slow loris") holds a connection forever, and
enough of them hold them all; and its own connection limit answers in plain text. A protocol
class that mixes in `ConnectionGuards` (before uvicorn's protocol in the bases) gets:
  - a header timeout: a request's headers must arrive within `header_timeout` seconds of the
    connection opening (or of the previous response on a keep-alive connection), else the
    connection is closed;
  - a connection cap: with `max_connections` open, one more is answered 503 with the OpenAI error
    body and closed before anything is read;
  - a request head (request line and headers) bounded by `max_head_bytes`: past it the request is
    answered 431 with the OpenAI error body and the connection closed, before the parser buffers
    more, whether the head comes in one read or trickles in over many;
  - malformed HTTP answered 400 with the OpenAI error body, and the connection closed.
Each protocol says when a request head is still pending (`_head_pending`), as only it can tell.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

from kvserve.web.errors import error_body

MAX_HEAD_BYTES = 64 << 10  # a request's line and headers, the server's and the router's


def raw_error_response(status: int, reason: str, message: str, code: str | None = None) -> bytes:
    """A whole HTTP/1.1 response with the OpenAI error body, for writing before any parsing."""
    body = json.dumps(error_body(status, message, None, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


class HeadBytes:
    """The bytes of the request head being read, counted up to its end (the blank line), across
    reads: fed only while a head is pending, so a body's bytes are never counted."""

    _END = re.compile(rb"\r?\n\r?\n")

    def __init__(self) -> None:
        self.seen = 0
        self.tail = b""  # the last bytes of the previous read: the blank line may be split between reads

    def feed(self, data: bytes) -> int:
        """The head's size so far, with `data`; counting starts again after a head's end."""
        window = self.tail + data
        end = self._END.search(window)
        if end is None:
            self.seen, self.tail = self.seen + len(data), window[-3:]
            return self.seen
        size = self.seen + end.end() - len(self.tail)
        self.seen, self.tail = 0, b""
        return size


class ConnectionGuards:
    """The header timeout, the connection cap and the head bound (see the module docstring)."""

    header_timeout: float
    max_connections: int
    max_head_bytes: int = MAX_HEAD_BYTES
    _head: HeadBytes | None = None
    who: str  # "server" or "router", for the 503's message
    guard_log: logging.Logger
    _header_timer: asyncio.TimerHandle | None = None
    # Given by uvicorn's protocol classes:
    connections: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (a mixin: the uvicorn protocol after it in the MRO has these methods, and keeps the transport)
        super().connection_made(transport)  # type: ignore[misc]
        if len(self.connections) > self.max_connections:
            self.guard_log.warning("refused a connection: %d open, the limit is %d", len(self.connections) - 1,
                                   self.max_connections)
            self.transport.write(raw_error_response(
                503, "Service Unavailable",
                f"the {self.who} has {self.max_connections} connections open, its limit: retry after a moment",
                "connection_refused"))
            self.transport.close()
            return
        self._arm_header_timer()

    def _head_pending(self) -> bool:
        """Whether the connection is waiting for (the rest of) a request head."""
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        if self._head_pending() and not self.transport.is_closing():
            self._head = self._head or HeadBytes()
            if (size := self._head.feed(data)) > self.max_head_bytes:
                self.guard_log.info("a request head of %d bytes or more: answered 431, connection closed", size)
                self.transport.write(raw_error_response(
                    431, "Request Header Fields Too Large",
                    f"the request's line and headers are larger than the {self.who}'s limit of "
                    f"{self.max_head_bytes} bytes", "headers_too_large"))
                self.transport.close()
                return
        super().data_received(data)  # type: ignore[misc]

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self._head_pending() and not self.transport.is_closing():
            self.guard_log.info("closed a connection that sent no complete request headers within %g s",
                                self.header_timeout)
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (a Content-Length of -1, both Content-Length and Transfer-Encoding, a bad
        request line) answered with the OpenAI error body rather than uvicorn's plain text."""
        self.guard_log.info("malformed HTTP request: %s", msg)
        if not self.transport.is_closing():
            self.transport.write(raw_error_response(400, "Bad Request", f"malformed HTTP request: {msg}"))
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)  # type: ignore[misc]


def h11_options(header_timeout: float, max_connections: int, guard_log: logging.Logger) -> dict[str, Any]:
    """The server's: the uvicorn.Config arguments that choose h11 with these limits."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(ConnectionGuards, H11Protocol):
        who = "server"

        def _head_pending(self) -> bool:
            # IDLE: h11 has not yet read a whole request head on this cycle (uvicorn keeps the
            # previous cycle object around on keep-alive connections, so it cannot tell).
            return self.conn.their_state is h11.IDLE

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request head is in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # a keep-alive connection: the next request's clock
                self._arm_header_timer()

    GuardedH11Protocol.header_timeout, GuardedH11Protocol.max_connections = header_timeout, max_connections
    GuardedH11Protocol.guard_log = guard_log
    # h11's own bound on what it buffers of an incomplete head (16 KiB unless told) is the same as
    # the guard's, for a head read while the previous request is still being answered.
    return {"http": GuardedH11Protocol, "h11_max_incomplete_event_size": MAX_HEAD_BYTES}


def httptools_options(header_timeout: float, max_connections: int) -> dict[str, Any]:
    """The router's: the uvicorn.Config arguments that choose httptools with these limits."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # a dependency, but an install may have lost it
        raise RuntimeError("kvserve route needs httptools: pip install 'httptools>=0.6'") from None

    class BoundedHttpTools(ConnectionGuards, HttpToolsProtocol):
        who = "router"

        def _head_pending(self) -> bool:
            return not (self.cycle is not None and not self.cycle.response_complete)

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # A keep-alive connection waits for its next head: that head's clock starts now,
            # unless a pipelined request already started.
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()

    BoundedHttpTools.header_timeout, BoundedHttpTools.max_connections = header_timeout, max_connections
    BoundedHttpTools.guard_log = logging.getLogger("uvicorn.error")
    return {"http": BoundedHttpTools}
