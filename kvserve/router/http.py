"""The router's HTTP/1.1 server protocol: uvicorn's httptools one (C parser), with a request head
larger than `max_head_bytes` answered 400 and its connection closed.

httptools makes uvicorn's send() per streamed chunk a few bytes of Python where h11's is a
state machine in Python (about a sixth of the router's CPU per token); the router's client to
replicas parses with it too (kvserve/router/upstream.py), so it is a dependency. uvicorn's
httptools protocol has no bound on a head (its h11 one has), so BoundedHttpTools counts what
arrives while a request's head is incomplete.
"""
from __future__ import annotations

from typing import Any


def http_options(max_head_bytes: int) -> dict[str, Any]:
    """The uvicorn.Config arguments that choose the protocol."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # a dependency, but an install may have lost it
        raise RuntimeError("kvserve route needs httptools: pip install 'httptools>=0.6'") from None

    class BoundedHttpTools(HttpToolsProtocol):
        _in_head = True  # a request's head has begun (or may begin) and is not complete
        _head_bytes = 0

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

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
