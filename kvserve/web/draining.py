"""uvicorn, but the first SIGTERM/SIGINT drains, for the server and the router alike: new requests
get 503 while those in flight finish (up to a drain timeout), then the process exits. A second
signal during the drain exits at once, and so does one that arrives while still starting.

uvicorn alone would close the listening socket at once (new clients see "connection refused"
instead of a 503 they can act on) and re-raise the signal after shutdown. Subclasses say how
their own work drains (`drain`) and how they leave early (`exit_early`, `exit_during_drain`).
"""
from __future__ import annotations

import asyncio
import signal
from types import FrameType

import uvicorn


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self.forced = False  # a second signal is ending the process: the drain must not start uvicorn's shutdown

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        name = signal.Signals(sig).name
        if self._loop is None or not self.started:
            self.exit_early(name)
        elif self._draining:
            self._loop.call_soon_threadsafe(self.exit_during_drain, name)
        else:
            self._draining = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain_then_exit(name)))

    async def _drain_then_exit(self, name: str) -> None:
        await self.drain(name)
        if not self.forced:
            self.should_exit = True

    async def drain(self, signal_name: str) -> None:
        """Refuse new work, and return once the work in flight is done or cut off (on the loop)."""
        raise NotImplementedError

    def exit_early(self, signal_name: str) -> None:
        """A signal while starting (in the signal handler): uvicorn's own exit, forced by a second one."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    def exit_during_drain(self, signal_name: str) -> None:
        """A second signal during the drain (on the loop): uvicorn's shutdown now, forced by a third."""
        self.forced = True
        self.exit_early(signal_name)
