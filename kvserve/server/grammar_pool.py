"""Grammar compiles on a pool of their own, bounded in threads, queue and time, owned by their request.

Compiling a constraint is C++ work of up to a second within the size limits
(kvserve/structured/limits.py). On the default thread pool, which body parsing and tokenizing
share, a few slow compiles would starve every other request while /health still says 200. So:
  - compiles run on `threads` threads of their own; at most `max_pending` wait or run at once,
    one more request is answered 429 at once;
  - a request waits at most `timeout` seconds for its compile, then gets a 400 naming the limit;
  - a request that ends (its client left — watched while it waits —, or the timeout) takes its
    compile off the queue if it has not started. One that has started runs to its end (xgrammar cannot be interrupted),
    bounded by the size limits; it still counts against `max_pending` until then, and its
    result is kept in the cache for the next request that asks;
  - a request whose constraint is already compiling waits for that compile instead of starting
    another, so one slow schema sent again and again holds one thread, and other requests'
    grammars still compile on the rest;
  - a wait is work a drain may cut off (`tracked`: ServerState.work): past the drain timeout
    the request gets a 503, and a compile still running never holds the process
    (kvserve/server/lifecycle.py exits without joining its thread).
Every generation route compiles here, before its prompt is tokenized and checked
(kvserve/server/context.py); the engine's check only reads what was compiled.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from starlette.types import Receive

from kvserve.errors import InvalidParam
from kvserve.server.errors import APIError, cut_off
from kvserve.structured.spec import Constraint

log = logging.getLogger("kvserve.server")


class GrammarPool:
    def __init__(self, threads: int = 2, max_pending: int = 8, timeout: float = 10.0) -> None:
        self.threads = threads
        self.max_pending = max_pending
        self.timeout = timeout
        self.pending = 0  # compiles queued or running (changed on the loop and by done callbacks)
        self.timeouts = 0
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiling: dict[tuple[str, str], _Job] = {}  # by constraint, on the event loop

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="kvserve-grammar")
        return self._executor

    async def compile(self, compiler: Any, c: Constraint, receive: Receive | None = None,
                      tracked: set[asyncio.Future] | None = None) -> None:
        """Compile c for this request (it is pinned on c), or raise: InvalidParam (400) for a
        constraint over the limits, too slow or invalid; APIError 429 when the pool is full, 400
        when the client left (`receive`: the request's ASGI receive, its body already read), 503
        when a drain cut the wait off (`tracked`: the server's work that a drain may cancel).
        Requests for a constraint already compiling wait for that compile: a schema sent again
        and again (a client retrying) takes one thread, not all of them."""
        if compiler.cached(c):
            return
        job = self._compiling.get(c.key)
        if job is None:
            with self._lock:
                if self.pending >= self.max_pending:
                    raise APIError(429, f"{self.pending} structured-output grammars are compiling, this server's "
                                   "limit: retry after a moment", code="grammar_pool_full", headers={"Retry-After": "1"})
                self.pending += 1
            future = self._pool().submit(compiler.build, c)
            future.add_done_callback(self._done)  # before the loop hears of the end: a waiter sees pending counted down
            job = self._compiling[c.key] = _Job(future)
            job.result.add_done_callback(lambda _, key=c.key, j=job: self._forget(key, j))
        job.waiters += 1
        waiting = asyncio.shield(job.result)  # a waiter that leaves cancels its own wait only
        left = asyncio.ensure_future(_until_disconnect(receive)) if receive is not None else None
        if tracked is not None:
            tracked.add(waiting)
        try:
            done, _ = await asyncio.wait({waiting, left} - {None}, timeout=self.timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiting in done:
                if waiting.cancelled():  # a drain past its timeout cut it off
                    raise cut_off()
                c.compiled[:] = [waiting.result()]  # or the compile's own error
                return
            if left is not None and left in done:
                log.info("a client left while its grammar (%s) compiled", c.param)
                raise APIError(400, "the client disconnected while its grammar compiled", code="client_disconnected")
            self.timeouts += 1
            log.info("a grammar compile (%s) passed %g s: the request gets a 400", c.param, self.timeout)
            raise InvalidParam(c.param, f"{c.param} took longer than {self.timeout:g} s to compile, this server's "
                               "limit (--grammar-compile-timeout): make it simpler")
        finally:
            waiting.cancel()
            job.waiters -= 1
            if not job.waiters and job.future.cancel():  # not started, and no request waits for it: never starts
                self._forget(c.key, job)
            if tracked is not None:
                tracked.discard(waiting)
            if left is not None:
                left.cancel()

    def _done(self, future: Any) -> None:
        with self._lock:
            self.pending -= 1

    def _forget(self, key: tuple[str, str], job: _Job) -> None:
        if self._compiling.get(key) is job:
            del self._compiling[key]
        if job.result.done() and not job.result.cancelled():
            job.result.exception()  # retrieved: a compile's error with no waiter left is not logged as lost

    def shutdown(self) -> None:
        """Drop the queued compiles; a running one is left to the process's exit (lifecycle.py)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


class _Job:
    """One compile and the requests waiting for it."""

    def __init__(self, future: Future) -> None:
        self.future = future  # on the pool's thread
        self.result = asyncio.wrap_future(future)  # the same, on the event loop
        self.waiters = 0


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
