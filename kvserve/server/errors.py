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
    if renames and param is not None and param in renames:  # say the name the client used
        message = re.sub(rf"\b{param}\b", renames[param], message)
        param = renames[param]
    return APIError(400, message, param=param)


def from_validation_error(e: ValidationError) -> APIError:
    """A 400 naming the first offending field, e.g. messages[0].role, or, inside a list of blocks
    told apart by their type (Anthropic's content), the block and its field: messages[1].content[0].id."""
    errors = e.errors(include_url=False)
    err = errors[0]
    if len(err["loc"]) >= 2 and err["loc"][-2] in UNION_FIELDS:  # a union's first branch failed
        # Of that union's branches, the one that got furthest into the input.
        site = err["loc"][:-1]
        err = max((x for x in errors if x["loc"][:len(site)] == site), key=lambda x: len(x["loc"]))
    loc, msg = err["loc"], re.sub(r" or instance of \w+", "", err["msg"].removeprefix("Value error, "))
    path, union, fields, tag_next = "", None, field_names(), False
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif tag_next:  # a block's type, which its union told it apart by: not a field
            tag_next = False
        elif part in fields or (err["type"] == "extra_forbidden" and i == len(loc) - 1):
            path += ("." if path else "") + (part if len(part) <= SHOWN_CHARS else part[:SHOWN_CHARS] + "...")
            union = part if part in UNION_FIELDS else None
        elif union and part.startswith("list[tagged-union[") and i + 1 < len(loc):  # into the block
            union, tag_next = None, True
        elif union:  # a union branch tag like "list[int]": say what the field accepts instead
            msg = f"must be {UNION_FIELDS[union]}"
            break
    if err["type"] in ("union_tag_invalid", "union_tag_not_found"):  # a block whose type is unknown or missing
        path += ".type"
    if err["type"] == "extra_forbidden":
        msg = "is not a known parameter (check its spelling)"
    elif err["type"] in ("missing", "union_tag_not_found"):
        msg = "is required"
    return APIError(400, f"{path}: {msg}" if path else msg, param=path or None)
