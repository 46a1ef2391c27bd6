"""The server's side of the engine: tokenize off the event loop, run a request's prompts,
observe latencies, and clean up on every way out. Everything goes through the AsyncEngine
(kvserve.engine.async_engine), the one object that talks to the engine's loop.

A completion request may hold several prompts; each is one engine request, all of them share
the engine's batch with everyone else's, and their outputs are merged as they come.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from starlette.types import Receive

from kvserve.config import ModelConfig
from kvserve.engine.async_engine import EngineDeadError, RequestTimeoutError, StreamStalledError
from kvserve.engine.engine import EngineStats
from kvserve.errors import InvalidParam
from kvserve.fim import encode_fim
from kvserve.kv.events import BlockEventLog
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import APIError
from kvserve.server.grammar_pool import GrammarPool
from kvserve.server.lifecycle import ServerState
from kvserve.server.metrics import ServerMetrics
from kvserve.server.vllm_metrics import CacheInfo
from kvserve.structured import reasoning, tool_calls
from kvserve.structured.grammar_cache import GrammarCache
from kvserve.tokenizer import PromptTooLong, Tokenizer
from kvserve.tokenizer.chat_template import ChatPrompt


def engine_dead() -> APIError:
    return APIError(503, "the engine stopped after an internal error; the server must be restarted",
                    code="engine_dead")


@dataclass
class Job:
    """One HTTP request's work: its prompts (token ids), sampling, id and arrival time."""

    prompts: list[list[int]]
    params: SamplingParams
    arrival: float  # time.monotonic() when the HTTP request arrived
    request_id: str
    pooling: bool = False  # embeddings: each prompt's final output carries its pooled vector

    @property
    def num_seqs(self) -> int:
        return len(self.prompts) * self.params.n


class EngineClient:
    """The server's one handle on the model and its engine: tokenizer, model config, KV pool and
    its events, encoding and checking prompts, running jobs. Handlers go through it, never to the
    loaded LLM (kvserve/server/lifecycle.py loads it and owns its lifetime)."""

    def __init__(self, state: ServerState, metrics: ServerMetrics, grammars: GrammarPool) -> None:
        self.state = state
        self.metrics = metrics
        self.grammars = grammars
        self._thinks: tuple[Tokenizer, bool] | None = None
        self._tool_formats: tuple[Tokenizer, frozenset[str] | None] | None = None

    # -- what the model is (valid once the server is ready) ---------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.state.loaded.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.state.loaded.config

    @property
    def max_model_len(self) -> int:
        return self.state.loaded.max_model_len

    @property
    def model_path(self) -> str:
        return str(self.state.loaded.model_path)

    @property
    def quantization(self) -> str:
        """How the weights are held: none, or the kernel format of quantized matrices."""
        return str(self.state.loaded.quantization)

    def cache_info(self) -> CacheInfo | None:
        """The KV pool's shape (None before the model is loaded)."""
        llm = self.state.llm
        if llm is None:
            return None
        pool = llm.manager.pool
        return CacheInfo(llm.manager.block_size, pool.num_blocks, str(llm.kv_dtype).removeprefix("torch."),
                         pool.enable_caching)

    def kv_events(self) -> BlockEventLog | None:
        """The pool's block events (None before the model is loaded)."""
        return None if self.state.llm is None else self.state.llm.manager.pool.events

    def grammar_cache(self) -> GrammarCache | None:
        """The engine's compiled grammars (None before the model is loaded)."""
        return None if self.state.llm is None else self.state.llm.engine.grammars.cache

    def stats(self) -> EngineStats | None:
        return self.state.engine.stats() if self.state.engine is not None else None

    def timeline(self, engine_request_id: str) -> dict | None:
        return None if self.state.engine is None else self.state.engine.timeline(engine_request_id)

    async def engine_state(self) -> dict:
        """The engine as JSON for the live page (a snapshot taken on the engine thread)."""
        return await self.state.running.state()

    def validate(self, ids: list[int], params: SamplingParams) -> list[int]:
        """The engine's checks of a prompt's ids and its parameters (on the calling thread)."""
        return self.state.running.inputs.check(ids, params)

    async def tokenize(self, prompts: Sequence[str | list[int]], params: SamplingParams,
                       receive: Receive | None = None) -> list[list[int]]:
        """Token ids of each prompt, checked against the context and the KV pool (InvalidParam if
        not). On a worker thread; a long prompt is refused after about a context's worth of it.
        A constraint is compiled first (`compile`), so the check only reads it."""
        await self.compile(params, receive)
        inputs = self.state.running.inputs
        return await asyncio.to_thread(lambda: [inputs.check(inputs.encode(p), params) for p in prompts])

    def encode_chat_now(self, prompt: ChatPrompt) -> list[int]:
        """The conversation's prompt ids by the model's chat template, content kept as text (on the
        calling thread: a worker's, never the event loop's)."""
        tok, limit = self.tokenizer, self.max_model_len
        try:
            return tok.encode_prompt(prompt, self.state.settings.special_tokens_in_messages, limit)
        except PromptTooLong:
            raise InvalidParam("prompt", f"the conversation is more than {limit} tokens, the context's length: "
                               "shorten the messages") from None

    @property
    def thinks(self) -> bool:
        """Whether the model writes a <think> block before its answer (its chat template says so;
        read once per tokenizer, not per request)."""
        tok = self.tokenizer
        if self._thinks is None or self._thinks[0] is not tok:
            self._thinks = (tok, reasoning.thinks(tok.chat_template.source))
        return self._thinks[1]

    @property
    def tool_formats(self) -> frozenset[str] | None:
        """The tool-call formats the model's chat template teaches (structured/tool_calls.py; None:
        it names none, any is read). Read once per tokenizer."""
        tok = self.tokenizer
        if self._tool_formats is None or self._tool_formats[0] is not tok:
            self._tool_formats = (tok, tool_calls.template_formats(tok.chat_template.source))
        return self._tool_formats[1]

    def reasoning(self, job: Job) -> bool | None:
        """None where the output holds no reasoning (a model that does not think, or output a grammar
        shapes from its first token); else whether the prompt leaves the output inside <think>
        (kvserve/structured/reasoning.py: R1's template opens the block in the prompt)."""
        if job.params.constraint is not None or not self.thinks:
            return None
        return reasoning.prompt_opens_reasoning(self.tokenizer.decode(job.prompts[0][-8:]))

    def reasoning_tokens(self, job: Job, final: RequestOutput | None) -> int:
        """Of the final output's tokens (every choice), those of its <think> blocks."""
        inside = self.reasoning(job)
        if inside is None or final is None:
            return 0
        skip = job.params.skip_special_tokens  # the text the reasoning split read
        return sum(reasoning.reasoning_tokens(list(c.token_ids), lambda ids: self.tokenizer.decode(ids, skip), inside)
                   for c in final.outputs)

    async def encode_chat(self, prompt: ChatPrompt) -> list[int]:
        return await asyncio.to_thread(self.encode_chat_now, prompt)

    async def compile(self, params: SamplingParams, receive: Receive | None = None) -> None:
        """The request's constraint compiled on the grammar pool (kvserve/server/grammar_pool.py),
        given up if the client leaves (`receive`: the request's, its body read) or a drain cuts
        it off: the one place the server compiles."""
        if params.constraint is not None:
            await self.grammars.compile(self.state.loaded.engine.grammars, params.constraint, receive, self.state.work)

    async def encode_fim(self, prompts: Sequence[str], suffix: str) -> list[list[int]]:
        """Each prompt with the suffix as a fill-in-the-middle prompt (kvserve/fim.py), off the loop."""
        tok, limit = self.tokenizer, self.max_model_len
        try:
            return await asyncio.to_thread(lambda: [encode_fim(tok, p, suffix, limit) for p in prompts])
        except PromptTooLong:
            raise InvalidParam("prompt", f"prompt and suffix are more than {limit} tokens, the context's length: "
                               "shorten them") from None

    def encode_now(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tok, limit = self.tokenizer, self.max_model_len
        try:
            return tok.encode(text, add_special_tokens, limit)
        except PromptTooLong:
            raise InvalidParam("prompt", f"prompt is more than {limit} tokens, the context's length") from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return await asyncio.to_thread(self.encode_now, text, add_special_tokens)

    async def outputs(self, job: Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, snapshot) after every engine step that changed one of the job's requests."""
        if len(job.prompts) == 1:
            async with aclosing(self._one(job, 0)) as it:
                async for out in it:
                    yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async with aclosing(self._one(job, i)) as it:
                    async for out in it:
                        queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            else:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(job.prompts))]
        try:
            running = len(tasks)
            while running:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    running -= 1
                    continue
                yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def finals(self, job: Job) -> list[RequestOutput]:
        """Each prompt's final output, once all are done: a whole (unstreamed) answer's."""
        finals: list[RequestOutput | None] = [None] * len(job.prompts)
        async with aclosing(self.outputs(job)) as outputs:
            async for i, out in outputs:
                finals[i] = out
        return finals  # type: ignore[return-value]  # one for each prompt: outputs() raises otherwise

    async def _one(self, job: Job, i: int) -> AsyncGenerator[RequestOutput, None]:
        engine = self.state.running
        out: RequestOutput | None = None
        reasons = ["abort"] * job.params.n  # unless it finishes
        last = None
        try:
            stream = engine.generate(job.prompts[i], job.params, f"{job.request_id}-{i}", job.arrival, job.pooling)
            async with aclosing(stream) as it:
                async for out in it:
                    now = time.monotonic()
                    if any(c.delta_token_ids for c in out.outputs):
                        if last is not None:
                            self.metrics.inter_token_latency.observe(now - last)
                        last = now
                    yield out
            if out is not None:
                reasons = [c.finish_reason or "abort" for c in out.outputs]
        except EngineDeadError:
            reasons = ["error"] * job.params.n
            raise engine_dead() from None
        except StreamStalledError as e:
            raise APIError(408, str(e), code="client_too_slow") from None
        except RequestTimeoutError as e:
            raise APIError(504, str(e), code="request_timeout") from None
        finally:
            self.metrics.observe_finished(out.metrics if out else None, reasons, time.monotonic())


def usage(outs: Sequence[RequestOutput | None], reasoning_tokens: int | None = None) -> dict:
    """OpenAI's usage block over a job's final outputs (one per prompt); a chat's also counts the
    completion's reasoning tokens (EngineClient.reasoning_tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in outs if o)
    completion = sum(len(c.token_ids) for o in outs if o for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs if o)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out
