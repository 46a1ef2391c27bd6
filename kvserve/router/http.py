"""The router's HTTP/1.1 server protocol: uvicorn's httptools one (C parser), with connection
hygiene shared with the server (kvserve/web/guards.py: a header timeout, so that clients
trickling header bytes cannot hold the router's connections, and a connection cap answered with
the OpenAI error body), and a request head larger than `max_head_bytes` answered 400 and closed.

httptools makes uvicorn's send() per streamed chunk a few bytes of Python where h11's is a
state machine in Python (about a sixth of the router's CPU per token); the router's client to
replicas parses with it too (kvserve/router/upstream.py), so it is a dependency. uvicorn's
httptools protocol has no bound on a head (its h11 one has) nor a header timeout, and its
`limit_concurrency` answers plain text, so BoundedHttpTools adds them.
"""
from __future__ import annotations

import logging
from typing import Any

from kvserve.web.guards import ConnectionGuards


def http_options(max_head_bytes: int, header_timeout: float, max_connections: int) -> dict[str, Any]:
    """The uvicorn.Config arguments that choose the protocol."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # a dependency, but an install may have lost it
        raise RuntimeError("kvserve route needs httptools: pip install 'httptools>=0.6'") from None

    class BoundedHttpTools(ConnectionGuards, HttpToolsProtocol):
        who = "router"
        _in_head = True  # a request's head has begun (or may begin) and is not complete
        _head_bytes = 0

        def _head_pending(self) -> bool:
            return not (self.cycle is not None and not self.cycle.response_complete)

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

    BoundedHttpTools.header_timeout, BoundedHttpTools.max_connections = header_timeout, max_connections
    BoundedHttpTools.guard_log = logging.getLogger("uvicorn.error")
    return {"http": BoundedHttpTools}
