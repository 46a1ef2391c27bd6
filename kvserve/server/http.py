"""Connection hygiene under uvicorn's HTTP/1.1 protocol (h11), for the server.

kvserve/web/guards.py's header timeout, connection cap and JSON 400 for malformed HTTP (a
Content-Length of -1 or 10^30), shared with the router; here only what h11 alone can tell: when a
request head is complete.
"""
from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.web.guards import ConnectionGuards

log = logging.getLogger("kvserve.server")


def guarded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class with these limits, for `uvicorn.Config(http=...)`."""

    class GuardedH11Protocol(ConnectionGuards, H11Protocol):
        who, guard_log = "server", log

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
    return GuardedH11Protocol
