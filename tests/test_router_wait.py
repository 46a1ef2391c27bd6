"""A request that finds no healthy replica waits (bounded in time and in number) for one to come up,
and a replica that answers is routable at once: stand-in replicas on loopback, started late."""
from __future__ import annotations

import re
import threading
import time

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvserve.router.replicas import HEALTHY, UNHEALTHY
from kvserve.router.settings import RouterSettings
from kvserve.router.state import RouterState
from router_harness import AppThread, RouterThread
from server_harness import free_port


def late_replica(port: int) -> AppThread:
    """A replica that comes up on `port` (a restart: nothing listened there before)."""

    async def ok(request: Request) -> JSONResponse:
        return JSONResponse({"ok": True})

    return AppThread(Starlette(routes=[Route("/health", ok), Route("/v1/completions", ok, methods=["POST"])]), port)


def post(router: RouterThread, results: list) -> None:
    t0 = time.monotonic()
    with router.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
    results.append((r.status_code, r.json(), time.monotonic() - t0))


def waiting_gauge(router: RouterThread) -> float:
    metrics = httpx.get(router.url + "/metrics").text
    return float(re.search(r"^kvserve_router_waiting_requests (\S+)$", metrics, re.M)[1])


def test_a_request_sent_while_no_replica_is_up_is_answered_once_one_comes_back():
    port = free_port()
    # Health checks a minute apart: only the checks made while a request waits can find it.
    router = RouterThread([f"http://127.0.0.1:{port}"], "round_robin", health_interval=60, replica_wait=10)
    replica = None
    try:
        results: list = []
        client = threading.Thread(target=post, args=(router, results))
        client.start()
        router.wait_for(lambda: router.state.waiting == 1)
        assert waiting_gauge(router) == 1.0
        time.sleep(1.0)
        replica = late_replica(port)
        up = time.monotonic()
        client.join(10)
        answered = time.monotonic() - up
        assert [(status, body) for status, body, _ in results] == [(200, {"ok": True})]
        assert results[0][2] > 1.0 and answered < 1.0  # woken within a fast check (0.1 s), not a minute later
        assert router.admin()[replica.url]["state"] == "healthy" and waiting_gauge(router) == 0.0
    finally:
        router.stop()
        if replica is not None:
            replica.stop()


def test_a_request_waiting_past_the_bound_gets_the_503_promptly():
    router = RouterThread([f"http://127.0.0.1:{free_port()}"], "least_load", replica_wait=0.5)
    try:
        results: list = []
        post(router, results)
        (status, body, took), = results
        assert status == 503 and body["error"]["code"] == "no_replica"
        assert body["error"]["message"] == ("no replica could take the request: none is healthy, and none came up "
                                            "within 0.5 s")
        assert 0.5 <= took < 1.5
    finally:
        router.stop()


def test_the_wait_is_bounded_in_number_and_the_waiting_are_answered_when_a_replica_comes_up():
    port = free_port()
    router = RouterThread([f"http://127.0.0.1:{port}"], "round_robin", replica_wait=10, max_waiting=2)
    replica = None
    try:
        results: list = []
        clients = [threading.Thread(target=post, args=(router, results)) for _ in range(2)]
        for c in clients:
            c.start()
        router.wait_for(lambda: router.state.waiting == 2)
        post(router, results)  # the third: no room to wait
        (status, body, took), = results
        assert status == 503 and took < 0.5
        assert body["error"]["message"] == ("no replica could take the request: none is healthy, and 2 requests "
                                            "wait for one already")
        replica = late_replica(port)
        for c in clients:
            c.join(10)
        assert [status for status, _, _ in results[1:]] == [200, 200]
    finally:
        router.stop()
        if replica is not None:
            replica.stop()


def test_one_passed_check_or_answer_brings_a_replica_back_but_not_one_that_said_it_is_not_ready():
    state = RouterState(RouterSettings(replicas=("http://127.0.0.1:1", "http://127.0.0.1:2")))
    checked, answered = state.replicas
    for r in (checked, answered):
        r.state, r.fails = UNHEALTHY, 2
    assert checked.health_result(True, state.settings) == HEALTHY and checked.ups == 1
    state.answered(answered)  # out for not answering its checks; a proxied answer proves it is up
    assert answered.state == HEALTHY and answered.ups == 1
    answered.state, answered.unready = UNHEALTHY, True  # its /health said 503 (draining): only a check decides
    state.answered(answered)
    assert answered.state == UNHEALTHY and answered.ups == 1
