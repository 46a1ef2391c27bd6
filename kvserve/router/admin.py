"""`/admin/replicas`: list, add and remove replicas at run time (how `kvserve serve --join` registers).

Behind the router's admin key (Authorization: Bearer KEY). A router started without one accepts
admin calls from loopback clients only, so a router on a shared network is never open to change.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import time

from fastapi import FastAPI, Request

from kvserve.router.state import RouterState
from kvserve.server.errors import APIError


def _require_admin(request: Request, key: str | None) -> None:
    if key:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):
            raise APIError(401, "the admin API needs Authorization: Bearer <the router's --admin-key>",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return
    host = request.client.host if request.client else ""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise APIError(403, "the admin API is open to loopback clients only: start the router with --admin-key "
                       "to use it from elsewhere", code="admin_forbidden")


async def _url(request: Request) -> str:
    """The replica URL, from a JSON body {"url": ...} or ?url=."""
    url = request.query_params.get("url")
    if url is None:
        raw = await request.body()
        if len(raw) > 64 << 10:
            raise APIError(413, "the admin request body is larger than 64 KiB")
        try:
            data = json.loads(raw or b"null")
        except ValueError:
            raise APIError(400, 'the body must be JSON: {"url": "http://HOST:PORT"}', param="url") from None
        url = data.get("url") if isinstance(data, dict) else None
    if not isinstance(url, str) or not url:
        raise APIError(400, 'give the replica as {"url": "http://HOST:PORT"}', param="url")
    return url


def add_admin_routes(app: FastAPI, state: RouterState) -> None:
    key = state.settings.admin_key

    @app.get("/admin/replicas")
    async def list_replicas(request: Request) -> dict:
        _require_admin(request, key)
        now = time.monotonic()
        return {"policy": state.settings.policy.name, "cache_source": state.settings.policy.cache_source,
                "replicas": [r.describe(now) for r in state.replicas]}

    @app.post("/admin/replicas")
    async def add_replica(request: Request) -> dict:
        _require_admin(request, key)
        try:
            replica, new = await state.add(await _url(request))
        except ValueError as e:
            raise APIError(400, str(e), param="url") from None
        return {"added": new, **replica.describe(time.monotonic())}

    @app.delete("/admin/replicas")
    async def remove_replica(request: Request) -> dict:
        _require_admin(request, key)
        url = await _url(request)
        try:
            replica = state.remove(url)
        except ValueError as e:
            raise APIError(400, str(e), param="url") from None
        if replica is None:
            raise APIError(404, f"no replica {url} (see GET /admin/replicas)", param="url")
        return {"removed": True, **replica.describe(time.monotonic())}
