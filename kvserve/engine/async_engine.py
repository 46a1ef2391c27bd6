"""AsyncEngine: the engine's own loop on a thread, awaited per request from asyncio.

Model work runs on the engine thread (torch releases the GIL inside its kernels), so the HTTP
event loop stays responsive. Requests and aborts cross into the thread through a queue and are
applied between steps; each step's outputs cross back with call_soon_threadsafe onto the
request's asyncio.Queue. If a step raises, the engine is dead: every waiting consumer gets
EngineDeadError instead of hanging, and is_alive turns False.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvserve.engine.engine import EngineStats, LLMEngine
from kvserve.engine.snapshot import engine_state
from kvserve.errors import KVServeError
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine")


class EngineDeadError(KVServeError, RuntimeError):
    """The engine loop stopped after an internal error; the server must be restarted."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    tokenized_time: float  # when the prompt reached the engine as token ids


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Snapshot:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


def _resolve(future: asyncio.Future, result: object) -> None:
    if future.done():  # its caller gave up
        return
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.Queue[_Add | _Abort | _Snapshot | None] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams
        self._stats = engine.stats()
        self.error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    # -- the asyncio side -----------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished (queued or running)."""
        with self._lock:
            return len(self._streams)

    def stats(self) -> EngineStats:
        """Counters as of the last step (read without touching the engine thread)."""
        return self._stats

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changed it; the last is finished.

        Bad input raises ValueError before anything is yielded. Leaving the iteration early
        (the client went away, the task was cancelled) aborts the request and frees its blocks.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self.error
        ids = self.engine.validate(prompt, params)
        rid = request_id or uuid.uuid4().hex
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), q)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._inbox.put(_Add(rid, prompt, ids, params, arrival, time.monotonic()))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, ValueError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item}") from item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(rid, None)
            if not finished:
                self._inbox.put(_Abort(rid))

    def timeline(self, request_id: str) -> dict | None:
        """A recent request's timeline (see engine/timeline.py); safe from any thread."""
        return self.engine.timeline.get(request_id)

    async def state(self) -> dict:
        """A snapshot of the engine (engine/snapshot.py), taken on the engine thread between steps."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self.error
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Snapshot(loop, future))
        return await future

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def shutdown(self, timeout: float | None = 5.0) -> None:
        self._stopping = True
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- the engine thread ----------------------------------------------------------------
    def _apply(self, cmd: _Add | _Abort | _Snapshot | None) -> None:
        if isinstance(cmd, _Add):
            with self._lock:
                if cmd.request_id not in self._streams:  # its consumer left before admission
                    return
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, cmd.arrival_time, cmd.prompt_token_ids)
                self.engine.timeline.mark(cmd.request_id, "tokenized", cmd.tokenized_time)
            except ValueError as e:  # e.g. an id still held by an abort not yet applied
                self._deliver(e, cmd.request_id)
        elif isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)
        elif isinstance(cmd, _Snapshot):
            try:
                state = engine_state(self.engine)
            except Exception as e:  # noqa: BLE001 - a picture of the engine must not stop it
                log.exception("engine snapshot failed")
                state = e
            try:
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, state)
            except RuntimeError:  # that event loop is closed
                pass

    def _deliver(self, out: RequestOutput | BaseException, rid: str) -> None:
        with self._lock:
            target = self._streams.get(rid)
        if target is not None:
            loop, q = target
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # that event loop is closed
                pass

    def _loop(self) -> None:
        try:
            while not self._stopping:
                block = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._inbox.get(block=block, timeout=0.5 if block else None)
                    self._apply(cmd)
                    while True:  # drain everything that arrived, so it joins this step
                        self._apply(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out, out.request_id)
                self._stats = self.engine.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the loop; consumers must learn
            log.exception("engine loop failed")
            self.error = e
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(e, rid)
