"""The precise cache-aware source renders a request exactly as its replica does: tools, tool calls
and tool results, the replica's own --chat-template, through the server's own ChatPrompt and block
hasher. Two real replicas served with a custom template; a router in front. A replica whose
rendering the router cannot reproduce is routed by text, and says so."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvserve.router.request import parse_request
from router_harness import AppThread, RouterThread
from server_harness import MODEL_NAME, start_server, tiny_model_dir

pytestmark = pytest.mark.slow  # two server processes for the module

# Not the model's template: a router rendering with the model file's own would hash other tokens.
TEMPLATE = ("{%- for m in messages -%}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor -%}"
            "{%- if add_generation_prompt -%}[ASSISTANT] {% endif -%}")
SYSTEM = " ".join(f"Rule {i}: call the weather tool before you answer about the weather." for i in range(10))
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Today's weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def conversation(*extra: dict) -> dict:
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear", "celsius": 21}'},
        *extra,
    ]
    return {"model": MODEL_NAME, "messages": messages, "tools": TOOLS, "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "template.jinja"
    path.write_text(TEMPLATE)
    servers = [start_server(tmp_path_factory, "--chat-template", str(path)) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _synced(router: RouterThread, url: str) -> None:
    replica = next(r for r in router.state.replicas if r.url == url)

    def caught_up() -> bool:
        b = router.state.index.blocks.get(replica)
        seq = httpx.get(url + "/kv/events", params={"since": 10**9}, headers={"Authorization": "Bearer test-key"}).json()["seq"]
        return b is not None and b.seq == seq and not any(p[0] > 0 or p[1] > time.monotonic() for p in b.pending.values())

    router.wait_for(caught_up)


def test_a_tool_calling_conversation_under_a_custom_template_is_routed_to_the_replica_holding_it(replicas):
    router = RouterThread([s.url for s in replicas], "cache_aware", cache_source="precise")
    try:
        router.wait_for(lambda: all(a.get("kv_events") == "followed" for a in router.admin().values()))
        with router.client() as c:
            first = c.post("/v1/chat/completions", json=conversation())
            assert first.status_code == 200, first.text
            home = first.headers["x-kvserve-replica"]
            turns = [{"role": "assistant", "content": "It is clear and 21 degrees in Paris."}]
            for question in ["And in Rome?", "Should I take an umbrella?"]:
                _synced(router, home)
                r = c.post("/v1/chat/completions", json=conversation(*turns, {"role": "user", "content": question}))
                cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (r.headers["x-kvserve-replica"], r.headers["x-kvserve-route"]) == (home, "prefix_hit")
                # What the router expected the replica to hold is what the replica found.
                assert int(r.headers["x-kvserve-prefix-match"]) == cached > 32
                turns += [{"role": "user", "content": question}, {"role": "assistant", "content": "Yes."}]
    finally:
        router.stop()


def test_the_router_renders_a_tool_conversation_to_the_replicas_own_prompt_ids(replicas):
    """Token for token: the router's ids for a request are the ones the replica counts."""
    router = RouterThread([replicas[0].url], "cache_aware", cache_source="precise")
    try:
        router.wait_for(lambda: all(a.get("kv_events") == "followed" for a in router.admin().values()))
        body = conversation({"role": "user", "content": "Thanks!"})
        req = parse_request("/v1/chat/completions", json.dumps(body).encode())
        asyncio.run(router.state.index.prepare(req))
        (ids,) = req.token_ids.values()
        with replicas[0].client() as c:
            usage = c.post("/v1/chat/completions", json=body).json()["usage"]
        assert len(ids) == usage["prompt_tokens"]
    finally:
        router.stop()


def test_a_replica_whose_rendering_cannot_be_reproduced_is_routed_by_text(tmp_path_factory):
    """Its fingerprint names a renderer the router cannot rebuild from the model file and the
    template it offers: the router says so and does not hash prompts for it."""
    model = str(tiny_model_dir(tmp_path_factory))

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ready"})

    async def events(request: Request) -> JSONResponse:
        return JSONResponse({"model": model, "block_size": 16, "caching": True, "instance": "i1", "seq": 0,
                             "renderer": "0" * 32, "held": []})

    async def renderer(request: Request) -> JSONResponse:
        return JSONResponse({"fingerprint": "0" * 32, "chat_template": TEMPLATE, "special_tokens_in_messages": False})

    app = AppThread(Starlette(routes=[Route("/health", health), Route("/kv/events", events),
                                      Route("/kv/renderer", renderer)]))
    router = RouterThread([app.url], "cache_aware", cache_source="precise", health_interval=60)
    try:
        router.wait_for(lambda: router.admin()[app.url].get("kv_events", "").startswith("routed by text"))
        assert router.admin()[app.url]["kv_events"] == "routed by text: its tokenizer differs from the model file's here"
        assert router.state.index.usable(router.state.replicas.eligible()[0]) is None
    finally:
        router.stop()
        app.stop()
