"""The shape every generation route shares: parse the body, start its job (a chat's admitted,
encoded and checked in one worker hop: `ServerContext.start_job`; a batch of prompts or of
embedding inputs admitted, then tokenized together), then answer it streamed or whole. A
subclass per API says only what differs: how a body becomes a job (`start`), its stream's events
as plain dicts (`events`) and its whole answer (`body`), `FIELDS`, its names for the engine's
words, so that a check made by the engine names the field as the client sent it, and `dialect`,
its error shape, whose framing writes its stream (kvserve/web/framing.py: SSE, named SSE or
NDJSON). One runner (`EventStream`) frames every API's events and ends a stream that fails with
the route's `failed` events. A route with no stream (embeddings) says so in `streams`.

One instance serves one HTTP request, so what `start` learns (the parsed body, per-prompt
extras such as echoed texts) is kept on it for `events` and `body`.

How an answer is sent, below the class: both kinds watch the connection for http.disconnect
while the engine works. When the client leaves, the work is cancelled; the engine iterator's
cleanup then aborts the request, and the engine frees its KV blocks before its next step. The
work is also registered in `tracked` (ServerState.work), so that a drain past its timeout can
cancel it; the client then gets a 503 (or, mid-stream, a final error event) instead of a dropped
connection. The admission is released in every case, even if the client left before the first
byte.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import OPENAI, APIError, Dialect, cut_off, from_invalid
from kvserve.server.generation import Job
from kvserve.web.framing import Framing

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission

log = logging.getLogger("kvserve.server")
T = TypeVar("T")


class Serving:
    request_model: ClassVar[type]  # the pydantic model the body is parsed into
    # The engine's words (SamplingParams' fields, "prompt") that this API spells otherwise:
    # an InvalidParam about "max_tokens" is reported as, say, "max_output_tokens".
    FIELDS: ClassVar[Mapping[str, str]] = {}
    dialect: ClassVar[Dialect] = OPENAI  # how an error is said, in a body and once a stream has begun
    framing: ClassVar[Framing | None] = None  # how its stream is written, if not as its dialect's

    def __init__(self, ctx: ServerContext, request: Request) -> None:
        self.ctx = ctx
        self.request = request
        self.arrival = time.monotonic()  # when the HTTP request arrived: the job's clock starts here
        self.req: Any = None
        self.fields: Mapping[str, str] = self.FIELDS  # `start` may fit it to the body (max_completion_tokens)

    @classmethod
    async def handle(cls, request: Request, ctx: ServerContext) -> Response:
        self = cls(ctx, request)
        ctx.state.require_ready()
        self.req = await ctx.parse(request, cls.request_model)
        try:
            started = await self.start()
        except ValueError as e:  # an InvalidParam (the route's checks or the engine's), a template's refusal
            raise from_invalid(e, self.fields) from None
        if isinstance(started, Response):  # nothing for the engine to do
            return started
        return await self.answer(*started)

    async def answer(self, admission: Admission, job: Job) -> Response:
        """Stream the job's events, or collect it and send the body; the admission is released
        when the response is done, however it ends. A client that leaves before a whole answer
        is ready gets nothing, and its work is dropped."""
        state = self.ctx.state
        if self.streams():
            return EventStream(self.events(job), self.framing or self.dialect.framing, self.failed, admission.release,
                               state.work)
        try:
            result = await run_until_disconnect(self.request, self.collect(job), state.work)
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening
        finally:
            admission.release()
        return JSONResponse(self.body(job, result))

    async def start_job(self, params: SamplingParams, encode: Callable[[], list[int]], *, prefix: str,
                        sep: str = "-", fit_within: int | None = None) -> tuple[Admission, Job]:
        """`ServerContext.start_job` for this request (its refusals are answered by `handle`)."""
        return await self.ctx.start_job(self.request, params, encode, arrival=self.arrival, prefix=prefix, sep=sep,
                                        fit_within=fit_within)

    def streams(self) -> bool:
        return bool(self.req.stream)

    async def start(self) -> tuple[Admission, Job] | Response:
        """Check the parsed body (self.req) and start its job; 4xx for what is wrong (an
        InvalidParam is one). A ready Response instead when the engine has nothing to do."""
        raise NotImplementedError

    def events(self, job: Job) -> AsyncIterator[dict]:
        """The streamed answer's events, as the API names them (framed by `framing`)."""
        raise NotImplementedError

    def failed(self, e: APIError) -> list[dict]:
        """The events that end a stream that failed after it began (by default the dialect's error)."""
        return self.dialect.error_events(e)

    async def collect(self, job: Job) -> Any:
        """What a whole answer is made from: each prompt's final output."""
        return await self.ctx.client.finals(job)

    def body(self, job: Job, result: Any) -> dict:
        """The whole answer's JSON body."""
        raise NotImplementedError


# -- how an answer is sent (the module docstring's second half) --------------------------------
class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _first_of(work: asyncio.Future, receive: Receive, tracked: set[asyncio.Future]) -> bool:
    """Wait for work or a disconnect; True if the client left. Nothing is left running after."""
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    tracked.add(work)
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        return watch.done() and not work.done()
    finally:
        tracked.discard(work)
        for task in (work, watch):
            task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)


async def run_until_disconnect(request: Request, work: Awaitable[T], tracked: set[asyncio.Future]) -> T:
    """The result of work; ClientDisconnected if the client left first, a 503 if it was cut off."""
    task = asyncio.ensure_future(work)
    if await _first_of(task, request.receive, tracked):
        raise ClientDisconnected
    if task.cancelled():
        raise cut_off()
    return task.result()


class EventStream(Response):
    """A stream of events, each framed as it comes; an error from the events (an APIError: the
    engine's), a cut-off or a failure ends it with `failed`'s events, and every stream ends with
    the framing's end."""

    def __init__(self, events: AsyncIterator[dict], framing: Framing, failed: Callable[[APIError], list[dict]],
                 on_close: Callable[[], None], tracked: set[asyncio.Future]) -> None:
        self.events = events
        self.framing = framing
        self.failed = failed
        self.on_close = on_close
        self.tracked = tracked
        self.media_type = framing.media_type
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        try:
            if await _first_of(pump, receive, self.tracked):
                return  # the client left; nobody to tell
            if pump.cancelled():  # cut off by the server (drain timeout, or a client that reads nothing)
                if self._started:
                    last = {"type": "http.response.body", "body": self._last(cut_off()), "more_body": False}
                    try:  # bounded: a client that reads nothing cannot hold this task
                        await asyncio.wait_for(send(last), 1.0)
                    except (TimeoutError, OSError):
                        log.info("a stream was cut off without its last event: its client is not reading")
                else:
                    await cut_off().response(scope["path"])(scope, receive, send)
            elif pump.exception() is not None:
                log.error("a stream failed", exc_info=pump.exception())
                if self._started:
                    error = APIError(500, "internal server error (see the server log)")
                    await send({"type": "http.response.body", "body": self._last(error), "more_body": False})
        finally:
            self.on_close()

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        self._started = True
        end = self.framing.end
        try:
            async for event in self.events:
                await send({"type": "http.response.body", "body": self.framing.frame(event), "more_body": True})
        except APIError as e:  # the engine's refusal mid-stream: said in the API's words
            end = self._last(e)
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()
        await send({"type": "http.response.body", "body": end, "more_body": False})

    def _last(self, e: APIError) -> bytes:
        return self.framing.close(self.failed(e))
