"""The server's lifecycle and admission control.

Phases: loading → ready → draining. The engine can die in any phase after loading; /health
then answers 503 and so does every new request. Admission counts sequences (a request with
n = 4 is four): up to max_num_seqs run in the engine and max_queued_requests more may wait;
beyond that a request gets 429 before anything is generated, so the work already admitted is
bounded and always finishes.
"""
from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvserve.engine.async_engine import AsyncEngine
from kvserve.server.errors import APIError
from kvserve.server.settings import ServerSettings

if TYPE_CHECKING:
    from kvserve.llm import LLM

log = logging.getLogger("kvserve.server")


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
        self.work: set[asyncio.Future] = set()  # responses being generated (see streaming.py)

    # -- lifecycle ------------------------------------------------------------------------
    def set_ready(self, llm: LLM) -> None:
        """Start serving llm; its engine gets a loop of its own (one app per LLM)."""
        self.llm = llm
        self.engine = AsyncEngine(llm.engine)
        self.phase = Phase.READY

    def load_in_background(self, load: Callable[[], LLM], on_failure: Callable[[BaseException], None]) -> None:
        """Load the model on a thread so /health can answer 503 meanwhile."""
        loop = asyncio.get_running_loop()

        def run() -> None:
            try:
                llm = load()
            except BaseException as e:  # noqa: BLE001 - reported to the serving side
                self.phase = Phase.FAILED
                loop.call_soon_threadsafe(on_failure, e)
                return
            loop.call_soon_threadsafe(self._loaded, llm)

        threading.Thread(target=run, name="kvserve-load", daemon=True).start()

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
        return (200 if self.phase is Phase.READY else 503), self.phase.value

    def require_ready(self) -> None:
        """503 unless new work can be taken."""
        status, what = self.health()
        if status != 200:
            reason = {
                "loading": "the model is still loading: retry shortly",
                "draining": "the server is shutting down: send the request elsewhere",
                "dead": "the engine stopped after an internal error: the server must be restarted",
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

    # -- admission ------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.llm.scheduler_config.max_num_seqs + self.settings.max_queued_requests

    def admit(self, num_seqs: int) -> Admission:
        """Reserve room for num_seqs sequences, or raise 429."""
        self.require_ready()
        if self.num_admitted_seqs + num_seqs > self.capacity and self.num_admitted_seqs > 0:
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
