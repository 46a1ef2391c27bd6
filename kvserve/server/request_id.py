"""`x-request-id` on every response, so a client (or a proxy in front) can match its request with
the server's log and timeline.

A client's own id is echoed when it is sane (1 to 128 printable ASCII characters, no spaces);
otherwise the server makes one. A generation route names its request by the id it hands the
engine (`chatcmpl-…`, `cmpl-…`: the response's `id`, and the key of
`GET /v1/requests/{id}/timeline`), so without a client id the header is that same id. A client's
id is not handed to the engine as is: two clients may send the same one, and engine ids must be
unique; the route logs which engine id it got, and a generation's answer also carries that engine
id as `x-kvserve-request-id` (the router's map of stored responses, router/response_homes.py).
"""
from __future__ import annotations

import logging
import uuid

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvserve.server")
HEADER = b"x-request-id"
ENGINE_HEADER = b"x-kvserve-request-id"  # the engine's own id (the response's `id`), even when x-request-id is the client's
MAX_LENGTH = 128


def sane(value: bytes) -> bool:
    """1..MAX_LENGTH visible ASCII characters (0x21-0x7e): safe to echo in a header and a log."""
    return 0 < len(value) <= MAX_LENGTH and all(0x21 <= b <= 0x7E for b in value)


def name(request: Request, prefix: str, sep: str = "-") -> str:
    """A new engine id for the request's work (`<prefix>-<hex>`; the Responses API's are
    `resp_<hex>`, as OpenAI's), which its x-request-id will carry unless the client sent its own;
    a client's id is logged beside it."""
    engine_id = f"{prefix}{sep}{uuid.uuid4().hex}"
    state = request.scope.setdefault("state", {})
    state["engine_request_id"] = engine_id
    if state.get("client_request_id"):
        log.info("x-request-id %s is %s", state["client_request_id"], engine_id)
    return engine_id


class RequestIdMiddleware:
    """Sets `x-request-id` on every HTTP response (a plain ASGI middleware: it must not buffer streams)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == HEADER), None)
        state = scope.setdefault("state", {})
        if given is not None and sane(given):
            state["client_request_id"] = given.decode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = state.get("client_request_id") or state.get("engine_request_id") or uuid.uuid4().hex
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() not in (HEADER, ENGINE_HEADER)]
                headers.append((HEADER, rid.encode("ascii")))
                if state.get("engine_request_id"):  # whatever the client's id: a router keys stored responses by it
                    headers.append((ENGINE_HEADER, state["engine_request_id"].encode("ascii")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)
