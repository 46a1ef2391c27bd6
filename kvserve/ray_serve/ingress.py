"""The HTTP side: Serve's proxy hands every request here; its body is read (under the replicas'
limit) and the whole request goes to a KvserveReplica through the deployment handle, whose router
(router.py) picks the replica by the prompt.

A replica that dies before any of its answer reached the client is no failure: the request is
sent again (`retries` times, with backoff; the router has dropped the dead replica by then). So
a whole answer is collected before it is sent, and a stream's head waits for its first event.
A stream that dies after that ends with an error event in the API's own dialect
(kvserve/web/errors.py; OpenAI's is a `data: {"error": ...}` event and `[DONE]`): its tokens so
far reached the client, and sending the request again would repeat them.
"""
# (No `from __future__ import annotations`: FastAPI must resolve the route's `Request` parameter
# through Serve's wrapper of the class.)
import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kvserve.ray_serve.forwarding import ForwardedRequest, ResponseHead
from kvserve.web.body import read_body
from kvserve.web.errors import APIError, dialect

log = logging.getLogger("kvserve.ray_serve")

REPLICA_GONE = (RayActorError, ActorUnavailableError)  # (ActorDiedError is a RayActorError)
STREAM_TYPES = (b"text/event-stream", b"application/x-ndjson")
_DROPPED = frozenset({b"content-length", b"transfer-encoding", b"connection"})  # set again by this hop

api = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)


@dataclass(frozen=True)
class IngressSettings:
    max_body_bytes: int = 4 << 20  # the replicas' own limit (`--max-body-mib`)
    retries: int = 3  # sends again after a replica died with nothing of its answer sent
    retry_backoff: float = 0.2  # seconds before the first of them, doubling


@serve.ingress(api)
class KvserveIngress:
    def __init__(self, replicas: DeploymentHandle, settings: IngressSettings = IngressSettings()) -> None:
        self.replicas = replicas.options(stream=True, method_name="forward")
        self.settings = settings

    @api.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "HEAD", "OPTIONS"])
    async def forward(self, request: Request) -> Response:
        scope = dict(request.scope)
        root = scope.get("root_path", "")
        if root and scope["path"].startswith(root):
            scope["path"] = scope["path"][len(root):] or "/"
        try:
            body = await read_body(scope, request.receive, self.settings.max_body_bytes, "server")
        except APIError as e:
            return e.response(scope["path"])
        return await self._answer(ForwardedRequest.from_scope(scope, body))

    async def _answer(self, fwd: ForwardedRequest) -> Response:
        why = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                await asyncio.sleep(self.settings.retry_backoff * 2 ** (attempt - 1))
            # (Ray types remote() as either kind; a handle with stream=True gives the generator)
            gen = cast(DeploymentResponseGenerator, self.replicas.remote(fwd))
            try:
                head: ResponseHead = await gen.__anext__()
                headers = [(k, v) for k, v in head.headers if k.lower() not in _DROPPED]
                if not (head.header(b"content-type") or b"").startswith(STREAM_TYPES):
                    body = b"".join([chunk async for chunk in gen])
                    response = Response(body, status_code=head.status)
                    response.raw_headers = [*headers, (b"content-length", str(len(body)).encode())]
                    return response
                first = await anext(gen, b"")  # until a stream's first event, it can go elsewhere
            except REPLICA_GONE as e:
                gen.cancel()
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("%s %s: the replica died before answering (%s); %s", fwd.method, fwd.path, why,
                            "sending it again" if attempt < self.settings.retries else "giving up")
                continue
            except Exception as e:  # the replica raised: an error body, not a traceback
                gen.cancel()
                log.exception("%s %s: the replica failed", fwd.method, fwd.path)
                return APIError(500, f"the replica failed ({type(e).__name__}): retry the request",
                                code="replica_failed").response(fwd.path)
            except BaseException:  # cancelled: the client left, so the replica's work stops too
                gen.cancel()
                raise
            response = StreamingResponse(self._relay(gen, first, fwd.path), status_code=head.status)
            response.raw_headers = headers
            return response
        return APIError(503, f"no replica could answer ({why}): retry the request",
                        code="replica_failed").response(fwd.path)

    @staticmethod
    async def _relay(gen: DeploymentResponseGenerator, first: bytes, path: str) -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in gen:
                yield chunk
        except Exception as e:  # noqa: BLE001 - ended with an event the client's parser understands
            gone = isinstance(e, REPLICA_GONE)
            log.warning("%s: the replica serving a stream %s mid-answer (%s)", path, "died" if gone else "failed",
                        type(e).__name__)
            what = "died" if gone else f"failed ({type(e).__name__})"
            error = APIError(503, f"the replica serving this stream {what} mid-answer: retry the request",
                             code="replica_failed")
            yield dialect(path).stream_error(error)
        finally:
            gen.cancel()  # a client that left: the replica's app sees it go and aborts the request
