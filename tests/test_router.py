"""The router in front of two real kvserve servers: proxying, policies, the cache-aware source.

Both replicas are shared by the module (starting one costs seconds); each test runs its own
router in front of them. The replicas' KV cache is small (≈39 blocks of 16 tokens) so that a
few long prompts evict older ones.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest

from router_harness import ADMIN_KEY, RouterThread
from server_harness import MODEL_NAME, start_server

pytestmark = pytest.mark.slow  # two server processes for the module
KV_GIB = "0.0003"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    servers = [start_server(tmp_path_factory, "--kv-cache-gib", KV_GIB) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture
def router_factory(replicas):
    routers = []

    def make(policy: str = "round_robin", **kw) -> RouterThread:
        r = RouterThread([s.url for s in replicas], policy, **kw)
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.stop()


def completion(prompt: str, max_tokens: int = 4, **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw}


def test_round_robin_spreads_requests_evenly(replicas, router_factory):
    router = router_factory("round_robin")
    with router.client() as c:
        seen = Counter(c.post("/v1/completions", json=completion(f"request {i}")).headers["x-kvserve-replica"]
                       for i in range(10))
    assert seen == {replicas[0].url: 5, replicas[1].url: 5}
    admin = router.admin()
    assert [admin[s.url]["requests"] for s in replicas] == [5, 5]
    assert all(a["in_flight"] == 0 and a["outstanding_tokens"] == 0 for a in admin.values())
    metrics = httpx.get(router.url + "/metrics").text
    assert f'kvserve_router_requests_total{{replica="{replicas[0].url}"}} 5.0' in metrics


def test_answers_and_streams_pass_through_as_the_replica_sent_them(replicas, router_factory):
    router = router_factory("round_robin")
    body = completion("The router passes this through", max_tokens=12, ignore_eos=True)
    with router.client() as c, replicas[0].client() as direct:
        via = c.post("/v1/completions", json=body).json()
        alone = direct.post("/v1/completions", json=body).json()
        assert via["choices"] == alone["choices"] and via["usage"]["completion_tokens"] == 12
        events = []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == alone["choices"][0]["text"]
        models = c.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL_NAME


@pytest.mark.parametrize("body", [
    b'{"model": "tiny", "prompt": "hi", "max_tokens": "many"}',
    b'{"model": "tiny", "prompt": "hi", "temprature": 0}',
    b'{"model": "tiny", "prompt": ',
    b'{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}',
])
def test_a_replicas_4xx_passes_through_unchanged(replicas, router_factory, body):
    router = router_factory("cache_aware")
    headers = {"Content-Type": "application/json"}
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    with router.client() as c, replicas[0].client() as direct:
        via, alone = c.post(path, content=body, headers=headers), direct.post(path, content=body, headers=headers)
    assert via.status_code == alone.status_code == 400
    assert via.content == alone.content
    assert via.json()["error"]["type"] == "invalid_request_error"


def test_the_routers_own_errors_are_openai_error_bodies(replicas, router_factory):
    router = router_factory("round_robin", max_body_bytes=2000, max_headers=20)
    with router.client() as c:
        r = c.post("/nowhere", json={})
        assert r.status_code == 404
        assert r.json() == {"error": {"message": "there is no such route: see GET /v1/models and the docs for the API",
                                      "type": "invalid_request_error", "param": None, "code": None}}
        r = c.post("/v1/completions", json=completion("x" * 3000))
        assert r.status_code == 413
        assert r.json()["error"] == {"message": "the request body is larger than the router's limit of 2000 bytes",
                                     "type": "invalid_request_error", "param": None, "code": "request_too_large"}
        r = c.post("/v1/completions", json=completion("hi"), headers={f"x-extra-{i}": "1" for i in range(30)})
        assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    # The admin API wants the admin key, not a client's.
    r = httpx.get(router.url + "/admin/replicas", headers={"Authorization": "Bearer not-it"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("policy", ["least_load", "power_of_two"])
def test_load_aware_policies_avoid_a_replica_busy_with_a_long_request(replicas, router_factory, policy):
    router = router_factory(policy)
    with router.client() as c, httpx.Client(base_url=router.url, headers=c.headers, timeout=60) as slow:
        # A long stream the client does not read yet: the router counts it in flight until it ends.
        with slow.stream("POST", "/v1/completions", json=completion("a long one", 500, ignore_eos=True, stream=True)) as r:
            busy = r.headers["x-kvserve-replica"]
            assert router.admin()[busy]["in_flight"] == 1
            others = {c.post("/v1/completions", json=completion(f"short {i}")).headers["x-kvserve-replica"]
                      for i in range(6)}
            assert others == {s.url for s in replicas} - {busy}
            r.read()
    router.wait_for(lambda: all(a["in_flight"] == 0 for a in router.admin().values()))


def chat(system: str, question: str, max_tokens: int = 3) -> dict:
    return {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


SYSTEM = " ".join(f"Rule {i}: answer in the manner of a careful librarian." for i in range(12))


def _synced(router: RouterThread, replica_url: str) -> None:
    """Wait until the router has read the replica's latest events and no prompt is pending."""
    state = router.state
    replica = next(r for r in state.replicas if r.url == replica_url)

    def caught_up() -> bool:
        b = state.index.blocks.get(replica)
        seq = httpx.get(replica_url + "/kv/events", params={"since": 10**9},
                        headers={"Authorization": "Bearer test-key"}).json()["seq"]
        return b is not None and b.seq == seq and not any(p[0] > 0 or p[1] > time.monotonic() for p in b.pending.values())

    router.wait_for(caught_up)


def test_cache_aware_precise_routes_to_the_replica_holding_the_prefix(replicas, router_factory):
    router = router_factory("cache_aware", cache_source="precise")
    router.wait_for(lambda: all(a.get("kv_events") == "followed" for a in router.admin().values()))
    with router.client() as c:
        first = c.post("/v1/chat/completions", json=chat(SYSTEM, "Where are the atlases?"))
        home = first.headers["x-kvserve-replica"]
        assert first.json()["usage"]["prompt_tokens"] > 100
        for q in ["Is the map room open?", "Who wrote this book?", "May I borrow two?"]:
            _synced(router, home)
            r = c.post("/v1/chat/completions", json=chat(SYSTEM, q))
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert r.headers["x-kvserve-replica"] == home and r.headers["x-kvserve-route"] == "prefix_hit"
            # What the router expected the replica to hold is what the replica found.
            assert int(r.headers["x-kvserve-prefix-match"]) == cached >= 96
        # Long prompts sent straight to that replica evict the shared prefix; the router follows.
        home_server = next(s for s in replicas if s.url == home)
        with home_server.client() as direct:
            for i in range(5):
                filler = " ".join(f"item{i}-{j}" for j in range(90))
                assert direct.post("/v1/completions", json=completion(filler, 1)).status_code == 200
        _synced(router, home)
        r = c.post("/v1/chat/completions", json=chat(SYSTEM, "And now?"))
        assert r.headers["x-kvserve-route"] == "no_match" and r.headers["x-kvserve-prefix-match"] == "0"
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hits = httpx.get(router.url + "/metrics").text
    assert 'kvserve_router_decisions_total{outcome="prefix_hit",policy="cache_aware"} 3.0' in hits


def test_a_precise_router_answers_only_once_it_can_read_every_replicas_blocks(replicas, router_factory):
    """Its start waits for each replica's first /kv/events read and tokenizer: a burst sent at once
    is matched on the replicas' blocks (and on the blocks of its own requests, pending), not
    dealt out blind, which scattered each new prefix over the replicas."""
    router = router_factory("cache_aware", cache_source="precise")
    fresh = " ".join(f"Point {i}: speak as a patient museum guide would." for i in range(12))  # held nowhere
    state = router.state  # started: uvicorn has run the router's start
    assert all(state.index.usable(r) is not None for r in state.replicas)
    notes = [a.get("kv_events") for a in router.admin().values()]
    assert all(n.startswith("followed") for n in notes), notes  # (or "… over ZMQ")
    with router.client() as c:
        routes = [c.post("/v1/chat/completions", json=chat(fresh, f"Q{i}?")) for i in range(2)]
    assert routes[0].headers["x-kvserve-replica"] == routes[1].headers["x-kvserve-replica"]
    assert [r.headers["x-kvserve-route"] for r in routes] == ["no_match", "prefix_hit"]


def test_cache_aware_approximate_keeps_a_shared_prefix_on_one_replica(replicas, router_factory):
    router = router_factory("cache_aware", cache_source="approximate")
    other_system = " ".join(f"Clause {i}: reply as a terse ship's captain would." for i in range(12))
    with router.client() as c:
        homes = [c.post("/v1/chat/completions", json=chat(SYSTEM, f"Question {i}?")) for i in range(4)]
        assert len({r.headers["x-kvserve-replica"] for r in homes}) == 1
        assert [r.headers["x-kvserve-route"] for r in homes][1:] == ["prefix_hit"] * 3
        away = [c.post("/v1/chat/completions", json=chat(other_system, f"Order {i}!")) for i in range(3)]
        assert len({r.headers["x-kvserve-replica"] for r in away}) == 1


def test_cache_aware_falls_back_to_load_when_loads_are_imbalanced(replicas, router_factory):
    router = router_factory("cache_aware", cache_source="approximate", balance_abs_tokens=100, balance_rel=1.5)
    with router.client() as c, httpx.Client(base_url=router.url, headers=c.headers, timeout=60) as slow:
        home = c.post("/v1/chat/completions", json=chat(SYSTEM, "first")).headers["x-kvserve-replica"]
        # The router counts an answer's load until its relay ends, a moment after the client has it all.
        router.wait_for(lambda: all(a["in_flight"] == 0 for a in router.admin().values()))
        # Make the prefix's home busy: a long stream of the same prefix stays in flight there.
        with slow.stream("POST", "/v1/chat/completions", json={**chat(SYSTEM, "long", 400), "stream": True}) as r:
            assert r.headers["x-kvserve-replica"] == home
            elsewhere = c.post("/v1/chat/completions", json=chat(SYSTEM, "third"))
            assert elsewhere.headers["x-kvserve-route"] == "load_fallback"
            assert elsewhere.headers["x-kvserve-replica"] != home
            r.read()


def test_admin_api_adds_and_removes_replicas(replicas, router_factory):
    router = router_factory("round_robin")
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=router.url, headers=auth) as admin:
        extra = "http://127.0.0.1:9"  # nothing listens there
        r = admin.post("/admin/replicas", json={"url": extra})
        assert r.status_code == 200 and r.json()["added"] is True and r.json()["state"] == "starting"
        assert admin.post("/admin/replicas", json={"url": extra}).json()["added"] is False
        assert admin.post("/admin/replicas", json={"url": "ftp://x"}).status_code == 400
        assert extra in router.admin()
        with router.client() as c:  # never sent to a replica that has not passed a check
            assert Counter(c.post("/v1/completions", json=completion(f"q{i}")).status_code for i in range(4)) == {200: 4}
        assert admin.request("DELETE", "/admin/replicas", json={"url": extra}).json()["removed"] is True
        assert admin.request("DELETE", "/admin/replicas", json={"url": extra}).status_code == 404
        assert extra not in router.admin()


def test_anthropic_and_ollama_requests_are_proxied_and_cache_routed(replicas, router_factory):
    """One request of each foreign API through the router, streamed and not: answered as the
    replica answers, routed by the prefix the replica holds (the router renders them with the
    server's own code), and the router's own errors in each API's shape."""
    import anthropic
    import ollama

    router = router_factory("cache_aware", cache_source="precise", max_body_bytes=4000)
    router.wait_for(lambda: all(a.get("kv_events") == "followed" for a in router.admin().values()))
    claude = anthropic.Anthropic(base_url=router.url, api_key="test-key", max_retries=0)
    ask = [{"role": "user", "content": "Where are the atlases?"}]
    first = claude.messages.with_raw_response.create(model=MODEL_NAME, max_tokens=3, system=SYSTEM, messages=ask,
                                                     extra_body={"temperature": 0})
    home = first.headers["x-kvserve-replica"]
    _synced(router, home)
    with claude.messages.stream(model=MODEL_NAME, max_tokens=3, system=SYSTEM, messages=ask,
                                extra_body={"temperature": 0}) as stream:
        again = stream.get_final_message()
        assert stream.response.headers["x-kvserve-replica"] == home
        assert stream.response.headers["x-kvserve-route"] == "prefix_hit"
        assert int(stream.response.headers["x-kvserve-prefix-match"]) == again.usage.cache_read_input_tokens >= 96
    assert again.usage.output_tokens == 3 and again.stop_reason == "max_tokens"
    assert [b.text for b in again.content] == [b.text for b in first.parse().content]

    llama = ollama.Client(host=router.url, headers={"Authorization": "Bearer test-key"})
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Is the map room open?"}]
    parts = list(llama.chat(model=MODEL_NAME, messages=messages, options={"temperature": 0, "num_predict": 3}, stream=True))
    assert parts[-1].done and parts[-1].eval_count == 3
    whole = llama.chat(model=MODEL_NAME, messages=messages, options={"temperature": 0, "num_predict": 3})
    assert whole.message.content == "".join(p.message.content for p in parts)
    assert [m.model for m in llama.list().models] == [f"{MODEL_NAME}:latest"]

    with router.client() as c:
        big = "x" * 5000
        r = c.post("/v1/messages", json={"model": MODEL_NAME, "max_tokens": 2, "system": big, "messages": ask})
        assert r.status_code == 413 and r.json()["type"] == "error"
        assert r.json()["error"] == {"type": "invalid_request_error",
                                     "message": "the request body is larger than the router's limit of 4000 bytes"}
        r = c.post("/api/chat", json={"model": MODEL_NAME, "messages": [{"role": "user", "content": big}]})
        assert r.status_code == 413 and r.json() == {"error": "the request body is larger than the router's limit of "
                                                              "4000 bytes"}


def test_stored_responses_are_reached_on_the_replica_that_made_them(replicas, router_factory):
    """previous_response_id, GET and DELETE of a stored response go where it is stored: by the map
    the router keeps from replicas' answers, and, for a router that does not know it, by asking."""
    from openai import OpenAI

    router = router_factory("round_robin")
    client = OpenAI(base_url=router.url + "/v1", api_key="test-key", max_retries=0)
    ask = dict(model=MODEL_NAME, max_output_tokens=3, temperature=0)
    first = client.responses.with_raw_response.create(input="Name a colour.", **ask)
    home, prev = first.headers["x-kvserve-replica"], first.parse().id
    assert first.headers["x-kvserve-request-id"] == prev
    for i in range(3):  # round robin alone would alternate replicas: each turn follows its conversation
        turn = client.responses.with_raw_response.create(input=f"And another, {i}?", previous_response_id=prev, **ask)
        assert (turn.headers["x-kvserve-replica"], turn.headers["x-kvserve-route"]) == (home, "response_home")
        prev = turn.parse().id
    with client.responses.with_streaming_response.create(input="One more?", previous_response_id=prev, stream=True,
                                                         **ask) as streamed:
        assert streamed.headers["x-kvserve-replica"] == home
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.incomplete"  # max_output_tokens reached
    prev = events[-1]["response"]["id"]

    fresh = router_factory("round_robin")  # a router started since: it finds the response by asking
    with fresh.client() as c:
        for _ in range(2):  # whichever replica round robin offers first
            got = c.get(f"/v1/responses/{prev}")
            assert got.status_code == 200 and got.json()["id"] == prev and got.headers["x-kvserve-replica"] == home
        turn = c.post("/v1/responses", json={"input": "Last one?", "previous_response_id": prev, **ask})
        assert turn.status_code == 200 and turn.headers["x-kvserve-replica"] == home
        assert c.delete(f"/v1/responses/{prev}").json() == {"id": prev, "object": "response.deleted", "deleted": True}
        missing = c.get(f"/v1/responses/{prev}")  # asked of both replicas: the last one's own answer
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
        refused = c.post("/v1/responses", json={"input": "Hello?", "previous_response_id": "resp_nowhere", **ask})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "previous_response_not_found"
