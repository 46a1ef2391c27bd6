"""From an HTTP request to checked values, or a 4xx naming what is wrong."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvserve.sampling_params import SamplingParams
from kvserve.server.body import read_json
from kvserve.server.errors import APIError, from_validation_error, from_value_error
from kvserve.server.settings import ServerSettings

M = TypeVar("M", bound=BaseModel)


async def parse(request: Request, model: type[M], settings: ServerSettings) -> M:
    """The body as `model`: 413 past the size limit, 400 for anything malformed, 404 for an
    unknown model name."""
    body = await read_json(request, settings.max_body_bytes)
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from None
    name = getattr(parsed, "model", None)
    if name is not None and name != settings.model_name:
        raise APIError(404, f"the model {name!r} is not served here: GET /v1/models lists the one that is",
                       param="model", code="model_not_found")
    return parsed


def check_limits(settings: ServerSettings, n: int, logprobs: int | None, logprobs_param: str) -> None:
    if n > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n} on this server, got {n}", param="n")
    if logprobs is not None and logprobs > settings.max_logprobs:
        raise APIError(400, f"{logprobs_param} must be at most {settings.max_logprobs} on this server, got {logprobs}",
                       param=logprobs_param)


def reject(condition: bool, param: str, message: str) -> None:
    """400 for a parameter the engine does not support in the value given."""
    if condition:
        raise APIError(400, f"{param} {message}", param=param)


def sampling_params(build: Callable[[], SamplingParams], renames: Mapping[str, str] | None = None) -> SamplingParams:
    try:
        return build()
    except ValueError as e:
        raise from_value_error(e, renames) from None
