"""From an HTTP request to checked values, or a 4xx naming what is wrong.

Every API's request models are `Strict`: JSON types are taken at their word ("1" is not a number
and 1 is not a boolean; an integer is accepted where a number is expected, as OpenAI does),
unknown fields are an error, so a misspelt parameter is reported instead of silently ignored,
and `null` means a field's default. Items a client's SDK echoes back (`Echoed`) drop the fields
kvserve has no use for instead. Ranges are checked afterwards by SamplingParams and the server's
limits, which know the allowed values.

The body is read here rather than by FastAPI so that each way of being malformed gets its own
OpenAI error (413 or 400) instead of a generic 422. The size limit is enforced while reading (and
from Content-Length, before reading). A well-formed body goes straight to pydantic's strict
`model_validate_json`; only a body pydantic cannot parse is examined again, to say where it is
broken (invalid UTF-8, a lone surrogate, nesting) in words a client can act on.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any, TypeVar

from fastapi import Request
from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

from kvserve.errors import SHOWN_CHARS, shown
from kvserve.server.errors import APIError
from kvserve.web.body import read_body

M = TypeVar("M", bound=BaseModel)
_BIG_BODY = 256 << 10

# What a union-typed field accepts, for the error message (pydantic would list every branch).
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string, a list of strings or null",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "tool_choice": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
    "guided_json": "a JSON schema (an object, or a string holding one)",
    "input": ("a string or a list: of strings, token ids or lists of token ids (embeddings), or of input items "
              "(objects: responses)"),
    "output": "a string or a list of {\"type\": \"input_text\", \"text\": ...} parts",
    "system": "a string or a list of {\"type\": \"text\", \"text\": ...} blocks",
}


# OpenAI's limits on `metadata` and kvserve's on `user`: a stored response keeps both and echoes
# them back, so a client must not be able to park megabytes in them.
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
USER_CHARS = 256


def _small_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > METADATA_KEYS:
        raise ValueError(f"at most {METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"keys are at most {METADATA_KEY_CHARS} characters, got {len(key)} in {shown(key)}")
        if len(value) > METADATA_VALUE_CHARS:
            raise ValueError(f"values are at most {METADATA_VALUE_CHARS} characters, got {len(value)} in the value "
                             f"of {shown(key)}")
    return metadata


def _short_user(user: str) -> str:
    if len(user) > USER_CHARS:
        raise ValueError(f"must be at most {USER_CHARS} characters (an id for the end user), got {len(user)}")
    return user


Metadata = Annotated[dict[str, str], AfterValidator(_small_metadata)]
User = Annotated[str, AfterValidator(_short_user)]


def legacy_call_id(name: str) -> str:
    """The id pairing an assistant's legacy function_call with the `function` message answering it."""
    return f"call_{name}"


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for an optional field means its default (OpenAI's clients send them)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


class Echoed(Strict):
    """An item a client may send back as an SDK dumped it (OpenAI's output items, Anthropic's
    content blocks): fields kvserve has no use for (ids, statuses, annotations, fields of newer API
    versions) are dropped instead of refused, as those APIs take them."""

    model_config = ConfigDict(extra="ignore")


class FunctionDef(Strict):
    """A function a model may call (OpenAI's shape, which Ollama's tools share)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class KVServeOptions(Strict):
    """kvserve's extension field `"kvserve": {...}` (docs/server.md)."""

    timeline: bool = False  # the request's timeline in the final chunk (or the body)


def field_names() -> frozenset[str]:
    """The field names (and aliases) of every strict request model, of every API, for error paths."""
    names: set[str] = set()
    stack: list[type[Strict]] = [Strict]
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        names.update(cls.model_fields)
        names.update(f.alias for f in cls.model_fields.values() if f.alias)
    return frozenset(names)


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
