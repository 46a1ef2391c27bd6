"""Ollama's API: /api/chat and /api/generate (the model's routes: kvserve/server/ollama/models.py).

Generation runs as a chat completion does (`ServerContext.start_job`: the same admission, limits,
abort-on-disconnect and metrics) and is answered as Ollama answers:

  streaming   NDJSON (application/x-ndjson), on by default; `"stream": false` gives one object
  each line   {"model", "created_at", "message": {"role", "content"} | "response", "done": false}
  the last    "done": true, "done_reason" (stop | length), and the counts and durations Ollama
              reports, durations in nanoseconds: total_duration (arrival to end), load_duration
              (0: the model is loaded), prompt_eval_count / prompt_eval_duration (the prompt and
              its prefill, to the first token), eval_count / eval_duration (the answer's tokens,
              first to last); /api/generate adds `context` (prompt and answer ids, which a next
              request may send back)
  format      "json" (any JSON object) or a JSON schema: structured output
  tools       calls parsed from the answer, as message.tool_calls [{"function": {"name", "arguments": {...}}}]
  errors      {"error": "..."} with a 4xx (kvserve/server/errors.py); mid-stream, one such line

An empty prompt (or no messages) only "loads" the model, as in Ollama: done_reason "load". The
body's sampling is read in server/ollama/protocol.py, the answer's shapes made in answers.py.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, ClassVar

from fastapi.responses import JSONResponse, Response

from kvserve.outputs import RequestOutput
from kvserve.server.canonical import Sampling
from kvserve.server.errors import OLLAMA, APIError
from kvserve.server.generation import Job
from kvserve.server.ollama.answers import lines, now, whole
from kvserve.server.ollama.protocol import ChatRequest, GenerateRequest, sampling, to_chat
from kvserve.server.parsing import check_limits
from kvserve.server.serving import Serving

if TYPE_CHECKING:
    from kvserve.server.lifecycle import Admission
    from kvserve.server.ollama.protocol import _Generation


def _loaded(req: _Generation, key: str, stream: bool) -> Response:
    """Ollama's answer to a request with nothing to generate: the model is loaded (it always is)."""
    body = {"model": req._name, "created_at": now(), key: {"role": "assistant", "content": ""} if key == "message"
            else "", "done": True, "done_reason": "load"}
    if stream:
        return Response(json.dumps(body) + "\n", media_type=OLLAMA.framing.media_type)
    return JSONResponse(body)


class OllamaGeneration(Serving):
    """What /api/chat and /api/generate share: options, the context (num_ctx), the answer's shape
    under KEY ("message" or "response")."""

    KEY: ClassVar[str]
    PREFIX: ClassVar[str]  # of the job's id
    dialect = OLLAMA
    FIELDS = {"prompt": "messages", "max_tokens": "options.num_predict", "stop": "options.stop",
              "temperature": "options.temperature", "top_p": "options.top_p", "top_k": "options.top_k",
              "min_p": "options.min_p", "seed": "options.seed", "repetition_penalty": "options.repeat_penalty",
              "presence_penalty": "options.presence_penalty", "frequency_penalty": "options.frequency_penalty",
              "speculative": "options.speculative", "logprobs": "top_logprobs"}
    mode: str | None = None  # tool calls read from the answer ("auto") or not (None)

    async def start(self) -> tuple[Admission, Job] | Response:
        ctx, req = self.ctx, self.req
        req.checked(ctx.client.thinks)
        limit = ctx.client.max_model_len
        context = req.options.context(limit) if req.options is not None else limit
        spec = self.sampling()
        check_limits(1, spec.fixed["logprobs"], "top_logprobs", 1, ctx.settings.max_logprobs)
        params = spec.params(ctx.settings.defaults, ctx.settings.max_tokens_default)
        if self.empty():
            return _loaded(self.req, self.KEY, self.req.stream)
        return await self.start_job(params, lambda: _fits(self.prompt_ids(), context), prefix=self.PREFIX,
                                    fit_within=context)

    def sampling(self) -> Sampling:
        """What the body asks of the sampler (server/canonical.py)."""
        return sampling(self.req)

    def empty(self) -> bool:
        """Nothing to generate: Ollama's way to load a model."""
        raise NotImplementedError

    def prompt_ids(self) -> list[int]:
        """The prompt's token ids, on a worker thread (ServerContext.start_job's)."""
        raise NotImplementedError

    def events(self, job: Job) -> AsyncIterator[dict]:
        return lines(self.ctx, job, self.req, self.KEY, self.mode)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        return whole(self.ctx, job, self.req, finals[0], self.KEY, self.mode)


class Chat(OllamaGeneration):
    """POST /api/chat."""

    request_model = ChatRequest
    KEY, PREFIX = "message", "chat"

    def sampling(self) -> Sampling:
        self.turn = to_chat(self.req)
        self.mode = self.turn.tool_mode
        return self.turn.sampling

    def empty(self) -> bool:
        return not self.req.messages

    def prompt_ids(self) -> list[int]:
        return self.ctx.client.encode_chat_now(self.turn.prompt)


class Generate(OllamaGeneration):
    """POST /api/generate."""

    request_model = GenerateRequest
    KEY, PREFIX = "response", "generate"
    FIELDS = {**OllamaGeneration.FIELDS, "prompt": "prompt"}

    def empty(self) -> bool:
        return not self.req.prompt

    def prompt_ids(self) -> list[int]:
        req, client = self.req, self.ctx.client
        chat = req.chat_prompt()
        ids = client.encode_now(req.prompt) if chat is None else client.encode_chat_now(chat)
        return list(req.context or []) + ids


def _fits(ids: list[int], context: int) -> list[int]:
    if len(ids) >= context:
        raise APIError(400, f"the prompt is {len(ids)} tokens, which leaves no room in a context (options.num_ctx) of "
                       f"{context}: shorten it or raise num_ctx", param="options.num_ctx")
    return ids
