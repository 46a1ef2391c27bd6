"""Ollama's embeddings: POST /api/embed and its older form POST /api/embeddings, each input pooled
by the engine as every embedding route's are (kvserve/server/pooling.py: L2-normalised).

  /api/embed       {model, input: a string or a list of strings, truncate (default true),
                   options, keep_alive, dimensions} → {model, embeddings: [[...], ...],
                   total_duration, load_duration, prompt_eval_count}
  /api/embeddings  {model, prompt, options, keep_alive} → {embedding: [...]}

`truncate` (Ollama's default) cuts each input to the context (`options.num_ctx`, at most the
model's); `truncate: false` refuses a longer one. An empty input only "loads" the model, as in
Ollama: no embeddings. Errors are Ollama's `{"error": "..."}`.
"""
from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi.responses import JSONResponse, Response

from kvserve.outputs import RequestOutput
from kvserve.server.errors import OLLAMA
from kvserve.server.generation import Job
from kvserve.server.ollama.protocol import EmbeddingsRequest, EmbedRequest
from kvserve.server.pooling import Pooling, check_dimensions, vectors

if TYPE_CHECKING:
    from kvserve.server.lifecycle import Admission

_MARGIN = 8  # tokens past the cut: a prefix's last word may tokenize otherwise than in the whole text


class Embed(Pooling):
    """POST /api/embed."""

    request_model: ClassVar[type] = EmbedRequest
    FIELDS = {"prompt": "input"}  # the engine speaks of prompts
    dialect = OLLAMA

    def inputs(self) -> list[str | list[int]]:
        check_dimensions(self.ctx, self.req.dimensions)
        return [self.req.input] if isinstance(self.req.input, str) else list(self.req.input)

    async def start(self) -> tuple[Admission, Job] | Response:
        if not any(self.inputs()):  # nothing to embed: Ollama's way to load a model
            return JSONResponse(self._answer([], []))
        return await super().start()

    async def cut(self, inputs: list[str | list[int]]) -> list[str | list[int]]:
        if self.req.truncate is False:
            return inputs
        options, limit = self.req.options, self.ctx.client.max_model_len
        limit = options.context(limit) if options is not None else limit
        tokenizer = self.ctx.client.tokenizer
        return await asyncio.to_thread(lambda: [_first_tokens(tokenizer, str(text), limit) for text in inputs])

    def body(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        return self._answer(vectors(finals), finals)

    def _answer(self, embeddings: list[list[float]], finals: list[RequestOutput]) -> dict[str, Any]:
        return {"model": self.req._name, "embeddings": embeddings,
                "total_duration": max(1, int((time.monotonic() - self.arrival) * 1e9)), "load_duration": 0,
                "prompt_eval_count": sum(len(o.prompt_token_ids) for o in finals)}


class Embeddings(Embed):
    """POST /api/embeddings: one prompt, one vector (Ollama's older route; no truncation)."""

    request_model = EmbeddingsRequest
    FIELDS = {"prompt": "prompt"}

    def inputs(self) -> list[str | list[int]]:
        return [self.req.prompt]

    async def cut(self, inputs: list[str | list[int]]) -> list[str | list[int]]:
        return inputs

    def _answer(self, embeddings: list[list[float]], finals: list[RequestOutput]) -> dict[str, Any]:
        return {"embedding": embeddings[0] if embeddings else []}


def _first_tokens(tokenizer: Any, text: str, limit: int) -> list[int]:
    """The first `limit` tokens of `text`, reading only as much of it as they need: prefixes four
    times longer each time, until one holds more than enough tokens or is the whole text."""
    chars = 4 * (limit + _MARGIN)
    while True:
        ids = tokenizer.encode(text[:chars])
        if chars >= len(text) or len(ids) > limit + _MARGIN:
            return ids[:limit]
        chars *= 4
