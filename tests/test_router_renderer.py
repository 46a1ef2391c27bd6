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
# It renders the tools, the calls and the thinking switch, so a router that dropped any would miss.
TEMPLATE = ("{%- if tools -%}[TOOLS] {{ tools | tojson }}\n{% endif -%}"
            "{%- if enable_thinking is defined and not enable_thinking -%}[NO THINKING]\n{% endif -%}"
            "{%- for m in messages -%}[{{ m['role'] | upper }}] {{ m['content'] }}"
            "{%- if m.tool_calls %} {{ m.tool_calls | tojson }}{% endif %}\n{% endfor -%}"
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


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Today's weather in a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


def responses_turns(*extra: dict) -> dict:
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"sky": "clear", "celsius": 21}'},
             *extra]
    return {"model": MODEL_NAME, "instructions": SYSTEM, "input": items, "max_output_tokens": 2, "temperature": 0,
            "store": False, "tools": [{"type": "function", **{k: v for k, v in TOOLS[0]["function"].items()}}]}


def anthropic_turns(*extra: dict) -> dict:
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": '{"sky": "clear", "celsius": 21}'}]},
                *extra]
    return {"model": MODEL_NAME, "system": SYSTEM, "messages": messages, "tools": ANTHROPIC_TOOLS, "max_tokens": 2,
            "temperature": 0}


def ollama_turns(*extra: dict) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_name": "get_weather", "content": '{"sky": "clear", "celsius": 21}'},
                *extra]
    return {"model": MODEL_NAME, "messages": messages, "tools": TOOLS, "stream": False, "think": False,
            "options": {"num_predict": 2, "temperature": 0}}


# Each API: its path, a conversation with extra turns, a follow-up's turns, and from its answer
# (prompt tokens, tokens read from the prefix cache: None where the API does not say).
FAMILIES = {
    "responses": ("/v1/responses", responses_turns,
                  lambda q: [{"role": "assistant", "content": "Clear, 21 degrees."}, {"role": "user", "content": q}],
                  lambda a: (a["usage"]["input_tokens"], a["usage"]["input_tokens_details"]["cached_tokens"])),
    "anthropic": ("/v1/messages", anthropic_turns,
                  lambda q: [{"role": "assistant", "content": "Clear, 21 degrees."}, {"role": "user", "content": q}],
                  lambda a: (a["usage"]["input_tokens"] + a["usage"]["cache_read_input_tokens"],
                             a["usage"]["cache_read_input_tokens"])),
    "ollama": ("/api/chat", ollama_turns,
               lambda q: [{"role": "assistant", "content": "Clear, 21 degrees."}, {"role": "user", "content": q}],
               lambda a: (a["prompt_eval_count"], None)),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_calling_conversation_over_each_api_is_rendered_as_its_replica_renders_it_and_hits_on_follow_ups(
        replicas, family):
    path, body_of, turn, counts = FAMILIES[family]
    router = RouterThread([s.url for s in replicas], "cache_aware", cache_source="precise")
    try:
        router.wait_for(lambda: all(a.get("kv_events") == "followed" for a in router.admin().values()))
        with router.client() as c:
            first = c.post(path, json=body_of())
            assert first.status_code == 200, first.text
            home = first.headers["x-kvserve-replica"]
            turns: list[dict] = []
            for question in ["And in Rome?", "Should I take an umbrella?"]:
                turns += turn(question)
                body = body_of(*turns)
                req = parse_request(path, json.dumps(body).encode())
                asyncio.run(router.state.index.prepare(req))
                (ids,) = set(map(tuple, req.token_ids.values()))
                _synced(router, home)
                r = c.post(path, json=body)
                assert r.status_code == 200, r.text
                prompt_tokens, cached = counts(r.json())
                assert len(ids) == prompt_tokens  # token for token: the tools and calls rendered as the replica does
                assert (r.headers["x-kvserve-replica"], r.headers["x-kvserve-route"]) == (home, "prefix_hit")
                match = int(r.headers["x-kvserve-prefix-match"])
                assert match > 64 and (cached is None or match == cached), (match, cached)
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
