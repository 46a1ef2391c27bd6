"""Connection hygiene under uvicorn's HTTP/1.1 protocol (h11), for the server.

kvserve/web/guards.py's header timeout and connection cap (shared with the router), and:
  - malformed HTTP (a Content-Length of -1 or 10^30) is answered 400 with the OpenAI error body,
    not uvicorn's plain text.
"""
from __future__ import annotations

import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.server.errors import error_body
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

        def send_400_response(self, msg: str) -> None:
            log.info("malformed HTTP request: %s", msg)
            body = json.dumps(error_body(400, f"malformed HTTP request: {msg}")).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers, reason=b"Bad Request")))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:  # the state machine is past sending a response
                pass
            self.transport.close()

    GuardedH11Protocol.header_timeout, GuardedH11Protocol.max_connections = header_timeout, max_connections
    return GuardedH11Protocol
