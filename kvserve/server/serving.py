"""The shape every generation route shares: parse the body, start its job (admitted, encoded and
checked in one worker hop: `ServerContext.start_job`), then answer it streamed or whole. The
admission is released when the answer is done, however it ends, and a client that leaves stops
the work (kvserve/server/streaming.py). A subclass per API says only what differs: how a body
becomes a job (`start`), its stream's events (`events`) and its whole answer (`body`), and
`FIELDS`, its names for the engine's words, so that a check made by the engine names the field
as the client sent it. A route with no stream (embeddings) says so in `streams`.

One instance serves one HTTP request, so what `start` learns (the parsed body, per-prompt
extras such as echoed texts) is kept on it for `events` and `body`.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.sampling_params import SamplingParams
from kvserve.server.errors import dialect, from_invalid
from kvserve.server.generation import Job
from kvserve.server.streaming import ClientDisconnected, EventStream, run_until_disconnect

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission


class Serving:
    request_model: ClassVar[type]  # the pydantic model the body is parsed into
    # The engine's words (SamplingParams' fields, "prompt") that this API spells otherwise:
    # an InvalidParam about "max_tokens" is reported as, say, "max_output_tokens".
    FIELDS: ClassVar[Mapping[str, str]] = {}

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
            return EventStream(self.events(job), admission.release, state.work, dialect(self.request.url.path))
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

    def events(self, job: Job) -> AsyncIterator[bytes]:
        """The streamed answer's events, ready to send."""
        raise NotImplementedError

    async def collect(self, job: Job) -> Any:
        """What a whole answer is made from: each prompt's final output."""
        return await self.ctx.client.finals(job)

    def body(self, job: Job, result: Any) -> dict:
        """The whole answer's JSON body."""
        raise NotImplementedError
