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
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from starlette.responses import Response

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server import request_id
from kvserve.server.errors import APIError
from kvserve.server.generation import Job
from kvserve.server.parsing import reject
from kvserve.server.protocol import EmbeddingRequest
from kvserve.server.serving import Serving

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission


class Embedding(Serving):
    """POST /v1/embeddings: whole only (OpenAI's API has no stream of vectors)."""

    request_model: ClassVar[type] = EmbeddingRequest
    FIELDS = {"prompt": "input"}  # the engine speaks of prompts

    def streams(self) -> bool:
        return False

    def inputs(self) -> list[str | list[int]]:
        """The request's inputs (OpenAI's: a string, token ids, or a list of either); 400 for what is wrong."""
        check_dimensions(self.ctx, self.req.dimensions)
        return _inputs(self.req.input)

    async def start(self) -> tuple[Admission, Job] | Response:
        ctx = self.ctx
        inputs = self.inputs()
        params = SamplingParams(max_tokens=0)
        admission = ctx.state.admit(len(inputs), 1, param="input")  # before any tokenizing: 400 or 429 at once
        try:
            ids = await ctx.client.tokenize(await self.cut(inputs), params, self.request.receive)
        except BaseException:  # (Serving answers an InvalidParam, in this API's names)
            admission.release()
            raise
        return admission, Job(ids, params, self.arrival, request_id=request_id.name(self.request, "embd"), pooling=True)

    async def cut(self, inputs: list[str | list[int]]) -> list[str | list[int]]:
        """The inputs as the engine gets them: OpenAI's API refuses one longer than the context."""
        return inputs

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, self.req.encoding_format)}
                for i, v in enumerate(vectors(finals))]
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        return {"object": "list", "data": data, "model": self.ctx.settings.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def check_dimensions(ctx: ServerContext, dimensions: int | None) -> None:
    size = ctx.client.model_config.hidden_size
    reject(dimensions is not None and dimensions != size, "dimensions",
           f"is not supported: the embedding is the model's hidden state, {size} numbers (a shorter one would need "
           f"a model trained to be cut); leave dimensions out or send {size}")


def _inputs(given: str | list) -> list[str | list[int]]:
    """A string, token ids, or a batch of either → a list of inputs."""
    if isinstance(given, str) or (given and isinstance(given[0], int)):
        return [given]
    if not given:
        raise APIError(400, "input must not be empty", param="input")
    return list(given)


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


def vectors(finals: list[RequestOutput]) -> list[list[float]]:
    """Each input's embedding; a 500 for one that is not finite."""
    out = []
    for i, final in enumerate(finals):
        vector = final.embedding
        if vector is None or not all(map(math.isfinite, vector)):
            raise APIError(500, f"input[{i}]: the model produced no finite hidden state (broken weights, or an "
                           "overflow in a low-precision dtype: serve it with --dtype float32)")
        out.append(vector)
    return out
