"""POST /v1/responses: OpenAI's Responses API (GET and DELETE: server/openai/stored_responses.py).

A response is one chat turn. Its `input` (a string, or a list of items: messages,
`function_call`s and `function_call_output`s) becomes chat messages after `instructions` (as the
system message) and after the conversation of `previous_response_id`, if given; the model's
chat template renders them and the turn runs as a chat completion would, with the same sampling,
limits, structured output (`text.format`) and tool calling (function tools; `tool_choice`
"required" or a named function constrains the output). Its text becomes output items: a
thinking model's reasoning a `reasoning` item (one `reasoning_text` part), a `message` holding one
`output_text` part, and one `function_call` item per tool call.

Streamed, it is OpenAI's typed events, each with its `sequence_number`: response.created,
response.in_progress, then per item output_item.added, (content_part.added, output_text.delta... or
reasoning_text.delta..., their .done, content_part.done | function_call_arguments.delta, .done), output_item.done,
and last response.completed, or response.incomplete when max_output_tokens (or the context)
cut the output. A failure after the stream started is an `error` event and response.failed.

A finished response is kept in a bounded in-memory store (kvserve/server/response_store.py)
unless the request said `store: false`. The body becomes kvserve's chat in responses_protocol.py,
the answer OpenAI's objects and events in responses_output.py.
"""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from kvserve.outputs import RequestOutput
from kvserve.server.errors import APIError
from kvserve.server.generation import Job
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.openai.responses_output import Events, Output, ResponseObject
from kvserve.server.openai.responses_protocol import (
    ResponsesRequest,
    function_tools,
    input_items,
    plain_items,
    to_chat,
    tool_choice,
)
from kvserve.server.parsing import check_limits
from kvserve.server.response_store import StoredResponse
from kvserve.server.serving import Serving
from kvserve.web.framing import NAMED_SSE

if TYPE_CHECKING:
    from kvserve.server.lifecycle import Admission

log = logging.getLogger("kvserve.server")


class ModelResponse(Serving):
    """POST /v1/responses: one admitted response, its events (streamed) or its body (whole), and
    storing it."""

    request_model = ResponsesRequest
    FIELDS = {"prompt": "input", "max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
    framing = NAMED_SSE  # (OpenAI's error bodies, its own events: no [DONE])
    # A stream's state, for the events that end it if it fails (`failed`).
    _job: Job
    _event: Events
    _out: Output | None
    _final: RequestOutput | None

    async def start(self) -> tuple[Admission, Job]:
        ctx, req = self.ctx, self.req
        if ignored := req.ignored_fields():
            log.warning("ignored OpenAI field(s) kvserve does not use: %s", ", ".join(ignored))
        self.items = [*self._earlier(), *input_items(req)]
        turn = to_chat(req, self.items)
        self.mode = turn.tool_mode
        check_limits(1, req.top_logprobs, "top_logprobs", 1, ctx.settings.max_logprobs)
        wants_logprobs = turn.sampling.fixed["logprobs"] is not None
        self.logprobs = (lambda lps: chat_logprobs(lps, ctx.texts)["content"]) if wants_logprobs else None
        params = turn.sampling.params(ctx.settings.defaults, ctx.settings.max_tokens_default)
        started = await self.start_job(params, lambda: ctx.client.encode_chat_now(turn.prompt), prefix="resp", sep="_",
                                       # a default the client never sent must not be why it is refused
                                       fit_within=ctx.client.max_model_len if turn.sampling.defaulted else None)
        tools = function_tools(req.tools)
        self.object = ResponseObject(req, tools, tool_choice(req.tool_choice, tools), req.store and ctx.responses.keeps,
                                     ctx.settings.model_name, int(time.time()))
        self._job, self._event, self._out, self._final = started[1], Events(), None, None  # (a stream's state)
        return started

    def _earlier(self) -> list[dict[str, Any]]:
        """The plain items of the stored response this one continues (none without previous_response_id)."""
        given = self.req.previous_response_id
        if given is None:
            return []
        previous = self.ctx.responses.get(given)
        if previous is None:
            raise APIError(400, f"previous_response_id {given!r:.80} is not stored on this server: "
                           f"{self.ctx.responses.why_missing(given)}", param="previous_response_id",
                           code="previous_response_not_found")
        return list(previous.items())

    def _output(self, job: Job, events: Events | None) -> Output:
        return Output(self.mode, self.logprobs, events, self.ctx.client.reasoning(job), self.ctx.client.tool_formats)

    def _response(self, job: Job, status: str, output: list[dict[str, Any]], final: RequestOutput | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        tokens = self.ctx.client.reasoning_tokens(job, final) if final is not None else 0
        return self.object(job, status, output, final, tokens, error)

    def events(self, job: Job) -> AsyncIterator[dict]:
        return self._events(job)

    def failed(self, e: APIError) -> list[dict]:
        """An error event, then the response as it stood, failed."""
        event, out = self._event, self._out
        return [event("error", code=e.code, message=e.message, param=e.param),
                event("response.failed", response=self._response(self._job, "failed", out.items if out else [],
                                                                  self._final, {"code": "server_error", "message": e.message}))]

    def body(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        final = finals[0]
        choice = final.outputs[0]
        out = self._output(job, None)
        out.feed(choice.text, choice.logprobs)
        out.finish(choice.finish_reason)
        return self._finished(job, out, final)

    def _finished(self, job: Job, out: Output, final: RequestOutput | None) -> dict[str, Any]:
        body = self._response(job, out.status, out.items, final)
        if self.req.store:  # (a store of size 0 keeps none, and remembers why)
            conversation = (*self.items, *plain_items(body["output"], "output"))
            self.ctx.responses.put(body["id"], StoredResponse.of(body, conversation))
        else:
            self.ctx.responses.not_stored(body["id"])
        return body

    async def _events(self, job: Job) -> AsyncIterator[dict]:
        event = self._event
        yield event("response.created", response=self._response(job, "in_progress", []))
        yield event("response.in_progress", response=self._response(job, "in_progress", []))
        out = self._out = self._output(job, event)
        async with aclosing(self.ctx.client.outputs(job)) as outputs:
            async for _, self._final in outputs:
                choice = self._final.outputs[0]
                if choice.delta_text or choice.delta_logprobs:
                    for e in out.feed(choice.delta_text, choice.delta_logprobs):
                        yield e
                if choice.finished:
                    for e in out.finish(choice.finish_reason):
                        yield e
        body = self._finished(job, out, self._final)
        yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
