"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A response is one chat turn. Its `input` (a string, or a list of items: messages,
`function_call`s and `function_call_output`s) becomes chat messages after `instructions` (as the
system message) and after the conversation of `previous_response_id`, if given; the model's
chat template renders them and the turn runs as a chat completion would, with the same sampling,
limits, structured output (`text.format`) and tool calling (function tools; `tool_choice`
"required" or a named function constrains the output). Its text becomes output items: a
`message` holding one `output_text` part, and one `function_call` item per tool call.

Streamed, it is OpenAI's typed events, each with its `sequence_number`: response.created,
response.in_progress, then per item output_item.added, (content_part.added, output_text.delta...,
output_text.done, content_part.done | function_call_arguments.delta, .done), output_item.done,
and last response.completed, or response.incomplete when max_output_tokens (or the context)
cut the output. A failure after the stream started is an `error` event and response.failed.

A finished response is kept in a bounded in-memory store (kvserve/server/response_store.py)
unless the request said `store: false`.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.chat_render import ChatPrompt
from kvserve.server.errors import APIError, from_invalid, from_validation_error
from kvserve.server.generation import Job
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.openai_compat import ChoiceDeltas
from kvserve.server.parsing import check_limits, reject
from kvserve.server.protocol import (
    ResponsesContentPart,
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesFunctionTool,
    ResponsesMessageItem,
    ResponsesRequest,
)
from kvserve.server.response_store import StoredResponse
from kvserve.server.serving import Serving
from kvserve.structured.spec import Constraint, json_schema
from kvserve.structured.tools import forced_call_constraint

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission

log = logging.getLogger("kvserve.server")

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")
_TOOL_CHOICES = ("none", "auto", "required")


# --- the request ------------------------------------------------------------------------------

def _refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming each OpenAI field that asks for what kvserve does not do."""
    reject(req.background is True, "background", "is not supported: kvserve answers a response while the request is "
           "open (stream it for progress); send false or leave it out")
    reject(req.background_options is not None, "background_options", "is not supported: kvserve has no background mode")
    reject(req.conversation is not None, "conversation", "is not supported: kvserve has no Conversations API; chain "
           "responses with previous_response_id, or send the whole conversation as input")
    reject(req.prompt is not None, "prompt", "is not supported: kvserve has no stored prompt templates; send "
           "instructions and input")
    reject(req.truncation == "auto", "truncation", "\"auto\" is not supported: kvserve never drops input to fit the "
           "context (a conversation that does not fit is refused); send \"disabled\" or leave it out")
    reject(req.context_management is not None, "context_management", "is not supported: kvserve does not compact "
           "conversations")
    reject(req.moderation is not None, "moderation", "is not supported: kvserve runs no moderation model")
    reject(req.image is not None, "image", "is not supported: kvserve serves a text-only model")


def _validated(model: type[BaseModel], data: Any, where: str) -> Any:
    """`data` as `model`, or a 400 whose message and param start with `where` (e.g. input[2])."""
    if not isinstance(data, dict):
        raise APIError(400, f"{where}: must be an object", param=where)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        inner = from_validation_error(e)
        if inner.param is None:
            raise APIError(400, f"{where}: {inner.message}", param=where) from None
        raise APIError(400, f"{where}.{inner.message}", param=f"{where}.{inner.param}") from None


def _text(content: str | list[ResponsesContentPart], where: str) -> str:
    """A message's or a tool result's content as one string (text parts joined)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS:
            if part.text is None:
                raise APIError(400, f"{where}[{j}].text: is required", param=f"{where}[{j}].text")
            texts.append(part.text)
        elif part.type == "refusal":
            texts.append(part.refusal or "")
        else:
            raise APIError(400, f"{where}[{j}].type: {part.type!r} content is not supported: kvserve serves a "
                           "text-only model; send input_text parts", param=f"{where}[{j}].type")
    return "".join(texts)


def plain_items(raw: list[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """Input (or output) items as the plain forms this module works with:
        {"type": "message", "role", "content": str}
        {"type": "function_call", "call_id", "name", "arguments"}
        {"type": "function_call_output", "call_id", "output": str}
    Reasoning items are dropped (kvserve's models write none, and another's cannot be shown to
    this one); every other kind is a 400 naming it."""
    out = []
    for i, item in enumerate(raw):
        here = f"{where}[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind == "message":
            m = _validated(ResponsesMessageItem, item, here)
            out.append({"type": "message", "role": m.role, "content": _text(m.content, f"{here}.content")})
        elif kind == "function_call":
            c = _validated(ResponsesFunctionCallItem, item, here)
            out.append({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments})
        elif kind == "function_call_output":
            r = _validated(ResponsesFunctionCallOutputItem, item, here)
            out.append({"type": "function_call_output", "call_id": r.call_id, "output": _text(r.output, f"{here}.output")})
        elif kind == "reasoning":
            continue
        elif not isinstance(item, dict):
            raise APIError(400, f"{here}: must be an object", param=here)
        elif kind is None:
            raise APIError(400, f"{here}: give its type (message, function_call or function_call_output), or a role "
                           "for a message", param=f"{here}.type")
        else:
            raise APIError(400, f"{here}.type: {kind!r} items are not supported: kvserve takes message, function_call "
                           "and function_call_output items", param=f"{here}.type")
    return out


def chat_messages(items: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Plain items → the messages a chat template renders: developer is system, consecutive
    function calls are one assistant message's tool_calls (after its text, if any), and each
    function_call_output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": "system" if item["role"] == "developer" else item["role"],
                             "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _tools(raw: list[dict[str, Any]] | None) -> list[ResponsesFunctionTool]:
    tools = []
    for i, tool in enumerate(raw or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            where = f"tools[{i}].type" if isinstance(tool, dict) else f"tools[{i}]"
            what = f"the built-in tool {kind!r}" if isinstance(kind, str) else "a tool without a type"
            raise APIError(400, f"{where}: {what} is not supported: kvserve serves function tools only "
                           "({\"type\": \"function\", \"name\": ..., \"parameters\": {...}})", param=where)
        tools.append(_validated(ResponsesFunctionTool, tool, f"tools[{i}]"))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"tools: two tools are named {dup!r}; names must be unique", param="tools")
    return tools


def _tool_choice(choice: str | dict[str, Any] | None, tools: list[ResponsesFunctionTool]) -> str | dict[str, Any]:
    """"none", "auto", "required" or {"type": "function", "name": ...} (400 for the rest)."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                           f"\"name\": ...}}, got {choice!r:.60}", param="tool_choice")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice \"required\" needs tools: list the functions it may call", param="tool_choice")
        return choice
    kind = choice.get("type")
    if kind != "function":
        raise APIError(400, f"tool_choice: {kind!r:.60} is not supported: kvserve serves function tools only (\"none\", "
                       "\"auto\", \"required\" or {\"type\": \"function\", \"name\": ...})", param="tool_choice.type")
    name = choice.get("name", (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None)
    if not isinstance(name, str):
        raise APIError(400, "tool_choice.name: is required (the function to call)", param="tool_choice.name")
    if name not in {t.name for t in tools}:
        listed = ", ".join(repr(t.name) for t in tools) or "none"
        raise APIError(400, f"tool_choice names the function {name!r:.80}, which is not among the tools ({listed})",
                       param="tool_choice.name")
    return {"type": "function", "name": name}


def _chat_tool(t: ResponsesFunctionTool) -> dict[str, Any]:
    fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def _format(req: ResponsesRequest) -> dict[str, Any]:
    """text.format as the response echoes it."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return {"type": "text"}
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
            "strict": fmt.strict}


def _constraint(req: ResponsesRequest, tools: list[ResponsesFunctionTool], choice: str | dict) -> Constraint | None:
    """The output's one constraint. A forced call (tool_choice "required" or named) wins over
    text.format: that turn's output is the call, and text.format shapes a later turn's message
    (an agent forcing a tool and then answering in a schema sends both, each turn)."""
    if tools and choice not in ("auto", "none"):
        named = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
        return forced_call_constraint([_chat_tool(t) for t in tools], named, req.parallel_tool_calls is True)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        return Constraint("json_object", "", "text.format")
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema: is required for a json_schema format", param="text.format.schema")
        return json_schema(fmt.schema_, "text.format.schema")
    return None


def _tool_mode(tools: list, choice: str | dict, constraint: Constraint | None) -> str | None:
    """As openai_compat.tool_mode: None (no tool parsing), "auto" or "forced"."""
    if not tools or choice == "none":
        return None
    if choice == "auto":  # under text.format the answer is the schema's JSON, never a call
        return None if constraint is not None else "auto"
    return "forced"


def _sampling(req: ResponsesRequest, max_tokens: int, logprobs: int | None, defaults: dict,
              constraint: Constraint | None) -> SamplingParams:
    given = {**defaults, **{k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
                           if getattr(req, k) is not None}}
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(n=1, seed=req.seed, stop=stop, max_tokens=max_tokens, min_tokens=req.min_tokens,
                          ignore_eos=req.ignore_eos, logprobs=logprobs, priority=req.priority, constraint=constraint,
                          speculative=req.speculative, **given)


# --- the routes -------------------------------------------------------------------------------

class ModelResponse(Serving):
    """POST /v1/responses: one admitted response, its events (streamed) or its body (whole), and
    storing it."""

    request_model = ResponsesRequest
    FIELDS = {"prompt": "input", "max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}

    async def start(self) -> tuple[Admission, Job]:
        ctx, req = self.ctx, self.req
        if ignored := req.ignored_fields():
            log.warning("ignored OpenAI field(s) kvserve does not use: %s", ", ".join(ignored))
        _refuse_unsupported(req)
        self.tools = _tools(req.tools)
        self.choice = _tool_choice(req.tool_choice, self.tools)
        try:
            constraint = _constraint(req, self.tools, self.choice)
        except ValueError as e:  # InvalidParam: a malformed schema, or a named function not among the tools
            raise from_invalid(e) from None
        self.mode = _tool_mode(self.tools, self.choice, constraint)
        want_logprobs = LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs is not None
        self.logprobs = (lambda lps: chat_logprobs(lps, ctx.texts)["content"]) if want_logprobs else None
        check_limits(1, req.top_logprobs, "top_logprobs", 1, ctx.settings.max_logprobs)
        items = plain_items(req.input) if isinstance(req.input, list) else [
            {"type": "message", "role": "user", "content": req.input}]
        if req.previous_response_id is not None:
            previous = ctx.responses.get(req.previous_response_id)
            if previous is None:
                why = ctx.responses.why_missing(req.previous_response_id)
                raise APIError(400, f"previous_response_id {req.previous_response_id!r:.80} is not stored on this "
                               f"server: {why}", param="previous_response_id", code="previous_response_not_found")
            items = [*previous.conversation, *items]
        self.items = items
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + chat_messages(items)
        reject(not messages, "input", "must not be empty")
        reject(req.max_output_tokens is not None and req.max_output_tokens < 1, "max_output_tokens", "must be at least 1")
        defaulted = req.max_output_tokens is None
        max_tokens = ctx.settings.max_tokens_default if defaulted else req.max_output_tokens
        params = _sampling(req, max_tokens, (req.top_logprobs or 0) if want_logprobs else None, ctx.settings.defaults,
                           constraint)
        chat_tools = [_chat_tool(t) for t in self.tools] if self.mode is not None else None
        prompt = ChatPrompt(messages, True, chat_tools or None)
        started = await self.start_job(params, lambda: ctx.client.encode_chat_now(prompt), prefix="resp", sep="_",
                                       # a default the client never sent must not be why it is refused
                                       fit_within=ctx.client.max_model_len if defaulted else None)
        self.created_at = int(time.time())
        self.store = req.store and ctx.responses.capacity > 0
        return started

    def events(self, job: Job) -> AsyncIterator[bytes]:
        return self._events(job)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        final = finals[0]
        choice = final.outputs[0]
        out = _Output(self.mode, self.logprobs, None)
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
                     "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
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
            "text": {"format": _format(req), "verbosity": "medium"}, "tool_choice": self.choice,
            "tools": [t.model_dump(exclude_none=True, include={"type", "name", "description", "parameters", "strict"})
                      for t in self.tools],
            "top_logprobs": req.top_logprobs or 0, "top_p": params.top_p, "truncation": "disabled",
            "usage": usage if done else None, "user": req.user, "metadata": req.metadata or {},
        }

    def _finished(self, job: Job, out: _Output, final: RequestOutput) -> dict[str, Any]:
        body = self._object(job, out.status, out.items, final)
        if self.req.store:  # (a store of size 0 keeps none, and remembers why)
            conversation = (*self.items, *plain_items(body["output"], "output"))
            self.ctx.responses.put(StoredResponse(body, conversation))
        else:
            self.ctx.responses.not_stored(body["id"])
        return body

    async def _events(self, job: Job) -> AsyncIterator[bytes]:
        event = _Events()
        yield event("response.created", response=self._object(job, "in_progress", []))
        yield event("response.in_progress", response=self._object(job, "in_progress", []))
        out = _Output(self.mode, self.logprobs, event)
        final = None
        try:
            async with aclosing(self.ctx.client.outputs(job)) as outputs:
                async for _, final in outputs:
                    choice = final.outputs[0]
                    if choice.delta_text or choice.delta_logprobs:
                        for e in out.feed(choice.delta_text, choice.delta_logprobs):
                            yield e
                    if choice.finished:
                        for e in out.finish(choice.finish_reason):
                            yield e
            body = self._finished(job, out, final)
            yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
        except APIError as e:
            yield event("error", code=e.code, message=e.message, param=e.param)
            yield event("response.failed", response=self._object(job, "failed", out.items, final,
                                                                 error={"code": "server_error", "message": e.message}))


def get_response(ctx: ServerContext, response_id: str) -> dict[str, Any]:
    stored = ctx.responses.get(response_id)
    if stored is None:
        raise _not_found(ctx, response_id)
    return stored.body


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


class _Events:
    """One typed server-sent event per call, numbered from 0 (sequence_number)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, "sequence_number": self.sequence, **fields}, ensure_ascii=False,
                          separators=(",", ":"))
        self.sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()


class _Output:
    """The choice's text, as it comes, → output items, and (streamed) the events that build them.

    Text goes through the chat route's tool-call reader (openai_compat.ChoiceDeltas): content
    opens a message item (one output_text part), each call is a function_call item; text after
    a call is not kept (as on the chat route). A whole response runs the same code with no events.
    """

    def __init__(self, mode: str | None, logprobs: Callable[[list], list] | None, events: _Events | None) -> None:
        self.deltas = ChoiceDeltas(mode)
        self.logprobs = logprobs  # token logprobs → OpenAI's entries; None: not asked for
        self.emit = events
        self.items: list[dict[str, Any]] = []
        self.message: dict[str, Any] | None = None  # the open message item
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.status = "in_progress"

    def _event(self, kind: str, **fields: Any) -> list[bytes]:
        return [self.emit(kind, **fields)] if self.emit is not None else []

    def feed(self, text: str, lps: list | None) -> list[bytes]:
        entries = self.logprobs(lps) if self.logprobs is not None and lps else []
        out: list[bytes] = []
        for j, delta in enumerate(self.deltas.feed(text)):
            out += self._delta(delta, entries if j == 0 else [])
        return out

    def finish(self, finish_reason: str | None) -> list[bytes]:
        rest, finish_reason = self.deltas.finish(finish_reason)
        out: list[bytes] = []
        for delta in rest:
            out += self._delta(delta, [])
        cut = finish_reason == "length"
        out += self._close_call()
        if not self.items:  # nothing written: still one (empty) message, as OpenAI answers
            out += self._open_message()
        out += self._close_message("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        return out

    def _delta(self, delta: dict[str, Any], entries: list) -> list[bytes]:
        out: list[bytes] = []
        if delta.get("content"):
            if self.message is None:
                out += self._open_message()
            part = self.message["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += entries
            out += self._event("response.output_text.delta", item_id=self.message["id"], output_index=len(self.items) - 1,
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

    def _close_call(self) -> list[bytes]:
        call, self.call = self.call, None
        if call is None:
            return []
        index = self.items.index(call)
        call["status"] = "completed"
        return (self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                            arguments=call["arguments"])
                + self._event("response.output_item.done", output_index=index, item=call))

    def _open_message(self) -> list[bytes]:
        self.message = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
        index = len(self.items)
        self.items.append(self.message)
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        out = self._event("response.output_item.added", output_index=index, item=self.message)
        self.message["content"].append(part)
        return out + self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                 content_index=0, part=part)

    def _close_message(self, status: str) -> list[bytes]:
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
