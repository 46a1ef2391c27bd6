"""The one object every route handler of the server is given: settings, the model's state, the
engine client, metrics and the grammar pool. Handlers import this module, never the app."""
from __future__ import annotations

import functools
import hashlib

from fastapi import Request

from kvserve import __version__
from kvserve.engine.engine import EngineStats
from kvserve.server.generation import EngineClient
from kvserve.kv.events import BlockEventLog
from kvserve.server.grammar_pool import GrammarPool
from kvserve.server.lifecycle import ServerState
from kvserve.server.logprobs import TokenTexts
from kvserve.server.metrics import ServerMetrics
from kvserve.server.parsing import parse
from kvserve.server.response_store import ResponseStore
from kvserve.server.settings import ServerSettings
from kvserve.server.vllm_metrics import CacheInfo


class ServerContext:
    """What every route handler needs, in one object the app holds."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.state = ServerState(settings)
        self.grammars = GrammarPool(timeout=settings.grammar_compile_timeout)
        self.metrics = ServerMetrics(self._stats, lambda: self.state.num_admitted_requests, self._grammar_stats,
                                     settings.model_name, self._cache_info)
        self.client = EngineClient(self.state, self.metrics, self.grammars)
        self.responses = ResponseStore(settings.responses_store_size)
        self.kv_publisher = None  # the ZMQ KV events publisher (kvserve/server/kv_publisher.py), if asked for
        if settings.kv_events_endpoint is not None:
            from kvserve.server.kv_publisher import KVEventPublisher

            self.kv_publisher = KVEventPublisher(settings.kv_events_endpoint, settings.kv_events_replay_endpoint,
                                                 settings.kv_events_topic)
            self.kv_publisher.start(self._kv_events)

    def _stats(self) -> EngineStats | None:
        return self.state.engine.stats() if self.state.engine is not None else None

    def _cache_info(self) -> CacheInfo | None:
        llm = self.state.llm
        if llm is None:
            return None
        pool = llm.manager.pool
        return CacheInfo(llm.manager.block_size, pool.num_blocks, str(llm.kv_dtype).removeprefix("torch."),
                         pool.enable_caching)

    def _kv_events(self) -> tuple[BlockEventLog, int] | None:
        llm = self.state.llm
        return None if llm is None else (llm.manager.pool.events, llm.manager.block_size)

    def _grammar_stats(self) -> dict[str, float] | None:
        if self.state.llm is None:
            return None
        cache = self.state.llm.engine.grammars.cache
        return {"hits": cache.hits, "misses": cache.misses, "evictions": cache.evictions, "bytes": cache.bytes,
                "entries": len(cache), "pending": self.grammars.pending, "compile_timeouts": self.grammars.timeouts}

    async def parse(self, request: Request, model: type) -> object:
        return await parse(request, model, self.settings.max_body_bytes, self.settings.model_name)

    @functools.cached_property
    def texts(self) -> TokenTexts:
        """Token texts for logprobs (made once the model is loaded)."""
        return TokenTexts(self.state.llm.tokenizer)

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: changes when kvserve's version or the model served does."""
        llm = self.state.llm
        model = f"{self.settings.model_name}|{getattr(llm, 'model_path', '')}|{llm.config.vocab_size}"
        return "fp_" + hashlib.sha256(f"kvserve {__version__}|{model}".encode()).hexdigest()[:12]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self.state.llm.tokenizer.special_token_ids
