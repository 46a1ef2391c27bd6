"""POST /v1/chat/completions: a conversation rendered by the model's (sandboxed) chat template."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from kvserve.outputs import RequestOutput
from kvserve.server.canonical import ChoiceDeltas, chat_message
from kvserve.server.generation import Job, usage
from kvserve.server.insight import timeline_extension
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.openai.legacy import LegacyDeltas, legacy_message
from kvserve.server.openai.protocol import ChatCompletionRequest, log_ignored, to_chat
from kvserve.server.parsing import check_limits, reject_unsupported_extras
from kvserve.server.serving import Serving

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission


class ChatCompletion(Serving):
    """POST /v1/chat/completions: one conversation's next message, streamed or whole."""

    request_model = ChatCompletionRequest
    FIELDS = {"prompt": "messages", "logprobs": "top_logprobs"}  # the prompt is the conversation

    async def start(self) -> tuple[Admission, Job]:
        ctx, req = self.ctx, self.req
        log_ignored(req)
        reject_unsupported_extras(req)
        if req.max_completion_tokens is not None:
            self.fields = {**self.FIELDS, "max_tokens": "max_completion_tokens"}
        turn = to_chat(req)
        self.mode = turn.tool_mode
        check_limits(req.n, req.top_logprobs, "top_logprobs", ctx.settings.max_n, ctx.settings.max_logprobs)
        params = turn.sampling.params(ctx.settings.defaults, ctx.settings.max_tokens_default)
        return await self.start_job(params, lambda: ctx.client.encode_chat_now(turn.prompt), prefix="chatcmpl",
                                    # a default the client never sent must not be the reason its request is refused
                                    fit_within=ctx.client.max_model_len if turn.sampling.defaulted else None)

    def events(self, job: Job) -> AsyncIterator[dict]:
        return _stream(self.ctx, job, self.req, self.mode)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        return {**_response(self.ctx, job, self.req, finals[0], self.mode),
                **timeline_extension(self.ctx, job, self.req.kvserve)}


def _head(job: Job, ctx: ServerContext, obj: str) -> dict:
    return {"id": job.request_id, "object": obj, "created": int(time.time()), "model": ctx.settings.model_name,
            "system_fingerprint": ctx.system_fingerprint}


def _response(ctx: ServerContext, job: Job, req: ChatCompletionRequest, final: RequestOutput, mode: str | None) -> dict:
    choices = []
    for c in final.outputs:
        message, finish_reason = chat_message(c.text, c.finish_reason, mode, ctx.client.reasoning(job),
                                              ctx.client.tool_formats)
        if req.functions is not None:
            message, finish_reason = legacy_message(message, finish_reason)
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c.logprobs, ctx.texts) if c.logprobs is not None else None,
                        "finish_reason": finish_reason})
    return {**_head(job, ctx, "chat.completion"), "choices": choices,
            "usage": usage([final], ctx.client.reasoning_tokens(job, final))}


async def _stream(ctx: ServerContext, job: Job, req: ChatCompletionRequest, mode: str | None) -> AsyncIterator[dict]:
    head = _head(job, ctx, "chat.completion.chunk")
    if req.include_usage:
        head["usage"] = None  # on every chunk but the last (the OpenAI SDK expects the key)

    legacy = LegacyDeltas() if req.functions is not None else None

    def chunk(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None,
              extra: dict | None = None) -> dict | None:
        """One choice's chunk; None for what the legacy function_call shape has no room for."""
        if legacy is not None:
            shaped, finish_reason = legacy.delta(delta), legacy.finish_reason(finish_reason)
            if shaped is None:
                return None
            delta = shaped
        return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}], **(extra or {})}

    final = None
    done: set[int] = set()
    inside = ctx.client.reasoning(job)
    deltas = [ChoiceDeltas(mode, inside, ctx.client.tool_formats)
              for _ in range(job.params.n)]
    for i in range(job.params.n):
        if event := chunk(i, {"role": "assistant", "content": ""}):  # (always: no tool calls in it)
            yield event
    async with aclosing(ctx.client.outputs(job)) as outputs:
        async for _, out in outputs:
            final = out
            for c in out.outputs:
                if c.index in done or not (c.delta_text or c.delta_logprobs or c.finished):
                    continue
                lp = chat_logprobs(c.delta_logprobs, ctx.texts) if c.delta_logprobs is not None else None
                out_deltas = deltas[c.index].feed(c.delta_text)
                if lp and not out_deltas:
                    out_deltas = [{"content": ""}]
                for j, delta in enumerate(out_deltas):
                    if event := chunk(c.index, delta, lp if j == 0 else None):
                        yield event
                if c.finished:
                    done.add(c.index)
                    rest, finish_reason = deltas[c.index].finish(c.finish_reason)
                    for delta in rest:
                        if event := chunk(c.index, delta):
                            yield event
                    last = len(done) == job.params.n  # the final chunk carries the timeline if asked
                    extension = timeline_extension(ctx, job, req.kvserve) if last else None
                    if event := chunk(c.index, {}, None, finish_reason, extension):  # (always: an empty delta)
                        yield event
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage([final], ctx.client.reasoning_tokens(job, final))}

