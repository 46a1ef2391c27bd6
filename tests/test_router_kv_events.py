"""The router believes a replica's /kv/events only within bounds: bytes per answer, hashes held,
the shape of every field. A replica that breaks them is taken out with a log line, and the
router keeps answering meanwhile. Stand-in replicas on loopback (uvicorn) answer as each test
scripts; the checks of one answer are also run on their own (kv_page.parse_page)."""
from __future__ import annotations

import json
import logging
import os
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvserve.router.kv_page import BrokenRule, apply_events, parse_page
from router_harness import AppThread, RouterThread

HASHES = [os.urandom(32).hex() for _ in range(8)]


def page(**fields) -> dict:
    return {"model": "/nowhere/model.gguf", "block_size": 16, "caching": True, "instance": "i1", "seq": 3, **fields}


class EventsReplica:
    """/health always ready; /kv/events answers `self.answer(since)` (a Response)."""

    def __init__(self) -> None:
        self.answer = lambda since: JSONResponse(page(held=HASHES[:3]))
        self.polls = 0

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ready"})

        async def events(request: Request) -> Response:
            self.polls += 1
            return self.answer(int(request.query_params.get("since", 0)))

        app = Starlette(routes=[Route("/health", health), Route("/kv/events", events)])
        self.http = AppThread(app)
        self.port, self.url = self.http.port, self.http.url

    def stop(self) -> None:
        self.http.stop()


@pytest.fixture
def replica():
    r = EventsReplica()
    yield r
    r.stop()


def follow(replica: EventsReplica, **settings) -> RouterThread:
    # Health checks 60 s apart: only the events can take the replica out during a test.
    return RouterThread([replica.url], "cache_aware", cache_source="precise", health_interval=60, **settings)


def test_a_well_behaved_replicas_snapshot_then_events_are_followed(replica):
    def answer(since: int) -> Response:
        if since == 0:
            return JSONResponse(page(held=HASHES[:3]))
        return JSONResponse(page(seq=5, events=[[4, "+", HASHES[3]], [5, "-", HASHES[0]]]))

    replica.answer = answer
    router = follow(replica)
    try:
        router.wait_for(lambda: replica.polls >= 3)
        info = router.admin()[replica.url]
        assert (info["state"], info["blocks_held"]) == ("healthy", 3)
        held = router.state.index.blocks[router.state.replicas.eligible()[0]].held
        assert held == {bytes.fromhex(h) for h in HASHES[1:4]}
    finally:
        router.stop()


def test_a_replica_claiming_more_blocks_than_the_cap_is_taken_out_with_a_log_line(replica, caplog):
    replica.answer = lambda since: JSONResponse(page(held=HASHES[:6]))
    with caplog.at_level(logging.WARNING, logger="kvserve.router"):
        router = follow(replica, kv_max_held=5)
        try:
            router.wait_for(lambda: router.admin()[replica.url]["state"] == "unhealthy")
            info = router.admin()[replica.url]
            assert info["kv_events"] == "broke the rules: \"held\" has more than the router's limit of 5 entries"
            assert info["blocks_held"] == 0 and not router.state.index.blocks
        finally:
            router.stop()
    assert f"{replica.url}: its /kv/events broke the rules (\"held\" has more than the router's limit of 5 " \
           "entries): taken out" in caplog.text


def test_events_that_take_a_replica_past_the_cap_take_it_out(replica):
    def answer(since: int) -> Response:
        if since == 0:
            return JSONResponse(page(held=HASHES[:3]))
        return JSONResponse(page(seq=6, events=[[4, "+", HASHES[3]], [5, "+", HASHES[4]], [6, "+", HASHES[5]]]))

    replica.answer = answer
    router = follow(replica, kv_max_held=5)
    try:
        router.wait_for(lambda: router.admin()[replica.url]["state"] == "unhealthy")
        assert router.admin()[replica.url]["kv_events"] == \
            "broke the rules: it says it holds 6 blocks, more than the router's limit of 5"
    finally:
        router.stop()


def test_two_million_held_hashes_are_cut_at_the_byte_limit_while_the_router_keeps_answering(replica):
    """The issue's replica: 2 M hashes (~134 MB). The router reads at most kv_max_bytes (default
    24 MiB) of it, streamed, and its own /health answers throughout."""
    head = json.dumps(page(held=[]))[:-2].encode()  # ... "held": [
    item = b'"' + b"ab" * 32 + b'", '
    sent = [0]

    def body():
        yield head
        for _ in range(2_000_000 // 1000):
            sent[0] += 1000
            yield item * 1000
        yield b'"' + b"cd" * 32 + b'"]}'

    replica.answer = lambda since: StreamingResponse(body(), media_type="application/json")
    router = follow(replica)
    try:
        worst = 0.0
        deadline = time.monotonic() + 60
        while router.admin()[replica.url]["state"] != "unhealthy":
            assert time.monotonic() < deadline, "the replica was not taken out"
            t0 = time.monotonic()
            health = httpx.get(router.url + "/health", timeout=10)
            assert health.json()["status"] in ("ready", "no_replica")  # 503 once the replica is out
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
        info = router.admin()[replica.url]
        assert info["kv_events"] == f"broke the rules: its answer is more than the router's limit of {24 << 20} bytes"
        assert sent[0] < 600_000  # the rest of the 2 M was never read (64 KiB socket buffers aside)
        assert worst < 1.0  # reading the body on the event loop stalled /health 2.8 s
        assert httpx.get(router.url + "/health", timeout=10).status_code == 503  # its only replica is out
    finally:
        router.stop()


def test_a_malformed_hash_takes_the_replica_out(replica):
    replica.answer = lambda since: JSONResponse(page(held=[HASHES[0], "not-a-hash"]))
    router = follow(replica)
    try:
        router.wait_for(lambda: router.admin()[replica.url]["state"] == "unhealthy")
        assert router.admin()[replica.url]["kv_events"] == \
            "broke the rules: an entry of \"held\" is not a block hash (64 lowercase hex digits): 'not-a-hash'"
    finally:
        router.stop()


@pytest.mark.parametrize("body, message", [
    (b"\xff{}", "its answer is not UTF-8 (invalid start byte at byte 0)"),
    (b"[]", "expected '{' at character 0, found '[]'"),
    (json.dumps(page(held=[])).encode() + b" x", "text after the answer's end at character 107"),
    (json.dumps(page()).encode(), 'exactly one of "held" and "events" must be there'),
    (json.dumps(page(held=[], events=[])).encode(), 'exactly one of "held" and "events" must be there'),
    (json.dumps({**page(held=[]), "seq": "3"}).encode(), '"seq" is str, not int'),
    (json.dumps({**page(held=[]), "block_size": 0}).encode(), "block_size 0 or seq 3 out of range"),
    (json.dumps(page(events=[[1, "*", HASHES[0]]])).encode(),
     f"an entry of \"events\" is not [seq, \"+\" or \"-\", hash]: \"[1, '*', '{HASHES[0]}']\""),
    (json.dumps(page(model="m" * 5000, held=[])).encode(),
     '"model" at character 10 is not JSON of at most 4096 characters (Unterminated string starting at)'),
    (json.dumps(page(held=[HASHES[0].upper()])).encode(),
     f"an entry of \"held\" is not a block hash (64 lowercase hex digits): '{HASHES[0].upper()}'"),
])
def test_each_rule_of_an_answer(body, message):
    with pytest.raises(BrokenRule) as e:
        parse_page(body, 100)
    assert str(e.value) == message


def test_a_good_answer_parses_exactly_and_unknown_small_fields_are_skipped():
    p = parse_page(json.dumps({**page(events=[[4, "+", HASHES[1]], [5, "-", HASHES[0]]]), "new_field": [1]}).encode(),
                   100)
    assert p.fields == {"model": "/nowhere/model.gguf", "block_size": 16, "caching": True, "instance": "i1", "seq": 3}
    assert p.held is None and p.events == [(True, bytes.fromhex(HASHES[1])), (False, bytes.fromhex(HASHES[0]))]
    held = {bytes.fromhex(HASHES[0])}
    apply_events(held, p.events, 1)
    assert held == {bytes.fromhex(HASHES[1])}
    assert parse_page(b'{"caching": false}', 100).fields == {"caching": False}  # caching off: nothing else needed


def test_the_servers_own_answers_parse_as_it_renders_them():
    """kvserve/server/kv_events.py's own route on a FastAPI app, over a real event log (the
    server context around it holds only what the route reads)."""
    from types import SimpleNamespace

    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvserve.kv.events import REMOVED, STORED, BlockEventLog
    from kvserve.server.kv_events import kv_events

    log = BlockEventLog(capacity=4)
    from kvserve.server.vllm_metrics import CacheInfo

    tokenizer = SimpleNamespace(fingerprint=lambda special: f"renderer-{special}")
    client = SimpleNamespace(model_path="/m.gguf", tokenizer=tokenizer, kv_events=lambda: log,
                             cache_info=lambda: CacheInfo(16, 64, "float16", True))

    async def renderer_fingerprint() -> str:
        return tokenizer.fingerprint(False)

    ctx = SimpleNamespace(state=SimpleNamespace(require_ready=lambda: None), client=client, kv_publisher=None,
                          renderer_fingerprint=renderer_fingerprint)
    app = FastAPI()

    @app.get("/kv/events")  # as the route table mounts it
    async def events_route(request: Request) -> dict:
        return await kv_events(request, ctx)

    for h in HASHES[:3]:
        log.record(STORED, bytes.fromhex(h))
    log.record(REMOVED, bytes.fromhex(HASHES[0]))
    with TestClient(app) as c:
        events = parse_page(c.get("/kv/events", params={"since": 1}).content, 100)
        log.record(STORED, bytes.fromhex(HASHES[3]))  # the log keeps 4: a reader at 0 fell behind
        snapshot = parse_page(c.get("/kv/events", params={"since": 0}).content, 100)
    assert events.events == [(True, bytes.fromhex(HASHES[1])), (True, bytes.fromhex(HASHES[2])),
                             (False, bytes.fromhex(HASHES[0]))]
    assert snapshot.held == {bytes.fromhex(h) for h in HASHES[1:4]} and snapshot.fields["seq"] == 5
    assert snapshot.fields["renderer"] == "renderer-False"
