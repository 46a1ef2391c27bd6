"""AsyncEngine: the server's one handle on the engine, whose loop runs on a thread of its own.

The engine (LLMEngine) belongs to that thread alone. Everything else talks to this object:
`inputs` (the engine's input checks, safe on a worker thread: they read only the tokenizer and fixed sizes),
`generate` (submit, then await outputs), `abort`, `stats`, `stalled`, `timeline` (a request's
record, through its own lock) and `state` (a snapshot of the engine taken on its thread). Requests and aborts cross
into the thread through a queue and are applied between steps.

Outputs cross back through one mailbox per request that holds at most one unread snapshot:
a snapshot that arrives before the reader took the previous one is merged into it (its deltas
joined). A client that stops reading therefore costs one snapshot, not one per step, and after
`stream_stall_timeout` seconds unread its request is aborted and its KV blocks freed.

If a step raises, the engine is dead: every waiting consumer gets EngineDeadError instead of
hanging, and is_alive turns False. A step that takes longer than `stall_timeout` makes
`stalled` True, so /health can say the engine is not making progress.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace
from typing import Any

from kvserve.engine.engine import EngineStats, LLMEngine
from kvserve.engine.input_processor import InputProcessor
from kvserve.engine.snapshot import engine_state
from kvserve.errors import KVServeError, shown
from kvserve.outputs import CompletionOutput, OutputKind, RequestOutput
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve.engine")


class EngineDeadError(KVServeError, RuntimeError):
    """The engine loop stopped after an internal error; the server must be restarted."""


class StreamStalledError(KVServeError, RuntimeError):
    """The request's reader took no output for too long; the request was aborted."""


class RequestTimeoutError(KVServeError, TimeoutError):
    """The request ran past its time limit and was aborted."""


@dataclass(frozen=True)
class EngineTimeouts:
    stall_timeout: float = 60.0  # a step (or a command) running longer means the engine is stuck
    stream_stall_timeout: float = 60.0  # an unread output older than this aborts its request
    request_timeout: float | None = None  # whole-request limit; None: none


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    tokenized_time: float  # when the prompt reached the engine as token ids
    pooling: bool = False  # an embedding request (LLMEngine.add_request)


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


def _merge(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`new`, with the deltas of `old` (which nobody read) in front of its own."""
    by_index = {c.index: c for c in old.outputs}

    def join(c: CompletionOutput) -> CompletionOutput:
        o = by_index.get(c.index)
        if o is None:
            return c
        lps = None if c.delta_logprobs is None else (o.delta_logprobs or []) + c.delta_logprobs
        return replace(c, delta_text=o.delta_text + c.delta_text, delta_token_ids=o.delta_token_ids + c.delta_token_ids,
                       delta_logprobs=lps)

    return replace(new, outputs=[join(c) for c in new.outputs],
                   prompt_logprobs=new.prompt_logprobs if new.prompt_logprobs is not None else old.prompt_logprobs)


class _Mailbox:
    """One request's unread output (or error), handed from the engine thread to an event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._item: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.unread_since: float | None = None  # when the oldest unread output arrived
        self.reader: asyncio.Task | None = None  # the task reading it (cancelled if it stops reading)

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread. An error ends the stream: the reader gets the output put before it
        (tokens the engine made before it failed reach the client), then the error; nothing after."""
        with self._lock:
            if self._error is not None:
                return
            if isinstance(item, BaseException):
                self._error = item
            else:
                self._item = item if self._item is None else _merge(self._item, item)
            if self.unread_since is None:
                self.unread_since = time.monotonic()
        try:
            self.loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # that event loop is closed
            pass

    def cancel_reader(self) -> None:
        """Cancel the reading task: it is stuck writing to a client that reads nothing."""
        if self.reader is not None:
            try:
                self.loop.call_soon_threadsafe(self.reader.cancel)
            except RuntimeError:
                pass

    async def get(self) -> RequestOutput | BaseException:
        while True:
            with self._lock:
                item: RequestOutput | BaseException | None = self._item
                if item is None:
                    item = self._error  # kept: a reader that asks again gets the error again
                self._item, self.unread_since = None, None
                if item is None:
                    self._ready.clear()
            if item is not None:
                return item
            await self._ready.wait()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, timeouts: EngineTimeouts = EngineTimeouts()) -> None:
        self.engine = engine  # the loop thread's: others use the methods below
        self.timeouts = timeouts
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.tokenizer = engine.tokenizer
        self._inbox: queue.Queue[_Add | _Abort | _Snapshot | None] = queue.Queue()
        self._mailboxes: dict[str, _Mailbox] = {}
        self._lock = threading.Lock()  # guards _mailboxes
        self._stats = engine.stats()
        self.error: BaseException | None = None
        self._stopping = False
        self._busy_since: float | None = None  # when the loop began its current work; None while idle
        self._thread = threading.Thread(target=self._loop, name="kvserve-engine", daemon=True)
        self._thread.start()

    # -- the asyncio side -----------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def thread_done(self) -> bool:
        """The engine thread has ended: another thread may touch the engine now."""
        return not self._thread.is_alive()

    @property
    def stalled(self) -> bool:
        """True while one step (or command) has run for longer than stall_timeout."""
        since = self._busy_since
        return since is not None and time.monotonic() - since > self.timeouts.stall_timeout

    @property
    def num_requests(self) -> int:
        """Requests admitted and not yet finished (queued or running)."""
        with self._lock:
            return len(self._mailboxes)

    def stats(self) -> EngineStats:
        """Counters as of the last step (read without touching the engine thread)."""
        return self._stats

    @property
    def inputs(self) -> InputProcessor:
        """The engine's input checks (kvserve/engine/input_processor.py), safe on any thread."""
        return self.engine.inputs

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        pooling: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's output after every step that changed it; the last is finished.

        `prompt_token_ids` come from `inputs.process`. Leaving the iteration early (the client went
        away, the task was cancelled) aborts the request and frees its blocks. `pooling`: an
        embedding request (params with max_tokens=0); its final output carries the embedding.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self.error
        rid = request_id or uuid.uuid4().hex
        box = _Mailbox(asyncio.get_running_loop())
        box.reader = asyncio.current_task()
        with self._lock:
            if rid in self._mailboxes:
                raise ValueError(f"request id {shown(rid)} is already in use")
            self._mailboxes[rid] = box
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        self._inbox.put(_Add(rid, prompt_token_ids, params, arrival, time.monotonic(), pooling))
        limit = self.timeouts.request_timeout
        deadline = None if limit is None else arrival + limit
        finished = False
        try:
            while True:
                try:
                    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                    item = await asyncio.wait_for(box.get(), remaining)
                except TimeoutError:
                    raise RequestTimeoutError(
                        f"the request ran past the server's limit of {limit:g} s and was stopped: "
                        "ask for fewer tokens, or run it where --request-timeout is higher"
                    ) from None
                if isinstance(item, BaseException):  # EngineDeadError, StreamStalledError, or a refused add
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._mailboxes.pop(rid, None)
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
                box = self._mailboxes.get(cmd.request_id)
            if box is None:  # its consumer left before admission
                return
            try:
                # Deltas: a step's work for a stream does not grow with its output; the merge of
                # unread outputs joins deltas, and the final output carries the whole.
                self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.arrival_time,
                                        output_kind=OutputKind.DELTA, pooling=cmd.pooling)
                self.engine.timeline.mark(cmd.request_id, "tokenized", cmd.tokenized_time)
            except ValueError as e:  # e.g. an id still held by an abort not yet applied
                box.put(e)
        elif isinstance(cmd, _Abort):
            self.engine.abort_request(cmd.request_id)
        elif isinstance(cmd, _Snapshot):
            state: dict[str, Any] | Exception
            try:
                state = engine_state(self.engine)
            except Exception as e:  # a picture of the engine must not stop it
                log.exception("engine snapshot failed")
                state = e
            try:
                cmd.loop.call_soon_threadsafe(_resolve, cmd.future, state)
            except RuntimeError:  # that event loop is closed
                pass

    def _deliver(self, out: RequestOutput) -> None:
        with self._lock:
            box = self._mailboxes.get(out.request_id)
        if box is not None:
            box.put(out)

    def _abort_stalled_readers(self) -> None:
        """Abort requests whose reader has left an output unread for too long (back-pressure)."""
        limit, now = self.timeouts.stream_stall_timeout, time.monotonic()
        with self._lock:
            stalled = [(rid, box) for rid, box in self._mailboxes.items()
                       if box.unread_since is not None and now - box.unread_since > limit]
        for rid, box in stalled:
            log.warning("request %s: its client read nothing for %g s; aborted, its KV blocks freed", rid, limit)
            self.engine.abort_request(rid)
            box.put(StreamStalledError(
                f"the client read no output for {limit:g} s, so the request was stopped to free its memory"))
            box.cancel_reader()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                idle = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._inbox.get(block=idle, timeout=0.5 if idle else None)
                    self._busy_since = time.monotonic()
                    self._apply(cmd)
                    while True:  # drain everything that arrived, so it joins this step
                        self._apply(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._busy_since = self._busy_since or time.monotonic()
                    for out in self.engine.step():
                        self._deliver(out)
                    self._abort_stalled_readers()
                self._stats = self.engine.stats()
                self._busy_since = None
        except BaseException as e:  # any failure kills the loop; consumers must learn
            log.exception("engine loop failed")
            self.error = e
            dead = EngineDeadError(f"the engine stopped after an internal error ({type(e).__name__}: {e})")
            dead.__cause__ = e
            with self._lock:
                boxes = list(self._mailboxes.values())
            for box in boxes:
                box.put(dead)
