"""RouterSettings and PolicySettings: every knob of `kvserve route`, with the reason for its default.

docs/router.md explains each one; these defaults are for replicas on one host or one rack
(loopback or a LAN), where a health check answers in milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_load", "power_of_two", "cache_aware")
CACHE_SOURCES = ("auto", "precise", "approximate")


@dataclass(frozen=True)
class PolicySettings:
    name: str = "cache_aware"
    # cache_aware: where "holds the prefix" comes from. auto: the replica's published block hashes
    # when it publishes them and the router can load its tokenizer, else the text it was sent.
    cache_source: str = "auto"
    # A replica's cost for a request: its outstanding work (prompt tokens not yet computed and not
    # in its cache, plus output still to come: replicas.py) plus the request's own prompt tokens
    # it does not hold. The replica holding the prefix (or, for a new one, the smallest footprint)
    # loses to the cheapest replica only when its cost exceeds the cheapest's by more than
    # balance_abs_tokens AND is more than balance_rel times it. Both must hold: a small absolute
    # gap is noise, and a large gap between two busy replicas costs less than recomputing a long
    # prefix (and caching it twice, which evicts another).
    balance_abs_tokens: int = 4096
    balance_rel: float = 1.5
    # A match shorter than this many tokens is no reason to pick a replica (the least loaded wins):
    # one block of a chat template's header is in every prompt.
    min_match_tokens: int = 32
    # The approximate source: text characters per stored chunk, and chunks kept per replica
    # (least recently used dropped first): 16 Ki chunks of 64 characters ≈ 1 MiB of text.
    tree_chunk_chars: int = 64
    tree_max_chunks: int = 16384
    # How often the router reads each replica's /kv/events (seconds).
    kv_poll_interval: float = 0.1
    # How long the router's start waits for each replica's first /kv/events answer and its
    # tokenizer (seconds; a tokenizer loads in about one). Routed before, a burst of requests
    # sharing a new prefix scatters over the replicas, each computing the prefix: on the router
    # bench, most of the precise source's lag behind the approximate one.
    kv_ready_timeout: float = 15.0
    # What a replica's /kv/events may say: block hashes held (256 Ki: a pool of 4 Mi tokens in
    # 16-token blocks; ~25 MiB of the router's memory) and bytes per answer (a snapshot of that
    # many is ~17 MiB). A replica past either is taken out (kvserve/router/kv_page.py).
    kv_max_held: int = 1 << 18
    kv_max_bytes: int = 24 << 20
    # A replica followed over ZMQ (kvserve/router/kv_zmq.py): how often the router checks that a
    # batch the replica says it sent has arrived; one that has not sends it back to a full read.
    kv_stream_check: float = 5.0


@dataclass(frozen=True)
class RouterSettings:
    replicas: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    policy: PolicySettings = field(default_factory=PolicySettings)
    admin_key: str | None = None  # Bearer key of /admin/*; without one only loopback clients may use it
    allowed_hosts: tuple[str, ...] = ()  # Host header names answered (kvserve/server/hosts.py); empty: any
    replica_api_key: str | None = None  # sent to replicas on the router's own calls (/kv/events)
    # Health: a replica failing `unhealthy_after` checks in a row is out; `healthy_after` passes bring
    # it back. One pass is proof enough: a replica that answers is routable, and requests may be
    # waiting for it.
    health_interval: float = 1.0
    health_timeout: float = 2.0
    unhealthy_after: int = 2
    healthy_after: int = 1
    # A request that finds no healthy replica waits up to replica_wait seconds for one to come up
    # (a replica restarting while another is killed is back within seconds; a client would rather
    # wait than fail), at most max_waiting of them at once; past either, 503 no_replica.
    replica_wait: float = 10.0
    max_waiting: int = 256
    # Retries before the first byte reached the client (connect error, 429, 503): on another
    # replica, after a jittered exponential backoff, at most max_retries per request, and in all
    # at most retry_budget_ratio of requests (plus a small burst) so that retries cannot snowball.
    max_retries: int = 2
    backoff_base: float = 0.025
    backoff_max: float = 1.0
    retry_budget_ratio: float = 0.2
    retry_budget_burst: int = 10
    # Circuit breaker: after `breaker_failures` failed requests in a row a replica gets no traffic
    # for `breaker_cooldown` seconds, then one trial request decides.
    breaker_failures: int = 3
    breaker_cooldown: float = 5.0
    # Bounds on what the router accepts and holds.
    max_body_bytes: int = 4 << 20
    max_headers: int = 100
    max_concurrent_requests: int = 1024
    # Seconds a client has to send a request's headers (from the connection's opening, or the
    # previous answer on a keep-alive one): clients trickling header bytes lose their connection.
    header_timeout: float = 10.0
    # Open client connections; one more is answered 503 and closed. Room for every concurrent
    # request and as many idle keep-alive connections, plus a few.
    max_connections: int = 2112
    upstream_connections: int = 512
    connect_timeout: float = 2.0
    # Longest silence between two chunks of a replica's answer before the router gives up on it.
    # A last resort: a replica that dies closes its connections, and one that hangs fails its
    # health checks (its streams are then ended); an overloaded CPU replica may legitimately
    # queue a request for minutes before its first token.
    read_timeout: float = 600.0
    default_max_tokens: int = 256  # outstanding tokens counted for a request that names none
    drain_timeout: float = 30.0

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
