"""One client must not be able to take the router from everyone else: connections that trickle
their headers are closed after the header timeout, and connections past the cap get a 503 in the
OpenAI error body. A real router (uvicorn) on loopback; its raw sockets are the attacker."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from router_harness import RouterThread
from server_harness import free_port


@pytest.fixture(scope="module")
def router():
    r = RouterThread([f"http://127.0.0.1:{free_port()}"], "round_robin", header_timeout=1.0, max_connections=20)
    yield r
    r.stop()


def _read_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_connections_trickling_header_bytes_are_closed_after_the_header_timeout(router):
    socks = [socket.create_connection(("127.0.0.1", router.settings.port)) for _ in range(15)]
    for s in socks:
        s.sendall(b"GET /metrics HTTP/1.1\r\n")
        s.setblocking(False)
    t0, closed_at = time.monotonic(), {}
    while len(closed_at) < len(socks) and time.monotonic() - t0 < 5:  # one header byte per 0.1 s each
        for i, s in enumerate(socks):
            if i in closed_at:
                continue
            try:
                s.sendall(b"X")
                if s.recv(1) == b"":
                    closed_at[i] = time.monotonic() - t0
            except BlockingIOError:
                pass
            except (BrokenPipeError, ConnectionResetError):
                closed_at[i] = time.monotonic() - t0
        time.sleep(0.1)
    for s in socks:
        s.close()
    assert len(closed_at) == 15  # every one, though each kept sending
    assert 0.8 < min(closed_at.values()) and max(closed_at.values()) < 2.5
    assert httpx.get(router.url + "/metrics", timeout=5).status_code == 200


def test_half_sent_headers_on_a_kept_alive_connection_are_closed_too(router):
    with socket.create_connection(("127.0.0.1", router.settings.port)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        first = b""
        while b"\r\n\r\n" not in first:
            first += s.recv(65536)
        head, _, body = first.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line for line in head.split(b"\r\n") if line.startswith(b"content-length:")).split(b":")[1])
        while len(body) < length:
            body += s.recv(65536)
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # the second request's head, half sent
        t0 = time.monotonic()
        assert _read_all(s, 5) == b""  # closed by the router
        assert 0.5 < time.monotonic() - t0 < 3


def test_connections_past_the_cap_get_503_in_the_openai_body_and_are_closed(router):
    socks = [socket.create_connection(("127.0.0.1", router.settings.port)) for _ in range(20)]
    try:
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", router.settings.port)) as extra:
            head, _, body = _read_all(extra, 5).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        error = json.loads(body)["error"]
        assert error["type"] == "service_unavailable_error"
        assert error["message"] == "the router has 20 connections open, its limit: retry after a moment"
    finally:
        for s in socks:
            s.close()
    time.sleep(0.2)
    assert httpx.get(router.url + "/metrics", timeout=5).status_code == 200


def test_content_length_with_transfer_encoding_is_400_in_the_openai_body_and_closed(router):
    with socket.create_connection(("127.0.0.1", router.settings.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
        data = _read_all(s, 3)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert b"connection: close" in head.lower()
