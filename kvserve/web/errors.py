"""Error bodies, and turning every failure into one: for the server and the router alike.

Every error answers in the shape of the API its path belongs to (`dialect(path)`):
  OpenAI (/v1/*, the default)    {"error": {"message", "type", "param", "code"}}
  Anthropic (/v1/messages*)      {"type": "error", "error": {"type", "message"}}
  Ollama (/api/*)                {"error": "message"}
Bad input is a 4xx naming the parameter, its message cut short if it quotes too much of the
client's input; anything unforeseen is a 500 whose body says nothing about the service's insides
(the traceback goes to the log only). A stream that fails after its head was sent ends with the
dialect's error events instead (`Dialect.error_events`, framed as its streams are: kvserve/web/framing.py).
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvserve.web.framing import NAMED_SSE, NDJSON, SSE, Framing

log = logging.getLogger("kvserve.server")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    408: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self, path: str = "") -> ErrorResponse:
        """The answer in the shape of the API `path` belongs to (OpenAI's without one)."""
        return ErrorResponse(dialect(path).body(self), status_code=self.status, headers=self.headers)


class ErrorResponse(JSONResponse):
    """ASCII-escaped JSON: an echo of odd client text can never fail to encode."""

    def render(self, content: object) -> bytes:
        return _dumps(content)


MAX_MESSAGE_CHARS = 1000  # past this, a message quotes too much of the client's input: cut


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + f"... (cut: {len(message)} characters)"
    if param is not None and len(param) > MAX_MESSAGE_CHARS:
        param = param[:MAX_MESSAGE_CHARS] + "..."
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _dumps(body: object) -> bytes:
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class Dialect:
    """How one API family words an error: as a body, and as the last events of a stream."""

    framing: Framing = SSE  # how its streams are written

    def body(self, e: APIError) -> dict:
        return e.body()

    def error_events(self, e: APIError) -> list[dict]:
        return [self.body(e)]

    def stream_error(self, e: APIError) -> bytes:
        """The end of a stream that failed, ready to send."""
        return self.framing.close(self.error_events(e))


# Anthropic's error types (anthropic/types/shared/error_type.py) by status.
ANTHROPIC_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                         429: "rate_limit_error", 500: "api_error", 503: "overloaded_error", 504: "timeout_error"}


class Anthropic(Dialect):
    framing = NAMED_SSE  # its error event is named "error", by the body's type

    def body(self, e: APIError) -> dict:
        kind = ANTHROPIC_ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": e.body()["error"]["message"]}}


class Ollama(Dialect):
    framing = NDJSON  # one line, which the ollama client raises

    def body(self, e: APIError) -> dict:
        return {"error": e.body()["error"]["message"]}


OPENAI, ANTHROPIC, OLLAMA = Dialect(), Anthropic(), Ollama()


def dialect(path: str) -> Dialect:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path.startswith("/api/"):
        return OLLAMA
    return OPENAI


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        if 400 <= e.status < 500:  # the reason, never the body: the operator sees why a client failed
            log.info("%s %s -> %d %s: %s", request.method, request.url.path, e.status, e.param or "-", e.message)
        return e.response(request.url.path)

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, e: ClientDisconnect) -> JSONResponse:
        # A body cut off by the client: one line, not a traceback; nobody reads the answer.
        log.info("%s %s: the client disconnected before sending the whole body", request.method, request.url.path)
        return APIError(400, "the request body was cut off before its end").response(request.url.path)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = {404: "there is no such route: see GET /v1/models and the docs for the API",
                   405: f"this route does not accept {request.method}"}
        error = APIError(e.status_code, message.get(e.status_code, str(e.detail)), headers=getattr(e, "headers", None))
        return error.response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, "the request does not match the API's schema").response(request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so the server logs the traceback (once).
        return APIError(500, "internal server error (see the server log)").response(request.url.path)
