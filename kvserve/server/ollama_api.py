"""Ollama's API: /api/chat and /api/generate (the model's routes: kvserve/server/ollama_models.py).

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

An empty prompt (or no messages) only "loads" the model, as in Ollama: done_reason "load".
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams, with_defaults
from kvserve.server import ollama_embed, ollama_models
from kvserve.server.errors import OLLAMA, APIError
from kvserve.server.generation import Job
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.ollama_protocol import ChatRequest, GenerateRequest
from kvserve.server.openai_compat import ChoiceDeltas, chat_message
from kvserve.server.parsing import check_limits
from kvserve.server.serving import Serving
from kvserve.structured.spec import Constraint, json_schema

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission
    from kvserve.server.ollama_protocol import _Generation

log = logging.getLogger("kvserve.server")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _params(ctx: ServerContext, req: _Generation) -> tuple[SamplingParams, int]:
    """The request's sampling, and the context its prompt and answer must fit in (num_ctx or the model's)."""
    req.checked(ctx.client.thinks)
    options = req.options
    sampling = options.sampling() if options is not None else {}
    limit = ctx.client.max_model_len
    context = options.context(limit) if options is not None else limit
    predict = options.num_predict if options is not None else None  # -1, -2: all the context leaves
    fmt = req.format
    constraint = (None if fmt in (None, "") else Constraint("json_object", "", "format") if fmt == "json"
                  else json_schema(fmt, "format"))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    check_limits(1, logprobs, "top_logprobs", 1, ctx.settings.max_logprobs)
    max_tokens = ctx.settings.max_tokens_default if predict is None else None if predict in (-1, -2) else predict
    return with_defaults(ctx.settings.defaults, sampling, max_tokens=max_tokens, logprobs=logprobs,
                           constraint=constraint), context


def _stats(out: RequestOutput, arrival: float) -> dict[str, Any]:
    """Ollama's counts and durations (nanoseconds) of a finished request."""
    m, now = out.metrics, time.monotonic()
    first = (m.first_token_time if m and m.first_token_time else now)
    scheduled = (m.first_scheduled_time if m and m.first_scheduled_time else arrival)
    last = (m.last_token_time if m and m.last_token_time else now)
    ns = lambda seconds: max(1, int(seconds * 1e9))  # noqa: E731 - a rate is tokens / duration: never 0
    return {"total_duration": ns(now - arrival), "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids), "prompt_eval_duration": ns(first - scheduled),
            "eval_count": len(out.outputs[0].token_ids), "eval_duration": ns(last - first)}


def _loaded(req: _Generation, key: str, stream: bool) -> Response:
    """Ollama's answer to a request with nothing to generate: the model is loaded (it always is)."""
    body = {"model": req._name, "created_at": _now(), key: {"role": "assistant", "content": ""} if key == "message"
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
    @property
    def mode(self) -> str | None:
        """Tool calls read from the answer ("auto") or not (None)."""
        return None

    async def start(self) -> tuple[Admission, Job] | Response:
        params, context = _params(self.ctx, self.req)
        if self.empty():
            return _loaded(self.req, self.KEY, self.req.stream)
        return await self.start_job(params, lambda: _fits(self.prompt_ids(), context), prefix=self.PREFIX,
                                    fit_within=context)

    def empty(self) -> bool:
        """Nothing to generate: Ollama's way to load a model."""
        raise NotImplementedError

    def prompt_ids(self) -> list[int]:
        """The prompt's token ids, on a worker thread (ServerContext.start_job's)."""
        raise NotImplementedError

    def events(self, job: Job) -> AsyncIterator[dict]:
        return _stream(self.ctx, job, self.req, self.KEY, self.mode)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        return _whole(self.ctx, job, self.req, finals[0], self.KEY, self.mode)


class Chat(OllamaGeneration):
    """POST /api/chat."""

    request_model = ChatRequest
    KEY, PREFIX = "message", "chat"

    @property
    def mode(self) -> str | None:
        return "auto" if self.req.tools else None

    def empty(self) -> bool:
        return not self.req.messages

    def prompt_ids(self) -> list[int]:
        return self.ctx.client.encode_chat_now(self.req.chat_prompt())


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


def _calls(delta_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI tool calls as Ollama's: arguments as an object."""
    return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}}
            for c in delta_calls]


class WholeCalls:
    """Tool calls streamed in pieces (OpenAI's deltas: the first with id and name, then arguments
    as the model writes them) gathered whole: Ollama sends each call once, complete."""

    def __init__(self) -> None:
        self.by_index: dict[int, dict[str, Any]] = {}

    def feed(self, delta_calls: list[dict[str, Any]]) -> None:
        for call in delta_calls:
            whole = self.by_index.setdefault(call["index"], {"function": {"name": "", "arguments": ""}})
            fn = call.get("function") or {}
            whole["function"]["name"] += fn.get("name") or ""
            whole["function"]["arguments"] += fn.get("arguments") or ""

    def whole(self) -> list[dict[str, Any]]:
        return _calls([self.by_index[i] for i in sorted(self.by_index)])


def _inside(ctx: ServerContext, job: Job, req: _Generation) -> bool | None:
    """As EngineClient.reasoning; None too for raw /api/generate (the client wrote the prompt)."""
    return None if getattr(req, "raw", False) else ctx.client.reasoning(job)


def _whole(ctx: ServerContext, job: Job, req: _Generation, final: RequestOutput, key: str, mode: str | None) -> dict:
    c = final.outputs[0]
    body: dict[str, Any] = {"model": req._name, "created_at": _now()}
    message, _ = chat_message(c.text, c.finish_reason, mode if key == "message" else None, _inside(ctx, job, req),
                              ctx.client.tool_formats)
    thinking = message.get("reasoning_content") if req.think is not False else None
    if key == "message":
        body["message"] = {"role": "assistant", "content": message["content"] or ""}
        if thinking is not None:
            body["message"]["thinking"] = thinking
        if message.get("tool_calls"):
            body["message"]["tool_calls"] = _calls(message["tool_calls"])
    else:
        body["response"] = message["content"]
        if thinking is not None:
            body["thinking"] = thinking
    if c.logprobs is not None:
        body["logprobs"] = chat_logprobs(c.logprobs, ctx.texts)["content"]
    return {**body, "done": True, "done_reason": c.finish_reason, **_tail(final, job, key)}


def _tail(final: RequestOutput, job: Job, key: str) -> dict[str, Any]:
    context = {"context": final.prompt_token_ids + final.outputs[0].token_ids} if key == "response" else {}
    return {**_stats(final, job.arrival), **context}


async def _stream(ctx: ServerContext, job: Job, req: _Generation, key: str, mode: str | None) -> AsyncIterator[dict]:
    deltas = ChoiceDeltas(mode if key == "message" else None, _inside(ctx, job, req), ctx.client.tool_formats)

    def line(piece: dict[str, Any], done: bool = False, **extra: Any) -> dict[str, Any]:
        thinking = {"thinking": piece["thinking"]} if "thinking" in piece else {}
        value = {"role": "assistant", "content": piece["content"], **piece} if key == "message" else piece["content"]
        return {"model": req._name, "created_at": _now(), key: value, **(thinking if key == "response" else {}),
                "done": done, **extra}

    calls = WholeCalls()

    def pieces(delta: dict[str, Any]) -> dict[str, Any] | None:
        """Ollama's piece of one chat delta: content, or thinking (None for reasoning think false drops)."""
        if "reasoning_content" in delta:
            return None if req.think is False else {"content": "", "thinking": delta["reasoning_content"]}
        if key == "message":
            calls.feed(delta.get("tool_calls") or [])
        return {"content": delta.get("content", "")}

    def gathered() -> dict[str, Any]:
        return {"content": "", "tool_calls": calls.whole()}

    async with aclosing(ctx.client.outputs(job)) as outputs:
        async for _, out in outputs:
            c = out.outputs[0]
            out_deltas = deltas.feed(c.delta_text)
            lp = chat_logprobs(c.delta_logprobs, ctx.texts)["content"] if c.delta_logprobs else None
            if lp and not out_deltas:
                out_deltas = [{"content": ""}]
            for j, delta in enumerate(out_deltas):
                if (piece := pieces(delta)) is not None:
                    yield line(piece, **({"logprobs": lp} if lp and j == 0 else {}))
            if c.finished:
                rest, _ = deltas.finish(c.finish_reason)
                for delta in rest:
                    if (piece := pieces(delta)) is not None:
                        yield line(piece)
                if calls.by_index:
                    yield line(gathered())
                if (piece := pieces({})) is not None:  # (always: an empty delta)
                    yield line(piece, True, done_reason=c.finish_reason, **_tail(out, job, key))


def add_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.post("/api/chat")
    async def api_chat(request: Request) -> Response:
        return await Chat.handle(request, ctx)

    @app.post("/api/generate")
    async def api_generate(request: Request) -> Response:
        return await Generate.handle(request, ctx)

    ollama_models.add_routes(app, ctx)
    ollama_embed.add_routes(app, ctx)
