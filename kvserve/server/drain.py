"""Graceful shutdown: on SIGTERM stop admitting (503), let in-flight requests finish, then exit.

uvicorn alone would close the listening socket at once (new clients see "connection refused"
instead of a 503 they can act on) and re-raise the signal after shutdown. Here the first signal
only starts a drain; the process exits with status 0 once it is over.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from types import FrameType

import uvicorn

from kvserve.server.state import ServerState

log = logging.getLogger("kvserve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn, but the first SIGTERM/SIGINT drains: new requests get 503 while the admitted ones
    finish (up to drain_timeout), then the server exits. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None or not self.started:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            return
        self._draining = True
        name = signal.Signals(sig).name
        self._loop.call_soon_threadsafe(self._start_drain, name)

    def _start_drain(self, name: str) -> None:
        self._drain_task = asyncio.ensure_future(self._drain(name))

    async def _drain(self, name: str) -> None:
        self.state.begin_draining()
        n = self.state.num_admitted_requests
        log.info("%s: draining, %d request(s) in flight, up to %g s; new requests get 503", name, n, self.drain_timeout)
        if not await self.state.wait_idle(self.drain_timeout):
            log.warning("drain timeout: %d request(s) still in flight are cut off", self.state.num_admitted_requests)
            self.state.cancel_work()
            await self.state.wait_idle(2.0)
        self.should_exit = True
