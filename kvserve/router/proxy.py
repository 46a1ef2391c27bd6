"""Forwarding one request: pick a replica, retry what failed before the first byte, relay the answer.

The body is read once (bounded) and forwarded untouched; the answer is relayed chunk by chunk as
it arrives (no buffering), Server-Sent Events whole: an event cut short by a dying replica is
dropped and replaced by an error event, so a client's parser never sees half of one. A replica
that dies mid-answer ends the client's stream at once (the connection closes) or after
`read_timeout` of silence. A client that leaves closes the upstream request, so the replica
aborts the work.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import random
import time

import httpx
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvserve.router.policies import Decision
from kvserve.router.replicas import Load, Replica
from kvserve.router.request import RoutedRequest, parse_request
from kvserve.router.state import RouterState
from kvserve.server.errors import APIError, ErrorResponse

log = logging.getLogger("kvserve.router")

# Hop-by-hop headers (RFC 9110 §7.6.1) and those httpx or the router set anew.
_DROP_REQUEST = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                           "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
_DROP_RESPONSE = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                            "trailer", "transfer-encoding", "upgrade", "server", "date"})
_RETRY_STATUS = (429, 503)


def sse(data: dict | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def read_body(request: Request, limit: int) -> bytes:
    too_large = APIError(413, f"the request body is larger than the router's limit of {limit} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def retry_after_seconds(value: str | None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class Attempt:
    """One try on one replica: its load share and the policy's bookkeeping, ended exactly once."""

    def __init__(self, state: RouterState, decision: Decision, req: RoutedRequest, prompt_tokens: int,
                 max_tokens: int) -> None:
        self.state = state
        self.decision = decision
        self.replica: Replica = decision.replica
        self.load: Load = self.replica.start(prompt_tokens, max_tokens, decision.matched_tokens)
        state.policy.routed(decision, req)
        state.metrics.requests.labels(self.replica.url).inc()
        state.metrics.decisions.labels(state.settings.policy.name, decision.outcome).inc()
        state.record(self.replica.url, decision.outcome, decision.matched_tokens, req.path)
        if decision.source is not None:
            state.metrics.matched.observe(decision.matched_tokens)

    def end(self) -> None:
        if not self.load.done:
            self.load.release()
            self.state.policy.finished(self.decision)

    def failed(self, kind: str, why: str) -> None:
        self.state.metrics.errors.labels(self.replica.url, kind).inc()
        self.replica.request_failed(self.state.settings, why)
        self.end()


async def proxy(request: Request, state: RouterState) -> Response:
    arrival = time.perf_counter()
    s = state.settings
    if state.draining:
        raise APIError(503, "the router is shutting down: send the request elsewhere", code="draining",
                       headers={"Connection": "close"})
    if state.active >= s.max_concurrent_requests:
        state.metrics.rejected.labels("503").inc()
        raise APIError(503, f"the router is at its limit of {s.max_concurrent_requests} concurrent requests: "
                       "retry after a moment", code="router_busy", headers={"Retry-After": "1"})
    state.begin()
    try:
        body = await read_body(request, s.max_body_bytes)
        req = parse_request(request.url.path, body)
        if state.index is not None:
            await state.index.prepare(req)
        return await _send(request, state, req, body, arrival)
    except BaseException:
        state.end()
        raise


async def _send(request: Request, state: RouterState, req: RoutedRequest, body: bytes, arrival: float) -> Response:
    """Try replicas until one answers (or the retries run out); state.end() once the answer ends."""
    s = state.settings
    state.budget.on_request()
    prompt_tokens = (state.index.prompt_tokens(req) if state.index else None) or req.estimated_prompt_tokens()
    max_tokens = (req.max_tokens if req.max_tokens is not None else s.default_max_tokens) * req.n
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in _DROP_REQUEST]
    client_host = request.client.host if request.client else ""
    headers.append((b"x-forwarded-for", client_host.encode("latin-1")))
    url_tail = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    tried: set[Replica] = set()
    last: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None  # a 429/503 to pass on
    for attempt_no in range(s.max_retries + 1):
        candidates = state.replicas.eligible(tried)
        if not candidates:
            break
        if attempt_no > 0:
            delay = min(s.backoff_max, s.backoff_base * 2 ** (attempt_no - 1)) * random.uniform(0.5, 1.0)
            await asyncio.sleep(delay)
            candidates = state.replicas.eligible(tried) or candidates
        attempt = Attempt(state, state.policy.choose(candidates, req), req, prompt_tokens, max_tokens)
        replica = attempt.replica
        tried.add(replica)
        upstream_req = state.client.build_request(request.method, replica.url + url_tail, headers=headers,
                                                  content=body)
        try:
            upstream = await state.client.send(upstream_req, stream=True)
        except httpx.TimeoutException as e:
            attempt.failed("timeout", f"{type(e).__name__}: {e}")
            if not isinstance(e, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                break  # the replica may be working on it: sending it again doubles the load
            reason = "connect"
        except httpx.TransportError as e:
            attempt.failed("connect", f"{type(e).__name__}: {e}")
            reason = "connect"
        except BaseException:  # cancelled: the client left while the replica was connecting
            attempt.end()
            raise
        else:
            if upstream.status_code not in _RETRY_STATUS:
                if upstream.status_code >= 500:
                    attempt.failed("status", f"answered {upstream.status_code}")
                else:
                    replica.request_succeeded()
                state.metrics.first_byte.observe(time.perf_counter() - arrival)
                return RelayResponse(upstream, attempt, state)
            wait = retry_after_seconds(upstream.headers.get("retry-after"))
            if wait:
                replica.wait_until = time.monotonic() + min(wait, 60.0)
            try:
                last = (upstream.status_code, upstream.headers.raw, await upstream.aread())
            except httpx.HTTPError:
                last = None
            finally:
                await upstream.aclose()
            state.metrics.errors.labels(replica.url, "status").inc()
            if upstream.status_code == 503:
                replica.request_failed(s, "answered 503")
            attempt.end()
            reason = str(upstream.status_code)
        if attempt_no < s.max_retries and state.replicas.eligible(tried):
            if not state.budget.try_spend():
                log.warning("retry budget spent: not retrying %s", request.url.path)
                break
            state.metrics.retries.labels(replica.url, reason).inc()
    state.end()
    if last is not None:  # every replica tried said 429 or 503: the client sees the last one's own answer
        status, raw, content = last
        keep = [(k, v) for k, v in raw if k.decode("latin-1").lower() not in _DROP_RESPONSE | {"content-length"}]
        response = Response(content, status_code=status)
        response.raw_headers = [*keep, (b"content-length", str(len(content)).encode())]
        return response
    state.metrics.rejected.labels("503").inc()
    if not tried and any(r.state == "healthy" and not r.removed for r in state.replicas):
        wait = min((r.wait_until for r in state.replicas), default=0.0) - time.monotonic()
        return APIError(429, "every replica asked to wait (429): retry later", code="too_many_requests",
                        headers={"Retry-After": str(max(1, math.ceil(wait)))}).response()
    return APIError(503, "no replica could take the request: " + ("none is healthy" if not tried else
                    "every one tried failed"), code="no_replica", headers={"Retry-After": "1"}).response()


class RelayResponse(Response):
    """The replica's answer, relayed as it arrives; cleans up in every case (see module doc)."""

    def __init__(self, upstream: httpx.Response, attempt: Attempt, state: RouterState) -> None:
        self.upstream = upstream
        self.attempt = attempt
        self.state = state
        self.status_code = upstream.status_code
        self.background = None
        d = attempt.decision
        self.raw_headers = [(k, v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in _DROP_RESPONSE]
        self.raw_headers += [(b"x-kvserve-replica", attempt.replica.url.encode()),
                             (b"x-kvserve-route", d.outcome.encode()),
                             (b"x-kvserve-prefix-match", str(d.matched_tokens).encode())]
        self.is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        self.started = False
        self.lost: str | None = None
        self._relay: asyncio.Future | None = None

    def abort(self, why: str) -> None:
        """The replica stopped answering: end the client's answer now (health checks call this)."""
        if self._relay is not None and not self._relay.done():
            self.lost = why
            self._relay.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = self._relay = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        self.attempt.replica.streams.add(self)
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
            if relay.cancelled() and self.lost is not None:
                self.attempt.failed("timeout", self.lost)
                log.warning("%s: its answer in flight is ended", self.lost)
                if self.started and self.is_sse:
                    await send({"type": "http.response.body", "more_body": False,
                                "body": sse(APIError(503, self.lost + ": retry the request", code="replica_failed").body())
                                + sse("[DONE]")})
            elif relay.done() and relay.exception() is not None and not isinstance(relay.exception(), OSError):
                raise relay.exception()
        finally:
            self.attempt.replica.streams.discard(self)
            for task in (relay, watch):
                task.cancel()
            await asyncio.gather(relay, watch, return_exceptions=True)
            await self.upstream.aclose()  # a client that left: the replica sees it and aborts
            self.attempt.end()
            self.state.end()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self.started = True
        load, tail = self.attempt.load, b""
        try:
            async for chunk in self.upstream.aiter_raw():
                if self.is_sse:  # pass whole events only; count them as tokens produced
                    data = tail + chunk if tail else chunk
                    cut = data.rfind(b"\n\n") + 2
                    if cut == 1:
                        tail = data
                        continue
                    chunk, tail = data[:cut], data[cut:]
                    load.produced(chunk.count(b"data: "))
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as e:
            kind = "timeout" if isinstance(e, httpx.TimeoutException) else "midstream"
            why = f"the replica {self.attempt.replica.url} failed mid-answer ({type(e).__name__})"
            self.attempt.failed(kind, why)
            log.warning("%s", why)
            if not self.is_sse:
                raise OSError(why) from None  # the client sees the connection cut, not a false ending
            error = APIError(503, why + ": retry the request", code="replica_failed")
            await send({"type": "http.response.body", "body": sse(error.body()) + sse("[DONE]"), "more_body": False})
            return
        await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def router_error(status: int, message: str, code: str | None = None) -> ErrorResponse:
    return APIError(status, message, code=code).response()
