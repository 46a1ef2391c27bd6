"""ServerSettings: what the HTTP layer needs to know (the engine has its own config)."""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class ServerSettings:
    model_name: str  # the name clients pass as "model" (and /v1/models lists)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # Bearer token for every route but /health and /metrics
    allowed_origins: tuple[str, ...] = ()  # CORS stays off while empty
    # Sequences that may wait beyond the engine's max_num_seqs running ones; more get 429.
    max_queued_requests: int = 256
    max_n: int = 8  # completions per request
    max_logprobs: int = MAX_LOGPROBS  # top alternatives per token
    max_body_bytes: int = 4 << 20  # 4 MiB: far more than any context's worth of text
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
