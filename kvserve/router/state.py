"""RouterState: the replicas, the policy, the upstream client and the background loops, in one object.

Health checks run for every replica each `health_interval` (every WAITING_CHECK_INTERVAL while
requests wait for a replica); a cache_aware router with a precise source also follows each
replica's /kv/events (kvserve/router/kv_index.py). A request that finds no healthy replica waits
here (bounded in time and in number) and is woken the moment one comes up.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

import httpx

from kvserve.router.kv_index import KVIndex
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import Policy, make_policy
from kvserve.router.replicas import HEALTHY, UNHEALTHY, Replica, ReplicaSet, Tried
from kvserve.router.response_homes import ResponseHomes
from kvserve.router.settings import RouterSettings
from kvserve.router.upstream import Upstream, is_refusal, make_client

log = logging.getLogger("kvserve.router")
KEEP_DECISIONS = 50  # routing decisions the page at / shows (bounded memory)
# Seconds between health checks while requests wait for a replica: one that comes back is found
# within this, not a whole health_interval later.
WAITING_CHECK_INTERVAL = 0.1


class RetryBudget:
    """Retries may be at most `ratio` of requests (plus a burst): a token bucket, so a fleet-wide
    failure makes the router fail fast instead of tripling the load on what is left."""

    def __init__(self, ratio: float, burst: int) -> None:
        self.ratio = ratio
        self.burst = float(burst)
        self.tokens = float(burst)

    def on_request(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def try_spend(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


class RouterState:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.replicas = ReplicaSet(settings.replicas)
        self.metrics = RouterMetrics(lambda: self.replicas)
        self.budget = RetryBudget(settings.retry_budget_ratio, settings.retry_budget_burst)
        self.client: httpx.AsyncClient | None = None  # the router's own calls
        self.upstream: Upstream | None = None  # proxied requests (kvserve/router/upstream.py)
        self.index: KVIndex | None = None
        self.policy: Policy = make_policy(settings.policy, None)
        self.homes = ResponseHomes()  # stored Responses-API responses: which replica holds each
        self.active = 0  # requests the router is answering
        self.decisions: deque[dict] = deque(maxlen=KEEP_DECISIONS)  # oldest first
        self._decided = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._health: asyncio.Task | None = None
        self.waiting = 0  # requests waiting for a replica to come up
        self._came_up = asyncio.Event()  # set (and replaced) when a replica comes up: wakes the waiting
        self._hurry = asyncio.Event()  # a request started waiting: check health now

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        limits = httpx.Limits(max_connections=s.upstream_connections, max_keepalive_connections=s.upstream_connections)
        timeout = httpx.Timeout(connect=s.connect_timeout, read=s.read_timeout, write=30.0, pool=s.connect_timeout)
        self.client = make_client(limits, timeout)
        self.upstream = Upstream(s.upstream_connections, s.connect_timeout, s.read_timeout)
        if s.policy.name == "cache_aware" and s.policy.cache_source != "approximate":
            self.index = KVIndex(self.client, s.policy.kv_poll_interval, s.replica_api_key,
                                 max_bytes=s.policy.kv_max_bytes, max_held=s.policy.kv_max_held,
                                 mark_down=self.mark_down, stream_check=s.policy.kv_stream_check)
        self.policy = make_policy(s.policy, self.index)
        await self.check_all()  # know who is up before the first request
        for r in self.replicas:
            self._follow(r)
        if self.index is not None:  # ... and what they hold
            for r in await self.index.first_reads(s.policy.kv_ready_timeout):
                log.warning("cache_aware: %s's /kv/events not read within %.0f s of starting: its first requests are "
                            "routed without it", r.url, s.policy.kv_ready_timeout)
        self._health = asyncio.create_task(self._health_loop(), name="router health")

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self.index is not None:
            await self.index.close()
        if self.client is not None:
            await self.client.aclose()
        if self.upstream is not None:
            await self.upstream.close()

    def begin(self) -> None:
        self.active += 1
        self._idle.clear()

    def end(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def record(self, replica_url: str, outcome: str, matched_tokens: int, path: str, cost: int | None = None) -> None:
        """One routing decision, for the page at / (GET /router/state); cost: cache_aware's tokens
        that replica was expected to compute before this request's first."""
        self._decided += 1
        self.decisions.append({"n": self._decided, "time": round(time.time(), 3), "replica": replica_url,
                               "outcome": outcome, "matched_tokens": matched_tokens, "cost": cost, "path": path})

    # -- replicas joining and leaving -------------------------------------------------------
    async def add(self, url: str) -> tuple[Replica, bool]:
        replica, new = self.replicas.add(url)
        if new:
            log.info("replica added: %s", replica.url)
            await self.check(replica)
            self._follow(replica)
        return replica, new

    def remove(self, url: str) -> Replica | None:
        replica = self.replicas.remove(url)
        if replica is not None:
            log.info("replica removed: %s (%d request(s) in flight finish there)", replica.url, replica.in_flight)
            self.policy.forget(replica)
            self.homes.forget_replica(replica.url)
            if self.index is not None:
                self.index.forget(replica)
        return replica

    def _follow(self, replica: Replica) -> None:
        if self.index is not None:
            self.index.follow(replica)

    # -- health -----------------------------------------------------------------------------
    def mark_down(self, replica: Replica, why: str) -> None:
        """Out at once (kvserve/router/replicas.py): a refused connection, a broken /kv/events rule."""
        if replica.mark_down(why):
            log.warning("replica out: %s (%s)", replica.url, why)
            self.policy.forget(replica)

    def answered(self, replica: Replica) -> None:
        """A proxied request got its answer: the breaker closes, and a replica out for not
        answering its checks is back at once (one that said it is not ready waits for a check)."""
        replica.request_succeeded()
        if replica.state != HEALTHY and not replica.unready and not replica.removed:
            replica.come_up()
            self._in(replica)

    def _in(self, replica: Replica) -> None:
        log.info("replica in: %s", replica.url)
        self._came_up.set()
        self._came_up = asyncio.Event()

    async def wait_for_replica(self, tried: Tried, deadline: float) -> str | None:
        """Wait until a replica the request may go to is healthy; None then, else why not: the
        deadline passed, or max_waiting requests wait already."""
        if self.waiting >= self.settings.max_waiting:
            return f"{self.waiting} requests wait for one already"
        self.waiting += 1
        self.metrics.waiting.inc()
        self._hurry.set()
        try:
            while not self.replicas.up(tried):
                came_up, left = self._came_up, deadline - time.monotonic()
                if left <= 0:
                    return f"none came up within {self.settings.replica_wait:g} s"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(came_up.wait(), left)
            return None
        finally:
            self.waiting -= 1
            self.metrics.waiting.dec()

    async def check(self, replica: Replica) -> None:
        reachable, refused = True, False
        if self.client is None:
            raise RuntimeError("RouterState.start() first: it makes the client")
        try:
            r = await self.client.get(replica.url + "/health", timeout=self.settings.health_timeout)
            ok, why = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            ok, why, reachable, refused = False, f"/health: {type(e).__name__}: {e}", False, is_refusal(e)
        replica.unready = reachable and not ok
        if refused:
            self.mark_down(replica, why)
            changed = None
        else:
            changed = replica.health_result(ok, self.settings, None if ok else why)
        if changed == HEALTHY:
            self._in(replica)
        elif changed == UNHEALTHY:
            log.warning("replica out: %s (%s)", replica.url, why)
            self.policy.forget(replica)  # if it comes back it may have restarted empty
        if replica.state == UNHEALTHY and not reachable:
            # It stopped answering (hung, or its host is gone): streams from it would hang until the
            # read timeout. A replica that answers 503 (draining) finishes what it has instead.
            for stream in list(replica.streams):
                stream.abort(f"the replica {replica.url} stopped answering its health checks")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def _health_loop(self) -> None:
        interval = self.settings.health_interval
        fast = min(interval, WAITING_CHECK_INTERVAL)
        t0 = time.monotonic()  # start() has just checked
        while True:
            await asyncio.sleep(max(0.0, fast - (time.monotonic() - t0)))  # never more often than this
            if not self.waiting:  # nobody waits: the next check in `interval`, or as soon as someone does
                self._hurry.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurry.wait(), max(0.0, interval - (time.monotonic() - t0)))
            t0 = time.monotonic()
            try:
                await self.check_all()
            except Exception:  # the loop must survive anything
                log.exception("health checks failed")
