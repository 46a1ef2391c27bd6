"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

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
unless the request said `store: false`.
"""
from __future__ import annotations

import copy
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from kvserve.outputs import RequestOutput
from kvserve.server.errors import APIError, from_invalid
from kvserve.server.generation import Job
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.openai_compat import ChoiceDeltas
from kvserve.server.parsing import check_limits, reject
from kvserve.server.protocol import ResponsesRequest
from kvserve.server.response_store import StoredResponse
from kvserve.server.responses_protocol import (
    LOGPROBS_INCLUDE,
    chat_prompt,
    function_tools,
    input_items,
    output_constraint,
    plain_items,
    refuse_unsupported,
    sampling_params,
    text_format,
    tool_choice,
    tool_mode,
)
from kvserve.server.serving import Serving
from kvserve.web.framing import NAMED_SSE

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission

log = logging.getLogger("kvserve.server")


# --- the routes -------------------------------------------------------------------------------

class ModelResponse(Serving):
    """POST /v1/responses: one admitted response, its events (streamed) or its body (whole), and
    storing it."""

    request_model = ResponsesRequest
    FIELDS = {"prompt": "input", "max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
    # A stream's state, for the events that end it if it fails (`failed`).
    _job: Job
    _event: _Events
    _out: _Output | None
    _final: RequestOutput | None

    async def start(self) -> tuple[Admission, Job]:
        ctx, req = self.ctx, self.req
        if ignored := req.ignored_fields():
            log.warning("ignored OpenAI field(s) kvserve does not use: %s", ", ".join(ignored))
        refuse_unsupported(req)
        self.tools = function_tools(req.tools)
        self.choice = tool_choice(req.tool_choice, self.tools)
        try:
            constraint = output_constraint(req, self.tools, self.choice)
        except ValueError as e:  # InvalidParam: a malformed schema, or a named function not among the tools
            raise from_invalid(e) from None
        self.mode = tool_mode(self.tools, self.choice, constraint)
        want_logprobs = LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs is not None
        self.logprobs = (lambda lps: chat_logprobs(lps, ctx.texts)["content"]) if want_logprobs else None
        check_limits(1, req.top_logprobs, "top_logprobs", 1, ctx.settings.max_logprobs)
        items = input_items(req)
        if req.previous_response_id is not None:
            previous = ctx.responses.get(req.previous_response_id)
            if previous is None:
                why = ctx.responses.why_missing(req.previous_response_id)
                raise APIError(400, f"previous_response_id {req.previous_response_id!r:.80} is not stored on this "
                               f"server: {why}", param="previous_response_id", code="previous_response_not_found")
            items = [*previous.items(), *items]
        self.items = items
        prompt = chat_prompt(req, items, self.tools, self.mode)
        reject(not prompt.messages, "input", "must not be empty")
        reject(req.max_output_tokens is not None and req.max_output_tokens < 1, "max_output_tokens", "must be at least 1")
        defaulted = req.max_output_tokens is None
        max_tokens = ctx.settings.max_tokens_default if defaulted else req.max_output_tokens
        logprobs = (req.top_logprobs or 0) if want_logprobs else None
        params = sampling_params(req, max_tokens, logprobs, ctx.settings.defaults, constraint)
        started = await self.start_job(params, lambda: ctx.client.encode_chat_now(prompt), prefix="resp", sep="_",
                                       # a default the client never sent must not be why it is refused
                                       fit_within=ctx.client.max_model_len if defaulted else None)
        self.created_at = int(time.time())
        self.store = req.store and ctx.responses.keeps
        self._job, self._event, self._out, self._final = started[1], _Events(), None, None  # (a stream's state)
        return started

    framing = NAMED_SSE  # (OpenAI's error bodies, its own events: no [DONE])

    def events(self, job: Job) -> AsyncIterator[dict]:
        return self._events(job)

    def failed(self, e: APIError) -> list[dict]:
        """An error event, then the response as it stood, failed."""
        event, out = self._event, self._out
        return [event("error", code=e.code, message=e.message, param=e.param),
                event("response.failed", response=self._object(
                    self._job, "failed", out.items if out else [], self._final,
                    error={"code": "server_error", "message": e.message}))]

    def body(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        final = finals[0]
        choice = final.outputs[0]
        out = _Output(self.mode, self.logprobs, None, self.ctx.client.reasoning(job), self.ctx.client.tool_formats)
        out.feed(choice.text, choice.logprobs)
        out.finish(choice.finish_reason)
        return self._finished(job, out, final)

    def _object(self, job: Job, status: str, output: list[dict[str, Any]], final: RequestOutput | None = None,
                error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object (OpenAI's field order)."""
        req, params = self.req, job.params
        usage = None
        if final is not None:
            prompt, completion = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
            usage = {"input_tokens": prompt,
                     "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": completion,
                     "output_tokens_details": {"reasoning_tokens": self.ctx.client.reasoning_tokens(job, final)},
                     "total_tokens": prompt + completion}
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": job.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": self.ctx.settings.model_name, "output": output, "parallel_tool_calls": req.parallel_tool_calls is True,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": self.store, "temperature": params.temperature,
            "text": {"format": text_format(req), "verbosity": "medium"}, "tool_choice": self.choice,
            "tools": [t.model_dump(exclude_none=True, include={"type", "name", "description", "parameters", "strict"})
                      for t in self.tools],
            "top_logprobs": req.top_logprobs or 0, "top_p": params.top_p, "truncation": "disabled",
            "usage": usage if done else None, "user": req.user, "metadata": req.metadata or {},
        }

    def _finished(self, job: Job, out: _Output, final: RequestOutput | None) -> dict[str, Any]:
        body = self._object(job, out.status, out.items, final)
        if self.req.store:  # (a store of size 0 keeps none, and remembers why)
            conversation = (*self.items, *plain_items(body["output"], "output"))
            self.ctx.responses.put(body["id"], StoredResponse.of(body, conversation))
        else:
            self.ctx.responses.not_stored(body["id"])
        return body

    async def _events(self, job: Job) -> AsyncIterator[dict]:
        event = self._event
        yield event("response.created", response=self._object(job, "in_progress", []))
        yield event("response.in_progress", response=self._object(job, "in_progress", []))
        out = self._out = _Output(self.mode, self.logprobs, event, self.ctx.client.reasoning(job),
                                  self.ctx.client.tool_formats)
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


def get_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise _not_found(ctx, response_id)
    return stored.response()


def delete_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    if not ctx.responses.delete(response_id):
        raise _not_found(ctx, response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def _not_found(ctx: ServerContext, response_id: str) -> APIError:
    return APIError(404, f"no stored response {response_id!r:.80}: {ctx.responses.why_missing(response_id)}",
                    param="response_id", code="response_not_found")


# --- the answer -------------------------------------------------------------------------------

def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _opened(item: dict[str, Any] | None) -> dict[str, Any]:
    """An output item that was just opened, or open already."""
    if item is None:
        raise RuntimeError("no open output item")
    return item


class _Events:
    """One typed event per call, numbered from 0 (sequence_number)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        # A copy: the items an event carries grow as the next events are made, before it is framed.
        return {"type": kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}


class _Output:
    """The choice's text, as it comes, → output items, and (streamed) the events that build them.

    Text goes through the chat route's reasoning and tool-call readers (openai_compat.ChoiceDeltas):
    reasoning opens a reasoning item (one reasoning_text part), content a message item (one
    output_text part), each call is a function_call item; text after a call is not kept (as on the
    chat route). A whole response runs the same code with no events.
    """

    def __init__(self, mode: str | None, logprobs: Callable[[list], list] | None, events: _Events | None,
                 inside: bool | None = None, formats: frozenset[str] | None = None) -> None:
        self.deltas = ChoiceDeltas(mode, inside, formats)
        self.logprobs = logprobs  # token logprobs → OpenAI's entries; None: not asked for
        self.emit = events
        self.items: list[dict[str, Any]] = []
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item
        self.message: dict[str, Any] | None = None  # the open message item
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.status = "in_progress"

    def _event(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        return [self.emit(kind, **fields)] if self.emit is not None else []

    def feed(self, text: str, lps: list | None) -> list[dict[str, Any]]:
        entries = self.logprobs(lps) if self.logprobs is not None and lps else []
        out: list[dict[str, Any]] = []
        for j, delta in enumerate(self.deltas.feed(text)):
            out += self._delta(delta, entries if j == 0 else [])
        return out

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        rest, finish_reason = self.deltas.finish(finish_reason)
        out: list[dict[str, Any]] = []
        for delta in rest:
            out += self._delta(delta, [])
        cut = finish_reason == "length"
        out += self._close_reasoning() + self._close_call()
        if not any(item["type"] != "reasoning" for item in self.items):  # no answer: still one (empty) message, as OpenAI answers
            out += self._open_message()
        out += self._close_message("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        return out

    def _delta(self, delta: dict[str, Any], entries: list) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if thought := delta.get("reasoning_content"):
            if self.reasoning is None:
                out += self._open_reasoning()
            reasoning = _opened(self.reasoning)
            part = reasoning["content"][0]
            part["text"] += thought
            out += self._event("response.reasoning_text.delta", item_id=reasoning["id"],
                               output_index=len(self.items) - 1, content_index=0, delta=thought)
        if delta.get("content") or delta.get("tool_calls"):
            out += self._close_reasoning()
        if delta.get("content"):
            if self.message is None:
                out += self._open_message()
            message = _opened(self.message)
            part = message["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += entries
            out += self._event("response.output_text.delta", item_id=message["id"], output_index=len(self.items) - 1,
                               content_index=0, delta=delta["content"], logprobs=entries)
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a call begins (its arguments follow in pieces as the model writes them)
                out += self._close_message("completed") + self._close_call()
                self.call = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                             "call_id": call["id"], "name": fn["name"]}
                self.items.append(self.call)
                out += self._event("response.output_item.added", output_index=len(self.items) - 1, item=self.call)
            piece = fn.get("arguments") or ""
            if piece and self.call is not None:
                self.call["arguments"] += piece
                out += self._event("response.function_call_arguments.delta", item_id=self.call["id"],
                                   output_index=len(self.items) - 1, delta=piece)
        return out

    def _close_call(self) -> list[dict[str, Any]]:
        call, self.call = self.call, None
        if call is None:
            return []
        index = self.items.index(call)
        call["status"] = "completed"
        return (self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                            arguments=call["arguments"])
                + self._event("response.output_item.done", output_index=index, item=call))

    def _open_reasoning(self) -> list[dict[str, Any]]:
        self.reasoning = {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
        index = len(self.items)
        self.items.append(self.reasoning)
        part = {"type": "reasoning_text", "text": ""}
        out = self._event("response.output_item.added", output_index=index, item=self.reasoning)
        self.reasoning["content"].append(part)
        return out + self._event("response.content_part.added", item_id=self.reasoning["id"], output_index=index,
                                 content_index=0, part=part)

    def _close_reasoning(self) -> list[dict[str, Any]]:
        item, self.reasoning = self.reasoning, None
        if item is None:
            return []
        index, part = self.items.index(item), item["content"][0]
        item["status"] = "completed"
        return (self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"])
                + self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=index, item=item))

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
        index = len(self.items)
        self.items.append(self.message)
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        out = self._event("response.output_item.added", output_index=index, item=self.message)
        self.message["content"].append(part)
        return out + self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                 content_index=0, part=part)

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self.message = self.message, None
        if message is None:
            return []
        index, part = self.items.index(message), message["content"][0]
        message["status"] = status
        return (self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=part["logprobs"])
                + self._event("response.content_part.done", item_id=message["id"], output_index=index,
                              content_index=0, part=part)
                + self._event("response.output_item.done", output_index=index, item=message))
