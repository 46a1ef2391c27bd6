"""From an HTTP request to checked values, or a 4xx naming what is wrong.

The body is read here rather than by FastAPI so that each way of being malformed gets its own
OpenAI error (413 or 400) instead of a generic 422. The size limit is enforced while reading (and
from Content-Length, before reading). A well-formed body goes straight to pydantic's strict
`model_validate_json`; only a body pydantic cannot parse is examined again, to say where it is
broken (invalid UTF-8, a lone surrogate, nesting) in words a client can act on.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.errors import shown
from kvserve.server.errors import APIError, from_validation_error
from kvserve.web.body import read_body

M = TypeVar("M", bound=BaseModel)
_BIG_BODY = 256 << 10


async def parse(request: Request, model: type[M], limit: int, served_model: str) -> M:
    """The body as `model`: 413 past `limit` bytes, 400 for anything malformed, 404 for a model
    name other than `served_model`, 415 for a form's content type."""
    check_content_type(request)
    raw = await read_body(request.scope, request.receive, limit, "server")
    try:
        if len(raw) > _BIG_BODY:  # tens of ms for megabytes: off the event loop
            parsed = await asyncio.to_thread(model.model_validate_json, raw)
        else:
            parsed = model.model_validate_json(raw)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] == "json_invalid" and "recursion limit" in first["msg"]:  # valid JSON, too deep to read
            raise APIError(400, "the request body is nested too deeply: the server reads JSON up to 200 levels "
                                "of arrays and objects") from None
        if first["type"] == "json_invalid" or not first["loc"]:  # not JSON, or not an object
            _diagnose(raw)  # raises the precise 400
        raise from_validation_error(e) from None
    name = getattr(parsed, "model", None)
    if name is not None and name != served_model:
        raise APIError(404, f"the model {shown(name)} is not served here: GET /v1/models lists the one that is",
                       param="model", code="model_not_found")
    return parsed


# The types a web page can POST to another site without asking it first (CORS "simple" requests):
# refusing them keeps a page the user visits from making this server generate blind.
_FORM_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})


def check_content_type(request: Request) -> None:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind in _FORM_TYPES:
        raise APIError(415, f"the request body must be JSON sent with Content-Type: application/json, not {kind} "
                            "(with curl: -H 'Content-Type: application/json')", code="unsupported_media_type")


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _diagnose(raw: bytes) -> None:
    """Raise a 400 that says where a body pydantic refused to parse is broken."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply: the server reads JSON up to 200 levels "
                            "of arrays and objects") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_surrogates(body)
    raise APIError(400, "the request body is not valid JSON")


def _check_surrogates(body: dict[str, Any]) -> None:
    """400 for a string holding a lone surrogate ("\\ud800"): it is not Unicode text."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _is_unicode(value):
            raise APIError(400, f"{path}: the text holds a lone surrogate, which is not valid Unicode", param=path)
        if isinstance(value, dict):
            for k, v in value.items():
                if not _is_unicode(k):
                    where = f"a key in {path}" if path else "a key"
                    raise APIError(400, f"{where} holds a lone surrogate, which is not valid Unicode", param=path or None)
                stack.append((f"{path}.{k}" if path else k, v))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))


def _is_unicode(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_limits(n: int, logprobs: int | None, logprobs_param: str, max_n: int, max_logprobs: int) -> None:
    if n > max_n:
        raise APIError(400, f"n must be at most {max_n} on this server, got {n}", param="n")
    if logprobs is not None and logprobs > max_logprobs:
        raise APIError(400, f"{logprobs_param} must be at most {max_logprobs} on this server, got {logprobs}",
                       param=logprobs_param)


def reject(condition: bool, param: str, message: str) -> None:
    """400 for a parameter the engine does not support in the value given."""
    if condition:
        raise APIError(400, f"{param} {message}", param=param)


def reject_unsupported_extras(req: Any) -> None:
    """400 for the SGLang/vLLM extras (as SGLang's router forwards them) asking for what kvserve
    does not do; their default values pass."""
    reject(req.no_stop_trim, "no_stop_trim", "is not supported: kvserve always leaves a matched stop string out "
           "of the text; send false or leave it out")
    reject(req.return_hidden_states, "return_hidden_states", "is not supported: kvserve returns no hidden states")
    reject(getattr(req, "continue_final_message", False), "continue_final_message",
           "is not supported: the conversation's last message is always closed (add_generation_prompt opens the "
           "answer); send false or leave it out")
