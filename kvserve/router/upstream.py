"""The router's HTTP clients to replicas: aiohttp for proxied requests (make_session: its C
parser keeps the per-token cost low), and httpx for its own calls (health checks, /kv/events).
"""
from __future__ import annotations

import httpx


def make_client(limits: httpx.Limits, timeout: httpx.Timeout) -> httpx.AsyncClient:
    """The client for the router's own calls: a few small requests per replica per second."""
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def make_session(connections: int, connect_timeout: float, read_timeout: float):
    """The client for proxied requests: aiohttp's, whose HTTP parser is C (llhttp), where
    httpcore's h11 parses each streamed chunk in Python — most of the router's cost per token.

    Bodies pass untouched (no decompression, no Content-Type or User-Agent added); idle
    connections are kept 4 s, under uvicorn's 5 s keep-alive on the replicas' side, so that a
    request never goes out on a connection the replica is closing.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=4.0)
    timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_connect=connect_timeout,
                                    sock_read=read_timeout)
    # No cookie jar: a replica's Set-Cookie is for the client it answered, never to be replayed
    # on other clients' requests (and a jar costs a parse per answer).
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False,
                                 cookie_jar=aiohttp.DummyCookieJar(),
                                 skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
                                 trust_env=False)
