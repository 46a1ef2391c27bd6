"""POST /v1/embeddings: each input's pooled hidden state, OpenAI's shape.

An input is a string, token ids, or a list of either. Each one is an engine request that
generates nothing (max_tokens=0) and pools its prompt (`LLMEngine.add_request(pooling=True)`):
the mean of the final (normed) hidden states over the input's tokens, L2-normalised. Inputs are
admitted, counted and capped as a completion's prompts are (`--max-prompts`, the request share,
the context), and share the engine's steps with everyone's generation. Their KV blocks return to
the pool when they finish (full blocks stay in the prefix cache, as after any request).

`encoding_format: "base64"` is OpenAI's: the little-endian float32 bytes of the vector, base64.
`dimensions` would ask for a shorter vector, which a decoder's hidden state has no trained way to
give: refused, unless it is the model's own size.
"""
from __future__ import annotations

import base64
import math
import time
from contextlib import aclosing
from typing import TYPE_CHECKING

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server import request_id
from kvserve.server.errors import APIError, from_invalid
from kvserve.server.generation import Job
from kvserve.server.parsing import reject
from kvserve.server.protocol import EmbeddingRequest
from kvserve.server.streaming import respond

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext

_RENAMES = {"prompt": "input"}  # the engine speaks of prompts


async def create_embedding(request: Request, ctx: ServerContext) -> Response:
    arrival = time.monotonic()
    ctx.state.require_ready()
    req = await ctx.parse(request, EmbeddingRequest)
    size = ctx.client.model_config.hidden_size
    reject(req.dimensions is not None and req.dimensions != size, "dimensions",
           f"is not supported: the embedding is the model's hidden state, {size} numbers (a shorter one would need a "
           f"model trained to be cut); leave dimensions out or send {size}")
    inputs = _inputs(req.input)
    params = SamplingParams(max_tokens=0)
    admission = ctx.state.admit(len(inputs), 1, param="input")  # before any tokenizing: 400 or 429 at once
    try:
        ids = await ctx.client.tokenize(inputs, params, request.receive)
    except ValueError as e:
        admission.release()
        raise from_invalid(e, _RENAMES) from None
    except BaseException:
        admission.release()
        raise
    job = Job(ids, params, arrival, request_id=request_id.name(request, "embd"), pooling=True)
    return await respond(request, ctx.state, admission, False, _no_stream, lambda: _collect(ctx, job),
                         lambda finals: _response(ctx, finals, req.encoding_format))


def _no_stream():  # embeddings are never streamed
    raise AssertionError("unreachable")


def _inputs(given: str | list) -> list[str | list[int]]:
    """A string, token ids, or a batch of either → a list of inputs."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]
    if not given:
        raise APIError(400, "input must not be empty", param="input")
    return list(given)


async def _collect(ctx: ServerContext, job: Job) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(job.prompts)
    async with aclosing(ctx.client.outputs(job)) as outputs:
        async for i, out in outputs:
            finals[i] = out
    return finals  # type: ignore[return-value]


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def _response(ctx: ServerContext, finals: list[RequestOutput], fmt: str) -> dict:
    data = []
    for i, out in enumerate(finals):
        vector = out.embedding
        if vector is None or not all(map(math.isfinite, vector)):
            raise APIError(500, f"input[{i}]: the model produced no finite hidden state (broken weights, or an "
                           "overflow in a low-precision dtype: serve it with --dtype float32)")
        data.append({"object": "embedding", "index": i, "embedding": _encode(vector, fmt)})
    tokens = sum(len(o.prompt_token_ids) for o in finals)
    return {"object": "list", "data": data, "model": ctx.settings.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
