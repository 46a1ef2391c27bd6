"""The server's lifecycle: loading → ready → draining, admission control, liveness, signals.

Admission counts sequences (a request with n = 4 is four) and happens before any tokenizing:
up to max_num_seqs run in the engine and max_queued_requests more may wait; beyond that a
request gets 429 before any work is done. No request may hold more than `max_request_share` of
that capacity (nor more than `max_prompts` prompts): it would starve everyone else, so it gets a
400 at once, even on an idle server.

Liveness means progress: /health answers 503 `stalled` when the engine has work but one step has
run longer than its stall timeout, and `dead` once the engine loop has failed.

Signals: the first SIGTERM/SIGINT while serving drains (new requests get 503, admitted ones
finish, up to drain_timeout, and those still waiting then are cut off, grammar compiles'
included; their compile processes are killed), then the process exits 0, within EXIT_GRACE of
the server's end even when a thread still runs (a grammar's compile in this process, which cannot
be interrupted but was seen to end within the compile timeout: kvserve/server/grammar_pool.py).
A second signal, or one that arrives while the process is still starting, exits at once with
status 0 and one log line.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvicorn

from kvserve.engine.async_engine import AsyncEngine, EngineTimeouts
from kvserve.server.errors import APIError
from kvserve.web.draining import DrainingServer

if TYPE_CHECKING:
    from kvserve.llm import LLM
    from kvserve.server.settings import ServerSettings

log = logging.getLogger("kvserve.server")
EXIT_GRACE = 2.0  # seconds the interpreter gets to end once a drained server has stopped


def exit_now(reason: str) -> None:
    """Leave at once with status 0: no drain, no interpreter teardown racing loader threads."""
    log.info("%s: exiting now", reason)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(0)


class Phase(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"  # the model did not load


@dataclass
class Admission:
    """A reservation of engine capacity; release() exactly once, when the response is done."""

    state: ServerState
    num_seqs: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.state._release(self.num_seqs)


class ServerState:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.phase = Phase.LOADING
        self.llm: LLM | None = None  # once loaded
        self.engine: AsyncEngine | None = None
        self.started = int(time.time())
        self.num_admitted_seqs = 0
        self.num_admitted_requests = 0
        self._idle = asyncio.Event()  # set while no request is admitted (drain waits on it)
        self._idle.set()
        self.work: set[asyncio.Future] = set()  # responses being generated (see serving.py)
        # Called with the loaded model before /health says ready, on the loading thread (they may block there):
        # the grammar compile processes get its vocabulary, so no request waits for them.
        self.on_ready: list[Callable[[LLM], None]] = []

    @property
    def loaded(self) -> LLM:
        """The model, for what runs once the server is ready (an error before it is loaded)."""
        if self.llm is None:
            raise RuntimeError("the model is not loaded yet")
        return self.llm

    @property
    def running(self) -> AsyncEngine:
        """The engine, for what runs once the server is ready (an error before it runs)."""
        if self.engine is None:
            raise RuntimeError("the engine is not running yet")
        return self.engine

    # -- lifecycle ------------------------------------------------------------------------
    def set_ready(self, llm: LLM) -> None:
        """Start serving llm; its engine gets a loop of its own (one app per LLM)."""
        s = self.settings
        self.llm = llm
        self.engine = AsyncEngine(llm.engine, EngineTimeouts(s.stall_timeout, s.stream_stall_timeout, s.request_timeout))
        self.phase = Phase.READY

    def load_in_background(self, load: Callable[[], LLM], on_failure: Callable[[BaseException], None]) -> threading.Thread:
        """Load the model on a thread so /health can answer 503 meanwhile."""
        loop = asyncio.get_running_loop()

        def run() -> None:
            try:
                llm = load()
                for hook in self.on_ready:
                    hook(llm)
            except BaseException as e:  # noqa: BLE001 - reported to the serving side
                self.phase = Phase.FAILED
                loop.call_soon_threadsafe(on_failure, e)
                return
            try:
                loop.call_soon_threadsafe(self._loaded, llm)
            except RuntimeError:  # the server stopped while the model loaded
                pass

        thread = threading.Thread(target=run, name="kvserve-load", daemon=True)
        thread.start()
        return thread

    def _loaded(self, llm: LLM) -> None:
        if self.phase is Phase.LOADING:
            self.set_ready(llm)
            log.info("ready: %s, up to %d tokens per request", self.settings.model_name, llm.max_model_len)

    @property
    def engine_dead(self) -> bool:
        return self.engine is not None and not self.engine.is_alive

    def health(self) -> tuple[int, str]:
        if self.engine_dead:
            return 503, "dead"
        if self.engine is not None and self.engine.stalled:
            return 503, "stalled"
        return (200 if self.phase is Phase.READY else 503), self.phase.value

    def require_ready(self) -> None:
        """503 unless new work can be taken."""
        status, what = self.health()
        if status != 200:
            reason = {
                "loading": "the model is still loading: retry shortly",
                "draining": "the server is shutting down: send the request elsewhere",
                "dead": "the engine stopped after an internal error: the server must be restarted",
                "stalled": f"the engine has made no progress for over {self.settings.stall_timeout:g} s: "
                           "retry elsewhere or later",
                "failed": "the model failed to load: the server must be restarted",
            }[what]
            headers = {"Connection": "close"} if what == "draining" else {"Retry-After": "5"} if what == "loading" else {}
            raise APIError(503, reason, code=what, headers=headers)

    def begin_draining(self) -> None:
        if self.phase is Phase.READY or self.phase is Phase.LOADING:
            self.phase = Phase.DRAINING

    async def wait_idle(self, timeout: float) -> bool:
        """True once no admitted request is left, False if timeout passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def cancel_work(self) -> None:
        """Cut off every response still being generated (their clients get a 503)."""
        for task in list(self.work):
            task.cancel()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            if self.loaded.manager.disk is not None and self.engine.thread_done:
                # The prefix cache outlives the process: what RAM still caches goes to the disk tier.
                log.info("KV disk tier: %d cached blocks saved at shutdown", self.loaded.offload_prefix_cache())

    # -- admission ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.loaded.scheduler_config.max_num_seqs + self.settings.max_queued_requests

    @property
    def max_request_seqs(self) -> int:
        """The most sequences one request may hold: its share of the capacity, but at least max_n
        (one prompt with the largest n must fit) and never more than the whole capacity."""
        return min(self.capacity, max(self.settings.max_n, int(self.capacity * self.settings.max_request_share)))

    def admit(self, num_prompts: int, n: int, param: str = "prompt") -> Admission:
        """Reserve room for num_prompts × n sequences: 400 if one request may never hold that
        many, 429 while the server is too busy for them now. `param` names the prompts' field
        (an embedding request's is `input`)."""
        self.require_ready()
        s = self.settings
        if num_prompts > s.max_prompts:
            raise APIError(400, f"{param}: at most {s.max_prompts} {'inputs' if param == 'input' else 'prompts'} per "
                           f"request on this server, got {num_prompts}: split them over several requests", param=param)
        num_seqs = num_prompts * n
        if num_seqs > self.max_request_seqs:
            raise APIError(400, f"the request asks for {num_seqs} sequences ({num_prompts} prompts × n={n}) but one "
                           f"request may hold at most {self.max_request_seqs} on this server: send fewer prompts "
                           "or a smaller n", param="n" if num_prompts == 1 else param)
        if self.num_admitted_seqs + num_seqs > self.capacity:
            raise APIError(
                429, f"the server is at capacity ({self.num_admitted_seqs} sequences admitted, limit "
                f"{self.capacity}): retry after a moment",
                code="too_many_requests", headers={"Retry-After": "1"},
            )
        self.num_admitted_seqs += num_seqs
        self.num_admitted_requests += 1
        self._idle.clear()
        return Admission(self, num_seqs)

    def _release(self, num_seqs: int) -> None:
        self.num_admitted_seqs -= num_seqs
        self.num_admitted_requests -= 1
        if self.num_admitted_requests == 0:
            self._idle.set()


class EngineServer(DrainingServer):
    """The server's uvicorn: a drain lets the admitted requests finish (up to drain_timeout), a
    second signal cuts their streams off with an error event, and a signal while starting exits
    at once (kvserve/web/draining.py)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout

    async def serve(self, sockets=None) -> None:
        await super().serve(sockets)
        if self._draining:
            # Nothing is left to answer, but a thread may still hold the process: a grammar's compile
            # in this process runs to its end (up to the compile timeout) and the interpreter joins
            # the pool's threads at exit, as asyncio.run joins the loop's worker threads. Leave
            # anyway if they have not ended in a moment.
            timer = threading.Timer(EXIT_GRACE, exit_now, args=("threads still running after the drain",))
            timer.daemon = True
            timer.start()

    def exit_early(self, signal_name: str) -> None:
        exit_now(f"{signal_name} while starting")

    def exit_during_drain(self, signal_name: str) -> None:
        self.forced = True
        self.state.cancel_work()  # each stream gets its error event and [DONE] on this loop's next turns
        asyncio.get_running_loop().call_later(0.2, exit_now, f"second {signal_name} during the drain")

    async def drain(self, signal_name: str) -> None:
        self.state.begin_draining()
        n = self.state.num_admitted_requests
        log.info("%s: draining, %d request(s) in flight, up to %g s; new requests get 503", signal_name, n,
                 self.drain_timeout)
        if not await self.state.wait_idle(self.drain_timeout):
            log.warning("drain timeout: %d request(s) still in flight are cut off", self.state.num_admitted_requests)
            self.state.cancel_work()
            await self.state.wait_idle(2.0)
