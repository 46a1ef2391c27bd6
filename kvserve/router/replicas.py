"""The replicas a router sends to: state (health, circuit breaker, Retry-After), load, counters.

A replica is eligible for new work when its health checks pass, its circuit breaker is not open
and no 429 told the router to wait. One passed check (or, for a replica out for not answering, one
successful proxied answer) brings it back at once: requests may be waiting for it
(kvserve/router/state.py). A refused connection (a health check's or a request's) takes
it out at once, since nothing listens on its port, and so does breaking the /kv/events rules
(kvserve/router/kv_page.py). Load is what the router itself put there: requests in
flight and outstanding tokens (prompt tokens plus the tokens still to be generated), since a
replica's own queue figures would reach the router late.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvserve.router.settings import RouterSettings

STARTING, HEALTHY, UNHEALTHY = "starting", "healthy", "unhealthy"
# The replicas one request tried, each with its `ups` at the time: a replica that came up again
# since is a restarted process, which the request may be sent to.
Tried = Mapping["Replica", int]
NOT_TRIED: Tried = MappingProxyType({})


@dataclass
class Load:
    """One request's share of its replica's load, released exactly once."""

    replica: Replica
    prompt_tokens: int
    remaining: int  # output tokens still to come
    uncached: int = 0  # prompt tokens the replica is expected to compute (not in its prefix cache)
    done: bool = False

    def produced(self, n: int) -> None:
        """n more output tokens reached the client. The first means its prompt is computed (a
        replica streams nothing before its first token), so its uncached prompt tokens stop counting
        as work: kept until the answer ended, a replica that had just computed a burst of new
        prompts looked busy for as long as it streamed them, and new requests of the prompts it
        holds were sent elsewhere to compute them again."""
        if self.uncached:
            self.replica.outstanding_work -= self.uncached
            self.uncached = 0
        n = min(n, self.remaining)
        self.remaining -= n
        self.replica.outstanding_tokens -= n
        self.replica.outstanding_work -= n

    def release(self) -> None:
        if not self.done:
            self.done = True
            self.replica.in_flight -= 1
            self.replica.outstanding_tokens -= self.prompt_tokens + self.remaining
            self.replica.outstanding_work -= self.uncached + self.remaining


@dataclass(eq=False)
class Replica:
    url: str
    state: str = STARTING
    passes: int = 0  # health checks passed in a row
    ups: int = 0  # times it came up (turned healthy)
    unready: bool = False  # its last /health answered, but not 200 (loading, draining): only a check brings it back
    fails: int = 0  # health checks failed in a row
    failures: int = 0  # requests failed in a row (circuit breaker)
    open_until: float = 0.0  # breaker open (no traffic) until then
    trial: bool = False  # breaker half-open: one request is testing the replica
    wait_until: float = 0.0  # a 429's Retry-After
    in_flight: int = 0
    outstanding_tokens: int = 0
    # The work those requests still cost: prompt tokens not expected in its prefix cache and not
    # computed yet (until a request's first output), plus output still to come (a prefix hit is
    # nearly free to prefill; cache_aware balances this).
    outstanding_work: int = 0
    requests: int = 0
    errors: int = 0
    matched_tokens: int = 0  # prompt tokens the router expected to find in its cache
    prompt_tokens: int = 0  # prompt tokens of the requests it was sent (for the hit rate)
    last_error: str | None = None
    removed: bool = False
    extra: dict = field(default_factory=dict)
    streams: set = field(default_factory=set)  # answers being relayed (aborted if it stops answering)

    def eligible(self, now: float) -> bool:
        if self.state != HEALTHY or self.removed or now < self.wait_until:
            return False
        if self.open_until and now < self.open_until:
            return False
        return not (self.open_until and self.trial)  # half-open: only the one trial request

    def start(self, prompt_tokens: int, max_tokens: int, matched: int) -> Load:
        self.in_flight += 1
        self.requests += 1
        uncached = prompt_tokens - min(matched, prompt_tokens)
        self.outstanding_tokens += prompt_tokens + max_tokens
        self.outstanding_work += uncached + max_tokens
        self.prompt_tokens += prompt_tokens
        self.matched_tokens += matched
        if self.open_until:
            self.trial = True
        return Load(self, prompt_tokens, max_tokens, uncached)

    # -- the circuit breaker -------------------------------------------------------------
    def request_failed(self, settings: RouterSettings, why: str) -> None:
        self.errors += 1
        self.failures += 1
        self.last_error = why
        if self.failures >= settings.breaker_failures or self.trial:
            self.open_until = time.monotonic() + settings.breaker_cooldown
            self.trial = False

    def request_succeeded(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.trial = False

    def come_up(self) -> None:
        """In, routable now (breaker closed)."""
        self.state = HEALTHY
        self.ups += 1
        self.request_succeeded()

    # -- health --------------------------------------------------------------------------
    def health_result(self, ok: bool, settings: RouterSettings, why: str | None = None) -> str | None:
        """Count one check; returns the new state when it changed."""
        if ok:
            self.passes, self.fails = self.passes + 1, 0
            if self.state != HEALTHY and self.passes >= (1 if self.state == STARTING else settings.healthy_after):
                self.come_up()
                return HEALTHY
        else:
            self.passes, self.fails = 0, self.fails + 1
            self.last_error = why
            if self.state == HEALTHY and self.fails >= settings.unhealthy_after:
                self.state = UNHEALTHY
                return UNHEALTHY
        return None

    def mark_down(self, why: str) -> bool:
        """Out now, not after `unhealthy_after` checks: its host refused a connection (nothing
        listens there) or it broke the /kv/events rules. Passed checks bring it back. Whether it
        was in before."""
        self.passes, self.fails, self.last_error = 0, self.fails + 1, why
        if self.state == HEALTHY:
            self.state = UNHEALTHY
            return True
        return False

    def describe(self, now: float) -> dict:
        return {
            "url": self.url, "state": self.state, "eligible": self.eligible(now),
            "breaker": "open" if self.open_until > now else "half_open" if self.open_until else "closed",
            "retry_after_s": round(max(0.0, self.wait_until - now), 3),
            "in_flight": self.in_flight, "outstanding_tokens": self.outstanding_tokens,
            "outstanding_work": self.outstanding_work, "requests": self.requests, "errors": self.errors,
            "cache_hit_rate": round(self.matched_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
            "last_error": self.last_error, **self.extra,
        }


class ReplicaSet:
    def __init__(self, urls: tuple[str, ...] = ()) -> None:
        self._by_url: dict[str, Replica] = {}
        for url in urls:
            self.add(url)

    @staticmethod
    def normalize(url: str) -> str:
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"replica URL must start with http:// or https://, got {url!r}")
        return url

    def add(self, url: str) -> tuple[Replica, bool]:
        """The replica for url, and whether it is new."""
        url = self.normalize(url)
        if url in self._by_url:
            return self._by_url[url], False
        self._by_url[url] = replica = Replica(url)
        return replica, True

    def remove(self, url: str) -> Replica | None:
        replica = self._by_url.pop(self.normalize(url), None)
        if replica is not None:
            replica.removed = True  # requests in flight finish; nothing new is sent
        return replica

    def __iter__(self):
        return iter(list(self._by_url.values()))

    def __len__(self) -> int:
        return len(self._by_url)

    def up(self, tried: Tried = NOT_TRIED) -> list[Replica]:
        """Healthy replicas, less those the request tried since they last came up."""
        return [r for r in self._by_url.values() if r.state == HEALTHY and tried.get(r) != r.ups]

    def eligible(self, tried: Tried = NOT_TRIED) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.up(tried) if r.eligible(now)]
