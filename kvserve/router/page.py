"""The router's live page: replicas, their loads and the latest routing decisions, in a browser.

    GET /               the page (router/static/), no external resources
    GET /static/…       its script and style
    GET /router/state   what it polls: the policy, each replica's state and load, the last
                        KEEP_DECISIONS decisions; open like /metrics (no replica API key, no admin key)

Its cost is bounded: one pass over the replicas and a fixed-size ring of decisions.
"""
from __future__ import annotations

import time
from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from kvserve.router.state import RouterState
from kvserve.server.errors import APIError
from kvserve.server.insight import STATIC_TYPES

STATIC_FILES = ("index.html", "app.js", "app.css")


def _static(name: str) -> Response:
    data = resources.files("kvserve.router").joinpath("static", name).read_bytes()
    return Response(data, media_type=STATIC_TYPES[name[name.rfind("."):]], headers={"Cache-Control": "no-cache"})


def add_page_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/router/state")
    async def router_state() -> dict:
        now = time.monotonic()
        return {"policy": state.settings.policy.name, "cache_source": state.settings.policy.cache_source,
                "active": state.active, "draining": state.draining,
                "replicas": [r.describe(now) for r in state.replicas], "decisions": list(state.decisions)}

    @app.get("/")
    async def page() -> Response:
        return _static("index.html")

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC_FILES:
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return _static(name)
