"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over kvserve's chat.

The request becomes a conversation and tools (kvserve/server/anthropic_protocol.py) and runs as a
chat completion does (`ServerContext.start_job`: the same admission, limits, abort-on-disconnect and metrics);
the output is read for tool calls by the same parser and answered in Anthropic's shapes:

  content      a thinking block (a thinking model's reasoning, when `thinking` asks for it), text
               and tool_use blocks ({"type": "tool_use", "id", "name", "input": {...}})
  stop_reason  end_turn; max_tokens; stop_sequence (with `stop_sequence` set); tool_use;
               model_context_window_exceeded when the context, not max_tokens, ended the answer
               (max_tokens is a ceiling here: it is cut to what the context leaves, not refused)
  usage        input_tokens (prompt tokens not read from the prefix cache), cache_read_input_tokens
               (those that were), output_tokens

A stream is Anthropic's server-sent events, each named by an `event:` line: message_start,
content_block_start, ping (after the first block opens), content_block_delta (thinking_delta,
text_delta or input_json_delta), content_block_stop, message_delta (stop_reason, usage), message_stop; a failure
mid-stream is an `error` event. Errors are {"type": "error", "error": {"type", "message"}}
(kvserve/server/errors.py).
"""
from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import Request

from kvserve.errors import InvalidParam
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.sampling_params import with_defaults
from kvserve.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvserve.server.errors import ANTHROPIC, from_invalid
from kvserve.server.generation import Job
from kvserve.server.openai_compat import ChoiceDeltas, chat_message
from kvserve.server.serving import Serving
from kvserve.structured.spec import Constraint, json_schema
from kvserve.structured.tools import forced_call_constraint

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission

log = logging.getLogger("kvserve.server")


def _log_ignored(req: CountTokensRequest) -> None:
    if ignored := req.ignored_fields():
        log.warning("ignored Anthropic field(s) kvserve does not use: %s", ", ".join(ignored))


def _constraint(req: CountTokensRequest) -> Constraint | None:
    """A forced tool call's grammar, or output_config.format's schema (not both)."""
    tools, choice = req.openai_tools(), req.openai_tool_choice()
    forced = None
    if tools and choice not in ("auto", "none") and req.tool_choice is not None:  # (None is "auto")
        parallel = req.tool_choice.disable_parallel_tool_use is False  # one call unless asked for more
        forced = forced_call_constraint(tools, choice, parallel)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return forced
    if forced is not None:
        raise InvalidParam("output_config.format", "output_config.format cannot be combined with a forced "
                           "tool_choice (any or tool): give one output constraint")
    return json_schema(fmt.schema_, "output_config.format.schema")


def _tool_mode(req: CountTokensRequest) -> str | None:
    if req.openai_tools() is None:
        return None
    return "auto" if req.openai_tool_choice() == "auto" else "forced"


async def count_tokens(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    req = await ctx.parse(request, CountTokensRequest)
    _log_ignored(req)
    try:
        req.checked()
        _constraint(req)  # a bad tool_choice name or schema is refused here as in /v1/messages
        ids = await ctx.client.encode_chat(req.chat_prompt())
    except ValueError as e:
        raise from_invalid(e, Message.FIELDS) from None
    return {"input_tokens": len(ids)}


class Message(Serving):
    """POST /v1/messages."""

    request_model = MessagesRequest
    FIELDS = {"prompt": "messages", "stop": "stop_sequences"}
    dialect = ANTHROPIC

    async def start(self) -> tuple[Admission, Job]:
        ctx, req = self.ctx, self.req
        _log_ignored(req)
        req.checked()
        if req.max_tokens < 1:  # (0 scores a prompt on /v1/completions; Anthropic's API asks at least 1)
            raise InvalidParam("max_tokens", f"max_tokens must be at least 1, got {req.max_tokens}")
        given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k")}
        params = with_defaults(ctx.settings.defaults, given, max_tokens=req.max_tokens,
                                 stop=list(req.stop_sequences or []), constraint=_constraint(req),
                                 speculative=req.speculative)
        return await self.start_job(params, lambda: ctx.client.encode_chat_now(req.chat_prompt()), prefix="msg",
                                    fit_within=ctx.client.max_model_len)

    def events(self, job: Job) -> AsyncIterator[dict]:
        return _stream(self.ctx, job, self.req)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        return _message(self.ctx, job, self.req, finals[0])


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (or the opening delta of one) as a tool_use block."""
    fn = call["function"]
    call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
    return {"type": "tool_use", "id": call_id.replace("call_", "toolu_", 1), "name": fn["name"],
            "input": json.loads(fn["arguments"]) if fn.get("arguments") else {}}


def _stop(c: CompletionOutput, finish_reason: str | None, asked: int) -> tuple[str, str | None]:
    """stop_reason and stop_sequence of a finished answer (finish_reason after tool-call parsing)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return ("max_tokens" if len(c.token_ids) >= asked else "model_context_window_exceeded"), None
    if finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _usage(final: RequestOutput) -> dict[str, int]:
    prompt, cached = len(final.prompt_token_ids), final.num_cached_tokens
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached,
            "output_tokens": len(final.outputs[0].token_ids)}


def _head(ctx: ServerContext, job: Job) -> dict[str, Any]:
    return {"id": job.request_id, "type": "message", "role": "assistant", "model": ctx.settings.model_name}


def _message(ctx: ServerContext, job: Job, req: MessagesRequest, final: RequestOutput) -> dict[str, Any]:
    c = final.outputs[0]
    message, finish_reason = chat_message(c.text, c.finish_reason, _tool_mode(req), ctx.client.reasoning(job),
                                          ctx.client.tool_formats)
    thinking = message.get("reasoning_content") if req.thinking_on else None
    content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking is not None else []
    content += [{"type": "text", "text": message["content"]}] if message["content"] else []
    content += [_tool_use(call) for call in message.get("tool_calls", [])]
    stop_reason, stop_sequence = _stop(c, finish_reason, req.max_tokens)
    return {**_head(ctx, job), "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(final)}


class BlockEvents:
    """Chat deltas (reasoning_content, content, or tool_calls as openai_compat.ChoiceDeltas gives
    them) in, Anthropic's content block events out: a thinking block while reasoning comes (when the
    client asked for thinking), a text block while text comes, a tool_use block per call."""

    def __init__(self, thinking: bool = False) -> None:
        self.thinking = thinking
        self.index = -1  # of the open block, or of the last one
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.call: int | None = None  # the OpenAI index of the open tool call

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if (thought := delta.get("reasoning_content")) and self.thinking:
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": thought}})
        if text := delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": text}})
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id") is not None or self.open != "tool_use" or call.get("index") != self.call:
                out += self._start({**_tool_use({**call, "function": {"name": fn.get("name")}})})
                self.call = call.get("index")
            if fn.get("arguments"):
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return out

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        if self.index == 0:
            out.append({"type": "ping"})  # where Anthropic sends its first
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]


async def _stream(ctx: ServerContext, job: Job, req: MessagesRequest) -> AsyncIterator[dict]:
    deltas = ChoiceDeltas(_tool_mode(req), ctx.client.reasoning(job), ctx.client.tool_formats)
    blocks = BlockEvents(req.thinking_on)
    started = False
    async with aclosing(ctx.client.outputs(job)) as outputs:
        async for _, out in outputs:
            if not started:  # once the prompt is in: its tokens read from the prefix cache are known
                started = True
                yield {"type": "message_start", "message": {
                    **_head(ctx, job), "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {**_usage(out), "output_tokens": 0}}}
            c = out.outputs[0]
            for delta in deltas.feed(c.delta_text):
                for e in blocks.feed(delta):
                    yield e
            if not c.finished:
                continue
            rest, finish_reason = deltas.finish(c.finish_reason)
            for e in [e for delta in rest for e in blocks.feed(delta)] + blocks.close():
                yield e
            stop_reason, stop_sequence = _stop(c, finish_reason, req.max_tokens)
            yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": _usage(out)}
            yield {"type": "message_stop"}
