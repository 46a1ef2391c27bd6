"""Reading a request body: a size limit, strict UTF-8, strict JSON, no lone surrogates.

The body is read here rather than by FastAPI so that each way of being malformed gets its own
OpenAI error (413 or 400) instead of a generic 422.
"""
from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from kvserve.server.errors import APIError


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object, or an APIError: 413 past `limit` bytes, 400 if malformed."""
    too_large = APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise APIError(400, "the Content-Length header is not a number")
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise APIError(400, f"the request body is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    if "\\u" in text:  # only an escape can smuggle a lone surrogate past the UTF-8 check
        _check_surrogates(body)
    return body


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
