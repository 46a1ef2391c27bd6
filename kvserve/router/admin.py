"""`/admin/replicas`: list, add and remove replicas at run time (how `kvserve serve --join` registers).

Behind the router's admin key (Authorization: Bearer KEY). A router started without one accepts
admin calls from loopback clients only, so a router on a shared network is never open to change.

A browser on the router's host is a loopback client too, and any web page it shows may make it
send requests. So the admin API also refuses what only browsers send: a request whose `Origin`
is not the router itself or whose `Sec-Fetch-Site` says another site, and a POST or DELETE
without `Content-Type: application/json` (an HTML form cannot send that, and a script from
another origin cannot either without a CORS preflight, which the router never grants). Without
a key, the Host header must also be an address or `localhost`: a page whose domain name was
pointed at the router ("DNS rebinding") is its own origin, but its Host is that name.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import time
from urllib.parse import urlsplit

from fastapi import FastAPI, Request

from kvserve.router.state import RouterState
from kvserve.web.errors import APIError
from kvserve.web.hosts import host_name


def _refuse_browsers(request: Request, key: str | None) -> None:
    """403 (415) for what a web page of another origin can make a browser send (module doc)."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if origin is not None:
        parts = urlsplit(origin)
        if origin == "null" or parts.netloc.lower() != host.lower():
            raise APIError(403, f"the admin API refuses requests from web pages of other origins (Origin: "
                           f"{origin[:200]}): call it from a program, not a browser", code="cross_origin")
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise APIError(403, f"the admin API refuses requests a browser sends for another site (Sec-Fetch-Site: "
                       f"{site[:50]}): call it from a program, not a browser", code="cross_origin")
    if request.method in ("POST", "DELETE"):
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise APIError(415, f"the admin API takes a JSON body with Content-Type: application/json, not "
                           f"{media[:100] or 'none'}", code="unsupported_media_type")
    if not key:
        name = host_name(host).strip("[]")
        try:
            ipaddress.ip_address(name)
        except ValueError:
            if name != "localhost":
                raise APIError(403, f"without --admin-key the admin API answers requests addressed to an IP "
                               f"address or localhost only, not {host[:200]!r}: use http://127.0.0.1:PORT or "
                               "start the router with --admin-key", code="admin_forbidden") from None


def _require_admin(request: Request, key: str | None) -> None:
    _refuse_browsers(request, key)
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
    """The replica URL, from the JSON body {"url": ...} (never the query string, which a form or a
    link could carry)."""
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
