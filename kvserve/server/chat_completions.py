"""POST /v1/chat/completions: a conversation rendered by the model's (sandboxed) chat template."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING

from kvserve.outputs import RequestOutput
from kvserve.server import openai_compat
from kvserve.server.generation import Job, usage
from kvserve.server.insight import timeline_extension
from kvserve.server.logprobs import chat_logprobs
from kvserve.server.parsing import check_limits, reject, reject_unsupported_extras
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.serving import Serving

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission

class ChatCompletion(Serving):
    request_model = ChatCompletionRequest
    FIELDS = {"prompt": "messages", "logprobs": "top_logprobs"}  # the prompt is the conversation

    async def start(self) -> tuple[Admission, Job]:
        ctx, req = self.ctx, self.req
        openai_compat.log_ignored(req)
        reject_unsupported_extras(req)
        openai_compat.apply_legacy_functions(req)  # functions / function_call: as tools / tool_choice from here on
        reject(not req.messages, "messages", "must not be empty")
        reject(req.tool_choice not in (None, "auto", "none") and not req.tools, "tool_choice",
               "forces a tool call, which needs tools: give tools, or leave tool_choice out")
        reject(req.top_logprobs is not None and not req.logprobs, "top_logprobs", "needs logprobs set to true")
        check_limits(req.n, req.top_logprobs, "top_logprobs", ctx.settings.max_n, ctx.settings.max_logprobs)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        defaulted = max_tokens is None
        if defaulted:  # the server's default: cut below to what the context leaves once the prompt is known
            max_tokens = ctx.settings.max_tokens_default
        if req.max_completion_tokens is not None:
            self.fields = {**self.FIELDS, "max_tokens": "max_completion_tokens"}
        reject(max_tokens == 0, self.fields.get("max_tokens", "max_tokens"),
               "must be at least 1: a chat answer has a token (only /v1/completions scores a prompt with max_tokens 0)")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, logprobs, ctx.settings.defaults, openai_compat.constraint(req))
        prompt = req.chat_prompt()
        return await self.start_job(params, lambda: ctx.client.encode_chat_now(prompt), prefix="chatcmpl",
                                    # a default the client never sent must not be the reason its request is refused
                                    fit_within=ctx.client.max_model_len if defaulted else None)

    def events(self, job: Job) -> AsyncIterator[dict]:
        return _stream(self.ctx, job, self.req)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        return {**_response(self.ctx, job, self.req, finals[0]), **timeline_extension(self.ctx, job, self.req.kvserve)}


def _head(job: Job, ctx: ServerContext, obj: str) -> dict:
    return {"id": job.request_id, "object": obj, "created": int(time.time()), "model": ctx.settings.model_name,
            "system_fingerprint": ctx.system_fingerprint}


def _response(ctx: ServerContext, job: Job, req: ChatCompletionRequest, final: RequestOutput) -> dict:
    choices = []
    for c in final.outputs:
        message, finish_reason = openai_compat.chat_message(c.text, c.finish_reason, openai_compat.tool_mode(req),
                                                            ctx.client.reasoning(job), ctx.client.tool_formats)
        if req.functions is not None:
            message, finish_reason = openai_compat.legacy_message(message, finish_reason)
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c.logprobs, ctx.texts) if c.logprobs is not None else None,
                        "finish_reason": finish_reason})
    return {**_head(job, ctx, "chat.completion"), "choices": choices,
            "usage": usage([final], ctx.client.reasoning_tokens(job, final))}


async def _stream(ctx: ServerContext, job: Job, req: ChatCompletionRequest) -> AsyncIterator[dict]:
    head = _head(job, ctx, "chat.completion.chunk")
    if req.include_usage:
        head["usage"] = None  # on every chunk but the last (the OpenAI SDK expects the key)

    legacy = openai_compat.LegacyDeltas() if req.functions is not None else None

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
    deltas = [openai_compat.ChoiceDeltas(openai_compat.tool_mode(req), inside, ctx.client.tool_formats)
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

