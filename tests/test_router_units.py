"""The router's parts on their own (no model): prefix tree, block hashes, event log, policies, and
retries / Retry-After / circuit breaker against small real HTTP servers on loopback."""
from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.events import BlockEventLog
from kvserve.kv.manager import KVCacheManager
from kvserve.router.kv_index import KVIndex, Renderer, ReplicaBlocks, block_hashes, prepare_hashes
from kvserve.router.policies import CacheAware, LeastLoad, RoundRobin
from kvserve.router.prefix_tree import PrefixTree
from kvserve.router.proxy import retry_after_seconds
from kvserve.router.replicas import HEALTHY, Replica
from kvserve.router.request import parse_request
from kvserve.router.settings import PolicySettings, RouterSettings
from kvserve.router.state import RetryBudget
from router_harness import AppThread, RouterThread
from server_harness import free_port


def test_router_hashes_prompt_blocks_exactly_as_the_kv_manager_looks_them_up():
    pool = BlockPool(16)
    manager = KVCacheManager(pool, block_size=4)
    ids = list(range(100, 119))  # 19 tokens: 4 full blocks, the last token never from cache
    assert manager.allocate("a", len(ids))
    manager.cache_computed("a", ids, len(ids))
    held = {h for _, kind, h in pool.events.since(0).events if kind == "+"}
    hashes = block_hashes(ids, 4)
    assert len(hashes) == 4 == len(manager.find_prefix(ids))
    blocks = ReplicaBlocks("m", 4, held=held)
    assert blocks.match(hashes) == 16
    assert blocks.match(block_hashes(ids[:9], 4)) == 8  # (9 - 1) // 4 blocks
    assert blocks.match(block_hashes([7] + ids[1:], 4)) == 0  # chained: a different first token changes all


def test_event_log_gives_events_then_a_snapshot_to_a_reader_that_fell_behind():
    log = BlockEventLog(capacity=3)
    for i in range(3):
        log.record("+", bytes([i]))
    page = log.since(1)
    assert [(s, k, h) for s, k, h in page.events] == [(2, "+", b"\x01"), (3, "+", b"\x02")] and page.held is None
    log.record("-", b"\x00")
    log.record("+", b"\x03")
    behind = log.since(1)  # events 2..5 wanted, 3..5 kept
    assert behind.events is None and sorted(behind.held) == [b"\x01", b"\x02", b"\x03"] and behind.seq == 5
    assert log.since(5).events == [] and log.since(99).held is not None  # a restarted server starts over


def test_block_pool_eviction_is_published():
    pool = BlockPool(2)
    manager = KVCacheManager(pool, block_size=2)
    manager.allocate("a", 4)
    manager.cache_computed("a", [1, 2, 3, 4], 4)
    manager.free("a")
    manager.allocate("b", 4)  # takes both cached blocks: both evicted
    kinds = [k for _, k, _ in pool.events.since(0).events]
    assert kinds == ["+", "+", "-", "-"] and len(pool.events) == 0
    pool.check_invariant()


def test_prefix_tree_matches_whole_chunks_and_forgets_least_recent_first():
    tree = PrefixTree(chunk_chars=4, max_chunks=4)
    tree.insert("abcdefgh")
    assert tree.match("abcdefghij") == 8 and tree.match("abcdXXXX") == 4 and tree.match("Xbcd") == 0
    tree.insert("zzzzyyyy")  # 4 chunks kept: all of both
    tree.insert("qqqq")  # drops the least recently used: "efgh" (the match above refreshed "abcd")
    assert len(tree) == 4 and tree.match("abcdefgh") == 4 and tree.match("zzzzyyyy") == 8


def test_parse_request_reads_prompt_messages_and_token_budget():
    r = parse_request("/v1/chat/completions", b'{"messages": [{"role": "developer", "content": [{"type": "text", '
                                              b'"text": "be brief"}]}], "max_completion_tokens": 7, "n": 2}')
    assert r.messages == [{"role": "system", "content": "be brief"}] and r.max_tokens == 7 and r.n == 2
    assert parse_request("/v1/completions", b'{"prompt": [1, 2, 3]}').prompt == [1, 2, 3]
    assert not parse_request("/v1/completions", b'{"prompt": ').routable


def test_retry_after_accepts_seconds_and_http_dates():
    assert retry_after_seconds("3") == 3.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    in_a_minute = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 60))
    assert 55 < retry_after_seconds(in_a_minute) <= 60


def _replicas(*loads: int) -> list[Replica]:
    out = []
    for i, load in enumerate(loads):
        r = Replica(f"http://r{i}", state=HEALTHY)
        r.outstanding_tokens = load
        out.append(r)
    return out


def test_round_robin_and_least_load_choices():
    rs = _replicas(0, 0, 0)
    req = parse_request("/v1/completions", b'{"prompt": "x"}')
    assert [RoundRobin().choose(rs, req).replica for _ in range(1)] == [rs[0]]
    rr = RoundRobin()
    assert [rr.choose(rs, req).replica.url for _ in range(6)] == ["http://r0", "http://r1", "http://r2"] * 2
    busy = _replicas(900, 10, 500)
    assert LeastLoad().choose(busy, req).replica is busy[1]


def test_cache_aware_prefers_the_prefix_until_loads_are_imbalanced_beyond_both_thresholds():
    policy = CacheAware(PolicySettings(cache_source="approximate", balance_abs_tokens=1000, balance_rel=2.0,
                                       min_match_tokens=8), None)
    text = "You are a helpful assistant. " * 20
    req = parse_request("/v1/completions", ('{"prompt": "%s"}' % text).encode())
    a, b = _replicas(0, 0)
    policy.tree(a).insert(text)
    assert policy.choose([a, b], req).outcome == "prefix_hit" and policy.choose([a, b], req).replica is a
    a.outstanding_work, b.outstanding_work = 1900, 950  # 950 apart: under the absolute threshold
    assert policy.choose([a, b], req).replica is a
    a.outstanding_work, b.outstanding_work = 5000, 3000  # far apart but under 2x
    assert policy.choose([a, b], req).replica is a
    a.outstanding_work, b.outstanding_work = 5000, 2000  # beyond both
    d = policy.choose([a, b], req)
    assert (d.replica, d.outcome) == (b, "load_fallback")
    a.outstanding_work, b.outstanding_work = 1000, 0  # many prompt tokens, all cached: little work
    a.outstanding_tokens, b.outstanding_tokens = 50_000, 0
    assert policy.choose([a, b], req).replica is a
    fresh = parse_request("/v1/completions", b'{"prompt": "Something else entirely, never sent before"}')
    a.outstanding_work = b.outstanding_work = 0
    assert policy.choose([a, b], fresh).outcome == "no_match"



def test_cache_aware_deals_new_prefixes_by_footprint_not_momentary_load():
    """A prompt nobody holds goes to the replica this router has sent the least prompt text, not
    the momentarily idlest: 4 prompts sent in turn end up 2 and 2 however the loads move — with
    either source, and whatever the replicas' pools held before (a full pool says nothing)."""
    prompts = [f"System prompt {i}: " + f"house rule {i} " * 40 for i in range(4)]
    index = KVIndex(None, 0.1, None)  # type: ignore[arg-type]
    index._renderers["r"] = object()  # type: ignore[assignment]
    for source in ("approximate", "precise"):
        policy = CacheAware(PolicySettings(cache_source=source, min_match_tokens=8), index)
        a, b = _replicas(0, 0)
        index.blocks[a] = ReplicaBlocks("m", 16, renderer="r", held={i.to_bytes(4, "big") for i in range(300)})  # full
        index.blocks[b] = ReplicaBlocks("m", 16, renderer="r", held=set())
        placed = []
        for i, text in enumerate(prompts):
            req = parse_request("/v1/completions", ('{"prompt": "%s"}' % text).encode())
            a.outstanding_work, b.outstanding_work = (0, 500) if i % 2 else (0, 0)  # a always the idler
            d = policy.choose([a, b], req)
            assert d.outcome == "no_match"
            policy.routed(d, req)
            placed.append(d.replica.url)
        assert placed == ["http://r0", "http://r1", "http://r0", "http://r1"], source
        chunks = sum(len(t) // 64 for t in prompts[0::2])  # 64-character chunks of text, 4 characters a token
        assert len(policy.tree(a)) == chunks and policy.footprint(a) == policy.footprint(b) == chunks * 16
        policy.forget(a)  # a replica that left, or came back empty, gets the next new prefix
        a.outstanding_work, b.outstanding_work = 900, 0
        fresh = parse_request("/v1/completions", b'{"prompt": "Something never sent before, anywhere at all"}')
        assert policy.choose([a, b], fresh).replica is a


def _precise(prompts: dict[str, list[int]]) -> tuple[KVIndex, dict]:
    """An index whose one renderer takes token ids as they are, and a request per prompt, hashed."""
    index = KVIndex(None, 0.1, None)  # type: ignore[arg-type]
    index._renderers["r"] = Renderer(None)  # type: ignore[arg-type]  (token-id prompts need no tokenizer)
    reqs = {}
    for name, ids in prompts.items():
        reqs[name] = req = parse_request("/v1/completions", json.dumps({"prompt": ids}).encode())
        prepare_hashes(req, index._renderers, {("r", 16)})
    return index, reqs


def test_cache_aware_cost_counts_the_prompt_tokens_a_replica_would_compute():
    """The prefix's replica loses only when its cost — outstanding work plus the prompt tokens it
    lacks — exceeds the cheapest's beyond both thresholds; an idle replica without the prefix costs
    the whole prompt. (Balancing raw loads, a = 2500 against an idle b was "imbalanced": b got a
    1000-token prompt to compute while a would have answered after 2500 + 8.)"""
    index, reqs = _precise({"p": list(range(1000, 2000))})
    req = reqs["p"]
    policy = CacheAware(PolicySettings(cache_source="precise", balance_abs_tokens=2000, balance_rel=1.5), index)
    a, b = _replicas(0, 0)
    index.blocks[a] = ReplicaBlocks("m", 16, renderer="r", held=set(req.hashes[("r", 16)]))  # 62 blocks: 992 tokens
    index.blocks[b] = ReplicaBlocks("m", 16, renderer="r")
    for work_a, work_b, to, outcome, cost in [
            (0, 0, a, "prefix_hit", 8),  # b would compute all 1000
            (2500, 0, a, "prefix_hit", 2508),  # 2508 against 1000: 1508 apart, under 2000
            (3500, 0, b, "load_fallback", 1000),  # 3508 against 1000: beyond both
            (7200, 4000, a, "prefix_hit", 7208),  # 7208 against 5000: beyond 2000 but under 1.5x
            (9000, 3000, b, "load_fallback", 4000)]:  # 9008 against 4000: beyond both
        a.outstanding_work, b.outstanding_work = work_a, work_b
        d = policy.choose([a, b], req)
        assert (d.replica, d.outcome, d.matched_tokens if d.replica is a else 0, d.cost) == \
            (to, outcome, 992 if to is a else 0, cost), (work_a, work_b)
    # Held on both: the cheaper of the two, whichever comes first in the list.
    index.blocks[b].held = set(req.hashes[("r", 16)])
    a.outstanding_work, b.outstanding_work = 300, 200
    assert policy.choose([a, b], req).replica is b and policy.choose([b, a], req).replica is b


def test_cache_aware_keeps_a_bursts_new_prefixes_together_before_any_replica_publishes_them():
    """Requests of two new prompts arriving together, none answered yet: each prompt's first
    request is dealt out by footprint, the rest follow it (its blocks count as pending there)."""
    index, reqs = _precise({f"p{i}": [i] * 40 + list(range(500)) for i in range(2)})
    policy = CacheAware(PolicySettings(cache_source="precise"), index)
    a, b = _replicas(0, 0)
    index.blocks[a] = ReplicaBlocks("m", 16, renderer="r")
    index.blocks[b] = ReplicaBlocks("m", 16, renderer="r")
    placed = []
    for name in ["p0", "p1", "p0", "p0", "p1"]:
        d = policy.choose([a, b], reqs[name])
        a_load = a.start(540, 32, d.matched_tokens) if d.replica is a else None
        b_load = b.start(540, 32, d.matched_tokens) if d.replica is b else None
        assert (a_load or b_load) is not None
        policy.routed(d, reqs[name])
        placed.append((name, d.replica.url, d.outcome))
    assert placed == [("p0", "http://r0", "no_match"), ("p1", "http://r1", "no_match"),
                      ("p0", "http://r0", "prefix_hit"), ("p0", "http://r0", "prefix_hit"),
                      ("p1", "http://r1", "prefix_hit")]


def test_a_request_counts_its_uncached_prompt_as_work_until_its_first_output_and_its_output_until_released():
    r = Replica("http://r0", state=HEALTHY)
    hit = r.start(prompt_tokens=1000, max_tokens=32, matched=960)
    miss = r.start(prompt_tokens=1000, max_tokens=32, matched=0)
    assert (r.outstanding_tokens, r.outstanding_work) == (2064, 40 + 32 + 1000 + 32)
    hit.produced(30)  # its first output: its prompt is computed, only its output is still work
    assert (r.outstanding_tokens, r.outstanding_work) == (2034, 2 + 1032)
    miss.produced(1)
    assert (r.outstanding_tokens, r.outstanding_work) == (2033, 2 + 31)
    hit.release()
    miss.release()
    miss.release()  # once only
    assert (r.outstanding_tokens, r.outstanding_work, r.in_flight) == (0, 0, 0)


def test_retry_budget_allows_a_burst_then_a_share_of_requests():
    budget = RetryBudget(ratio=0.5, burst=2)
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]
    budget.on_request()
    budget.on_request()
    assert budget.try_spend() and not budget.try_spend()


# -- retries and the circuit breaker, against small real HTTP servers -------------------------------
class Upstream:
    """A stand-in replica on loopback whose answer the test sets (kvserve itself cannot be made
    to answer 429 or 503 on demand)."""

    def __init__(self) -> None:
        self.status, self.headers, self.calls, self.seen = 200, {}, 0, None

        async def health(request: Request) -> JSONResponse:
            return JSONResponse({"status": "ready"})

        async def completions(request: Request) -> JSONResponse:
            self.calls += 1
            self.seen = (request.scope["raw_path"], request.scope["query_string"], request.headers.get("x-note"),
                         await request.body())
            self.cookie = request.headers.get("cookie")
            return JSONResponse({"error": {"message": f"status {self.status}", "type": "x", "param": None,
                                           "code": None}} if self.status != 200 else {"ok": True},
                                status_code=self.status, headers=self.headers)

        app = Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])
        self.http = AppThread(app)
        self.port, self.url = self.http.port, self.http.url

    def stop(self) -> None:
        self.http.stop()


@pytest.fixture
def upstreams():
    ups = [Upstream(), Upstream()]
    yield ups
    for u in ups:
        u.stop()


def test_a_replicas_cookie_reaches_its_client_and_no_other_request(upstreams):
    up = upstreams[0]
    up.headers = {"Set-Cookie": "session=alice; Path=/"}
    # By host name: a default client cookie jar ignores cookies from bare IP addresses.
    router = RouterThread([up.url.replace("127.0.0.1", "localhost")], "round_robin")
    try:
        with httpx.Client(base_url=router.url) as alice, httpx.Client(base_url=router.url) as bob:
            assert alice.post("/v1/completions", json={"prompt": "x"}).headers["set-cookie"] == "session=alice; Path=/"
            bob.post("/v1/completions", json={"prompt": "x"})
            assert up.calls == 2 and up.cookie is None  # the router kept no cookie for the next client
    finally:
        router.stop()


def test_429_is_retried_elsewhere_and_its_retry_after_honoured(upstreams):
    busy, ok = upstreams
    busy.status, busy.headers = 429, {"Retry-After": "30"}
    router = RouterThread([busy.url, ok.url], "round_robin")
    try:
        with router.client() as c:
            results = [c.post("/v1/completions", json={"prompt": "x"}) for _ in range(4)]
        assert [r.status_code for r in results] == [200] * 4
        assert busy.calls == 1 and ok.calls == 4  # asked once, then left alone for its 30 s
        assert 25 < router.admin()[busy.url]["retry_after_s"] <= 30
        ok.status, ok.headers = 429, {"Retry-After": "2"}
        with router.client() as c:
            r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 429 and r.json()["error"]["message"] == "status 429"  # the replica's own answer
    finally:
        router.stop()


def test_a_refused_connection_takes_the_replica_out_at_once_and_spends_no_retry_budget(upstreams):
    ok = upstreams[0]
    dead = f"http://127.0.0.1:{free_port()}"
    # No retry budget and no retries at all: a request that never reached a replica needs neither.
    router = RouterThread([ok.url], "round_robin", health_interval=60, max_retries=0, retry_budget_ratio=0.0,
                          retry_budget_burst=0)
    try:
        # A replica that passed its checks, then vanished: nothing listens on its port.
        with httpx.Client() as admin_client:
            admin_client.post(router.url + "/admin/replicas", json={"url": dead},
                              headers={"Authorization": "Bearer admin-key"})
        replica = next(r for r in router.state.replicas if r.url == dead)
        replica.state = HEALTHY
        with router.client() as c:
            assert [c.post("/v1/completions", json={"prompt": "x"}).status_code for _ in range(6)] == [200] * 6
        info = router.admin()[dead]
        assert (info["state"], info["errors"], info["breaker"]) == ("unhealthy", 1, "closed")  # out at the first refusal
        assert ok.calls == 6 and router.state.budget.tokens == 0.0
        metrics = httpx.get(router.url + "/metrics").text
        assert f'kvserve_router_retries_total{{reason="refused",replica="{dead}"}} 1.0' in metrics
    finally:
        router.stop()


class Dropper:
    """A replica on loopback that accepts connections and closes each one after sending `answer`
    (by default nothing)."""

    def __init__(self, answer: bytes = b"") -> None:
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.recv(65536)
            conn.sendall(self.answer)
            conn.close()

    def stop(self) -> None:
        self.sock.close()


def test_requests_cut_before_an_answer_are_retried_and_open_the_circuit_breaker(upstreams):
    ok, dropper = upstreams[0], Dropper()
    router = RouterThread([ok.url], "round_robin", health_interval=60, breaker_failures=2, breaker_cooldown=60)
    try:
        with httpx.Client() as admin_client:
            admin_client.post(router.url + "/admin/replicas", json={"url": dropper.url},
                              headers={"Authorization": "Bearer admin-key"})
        replica = next(r for r in router.state.replicas if r.url == dropper.url)
        replica.state = HEALTHY
        with router.client() as c:
            assert [c.post("/v1/completions", json={"prompt": "x"}).status_code for _ in range(6)] == [200] * 6
        info = router.admin()[dropper.url]
        assert info["breaker"] == "open" and info["errors"] == 2  # tried twice, then the breaker kept it out
        assert info["state"] == "healthy"  # it accepts connections: only its checks can take it out
        metrics = httpx.get(router.url + "/metrics").text
        assert f'kvserve_router_retries_total{{reason="connect",replica="{dropper.url}"}} 2.0' in metrics
    finally:
        router.stop()
        dropper.stop()


def test_a_replica_dying_between_a_whole_answers_head_and_body_is_retried_elsewhere(upstreams):
    """A replica writes a whole answer's head and body apart; SIGKILL between them left the
    client a 503 though nothing of the answer had reached it."""
    ok = upstreams[0]
    dying = Dropper(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n")
    router = RouterThread([ok.url], "round_robin", health_interval=60, breaker_failures=1000)
    try:
        with httpx.Client() as admin_client:
            admin_client.post(router.url + "/admin/replicas", json={"url": dying.url},
                              headers={"Authorization": "Bearer admin-key"})
        next(r for r in router.state.replicas if r.url == dying.url).state = HEALTHY
        with router.client() as c:
            results = [c.post("/v1/completions", json={"prompt": "x"}) for _ in range(4)]
        assert [(r.status_code, r.json()) for r in results] == [(200, {"ok": True})] * 4
        assert [r.headers["x-kvserve-replica"] for r in results] == [ok.url] * 4
        assert ok.calls == 4
        metrics = httpx.get(router.url + "/metrics").text
        sent = re.search(rf'kvserve_router_requests_total{{replica="{dying.url}"}} (\d+)', metrics)
        assert sent and int(sent[1]) >= 2  # round robin sent it some; each went on to the other
        assert f'kvserve_router_retries_total{{reason="connect",replica="{dying.url}"}} {sent[1]}.0' in metrics
    finally:
        router.stop()
        dying.stop()


def test_no_healthy_replica_is_a_503_with_an_openai_body():
    router = RouterThread([f"http://127.0.0.1:{free_port()}"], "least_load", replica_wait=0)
    try:
        with router.client() as c:
            r = c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "no_replica"
        assert httpx.get(router.url + "/health").status_code == 503
    finally:
        router.stop()


def test_router_settings_defaults_are_sane():
    s = RouterSettings()
    assert s.unhealthy_after >= 1 and s.healthy_after >= 1 and 0 < s.retry_budget_ratio < 1
    assert 0 < s.replica_wait < s.drain_timeout and 0 < s.max_waiting < s.max_concurrent_requests


def test_requests_pass_through_exactly_and_an_oversized_head_is_refused(upstreams):
    ok = upstreams[0]
    router = RouterThread([ok.url], "round_robin")
    try:
        with router.client() as c:
            body = b'{"prompt": "x"}'
            r = c.post("/v1/completions?user=a%20b&x=%2F", content=body, headers={"x-note": "n" * 30000})
        assert r.status_code == 200 and r.json() == {"ok": True}
        assert ok.seen == (b"/v1/completions", b"user=a%20b&x=%2F", "n" * 30000, body)
        # A request head past 64 KiB, sent in two parts or in one: refused, the connection closed.
        for parts in ([b"a" * 40000, b"a" * 40000], [b"a" * 100_000 + b"\r\n\r\n"]):
            with socket.create_connection(("127.0.0.1", router.settings.port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + parts[0])
                for part in parts[1:]:
                    time.sleep(0.2)
                    s.sendall(part)
                answer = b""
                while chunk := s.recv(4096):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 431 ") and b"headers_too_large" in answer and ok.calls == 1
    finally:
        router.stop()


def test_a_refusal_is_told_from_other_connect_errors():
    from kvserve.router.upstream import ConnectRefused, is_refusal

    both = "Multiple exceptions: [Errno 111] Connect call failed ('::1', 80, 0, 0), [Errno 111] Connect call failed ('127.0.0.1', 80)"
    mixed = "Multiple exceptions: [Errno 111] Connect call failed ('::1', 80, 0, 0), [Errno 101] Network is unreachable"
    wrapped = RuntimeError("All connection attempts failed")
    wrapped.__cause__ = ConnectionRefusedError(111, "Connect call failed")
    assert [is_refusal(e) for e in (ConnectionRefusedError(111, "x"), OSError(both), OSError(mixed), wrapped,
                                    ConnectRefused("x"), TimeoutError(), OSError(113, "No route to host"))] == \
        [True, True, False, True, True, False, False]


def test_the_stored_response_a_request_names_and_the_bounded_map_of_homes():
    from kvserve.router.response_homes import ResponseHomes, named_id

    assert named_id("GET", "/v1/responses/resp_ab") == named_id("DELETE", "/v1/responses/resp_ab") == "resp_ab"
    assert named_id("GET", "/v1/responses/resp_ab/input_items") == "resp_ab"
    assert named_id("POST", "/v1/responses", "resp_cd") == "resp_cd"
    assert named_id("POST", "/v1/responses") is None and named_id("POST", "/v1/responses", 7) is None
    assert parse_request("/v1/responses", b'{"input": "Hi", "previous_response_id": "resp_ef"}').response_id == "resp_ef"
    assert parse_request("/v1/responses/resp_gh", b"", "GET").response_id == "resp_gh"
    homes = ResponseHomes(capacity=2)
    homes.record("a", "http://r1")
    homes.record("b", "http://r2")
    assert homes.get("a") == "http://r1"  # used: now the newest
    homes.record("c", "http://r1")  # over capacity: the least recently used (b) goes
    assert (homes.get("b"), len(homes)) == (None, 2)
    homes.forget_replica("http://r1")
    assert len(homes) == 0
