"""Connection hygiene under uvicorn's HTTP/1.1 protocol (h11).

uvicorn keeps a connection open for as long as its client takes to send the headers, so a
client that sends half a request line and waits ("slow loris") holds a connection forever, and
enough of them hold them all. Here:
  - a request's headers must arrive within `header_timeout` seconds of the connection opening
    (or of the previous response on a keep-alive connection), else the connection is closed;
  - at most `max_connections` connections are open at once: one more is answered 503 (the OpenAI
    error body) and closed before anything is read;
  - malformed HTTP (a Content-Length of -1 or 10^30) is answered 400 with the OpenAI error body,
    not uvicorn's plain text.
"""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.server.errors import error_body

log = logging.getLogger("kvserve.server")


def raw_error_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with the OpenAI error body, for writing before any parsing."""
    body = json.dumps(error_body(status, message, None, "connection_refused" if status == 503 else None)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n")
    return head.encode() + body


def guarded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol class with these limits, for `uvicorn.Config(http=...)`."""

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("refused a connection: %d open, the limit is %d", len(self.connections) - 1,
                            max_connections)
                transport.write(raw_error_response(503, "Service Unavailable",
                                              f"the server has {max_connections} connections open, its limit: "
                                              "retry after a moment"))
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            # IDLE: h11 has not yet read a whole request head on this cycle (uvicorn keeps the
            # previous cycle object around on keep-alive connections, so it cannot tell).
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                log.info("closed a connection that sent no complete request headers within %g s", header_timeout)
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # the request head is in
                self._disarm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():  # a keep-alive connection: the next request's clock
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

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

    return GuardedH11Protocol
