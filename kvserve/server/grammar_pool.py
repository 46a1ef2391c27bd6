"""Grammar compiles on a pool of their own, bounded in processes, queue and time, owned by their request.

Compiling a constraint is C++ work: milliseconds for most schemas, minutes for some inside the
size limits (kvserve/structured/limits.py; an object of 4,000 optional properties), and xgrammar
cannot be interrupted. On the default thread pool, which body parsing and tokenizing share, slow
compiles would starve every other request while /health still says 200; on threads of their
own, they would hold those threads for minutes after their requests left. So:
  - each compile runs first in a worker process (kvserve/structured/compile_worker.py), one per
    thread of this pool (`workers`); at most `max_pending` compiles wait or run at once, one
    more request is answered 429 at once;
  - a request waits at most `timeout` seconds for its compile, then gets a 400 naming the limit;
  - a compile that no request waits for any more (its clients left — watched while they wait —,
    timed out, or were cut off by a drain) leaves the queue if it has not started, and has its
    process killed if it has: its worker is free at once, and nothing compiles for nobody;
  - what compiled in its worker is compiled again here, on the same thread, for the engine (a
    compiled grammar costs more to carry between processes than to compile: compile_worker.py),
    unless that second compile would end after its last request stops waiting: then the 400
    comes at once. This process only runs compiles seen to end within the timeout; a cache miss
    costs about twice a compile (a small schema: ~0.5 ms more than on a thread);
  - a request whose constraint is already compiling waits for that compile instead of starting
    another, so one slow schema sent again and again holds one worker, and other requests'
    grammars still compile on the rest;
  - a constraint whose compile ran for (nearly: 95% of) the whole timeout in its worker without
    ending is remembered (by digest, the last `REMEMBERED` of them, for `REMEMBER_FOR` seconds):
    sent again, it gets its 400 at once instead of holding a worker for the timeout once more;
  - each worker's memory is capped (`memory_mib`; compile_worker.py): past it, a 400;
  - shutdown kills the processes, waiting for none.
The processes start with the server (`start`): the fork server's import of xgrammar (~3 s) runs
while the model loads, its vocabulary follows once the model is loaded, before the server says
it is ready. (A server given a loaded model starts them at once and says ready meanwhile: a
structured request that comes before they are up waits for them, once, and that wait is not
counted against its timeout.)
Every generation route compiles here, before its prompt is tokenized and checked
(kvserve/server/context.py); the engine's check only reads what was compiled.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from starlette.types import Receive

from kvserve.errors import InvalidParam
from kvserve.server.errors import APIError, cut_off
from kvserve.structured.compile_worker import MEMORY_MIB, CompileProcesses, CompileWorker, WorkerGone
from kvserve.structured.grammar import GrammarCompiler
from kvserve.structured.spec import Constraint

log = logging.getLogger("kvserve.server")

REMEMBERED = 4096  # constraints known to compile past the timeout (a 32-byte digest each)
REMEMBER_FOR = 600.0  # seconds: a compile slowed by load gets another chance after this
SLOW = 0.95  # of the timeout: a compile that ran so long without ending is remembered as too slow


class GrammarPool:
    def __init__(self, workers: int = 2, max_pending: int = 8, timeout: float = 10.0,
                 memory_mib: float = MEMORY_MIB) -> None:
        self.workers = workers
        self.max_pending = max_pending
        self.timeout = timeout
        self.pending = 0  # compiles queued or running (changed on the loop and by done callbacks)
        self.timeouts = 0
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._compiling: dict[tuple[str, str], _Job] = {}  # by constraint, on the event loop
        self._processes = CompileProcesses(memory_mib)
        self._slow: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # digest → (seconds it ran, when)
        self._loading = False  # the vocabulary is on its way to the fork server
        self.started = threading.Event()  # set once it arrived there (or failed to): compiles can run

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.workers, thread_name_prefix="kvserve-grammar")
        return self._executor

    def start(self, compiler: GrammarCompiler | None = None, wait: float = 0.0) -> None:
        """Start the compile processes ahead of the first structured request, off the event loop:
        the fork server's import now, its vocabulary once the model is loaded (`compiler`); with
        `wait`, up to that many seconds until they are up (a server's loading thread waits so)."""
        if self._loading:
            self.started.wait(wait)
            return  # started already, the vocabulary on its way
        self._loading = compiler is not None

        def run() -> None:
            try:
                self._processes.start(_vocabulary(compiler) if compiler is not None else None)
            except Exception as e:  # noqa: BLE001 - the first structured request says what is wrong
                if not self._processes.closed:
                    log.warning("the grammar compile processes did not start: %s", e)
            finally:
                if compiler is not None:
                    self.started.set()  # (also when they failed: each compile then says why)

        threading.Thread(target=run, name="kvserve-grammar-start", daemon=True).start()
        if compiler is not None:
            self.started.wait(wait)

    async def compile(self, compiler: GrammarCompiler, c: Constraint, receive: Receive | None = None,
                      tracked: set[asyncio.Future] | None = None) -> None:
        """Compile c for this request (it is pinned on c), or raise: InvalidParam (400) for a
        constraint over the limits, too slow or invalid; APIError 429 when the pool is full, 400
        when the client left (`receive`: the request's ASGI receive, its body already read), 503
        when a drain cut the wait off (`tracked`: the server's work that a drain may cancel).
        Requests for a constraint already compiling wait for that compile: a schema sent again
        and again (a client retrying) takes one worker, not all of them."""
        if compiler.cached(c):
            return
        compiler.check(c)  # over the size limits: a 400 at once, whatever the pool is doing
        if self._known_slow(c):
            with self._lock:
                self.timeouts += 1
            log.info("a grammar (%s) that compiled past %g s before is refused at once", c.param, self.timeout)
            raise _too_slow(c, self.timeout)
        if not self.started.is_set():  # seconds, once, as the server starts: not counted against the timeout
            self.start(compiler)
            while not self.started.is_set():
                await asyncio.sleep(0.02)  # (a poll: only while the processes start)
        job = self._compiling.get(c.key)
        if job is None:
            with self._lock:
                if self.pending >= self.max_pending:
                    raise APIError(429, f"{self.pending} structured-output grammars are compiling, this server's "
                                   "limit: retry after a moment", code="grammar_pool_full", headers={"Retry-After": "1"})
                self.pending += 1
            job = _Job()
            future = self._pool().submit(self._run, compiler, c, job)
            future.add_done_callback(self._done)  # before the loop hears of the end: a waiter sees pending counted down
            job.attach(future)
            self._compiling[c.key] = job
            key, started = c.key, job
            job.result.add_done_callback(lambda _: self._forget(key, started))
        job.waiters += 1
        job.deadline = max(job.deadline, time.monotonic() + self.timeout)
        waiting = asyncio.shield(job.result)  # a waiter that leaves cancels its own wait only
        left = asyncio.ensure_future(_until_disconnect(receive)) if receive is not None else None
        if tracked is not None:
            tracked.add(waiting)
        try:
            done, _ = await asyncio.wait({waiting} if left is None else {waiting, left}, timeout=self.timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            if waiting in done:
                if waiting.cancelled():  # a drain past its timeout cut it off
                    raise cut_off()
                c.compiled[:] = [waiting.result()]  # or the compile's own error
                return
            if left is not None and left in done:
                log.info("a client left while its grammar (%s) compiled", c.param)
                raise APIError(400, "the client disconnected while its grammar compiled", code="client_disconnected")
            with self._lock:
                self.timeouts += 1
            log.info("a grammar compile (%s) passed %g s: the request gets a 400", c.param, self.timeout)
            raise _too_slow(c, self.timeout)
        finally:
            waiting.cancel()
            job.waiters -= 1
            if not job.waiters and not job.result.done():  # no request waits for it any more
                self._forget(c.key, job)  # the next request for c starts a compile of its own
                if not job.future.cancel():  # started: its process is killed, its worker free at once
                    self._ran(c, job.abandon())
            if tracked is not None:
                tracked.discard(waiting)
            if left is not None:
                left.cancel()

    def _run(self, compiler: GrammarCompiler, c: Constraint, job: _Job) -> Any:
        """On a pool thread: c compiled in this thread's worker process, then here if it compiled
        there in time."""
        compiler.check(c)  # over the size limits: refused before any work
        took = self._in_worker(compiler, c, job, retry=True)
        if job.abandoned:
            raise _Abandoned
        if time.monotonic() + took > job.deadline:  # compiled here too, it would end after every request left
            self._ran(c, took)
            with self._lock:
                self.timeouts += 1
            log.info("a grammar compile (%s) took %.1f s in its worker: compiled again here, it would end past "
                     "its requests' %g s, so they get a 400", c.param, took, self.timeout)
            raise _too_slow(c, self.timeout)
        return compiler.build(c)

    def _in_worker(self, compiler: GrammarCompiler, c: Constraint, job: _Job, retry: bool) -> float:
        """c compiled in this thread's worker process: the seconds it took. A worker that ended on it costs
        the request a 400, unless its fork server had ended (the workers die with it, whatever they
        compile): then c goes once more to a worker of a fork server started again."""
        try:
            worker = self._processes.worker(_vocabulary(compiler))
        except WorkerGone:
            if self._processes.closed:
                raise _Abandoned from None
            raise APIError(503, "the grammar compiler's processes failed to start: retry in a moment",
                           code="grammar_compiler_unavailable", headers={"Retry-After": "1"}) from None
        if not job.begin(worker):
            raise _Abandoned
        try:
            return worker.try_compile(c)
        except WorkerGone:
            self._processes.discard()
            if job.abandoned or self._processes.closed:
                raise _Abandoned from None
            if retry and worker.fork_server.ended(wait=0.1):  # its own: another thread may have started the next
                log.warning("the grammar compile fork server ended while a worker compiled %s: on a new one", c.param)
            else:
                log.warning("a grammar compile process ended while it compiled %s", c.param)
                raise InvalidParam(c.param, f"{c.param} could not be compiled: the grammar compiler's process ended "
                                   "on it (out of memory?): make it simpler") from None
        finally:
            job.end()
        return self._in_worker(compiler, c, job, retry=False)

    def _ran(self, c: Constraint, seconds: float) -> None:
        """c's compile ran `seconds` in its worker (without ending, or to its end): remember it if
        that is (nearly) the timeout. (From the loop and from pool threads.)"""
        if seconds < SLOW * self.timeout:  # (a request's wait starts a moment before its compile)
            return
        key = _digest(c)
        with self._lock:
            self._slow[key] = (seconds, time.monotonic())
            self._slow.move_to_end(key)
            while len(self._slow) > REMEMBERED:
                self._slow.popitem(last=False)

    def _known_slow(self, c: Constraint) -> bool:
        if not self._slow:
            return False
        key = _digest(c)
        with self._lock:
            seen = self._slow.get(key)
            if seen is not None and time.monotonic() - seen[1] > REMEMBER_FOR:
                del self._slow[key]
                return False
        return seen is not None and seen[0] >= SLOW * self.timeout

    def _done(self, future: Any) -> None:
        with self._lock:
            self.pending -= 1

    def _forget(self, key: tuple[str, str], job: _Job) -> None:
        if self._compiling.get(key) is job:
            del self._compiling[key]
        if job.result.done() and not job.result.cancelled():
            job.result.exception()  # retrieved: a compile's error with no waiter left is not logged as lost

    def shutdown(self) -> None:
        """Drop the queued compiles and kill the compile processes, the running compiles with them:
        nothing is waited for. A compile's second pass in this process (bounded by `timeout`) is
        left to the process's exit (lifecycle.py)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._processes.kill()


class _Job:
    """One compile, the requests waiting for it, and the worker process running it."""

    def __init__(self) -> None:
        self.waiters = 0
        self.deadline = 0.0  # time.monotonic() when its last request stops waiting
        self.abandoned = False  # no request waits for it: it never starts, or ends at once
        self.worker: CompileWorker | None = None  # while its process compiles it
        self.began = 0.0  # time.monotonic() when its worker took it
        self._lock = threading.Lock()

    def attach(self, future: Future) -> None:
        self.future = future  # on the pool's thread
        self.result = asyncio.wrap_future(future)  # the same, on the event loop

    def begin(self, worker: CompileWorker) -> bool:
        with self._lock:
            if not self.abandoned:
                self.worker = worker
                self.began = time.monotonic()
            return not self.abandoned

    def end(self) -> None:
        with self._lock:
            self.worker = None

    def abandon(self) -> float:
        """Stop it: the seconds its worker had run it (0 if it had not begun, or had ended)."""
        with self._lock:
            self.abandoned = True
            if self.worker is None:
                return 0.0
            self.worker.kill()
            return time.monotonic() - self.began


class _Abandoned(Exception):
    """A compile that no request waits for any more, stopped: nobody reads this."""


def _digest(c: Constraint) -> bytes:
    return hashlib.sha256(repr(c.key).encode()).digest()


def _vocabulary(compiler: GrammarCompiler) -> Callable[[], str]:
    return lambda: compiler.tokenizer_info().serialize_json()


def _too_slow(c: Constraint, timeout: float) -> InvalidParam:
    return InvalidParam(c.param, f"{c.param} took longer than {timeout:g} s to compile, this server's limit "
                        "(--grammar-compile-timeout): make it simpler")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
