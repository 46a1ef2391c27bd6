"""POST /v1/completions: one or more prompts, streamed or whole; with `suffix`, fill in the middle
(kvserve/fim.py).

Scoring a prompt (what lm-evaluation-harness's `local-completions` sends for log-likelihoods):
`echo: true` puts the prompt's text before the completion's, and with `logprobs: k` the
log-probabilities start with the prompt's tokens (the first one's null: nothing precedes it),
computed in the same forward that reads the prompt (SamplingParams.prompt_logprobs).
`max_tokens: 0` generates nothing: only the prompt is read (and scored, with logprobs).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

from kvserve.fim import fim_token_ids, no_fim_error
from kvserve.outputs import RequestOutput
from kvserve.server import request_id
from kvserve.server.generation import Job, usage
from kvserve.server.insight import timeline_extension
from kvserve.server.logprobs import completion_logprobs, prompt_logprobs
from kvserve.server.openai.protocol import CompletionRequest, constraint, log_ignored
from kvserve.server.parsing import check_limits, reject, reject_unsupported_extras
from kvserve.server.serving import Serving

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission


class Completion(Serving):
    """POST /v1/completions: each prompt continued, streamed or whole."""

    request_model = CompletionRequest
    echoes: list[str] | None = None  # each prompt's text, for `echo`

    async def start(self) -> tuple[Admission, Job]:
        ctx, req, request = self.ctx, self.req, self.request
        log_ignored(req)
        reject_unsupported_extras(req)
        reject(req.best_of is not None and req.best_of != req.n, "best_of", "is not supported (n is)")
        check_limits(req.n, req.logprobs, "logprobs", ctx.settings.max_n, ctx.settings.max_logprobs)
        spec = req.sampling(req.max_tokens, req.logprobs, constraint(req))
        params = spec.params(ctx.settings.defaults, ctx.settings.max_tokens_default)
        if req.echo and req.logprobs is not None:  # the prompt's tokens are scored too
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)
        prompts = req.prompts()
        fim = bool(req.suffix)  # an empty suffix asks for nothing a plain completion does not give
        if fim:
            reject(not all(isinstance(p, str) for p in prompts), "suffix", "needs the prompt as text, not token ids")
            if fim_token_ids(ctx.client.tokenizer) is None:
                raise no_fim_error()
        admission = ctx.state.admit(len(prompts), params.n)  # before any tokenizing: 400 or 429 at once
        try:
            given = prompts  # echoed as the client sent them (not as FIM markers), once they are known valid
            batch: Sequence[str | list[int]] = prompts
            if fim:  # (every prompt is text: checked above)
                batch = await ctx.client.encode_fim([p for p in prompts if isinstance(p, str)], req.suffix)
            ids = await ctx.client.tokenize(batch, params, request.receive)
            self.echoes = await _echo_texts(ctx, given, req) if req.echo else None
        except BaseException:  # (Serving answers an InvalidParam)
            admission.release()
            raise
        return admission, Job(ids, params, self.arrival, request_id=request_id.name(request, "cmpl"))

    def events(self, job: Job) -> AsyncIterator[dict]:
        return _stream(self.ctx, job, self.req, self.echoes)

    def body(self, job: Job, finals: list[RequestOutput]) -> dict:
        return {**_response(self.ctx, job, self.req, finals, self.echoes),
                **timeline_extension(self.ctx, job, self.req.kvserve)}


async def _echo_texts(ctx: ServerContext, prompts: list[str | list[int]], req: CompletionRequest) -> list[str]:
    """Each prompt as text, for echo: as sent, or its token ids decoded (special tokens as the
    completion's text shows them)."""
    tok = ctx.client.tokenizer
    return await asyncio.to_thread(lambda: [p if isinstance(p, str) else tok.decode(p, req.skip_special_tokens)
                                            for p in prompts])


def _head(job: Job, ctx: ServerContext) -> dict:
    return {"id": job.request_id, "object": "text_completion", "created": int(time.time()),
            "model": ctx.settings.model_name, "system_fingerprint": ctx.system_fingerprint}


def _logprobs(ctx: ServerContext, lps, offset: int, skip: bool) -> tuple[dict, int]:
    return completion_logprobs(lps or [], ctx.texts, offset, ctx.special_token_ids if skip else frozenset())


def _echo_logprobs(ctx: ServerContext, out: RequestOutput, skip: bool) -> dict:
    return prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs or [], ctx.texts,
                           ctx.special_token_ids if skip else frozenset())


def _response(ctx: ServerContext, job: Job, req: CompletionRequest, finals: list[RequestOutput],
              echoes: list[str] | None) -> dict:
    choices = []
    for i, out in enumerate(finals):
        echo = echoes[i] if echoes is not None else ""
        prompt_lp = _echo_logprobs(ctx, out, req.skip_special_tokens) if echoes is not None and req.logprobs is not None else None
        for c in out.outputs:
            lp = None
            if req.logprobs is not None:  # generated tokens' offsets count from the end of the echoed prompt
                lp = _logprobs(ctx, c.logprobs, len(echo), req.skip_special_tokens)[0]
                if prompt_lp is not None:  # the prompt's entries, then the completion's
                    lp = {k: prompt_lp[k] + lp[k] for k in prompt_lp}
            choices.append({"index": i * job.params.n + c.index, "text": echo + c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason})
    return {**_head(job, ctx), "choices": choices, "usage": usage(finals)}


async def _stream(ctx: ServerContext, job: Job, req: CompletionRequest, echoes: list[str] | None) -> AsyncIterator[dict]:
    head = _head(job, ctx)
    if req.include_usage:
        head["usage"] = None  # on every chunk but the last (the OpenAI SDK expects the key)
    finals: list[RequestOutput | None] = [None] * len(job.prompts)
    offsets: dict[int, int] = {}
    done: set[int] = set()
    echoed: set[int] = set()  # prompts whose echo went out: first, once its logprobs (if asked) are in
    async with aclosing(ctx.client.outputs(job)) as outputs:
        async for i, out in outputs:
            finals[i] = out
            if echoes is not None and i not in echoed and (req.logprobs is None or out.prompt_logprobs is not None):
                echoed.add(i)
                lp = _echo_logprobs(ctx, out, req.skip_special_tokens) if req.logprobs is not None else None
                for k in range(job.params.n):
                    offsets[i * job.params.n + k] = len(echoes[i])
                    yield {**head, "choices": [{"index": i * job.params.n + k, "text": echoes[i], "logprobs": lp,
                                                "finish_reason": None}]}
            for c in out.outputs:
                index = i * job.params.n + c.index
                if index in done or not (c.delta_text or c.delta_logprobs or c.finished):
                    continue
                lp = None
                if c.delta_logprobs is not None:
                    lp, offsets[index] = _logprobs(ctx, c.delta_logprobs, offsets.get(index, 0),
                                                   req.skip_special_tokens)
                if c.finished:
                    done.add(index)
                choice = {"index": index, "text": c.delta_text, "logprobs": lp, "finish_reason": c.finish_reason}
                last = len(done) == job.num_seqs  # the final chunk carries the timeline if asked
                yield {**head, "choices": [choice], **(timeline_extension(ctx, job, req.kvserve) if last else {})}
    if req.include_usage:
        yield {**head, "choices": [], "usage": usage(finals)}

