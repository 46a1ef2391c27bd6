"""Forwarding one request: pick a replica, retry what failed before the first byte, relay the answer.

The body is read once (bounded) and forwarded untouched; the answer is relayed chunk by chunk as
it arrives (no buffering), a stream's events whole (Server-Sent Events, or NDJSON lines for
Ollama's API): an event cut short by a dying replica is dropped and replaced by an error event in
the dialect of the request's API (kvserve/server/errors.py), so a client's parser never sees half
of one. The router's own errors take that dialect too. A replica
that dies between a whole answer's head and its body is tried like one that died before its head
(nothing reached the client). One that dies mid-answer ends the client's stream at once (the
connection closes; a stream none of which reached the client yet is a 503 instead) or after
`read_timeout` of silence. A request that finds no healthy replica it may go to, before any
replica answered it, waits up to `replica_wait` for one to come up (kvserve/router/state.py). The answer's
head goes to the client with its first body bytes. A client that leaves closes the upstream request, so the replica
aborts the work.

The app calls `handle` straight from its ASGI entry (kvserve/router/app.py): no framework
routing, middleware or Request object on the way, since the router's own latency is added to
every request's time to first token and to every streamed token.
"""
from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import random
import time

from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvserve.router.policies import Decision
from kvserve.router.replicas import Load, Replica
from kvserve.router.request import RoutedRequest, parse_request
from kvserve.router.response_homes import ID_HEADER, NOT_HERE, RESPONSES
from kvserve.router.state import RouterState
from kvserve.router.upstream import ConnectError, ConnectRefused, ConnectTimeout, ReadTimeout, UpstreamError
from kvserve.router.upstream import Response as Answer
from kvserve.web.body import read_body
from kvserve.web.errors import APIError, Dialect, ErrorResponse, dialect

log = logging.getLogger("kvserve.router")

# Hop-by-hop headers (RFC 9110 §7.6.1) and those the HTTP client or the router set anew.
_DROP_REQUEST = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                           b"trailer", b"transfer-encoding", b"upgrade", b"host", b"content-length"})
_DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
                            b"trailer", b"transfer-encoding", b"upgrade", b"server", b"date"})
_RETRY_STATUS = (429, 503)




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
        state.metrics.child(state.metrics.requests, self.replica.url).inc()
        state.metrics.child(state.metrics.decisions, state.settings.policy.name, decision.outcome).inc()
        state.record(self.replica.url, decision.outcome, decision.matched_tokens, req.path, decision.cost)
        if decision.source is not None:
            state.metrics.matched.observe(decision.matched_tokens)

    def end(self) -> None:
        if not self.load.done:
            self.load.release()
            self.state.policy.finished(self.decision)

    def failed(self, kind: str, why: str) -> None:
        self.state.metrics.child(self.state.metrics.errors, self.replica.url, kind).inc()
        self.replica.request_failed(self.state.settings, why)
        self.end()


async def handle(scope: Scope, receive: Receive, send: Send, state: RouterState) -> None:
    """One proxied request, as an ASGI app; the router's own failures answer OpenAI error bodies."""
    try:
        response = await proxy(scope, receive, state)
    except APIError as e:
        if 400 <= e.status < 500:  # the reason, never the body: the operator sees why a client failed
            log.info("%s %s -> %d: %s", scope["method"], scope["path"], e.status, e.message)
        response = e.response(scope["path"])
    except ClientDisconnect:  # nobody reads the answer; one line, not a traceback
        log.info("%s %s: the client disconnected before sending the whole body", scope["method"], scope["path"])
        response = APIError(400, "the request body was cut off before its end").response(scope["path"])
    except Exception:
        log.exception("%s %s failed", scope["method"], scope["path"])
        response = APIError(500, "internal server error (see the server log)").response(scope["path"])
    await response(scope, receive, send)


async def proxy(scope: Scope, receive: Receive, state: RouterState) -> Response:
    arrival = time.perf_counter()
    s = state.settings
    if len(scope["headers"]) > s.max_headers:
        raise APIError(431, f"the request has {len(scope['headers'])} headers, more than the router's "
                       f"limit of {s.max_headers}", code="headers_too_large")
    if state.draining:
        raise APIError(503, "the router is shutting down: send the request elsewhere", code="draining",
                       headers={"Connection": "close"})
    if state.active >= s.max_concurrent_requests:
        state.metrics.rejected_503.inc()
        raise APIError(503, f"the router is at its limit of {s.max_concurrent_requests} concurrent requests: "
                       "retry after a moment", code="router_busy", headers={"Retry-After": "1"})
    state.begin()
    try:
        body = await read_body(scope, receive, s.max_body_bytes, "router")
        req = parse_request(scope["path"], body, scope["method"])
        if state.index is not None:
            await state.index.prepare(req)
        return await _send(scope, state, req, body, arrival)
    except BaseException:
        state.end()
        raise


async def _send(scope: Scope, state: RouterState, req: RoutedRequest, body: bytes, arrival: float) -> Response:
    """Try replicas until one answers (or the retries run out); state.end() once the answer ends."""
    s = state.settings
    if (connections := state.upstream) is None:
        raise RuntimeError("RouterState.start() first: it opens the upstream connections")
    state.budget.on_request()
    prompt_tokens = (state.index.prompt_tokens(req) if state.index else None) or req.estimated_prompt_tokens()
    max_tokens = (req.max_tokens if req.max_tokens is not None else s.default_max_tokens) * req.n
    # The head's bytes are built once, for every try: the headers as the client sent them (less
    # the hop-by-hop ones), and the target still percent-encoded.
    client = scope.get("client")
    headers = b"".join([k + b": " + v + b"\r\n" for k, v in scope["headers"] if k.lower() not in _DROP_REQUEST]
                       + [b"x-forwarded-for: " + (client[0].encode() if client else b"") + b"\r\n"])
    query = scope.get("query_string", b"")
    target = (scope.get("raw_path") or scope["path"].encode()) + (b"?" + query if query else b"")
    method = scope["method"].encode()
    tried: dict[Replica, int] = {}  # each replica tried, with its `ups` then (kvserve/router/replicas.py)
    last: tuple[int, list[tuple[bytes, bytes]], bytes] | None = None  # a 429/503 to pass on
    retries = 0  # after real failures: at most max_retries, each paid from the retry budget
    retry: tuple[str, str, bool] | None = None  # the try to repeat elsewhere: its replica, why, and whether it is paid
    deadline = time.monotonic() + s.replica_wait  # for waiting for a replica, all waits together
    gave_up: str | None = None  # why waiting for a replica ended without one
    while True:
        candidates = state.replicas.eligible(tried)
        # Nothing answered yet and no replica is up: wait for one rather than fail.
        if (not candidates and last is None and s.replica_wait > 0 and not state.replicas.up(tried)
                and (gave_up := await state.wait_for_replica(tried, deadline)) is None):
            candidates = state.replicas.eligible(tried)
        if not candidates:
            break
        if retry is not None:
            url, reason, paid = retry
            retry = None
            if paid:  # a replica may have seen it: max_retries, the budget and a backoff apply
                if not state.budget.try_spend():
                    log.warning("retry budget spent: not retrying %s", scope["path"])
                    break
                retries += 1
                await asyncio.sleep(min(s.backoff_max, s.backoff_base * 2 ** (retries - 1)) * random.uniform(0.5, 1.0))
                candidates = state.replicas.eligible(tried) or candidates
            state.metrics.child(state.metrics.retries, url, reason).inc()
        attempt = Attempt(state, _home(state, req, candidates) or state.policy.choose(candidates, req), req,
                          prompt_tokens, max_tokens)
        replica = attempt.replica
        tried[replica] = replica.ups
        try:
            upstream = await connections.request(replica.url, method, target, headers, body)
            if upstream.status not in _RETRY_STATUS and not _streams(upstream):
                # Nothing has reached the client until the body's first bytes: a replica that dies
                # between a whole answer's head and body is tried no differently from one that died before.
                try:
                    await upstream.started()
                except BaseException:
                    upstream.close()
                    raise
        except ReadTimeout as e:  # the replica may be working on it: sending it again doubles the load
            attempt.failed("timeout", f"{type(e).__name__}: {e}")
            break
        except ConnectTimeout as e:  # connecting, or waiting for a free connection: nothing was sent
            attempt.failed("timeout", f"{type(e).__name__}: {e}")
            reason = "connect"
        except ConnectError as e:  # no connection (refused: nothing listens there): the request never reached it
            attempt.failed("connect", f"{type(e).__name__}: {e}")
            if isinstance(e, ConnectRefused):
                state.mark_down(replica, "a request's connection was refused")
            # Another replica gets it at once, free: neither max_retries nor the retry budget,
            # which are for requests a replica may have seen. `tried` bounds these tries.
            retry = (replica.url, "refused" if isinstance(e, ConnectRefused) else "connect", False)
            continue
        except UpstreamError as e:  # it closed before the answer's head (a replica that died)
            attempt.failed("connect", f"{type(e).__name__}: {e}")
            reason = "connect"
        except BaseException:  # cancelled: the client left while the replica was connecting
            attempt.end()
            raise
        else:
            if req.response_id is not None and upstream.status in (400, 404) and state.replicas.eligible(tried):
                answer = (upstream.status, upstream.headers, await _whole(upstream))
                if _not_stored_here(answer[2]):  # another replica may hold it: asked next, free (as a refusal is)
                    state.answered(replica)
                    attempt.end()
                    last = answer
                    continue
                state.metrics.first_byte.observe(time.perf_counter() - arrival)
                return _answer(*answer, attempt, state)
            if upstream.status not in _RETRY_STATUS:
                if upstream.status >= 500:
                    attempt.failed("status", f"answered {upstream.status}")
                else:
                    state.answered(replica)
                    _learn_home(state, req, scope["method"], upstream, replica)
                state.metrics.first_byte.observe(time.perf_counter() - arrival)
                return RelayResponse(upstream, attempt, state, dialect(scope["path"]))
            wait = retry_after_seconds((upstream.header(b"retry-after") or b"").decode("latin-1"))
            if wait:
                replica.wait_until = time.monotonic() + min(wait, 60.0)
            try:
                last = (upstream.status, upstream.headers, await upstream.body())
            except UpstreamError:
                last = None
            finally:
                upstream.close()
            state.metrics.child(state.metrics.errors, replica.url, "status").inc()
            if upstream.status == 503:
                replica.request_failed(s, "answered 503")
            attempt.end()
            reason = str(upstream.status)
        if retries >= s.max_retries:
            break
        retry = (replica.url, reason, True)
    state.end()
    if last is not None:  # every replica tried said 429 or 503 (or holds no such response): the last one's own answer
        return _passed_on(*last)
    state.metrics.rejected_503.inc()
    if not tried and state.replicas.up():
        wait = min((r.wait_until for r in state.replicas), default=0.0) - time.monotonic()
        return APIError(429, "every replica asked to wait (429): retry later", code="too_many_requests",
                        headers={"Retry-After": str(max(1, math.ceil(wait)))}).response(scope["path"])
    why = ("none is healthy" if not tried else "every one tried failed") + (f", and {gave_up}" if gave_up else "")
    return APIError(503, "no replica could take the request: " + why, code="no_replica",
                    headers={"Retry-After": "1"}).response(scope["path"])


def _passed_on(status: int, raw: list[tuple[bytes, bytes]], content: bytes) -> Response:
    keep = [(k, v) for k, v in raw if k.lower() not in _DROP_RESPONSE | {b"content-length"}]
    response = Response(content, status_code=status)
    response.raw_headers = [*keep, (b"content-length", str(len(content)).encode())]
    return response


def _answer(status: int, raw: list[tuple[bytes, bytes]], content: bytes, attempt: Attempt, state: RouterState) -> Response:
    """A replica's small whole answer, read already, passed on as the request's answer."""
    state.answered(attempt.replica)
    attempt.end()
    state.end()
    return _passed_on(status, raw, content)


async def _whole(upstream: Answer) -> bytes:
    try:
        return await upstream.body()
    finally:
        upstream.close()


def _not_stored_here(content: bytes) -> bool:
    """The replica's error says it holds no such stored response (the Responses routes' codes: server/openai/responses.py, stored_responses.py)."""
    try:
        error = json.loads(content).get("error")
        return isinstance(error, dict) and error.get("code") in NOT_HERE
    except (ValueError, AttributeError):
        return False


def _home(state: RouterState, req: RoutedRequest, candidates: list[Replica]) -> Decision | None:
    """The replica known to hold the stored response the request names, if it can take it."""
    url = state.homes.get(req.response_id) if req.response_id else None
    return next((Decision(r, "response_home") for r in candidates if r.url == url), None) if url else None


def _learn_home(state: RouterState, req: RoutedRequest, method: str, upstream: Answer, replica: Replica) -> None:
    if req.path == RESPONSES and method == "POST" and upstream.status == 200:
        rid = upstream.header(ID_HEADER)
        if rid:
            state.homes.record(rid.decode("latin-1"), replica.url)
    elif method == "DELETE" and req.response_id is not None and upstream.status == 200:
        state.homes.forget(req.response_id)


def _streams(upstream: Answer) -> bool:
    """An event stream's first bytes wait for the first token: the relay watches the client meanwhile."""
    content_type = upstream.header(b"content-type") or b""
    return content_type.startswith((b"text/event-stream", b"application/x-ndjson"))


class RelayResponse(Response):
    """The replica's answer, relayed as it arrives; cleans up in every case (see module doc).

    The relay runs on the request's own task; a small watcher task cancels it when the client
    leaves (uvicorn's send() is silent then, and a replica may be silent for long), and abort()
    does the same for a replica that stopped answering.
    """

    def __init__(self, upstream: Answer, attempt: Attempt, state: RouterState, dialect: Dialect) -> None:
        self.upstream = upstream
        self.attempt = attempt
        self.state = state
        self.status_code = upstream.status
        self.background = None
        d = attempt.decision
        self.raw_headers = [(k, v) for k, v in upstream.headers if k.lower() not in _DROP_RESPONSE]
        self.raw_headers += [(b"x-kvserve-replica", attempt.replica.url.encode()),
                             (b"x-kvserve-route", d.outcome.encode()),
                             (b"x-kvserve-prefix-match", str(d.matched_tokens).encode())]
        content_type = upstream.header(b"content-type") or b""
        # A stream's events end with this: relayed whole, each counted as a token produced.
        self.separator = (b"\n\n" if content_type.startswith(b"text/event-stream")
                          else b"\n" if content_type.startswith(b"application/x-ndjson") else None)
        self.dialect = dialect
        self.started = False
        self.lost: str | None = None  # why abort() ended the relay
        self._task: asyncio.Task | None = None  # the relay's, while it runs

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def abort(self, why: str) -> None:
        """The replica stopped answering: end the client's answer now (health checks call this)."""
        if self._task is not None:
            self.lost = why
            self._stop()

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._task = asyncio.current_task()
        watch = asyncio.ensure_future(self._watch(receive))
        self.attempt.replica.streams.add(self)
        try:
            try:
                await self._pump(send)
            except asyncio.CancelledError:
                if self._task is not None:
                    raise  # not by _stop(): cancelled from elsewhere (the server stopping)
                if (task := asyncio.current_task()) is not None:
                    task.uncancel()
            except OSError as e:  # a whole answer cut short: the client sees the connection cut, not a false ending
                if not self.started:  # nothing sent yet: an error answer says why
                    error = APIError(503, f"{e}: retry the request", code="replica_failed")
                    await error.response(scope["path"])(scope, receive, send)
            self._task = None
            if self.lost is not None:
                self.attempt.failed("timeout", self.lost)
                log.warning("%s: its answer in flight is ended", self.lost)
                error = APIError(503, self.lost + ": retry the request", code="replica_failed")
                if self.separator is not None:
                    await self._start(send)
                    await send({"type": "http.response.body", "more_body": False,
                                "body": self.dialect.stream_error(error)})
                elif not self.started:
                    await error.response(scope["path"])(scope, receive, send)
        finally:
            self._task = None
            self.attempt.replica.streams.discard(self)
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            self.upstream.close()  # a client that left: the replica sees it and aborts
            self.attempt.end()
            self.state.end()

    async def _start(self, send: Send) -> None:
        if not self.started:
            self.started = True
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

    async def _pump(self, send: Send) -> None:
        # The head goes out with the first body bytes, not before: the client wakes once for both
        # (each wake-up of another process costs ~0.15 ms here), and nothing waits on a head alone.
        load, tail, separator = self.attempt.load, b"", self.separator
        read = self.upstream.read
        try:
            while chunk := await read():
                if separator is not None:  # pass whole events only; count them as tokens produced
                    data = tail + chunk if tail else chunk
                    cut = data.rfind(separator) + len(separator)
                    if cut == len(separator) - 1:
                        tail = data
                        continue
                    if cut == len(data):
                        chunk, tail = data, b""
                    else:
                        chunk, tail = data[:cut], data[cut:]
                    load.produced(chunk.count(separator))
                if not self.started:
                    await self._start(send)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as e:
            kind = "timeout" if isinstance(e, TimeoutError) else "midstream"
            why = f"the replica {self.attempt.replica.url} failed mid-answer ({type(e).__name__})"
            self.attempt.failed(kind, why)
            log.warning("%s", why)
            if separator is None:
                raise OSError(why) from None  # the client sees the connection cut, not a false ending
            error = APIError(503, why + ": retry the request", code="replica_failed")
            await self._start(send)
            await send({"type": "http.response.body", "body": self.dialect.stream_error(error), "more_body": False})
            return
        await self._start(send)
        await send({"type": "http.response.body", "body": tail, "more_body": False})


def router_error(status: int, message: str, code: str | None = None) -> ErrorResponse:
    return APIError(status, message, code=code).response()
