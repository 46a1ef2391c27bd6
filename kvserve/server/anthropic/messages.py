"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over kvserve's chat.

The request becomes a conversation and tools (`to_chat`, kvserve/server/anthropic/protocol.py) and runs as a
chat completion does (`ServerContext.start_job`: the same admission, limits, abort-on-disconnect and metrics);
the output is read for tool calls by the same parser and answered in Anthropic's shapes
(kvserve/server/anthropic/content.py):

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

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from fastapi import Request

from kvserve.outputs import RequestOutput
from kvserve.server.anthropic.content import BlockEvents, head, message, stop, usage
from kvserve.server.anthropic.protocol import CountTokensRequest, MessagesRequest, constraint, to_chat, tool_mode
from kvserve.server.canonical import ChoiceDeltas
from kvserve.server.errors import ANTHROPIC, from_invalid
from kvserve.server.generation import Job
from kvserve.server.serving import Serving

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission

log = logging.getLogger("kvserve.server")


def _log_ignored(req: CountTokensRequest) -> None:
    if ignored := req.ignored_fields():
        log.warning("ignored Anthropic field(s) kvserve does not use: %s", ", ".join(ignored))


async def count_tokens(request: Request, ctx: ServerContext) -> dict:
    ctx.state.require_ready()
    req = await ctx.parse(request, CountTokensRequest)
    _log_ignored(req)
    try:
        req.checked()
        constraint(req)  # a bad tool_choice name or schema is refused here as in /v1/messages
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
        turn = to_chat(req)
        params = turn.sampling.params(ctx.settings.defaults, ctx.settings.max_tokens_default)
        return await self.start_job(params, lambda: ctx.client.encode_chat_now(turn.prompt), prefix="msg",
                                    fit_within=ctx.client.max_model_len)  # max_tokens is a ceiling here

    def events(self, job: Job) -> AsyncIterator[dict]:
        return _stream(self.ctx, job, self.req)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        c = self.ctx.client
        return message(job, self.req, finals[0], self.ctx.settings.model_name, c.reasoning(job), c.tool_formats)


async def _stream(ctx: ServerContext, job: Job, req: MessagesRequest) -> AsyncIterator[dict]:
    deltas = ChoiceDeltas(tool_mode(req), ctx.client.reasoning(job), ctx.client.tool_formats)
    blocks = BlockEvents(req.thinking_on)
    started = False
    async with aclosing(ctx.client.outputs(job)) as outputs:
        async for _, out in outputs:
            if not started:  # once the prompt is in: its tokens read from the prefix cache are known
                started = True
                yield {"type": "message_start", "message": {
                    **head(job, ctx.settings.model_name), "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {**usage(out), "output_tokens": 0}}}
            c = out.outputs[0]
            for delta in deltas.feed(c.delta_text):
                for e in blocks.feed(delta):
                    yield e
            if not c.finished:
                continue
            rest, finish_reason = deltas.finish(c.finish_reason)
            for e in [e for delta in rest for e in blocks.feed(delta)] + blocks.close():
                yield e
            stop_reason, stop_sequence = stop(c, finish_reason, req.max_tokens)
            yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                   "usage": usage(out)}
            yield {"type": "message_stop"}
