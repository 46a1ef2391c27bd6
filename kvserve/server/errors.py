"""The server's 400s from its own checks: an InvalidParam or a pydantic ValidationError turned into
an error naming the parameter as the client spelt it. The error bodies, their dialects (OpenAI's,
Anthropic's, Ollama's) and the handlers are kvserve/web/errors.py's, shared with the router, and
re-exported here for the server's modules."""
from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import ValidationError

from kvserve.errors import SHOWN_CHARS
from kvserve.server.protocol import UNION_FIELDS, field_names
from kvserve.tokenizer.chat_template import ChatTemplateError
from kvserve.web.errors import (  # noqa: F401 (re-exported)
    ANTHROPIC,
    OLLAMA,
    OPENAI,
    APIError,
    Dialect,
    ErrorResponse,
    dialect,
    error_body,
    install_handlers,
)


def cut_off() -> APIError:
    """A request's answer when a drain past its timeout cuts it off (kvserve/server/lifecycle.py)."""
    return APIError(503, "the server shut down before this request finished (drain timeout)", code="shutdown")


def from_invalid(e: ValueError, renames: Mapping[str, str] | None = None) -> APIError:
    """A 400 from an InvalidParam (it names its parameter) or a chat template's refusal."""
    message = str(e)
    param = getattr(e, "param", None)
    if isinstance(e, ChatTemplateError):
        param = "messages"
    if renames and param in renames:  # say the name the client used
        message = re.sub(rf"\b{param}\b", renames[param], message)
        param = renames[param]
    return APIError(400, message, param=param)


def from_validation_error(e: ValidationError) -> APIError:
    """A 400 naming the first offending field, e.g. messages[0].role."""
    err = e.errors(include_url=False)[0]
    loc, msg = err["loc"], re.sub(r" or instance of \w+", "", err["msg"].removeprefix("Value error, "))
    path, union, fields = "", None, field_names()
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in fields or (err["type"] == "extra_forbidden" and i == len(loc) - 1):
            path += ("." if path else "") + (part if len(part) <= SHOWN_CHARS else part[:SHOWN_CHARS] + "...")
            union = part if part in UNION_FIELDS else None
        elif union:  # a union branch tag like "list[int]": say what the field accepts instead
            msg = f"must be {UNION_FIELDS[union]}"
            break
    if err["type"] == "extra_forbidden":
        msg = "is not a known parameter (check its spelling)"
    elif err["type"] == "missing":
        msg = "is required"
    return APIError(400, f"{path}: {msg}" if path else msg, param=path or None)
