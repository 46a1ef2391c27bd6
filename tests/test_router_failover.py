"""Replicas that die: under load, mid-stream, and coming back. Real servers, killed for real."""
from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from router_harness import RouterThread, restart
from server_harness import MODEL_NAME, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    servers = [start_server(tmp_path_factory) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def completion(prompt: str, max_tokens: int, **kw) -> dict:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


def routed(router: RouterThread, prompt: str) -> tuple[int, str]:
    """A short completion through the router: its status and the replica that answered (else the error body)."""
    with router.client() as c:
        r = c.post("/v1/completions", json=completion(prompt, 2))
    return r.status_code, r.headers.get("x-kvserve-replica", r.text)


def test_killing_a_replica_under_load_fails_no_request_and_restarting_brings_it_back(replicas):
    router = RouterThread([s.url for s in replicas], "least_load", health_interval=0.25, unhealthy_after=2)
    a, b = replicas
    statuses: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def client_loop(i: int) -> None:
        with router.client() as c:
            n = 0
            while not stop.is_set():
                r = c.post("/v1/completions", json=completion(f"client {i} request {n}", 16))
                statuses.append((time.monotonic(), r.status_code, r.headers.get("x-kvserve-replica", "")))
                n += 1

    try:
        with ThreadPoolExecutor(4) as pool:
            try:
                for i in range(4):
                    pool.submit(client_loop, i)
                router.wait_for(lambda: len(statuses) >= 12, timeout=60)
                b.proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                out_after = router.wait_for(lambda: router.admin()[b.url]["state"] == "unhealthy", timeout=5)
                router.wait_for(lambda: sum(t > killed + out_after for t, _, _ in statuses) >= 12, timeout=60)
                b.proc.wait()
                restart(b)
                back = time.monotonic()
                router.wait_for(lambda: router.admin()[b.url]["state"] == "healthy", timeout=10)
                router.wait_for(lambda: any(t > back and url == b.url for t, _, url in statuses), timeout=30)
            finally:
                stop.set()  # the clients' threads end before the pool is left, even on failure
        assert Counter(status for _, status, _ in statuses) == {200: len(statuses)}  # no request failed
        assert out_after < 2.5  # two failed checks 0.25 s apart, with slack for a loaded machine
        assert {url for t, _, url in statuses if killed + 1.0 < t < back} == {a.url}
        admin = router.admin()[b.url]
        assert admin["in_flight"] == 0 and admin["state"] == "healthy"
    finally:
        stop.set()
        router.stop()


def test_a_stream_from_a_replica_that_stops_answering_ends_with_an_error_event(replicas):
    """A hung replica (SIGSTOP: the connection stays open, nothing comes) is not waited on until
    the read timeout: once its health checks fail the router ends its streams."""
    router = RouterThread([s.url for s in replicas], "round_robin", health_interval=0.25, unhealthy_after=2,
                          health_timeout=0.5)
    victim = None
    try:
        with router.client() as c:
            with c.stream("POST", "/v1/completions", json=completion("hold on", 2000, stream=True)) as r:
                victim = next(s for s in replicas if s.url == r.headers["x-kvserve-replica"])
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                events = [next(lines) for _ in range(3)]
                victim.proc.send_signal(signal.SIGSTOP)
                stopped = time.monotonic()
                events += list(lines)
                ended = time.monotonic() - stopped
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "replica_failed"
        assert ended < 5.0
    finally:
        if victim is not None:
            victim.proc.send_signal(signal.SIGCONT)
            victim.wait_ready()
        router.stop()


def test_a_burst_after_a_replica_is_killed_fails_no_request(replicas):
    """SIGKILL one of two replicas, then 20 requests at once: those sent to the dead one are
    refused at the connection, which takes it out at once, and go to the live one without
    spending the retry budget (zero here). Health checks are too slow to help (60 s apart)."""
    router = RouterThread([s.url for s in replicas], "round_robin", health_interval=60, retry_budget_ratio=0.0,
                          retry_budget_burst=0)
    a, b = replicas
    try:
        with ThreadPoolExecutor(20) as pool:  # kept-alive connections to both, then b dies
            warm = list(pool.map(lambda i: router.client().post("/v1/completions", json=completion(f"w{i}", 1)),
                                 range(4)))
            assert Counter(r.headers["x-kvserve-replica"] for r in warm) == {a.url: 2, b.url: 2}
            b.proc.send_signal(signal.SIGKILL)
            b.proc.wait()
            results = list(pool.map(lambda i: routed(router, f"burst {i}"), range(20)))
        assert results == [(200, a.url)] * 20
        info = router.admin()[b.url]
        assert info["state"] == "unhealthy" and info["in_flight"] == 0
        # Only requests that chose b before its first refusal came back went there (one, unless
        # several were connecting at that moment); each was refused and retried on a.
        sent_to_b = info["requests"] - 2
        assert 1 <= sent_to_b <= 5 and info["errors"] == sent_to_b
        metrics = httpx.get(router.url + "/metrics").text
        assert f'kvserve_router_retries_total{{reason="refused",replica="{b.url}"}} {sent_to_b:.1f}' in metrics
    finally:
        router.stop()
        if b.proc.poll() is not None:
            restart(b)


def test_requests_sent_while_one_replica_restarts_and_the_other_is_killed_wait_and_none_fails(replicas):
    """The soak's moment: b restarting and a SIGKILLed the same second. For a while no replica is
    up; the requests sent then are refused by both, wait, and are answered by b once it is back."""
    router = RouterThread([s.url for s in replicas], "round_robin", health_interval=1.0, replica_wait=60)
    a, b = replicas
    try:
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait()
        back = threading.Thread(target=restart, args=(b,))
        back.start()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda i: routed(router, f"while down {i}"), range(4)))
        back.join(60)
        assert results == [(200, b.url)] * 4
        info = router.admin()
        assert info[b.url]["state"] == "healthy" and info[a.url]["state"] == "unhealthy"
        assert router.state.waiting == 0
    finally:
        router.stop()
        for s in (a, b):
            if s.proc.poll() is not None:
                restart(s)


def test_a_stream_cut_by_a_replicas_death_ends_with_an_error_event(replicas):
    router = RouterThread([s.url for s in replicas], "round_robin")
    try:
        with router.client() as c:
            with c.stream("POST", "/v1/completions", json=completion("never ending", 2000, stream=True)) as r:
                victim = next(s for s in replicas if s.url == r.headers["x-kvserve-replica"])
                lines = r.iter_lines()
                events = [line for line, _ in zip((l for l in lines if l.startswith("data: ")), range(3))]
                victim.proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                events += [line for line in lines if line.startswith("data: ")]
                ended = time.monotonic() - killed
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "replica_failed" and error["type"] == "service_unavailable_error"
        assert all("choices" in json.loads(e[6:]) for e in events[:-2])  # whole events only, then the error
        assert ended < 5.0
    finally:
        router.stop()  # the module's last test: the victim stays down
