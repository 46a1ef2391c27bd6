"""The router's admin API refuses what a web page can make a browser send (cross-origin forms,
other sites' scripts, DNS rebinding), and `--allowed-hosts` keeps the router and the server to
their own names. A real router on loopback, a real server process; httpx plays the browser by
sending the headers a browser would."""
from __future__ import annotations

import httpx
import pytest

from kvserve.web.hosts import host_allowed, host_name, parse_allowed_hosts
from router_harness import ADMIN_KEY, RouterThread
from server_harness import API_KEY, free_port, start_server

EVIL = "http://evil.example"


@pytest.fixture(scope="module")
def open_router():
    """The default: no --admin-key (loopback clients only)."""
    r = RouterThread([], "round_robin", admin_key=None)
    yield r
    r.stop()


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]["message"]


def test_a_cross_origin_form_post_cannot_add_a_replica(open_router):
    url = open_router.url + "/admin/replicas"
    target = f"http://127.0.0.1:{free_port()}"
    # What an HTML form on another site makes the browser send: its Origin, a form body.
    form = httpx.post(url, content=f"url={target}", headers={"Origin": EVIL, "Content-Type":
                                                              "application/x-www-form-urlencoded"})
    assert _error(form, 403, "cross_origin") == ("the admin API refuses requests from web pages of other origins "
                                                 f"(Origin: {EVIL}): call it from a program, not a browser")
    # Browsers that send no Origin on a form still send Sec-Fetch-Site; and the form's type is refused anyway.
    _error(httpx.post(url, json={"url": target}, headers={"Sec-Fetch-Site": "cross-site"}), 403, "cross_origin")
    _error(httpx.post(url, json={"url": target}, headers={"Sec-Fetch-Site": "same-site"}), 403, "cross_origin")
    plain = httpx.post(url, content=f'{{"url": "{target}"}}', headers={"Content-Type": "text/plain"})
    assert _error(plain, 415, "unsupported_media_type") == \
        "the admin API takes a JSON body with Content-Type: application/json, not text/plain"
    _error(httpx.post(url, content=f"url={target}", headers={"Content-Type": "multipart/form-data; boundary=x"}),
           415, "unsupported_media_type")
    _error(httpx.post(url, json={"url": target}, headers={"Origin": "null"}), 403, "cross_origin")
    # The query string is no way in either (a link or a form's action could carry it).
    r = httpx.post(url + f"?url={target}", content=b"", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "url"
    _error(httpx.request("DELETE", url, content=f"url={target}"), 415, "unsupported_media_type")
    assert httpx.get(url).json()["replicas"] == []  # none of them was added
    # A program on this host (no Origin, or the router's own) may.
    same = httpx.post(url, json={"url": target}, headers={"Origin": open_router.url})
    assert same.status_code == 200 and same.json()["added"] is True
    assert httpx.request("DELETE", url, json={"url": target}).status_code == 200


def test_a_rebound_domain_name_cannot_reach_the_admin_api_without_a_key(open_router):
    # DNS rebinding: the page's own name points at 127.0.0.1, so it is its own origin.
    port = open_router.settings.port
    host = f"evil.example:{port}"
    r = httpx.post(open_router.url + "/admin/replicas", json={"url": "http://127.0.0.1:1"},
                   headers={"Host": host, "Origin": f"http://{host}"})
    assert _error(r, 403, "admin_forbidden") == (
        f"without --admin-key the admin API answers requests addressed to an IP address or localhost only, not "
        f"'{host}': use http://127.0.0.1:PORT or start the router with --admin-key")
    assert httpx.get(open_router.url + "/admin/replicas", headers={"Host": f"localhost:{port}"}).status_code == 200
    assert httpx.get(open_router.url + "/admin/replicas", headers={"Host": f"[::1]:{port}"}).status_code == 200


def test_with_a_key_the_key_decides_and_browsers_are_still_refused():
    router = RouterThread([], "round_robin")
    try:
        url = router.url + "/admin/replicas"
        key = {"Authorization": f"Bearer {ADMIN_KEY}"}
        _error(httpx.get(url), 401, "invalid_api_key")
        assert httpx.get(url, headers={**key, "Host": "router.internal"}).status_code == 200  # any name, with the key
        _error(httpx.post(url, json={"url": "http://127.0.0.1:1"}, headers={**key, "Origin": EVIL}), 403, "cross_origin")
    finally:
        router.stop()


def test_the_routers_allowed_hosts_refuse_other_names_on_every_path():
    router = RouterThread([f"http://127.0.0.1:{free_port()}"], "round_robin", allowed_hosts=("localhost", "127.0.0.1"))
    try:
        for method, path in (("GET", "/health"), ("POST", "/v1/completions"), ("GET", "/admin/replicas"), ("GET", "/")):
            r = httpx.request(method, router.url + path, headers={"Host": "evil.example"}, json={"prompt": "x"})
            assert _error(r, 400, "invalid_host") == ("the Host header 'evil.example' is not a name this service "
                                                      "answers to (its --allowed-hosts): use one of those")
        assert httpx.get(router.url + "/metrics").status_code == 200  # 127.0.0.1:PORT
        assert httpx.get(router.url + "/metrics", headers={"Host": f"localhost:{router.settings.port}"}).status_code == 200
    finally:
        router.stop()


def test_the_servers_allowed_hosts_refuse_other_names(tmp_path_factory):
    server = start_server(tmp_path_factory, "--allowed-hosts", "localhost,127.0.0.1")
    try:
        bad = httpx.get(server.url + "/v1/models", headers={"Host": "evil.example", "Authorization": f"Bearer {API_KEY}"})
        _error(bad, 400, "invalid_host")
        _error(httpx.get(server.url + "/health", headers={"Host": "evil.example"}), 400, "invalid_host")
        with server.client() as c:
            assert c.get("/v1/models").status_code == 200
    finally:
        server.stop()


def test_allowed_hosts_entries():
    allowed = parse_allowed_hosts(" LocalHost,10.0.0.2,*.internal,::1")
    assert allowed == ("localhost", "10.0.0.2", "*.internal", "::1")
    assert [host_name(h) for h in ("Example.COM:80", "[::1]:8000", "[::1]", "10.0.0.2", "::1")] == \
        ["example.com", "[::1]", "[::1]", "10.0.0.2", "::1"]
    assert [host_allowed(host_name(h), allowed) for h in
            ("localhost:8000", "10.0.0.2", "a.b.internal", "internal", "[::1]:8000", "evil.example", "")] == \
        [True, True, True, False, True, False, False]
    assert parse_allowed_hosts("") == () and host_allowed("anything", ("*",))
    for bad in ("a,,b", "*evil", "http://x/"):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            parse_allowed_hosts(bad)
