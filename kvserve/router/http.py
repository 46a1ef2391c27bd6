"""The router's HTTP/1.1 server protocol: uvicorn's httptools one (C parser), with connection
hygiene like the server's (kvserve/server/http.py):
  - a request head larger than `max_head_bytes` is answered 400 and its connection closed;
  - a request's headers must arrive within `header_timeout` seconds of the connection opening
    (or of the previous response on a keep-alive connection), else the connection is closed, so
    that clients trickling header bytes ("slow loris") cannot hold the router's connections;
  - at most `max_connections` connections are open at once: one more is answered 503 (the
    OpenAI error body) and closed before anything is read.

httptools makes uvicorn's send() per streamed chunk a few bytes of Python where h11's is a
state machine in Python (about a sixth of the router's CPU per token); the router's client to
replicas parses with it too (kvserve/router/upstream.py), so it is a dependency. uvicorn's
httptools protocol has no bound on a head (its h11 one has) nor a header timeout, and its
`limit_concurrency` answers plain text, so BoundedHttpTools adds them.
"""
from __future__ import annotations

import asyncio
from typing import Any

from kvserve.server.http import raw_error_response


def http_options(max_head_bytes: int, header_timeout: float, max_connections: int) -> dict[str, Any]:
    """The uvicorn.Config arguments that choose the protocol."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # a dependency, but an install may have lost it
        raise RuntimeError("kvserve route needs httptools: pip install 'httptools>=0.6'") from None

    class BoundedHttpTools(HttpToolsProtocol):
        _in_head = True  # a request's head has begun (or may begin) and is not complete
        _head_bytes = 0
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self.logger.warning("refused a connection: %d open, the limit is %d", len(self.connections) - 1,
                                    max_connections)
                transport.write(raw_error_response(
                    503, "Service Unavailable",
                    f"the router has {max_connections} connections open, its limit: retry after a moment"))
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
            busy = self.cycle is not None and not self.cycle.response_complete
            if not busy and not self.transport.is_closing():
                self.logger.info("closed a connection that sent no complete request headers within %g s",
                                 header_timeout)
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # A keep-alive connection waits for its next head: that head's clock starts now,
            # unless a pipelined request already started.
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # Counted only while one head goes on across reads: a read that also holds the end of
            # the previous request (a pipelined body) is not the head's. So: limit + one read.
            was_in_head = self._in_head
            super().data_received(data)
            if was_in_head and self._in_head and not self.transport.is_closing():
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self.logger.info("a request head over %d bytes: connection closed", max_head_bytes)
                    self.send_400_response(f"the request head is larger than {max_head_bytes} bytes")

    return {"http": BoundedHttpTools}
