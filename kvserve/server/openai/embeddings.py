"""POST /v1/embeddings: each input's pooled hidden state, OpenAI's shape.

An input is a string, token ids, or a list of either, each pooled by the engine as every
embedding route's are (server/pooling.py).

`encoding_format: "base64"` is OpenAI's: the little-endian float32 bytes of the vector, base64.
`dimensions` would ask for a shorter vector, which a decoder's hidden state has no trained way to
give: refused, unless it is the model's own size.
"""
from __future__ import annotations

import base64
from typing import ClassVar

import numpy as np

from kvserve.outputs import RequestOutput
from kvserve.server.errors import APIError
from kvserve.server.generation import Job
from kvserve.server.openai.protocol import EmbeddingRequest
from kvserve.server.pooling import Pooling, check_dimensions, vectors


class Embedding(Pooling):
    """POST /v1/embeddings."""

    request_model: ClassVar[type] = EmbeddingRequest
    FIELDS = {"prompt": "input"}  # the engine speaks of prompts

    def inputs(self) -> list[str | list[int]]:
        check_dimensions(self.ctx, self.req.dimensions)
        return _inputs(self.req.input)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, self.req.encoding_format)}
                for i, v in enumerate(vectors(finals))]
        tokens = sum(len(o.prompt_token_ids) for o in finals)
        return {"object": "list", "data": data, "model": self.ctx.settings.model_name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


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
