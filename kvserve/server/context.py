"""The one object every route handler of the server is given: settings, the model's state, the
engine client, metrics and the grammar pool. Handlers import this module, never the app."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request

from kvserve import __version__
from kvserve.kv.events import BlockEventLog
from kvserve.sampling_params import SamplingParams
from kvserve.server import request_id
from kvserve.server.generation import EngineClient, Job
from kvserve.server.grammar_pool import GrammarPool
from kvserve.server.lifecycle import Admission, ServerState
from kvserve.server.logprobs import TokenTexts
from kvserve.server.metrics import ServerMetrics
from kvserve.server.parsing import M, parse
from kvserve.server.response_store import ResponseStore
from kvserve.server.settings import ServerSettings
from kvserve.tokenizer import Tokenizer

# The most a loading server waits for its grammar compile processes before it says ready (they take
# ~3 s; past this, a structured request waits for them instead).
GRAMMAR_START_WAIT = 60.0
STATE_MIN_INTERVAL = 0.1  # seconds: the engine takes at most ten snapshots a second for the page
STATE_TIMEOUT = 30.0  # a step longer than this would be a stuck engine


class StateCache:
    """One engine snapshot shared by every caller within STATE_MIN_INTERVAL of it."""

    def __init__(self) -> None:
        self._at = 0.0
        self._pending: asyncio.Future | None = None

    async def get(self, ctx: ServerContext) -> dict[str, Any]:
        if self._pending is None or (self._pending.done() and time.monotonic() - self._at > STATE_MIN_INTERVAL):
            self._at = time.monotonic()
            self._pending = asyncio.ensure_future(asyncio.wait_for(ctx.client.engine_state(), STATE_TIMEOUT))
        return await asyncio.shield(self._pending)


class ServerContext:
    """What every route handler needs, in one object the app holds."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.state = ServerState(settings)
        self.grammars = GrammarPool(timeout=settings.grammar_compile_timeout,
                                    memory_mib=settings.grammar_compile_memory_mib)
        self.state.on_ready.append(lambda llm: self.grammars.start(llm.engine.grammars, wait=GRAMMAR_START_WAIT))
        # The metrics read the engine through the client, which is made after them (it observes into them).
        self.metrics = ServerMetrics(lambda: self.client.stats(), lambda: self.state.num_admitted_requests,
                                     self._grammar_stats, settings.model_name, lambda: self.client.cache_info())
        self.client = EngineClient(self.state, self.metrics, self.grammars)
        self.responses = ResponseStore(settings.responses_store_size, settings.responses_store_bytes)
        self.engine_states = StateCache()  # the engine's snapshots for /v1/engine/state
        self._fingerprint: tuple[Tokenizer, str] | None = None
        self.kv_publisher = None  # the ZMQ KV events publisher (kvserve/server/kv_publisher.py), if asked for
        if settings.kv_events_endpoint is not None:
            from kvserve.server.kv_publisher import KVEventPublisher

            self.kv_publisher = KVEventPublisher(settings.kv_events_endpoint, settings.kv_events_replay_endpoint,
                                                 settings.kv_events_topic, form=settings.kv_events_format)
            self.kv_publisher.start(self._kv_events)

    def _kv_events(self) -> tuple[BlockEventLog, int] | None:
        log, info = self.client.kv_events(), self.client.cache_info()
        return None if log is None or info is None else (log, info.block_size)

    def _grammar_stats(self) -> dict[str, float] | None:
        cache = self.client.grammar_cache()
        if cache is None:
            return None
        return {"hits": cache.hits, "misses": cache.misses, "evictions": cache.evictions, "bytes": cache.bytes,
                "entries": len(cache), "pending": self.grammars.pending, "compile_timeouts": self.grammars.timeouts}

    async def start_job(self, request: Request, params: SamplingParams, encode: Callable[[], list[int]], *,
                        arrival: float, prefix: str, sep: str = "-",
                        fit_within: int | None = None) -> tuple[Admission, Job]:
        """Admit one prompt's work (before any tokenizing: 400 or 429 at once), compile its
        constraint on the grammar pool (bounded in time and count), encode the prompt and check it
        against the context and the pool in one worker-thread hop (`encode` runs there; the check
        only reads the compiled grammar), and name it: the one way in for every chat-like route.

        fit_within: a context (in tokens) that max_tokens is cut to fit after the prompt (None or a
        larger max_tokens: all the room left), for a max_tokens the client did not send, or one that
        the API treats as a ceiling rather than a promise. A prompt that fills the whole context is
        refused by the engine's check, as any other. prefix, sep: the job id's
        (chatcmpl-<hex>; the Responses API's resp_<hex>, as OpenAI names them). A refusal (the
        template's, or the engine's InvalidParam) is raised as it is: the route (Serving) answers
        it in its API's field names."""
        admission = self.state.admit(1, params.n)

        def prepare() -> tuple[list[int], SamplingParams]:
            ids, p = encode(), params
            if fit_within is not None:
                room = fit_within - len(ids)
                p = dataclasses.replace(p, max_tokens=max(1, room if p.max_tokens is None else min(p.max_tokens, room)))
            return self.client.validate(ids, p), p

        try:
            await self.client.compile(params, request.receive)  # never on the worker threads: they are everyone's
            ids, params = await asyncio.to_thread(prepare)
        except BaseException:
            admission.release()
            raise
        return admission, Job([ids], params, arrival, request_id=request_id.name(request, prefix, sep))

    async def parse(self, request: Request, model: type[M]) -> M:
        return await parse(request, model, self.settings.max_body_bytes, self.settings.model_name)

    @functools.cached_property
    def texts(self) -> TokenTexts:
        """Token texts for logprobs (made once the model is loaded)."""
        return TokenTexts(self.client.tokenizer)

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: changes when kvserve's version or the model served does."""
        c = self.client
        model = f"{self.settings.model_name}|{c.model_path}|{c.model_config.vocab_size}"
        return "fp_" + hashlib.sha256(f"kvserve {__version__}|{model}".encode()).hexdigest()[:12]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self.client.tokenizer.special_token_ids

    async def renderer_fingerprint(self) -> str:
        """What turns a chat into prompt ids here, hashed (Tokenizer.fingerprint), for a router:
        hashing the vocabulary takes ~0.2 s, so once per tokenizer."""
        tok, special = self.client.tokenizer, self.settings.special_tokens_in_messages
        if self._fingerprint is None or self._fingerprint[0] is not tok:
            self._fingerprint = (tok, await asyncio.to_thread(tok.fingerprint, special))
        return self._fingerprint[1]
