"""What the HTTP layer of `kvserve serve` needs to know (the engine has its own config)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from kvserve.generation_defaults import MAX_TOKENS_DEFAULT, SamplingDefaults
from kvserve.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class ServerSettings:
    """What the HTTP layer needs to know (the engine has its own config)."""

    model_name: str  # the name clients pass as "model" (and /v1/models lists)
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    api_key: str | None = None  # Bearer token for every route but /health and /metrics
    allowed_origins: tuple[str, ...] = ()  # CORS stays off while empty
    allowed_hosts: tuple[str, ...] = ()  # Host header names answered (kvserve/web/hosts.py); empty: any
    # Sequences that may wait beyond the engine's max_num_seqs running ones; more get 429.
    max_queued_requests: int = 256
    max_n: int = 8  # completions per request
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_request_share: float = 0.25  # of running + queued capacity, the most one request may hold
    max_logprobs: int = MAX_LOGPROBS  # top alternatives per token
    max_body_bytes: int = 4 << 20  # 4 MiB: far more than any context's worth of text
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    stall_timeout: float = 60.0  # an engine step running longer turns /health 503 "stalled"
    stream_stall_timeout: float = 60.0  # a stream whose client reads nothing this long is aborted
    request_timeout: float | None = None  # whole-request limit in seconds; None: none
    header_timeout: float = 10.0  # seconds a client has to send a request's headers
    max_connections: int = 1024  # open HTTP connections; more are answered 503 and closed
    special_tokens_in_messages: bool = False  # let chat content spell control tokens
    grammar_compile_timeout: float = 10.0  # seconds a request waits for its grammar (kvserve/server/grammar_pool.py)
    grammar_compile_memory_mib: float = 1024.0  # what one compile may add to its process (structured/compile_worker.py)
    # For sampling fields a request leaves out: the model's recommendation or the server's
    # (kvserve/generation_defaults.py); None: SamplingParams' own (OpenAI's) defaults.
    sampling_defaults: SamplingDefaults | None = None
    max_tokens_default: int = MAX_TOKENS_DEFAULT  # chat requests without max_tokens (responses without max_output_tokens)
    responses_store_size: int = 1024  # finished /v1/responses kept for GET and previous_response_id (LRU); 0: none
    responses_store_bytes: int = 256 << 20  # and the JSON bytes they may hold together (kvserve/server/response_store.py)
    # vLLM's KV events over ZMQ (kvserve/server/kv_publisher.py): PUB endpoint, replay (ROUTER) endpoint, topic
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_format: Literal["array", "map"] = "array"  # kvserve/kv/event_wire.py: array (llm-d) or map (vllm-router)
    # sampling_defaults as SamplingParams keyword arguments, worked out once when the settings are
    # made (every generation request reads them) and read-only like the rest.
    defaults: Mapping[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = self.sampling_defaults.given() if self.sampling_defaults is not None else {}
        object.__setattr__(self, "defaults", MappingProxyType(given))  # frozen: set past the guard

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
