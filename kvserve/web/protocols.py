"""uvicorn's HTTP/1.1 protocols with kvserve's connection guards (kvserve/web/guards.py: a header
timeout, a connection cap answered with the OpenAI error body, a request head of at most 64 KiB
answered 431 past it, malformed HTTP answered 400), for the server (h11) and the router
(httptools). Each says what only its parser can tell: when a request head is complete.

The router runs httptools (C parser): uvicorn's send() per streamed chunk is then a few bytes of
Python where h11's is a state machine in Python (about a sixth of the router's CPU per token); its
client to replicas parses with it too (kvserve/router/upstream.py), so it is a dependency.
"""
from __future__ import annotations

import logging
from typing import Any

from kvserve.web.guards import MAX_HEAD_BYTES, ConnectionGuards


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
