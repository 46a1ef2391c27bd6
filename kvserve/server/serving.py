"""The shape every generation route shares: parse the body, start its job (admitted, encoded and
checked in one worker hop: `ServerContext.start_job`), then answer it streamed or whole. The
admission is released when the answer is done, however it ends, and a client that leaves stops
the work (kvserve/server/streaming.py). A subclass per API says only what differs: how a body
becomes a job (`start`), its stream's events (`events`) and its whole answer (`body`).

One instance serves one HTTP request, so what `start` learns (the parsed body, per-prompt
extras such as echoed texts) is kept on it for `events` and `body`.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from starlette.requests import Request
from starlette.responses import Response

from kvserve.server.generation import Job
from kvserve.server.streaming import respond

if TYPE_CHECKING:
    from kvserve.server.context import ServerContext
    from kvserve.server.lifecycle import Admission


class Serving:
    request_model: ClassVar[type]  # the pydantic model the body is parsed into

    def __init__(self, ctx: ServerContext, request: Request) -> None:
        self.ctx = ctx
        self.request = request
        self.arrival = time.monotonic()  # when the HTTP request arrived: the job's clock starts here
        self.req: Any = None

    @classmethod
    async def handle(cls, request: Request, ctx: ServerContext) -> Response:
        self = cls(ctx, request)
        ctx.state.require_ready()
        self.req = await ctx.parse(request, cls.request_model)
        admission, job = await self.start()
        return await respond(request, ctx.state, admission, self.streams(), lambda: self.events(job),
                             lambda: self.collect(job), lambda result: self.body(job, result))

    def streams(self) -> bool:
        return bool(self.req.stream)

    async def start(self) -> tuple[Admission, Job]:
        """Check the parsed body (self.req) and start its job; 4xx for what is wrong."""
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
