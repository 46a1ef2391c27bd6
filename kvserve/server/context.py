"""What every route handler needs, in one object the app holds."""
from __future__ import annotations

import functools

from kvserve.engine.engine import EngineStats
from kvserve.server.generation import EngineClient
from kvserve.server.logprobs import TokenTexts
from kvserve.server.metrics import ServerMetrics
from kvserve.server.settings import ServerSettings
from kvserve.server.state import ServerState


class ServerContext:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.state = ServerState(settings)
        self.metrics = ServerMetrics(self._stats, lambda: self.state.num_admitted_requests)
        self.client = EngineClient(self.state, self.metrics)

    def _stats(self) -> EngineStats | None:
        return self.state.engine.stats() if self.state.engine is not None else None

    @functools.cached_property
    def texts(self) -> TokenTexts:
        """Token texts for logprobs (made once the model is loaded)."""
        return TokenTexts(self.state.llm.tokenizer)

    @property
    def special_token_ids(self) -> frozenset[int]:
        return self.state.llm.tokenizer.special_token_ids
