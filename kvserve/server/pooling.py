"""The shape every embedding route shares: each input an engine request that generates nothing
(max_tokens=0) and pools its prompt (`LLMEngine.add_request(pooling=True)`): the mean of the
final (normed) hidden states over the input's tokens, L2-normalised. Inputs are admitted, counted
and capped as a completion's prompts are (`--max-prompts`, the request share, the context), and
share the engine's steps with everyone's generation. Their KV blocks return to the pool when they
finish (full blocks stay in the prefix cache, as after any request). Answered whole (no API has a
stream of vectors); each API says in a subclass how its body gives inputs (`inputs`), cuts them
(`cut`) and answers (`body`): server/openai/embeddings.py, server/ollama/embed.py.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from starlette.responses import Response

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server import request_id
from kvserve.server.errors import APIError
from kvserve.server.generation import Job
from kvserve.server.parsing import reject
from kvserve.server.serving import Serving

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission


class Pooling(Serving):
    def streams(self) -> bool:
        return False

    def inputs(self) -> list[str | list[int]]:
        """The request's inputs; 400 for what is wrong."""
        raise NotImplementedError

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
        """The inputs as the engine gets them (by default whole: one longer than the context is refused)."""
        return inputs


def check_dimensions(ctx: ServerContext, dimensions: int | None) -> None:
    size = ctx.client.model_config.hidden_size
    reject(dimensions is not None and dimensions != size, "dimensions",
           f"is not supported: the embedding is the model's hidden state, {size} numbers (a shorter one would need "
           f"a model trained to be cut); leave dimensions out or send {size}")


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
