"""The router's live page: replicas, their loads and the latest routing decisions, in a browser.

    GET /               the page (router/static/), no external resources
    GET /static/…       its script and style
    GET /router/state   what it polls: the policy, each replica's state and load, the last
                        KEEP_DECISIONS decisions; open like /metrics (no replica API key, no admin key)

Its cost is bounded: one pass over the replicas and a fixed-size ring of decisions.
"""
from __future__ import annotations

import time

from fastapi import FastAPI
from fastapi.responses import Response

from kvserve.router.state import RouterState
from kvserve.server.insight import static_file


def add_page_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/router/state")
    async def router_state() -> dict:
        now = time.monotonic()
        return {"policy": state.settings.policy.name, "cache_source": state.settings.policy.cache_source,
                "active": state.active, "draining": state.draining,
                "replicas": [r.describe(now) for r in state.replicas], "decisions": list(state.decisions)}

    @app.get("/")
    async def page() -> Response:
        return static_file("kvserve.router", "index.html")

    @app.get("/static/{name}")
    async def static(name: str) -> Response:
        return static_file("kvserve.router", name)
