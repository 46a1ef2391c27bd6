"""The server's 400s from its own checks: an InvalidParam turned into an error naming the
parameter as the client spelt it (a body pydantic refuses: server/parsing.py). The error bodies, their dialects (OpenAI's,
Anthropic's, Ollama's) and the handlers are kvserve/web/errors.py's, shared with the router, and
re-exported here for the server's modules."""
from __future__ import annotations

import re
from collections.abc import Mapping

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
