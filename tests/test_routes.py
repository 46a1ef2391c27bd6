"""The one route table (kvserve/server/routes.py) is what the app mounts, what the API key spares,
what each path's error dialect and the router's path lists agree with, and each API's route
modules stay small enough to read. In-process: the app is built, not started (no model loads)."""
from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from kvserve.router import app as router_app
from kvserve.router import request as router_request
from kvserve.server.app import build_app
from kvserve.server.routes import ROUTES
from kvserve.server.settings import ServerSettings
from kvserve.web.errors import ANTHROPIC, OLLAMA, OPENAI, dialect

DIALECTS = {"OpenAI": OPENAI, "vLLM": OPENAI, "kvserve": OPENAI, "Anthropic": ANTHROPIC, "Ollama": OLLAMA}
ROUTE_MODULE_LINES = 150  # issue 49's bound: an API's route module is read in one sitting


def _never_loads():
    raise AssertionError("not started")


@pytest.fixture(scope="module")
def app():
    return build_app(ServerSettings(model_name="m", api_key="secret"), load=_never_loads)


def test_the_app_serves_the_table_and_nothing_else(app) -> None:
    mounted = {(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    table = {(r.path, m) for r in ROUTES for m in r.methods.split()}
    assert mounted == table


def test_the_api_key_spares_the_open_routes_only(app) -> None:
    with TestClient(app) as client:  # (the model load fails on its thread: every route answers as when loading)
        for r in ROUTES:
            path = r.path.replace("{model_id:path}", "m").replace("{name}", "index.html")
            path = path.replace("{response_id}", "resp_x").replace("{request_id}", "x")
            method = r.methods.split()[0]
            status = client.request(method, path, json={} if method == "POST" else None).status_code
            assert (status != 401) == r.open, (method, path, status)


def test_each_paths_errors_speak_its_apis_dialect() -> None:
    for r in ROUTES:
        assert dialect(r.path) is DIALECTS[r.api], r.path


def test_the_router_reads_its_path_lists_from_the_table() -> None:
    assert set(router_request.GENERATION_PATHS) == {r.path for r in ROUTES if r.load == "generate"}
    assert set(router_request.PREFILL_PATHS) == {r.path for r in ROUTES if r.load == "prefill"}
    # Every API route is forwarded: under /v1/ or /api/ (the router's catch-alls), or named.
    for r in ROUTES:
        if r.api != "kvserve":
            assert r.path.startswith(("/v1/", "/api/")) or r.path in router_app.PROXIED_PATHS, r.path


def test_every_chat_route_gives_the_router_its_own_reading() -> None:
    chats = {r.path for r in ROUTES if r.load == "generate" and r.path != "/v1/completions"}
    assert chats == {r.path for r in ROUTES if r.chat is not None}


def test_each_apis_route_modules_are_short() -> None:
    # A route class's handle() is Serving's: the module is the class's.
    modules = {inspect.getmodule(getattr(r.endpoint, "__self__", r.endpoint)) for r in ROUTES if r.api != "kvserve"}
    long = {}
    for m in modules:
        lines = len(Path(inspect.getfile(m)).read_text().splitlines())
        if lines > ROUTE_MODULE_LINES:
            long[m.__name__] = lines
    assert not long, f"route modules over {ROUTE_MODULE_LINES} lines: {long}"
