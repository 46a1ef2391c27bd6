"""The router's live page at / in real headless Chromium, in front of two real kvserve servers:
it lists the replicas and gains a row for each routing decision."""
from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from router_harness import RouterThread
from server_harness import MODEL_NAME, start_server
from test_web_page import chromium

pytestmark = pytest.mark.slow  # two server processes and a browser
STATIC = Path(__file__).resolve().parent.parent / "kvserve" / "router" / "static"
SHARED = "You are a careful assistant who answers questions about caches in one short sentence. " * 5


def test_router_page_shows_replicas_and_decisions(tmp_path_factory, tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    for f in ("index.html", "app.js", "app.css"):
        text = (STATIC / f).read_text()
        assert not re.search(r"(src|href)=\"(https?:)?//|url\(\s*['\"]?https?:|import\s.*https?:", text), f"{f} loads from the network"
    exe = chromium()
    replicas, router = [], None
    try:
        replicas += [start_server(tmp_path_factory) for _ in range(2)]
        router = RouterThread([s.url for s in replicas], "cache_aware", cache_source="approximate")
        # Open without any key: neither the page nor its data needs the admin or the replicas' key.
        assert httpx.get(router.url + "/", timeout=10).headers["content-type"].startswith("text/html")
        assert httpx.get(router.url + "/static/nope.js", timeout=10).status_code == 404
        st = httpx.get(router.url + "/router/state", timeout=10).json()
        assert st["policy"] == "cache_aware" and st["decisions"] == []
        assert [r["url"] for r in st["replicas"]] == [s.url for s in replicas]

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1300, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(router.url + "/")
            page.wait_for_function("window.kvserveRouterView && window.kvserveRouterView.polls > 0", timeout=30_000)
            assert page.locator("#replicas tbody tr").evaluate_all("rows => rows.map(r => r.dataset.url)") == \
                [s.url for s in replicas]
            assert page.locator("#replicas tbody tr .pill").all_inner_texts() == ["healthy", "healthy"]
            assert "cache_aware" in page.inner_text("#policy")
            assert page.locator("#decisions tbody tr").count() == 0

            with router.client() as c:
                sent = [c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": SHARED + q, "max_tokens": 3,
                                                        "temperature": 0}) for q in ("Why?", "How?")]
            assert [r.status_code for r in sent] == [200, 200]
            chosen = [r.headers["x-kvserve-replica"] for r in sent]
            page.wait_for_function("document.querySelectorAll('#decisions tbody tr').length === 2", timeout=30_000)
            rows = [page.locator("#decisions tbody tr").nth(i).locator("td").all_inner_texts() for i in range(2)]
            # Latest first: the second request found the first one's prefix on the same replica.
            assert [r[0] for r in rows] == ["2", "1"] and [r[3] for r in rows] == chosen[::-1]
            assert rows[1][4] == "no_match" and rows[0][4] == "prefix_hit" and chosen[0] == chosen[1]
            assert int(rows[0][5]) >= 32 and all(r[2] == "/v1/completions" for r in rows)
            page.wait_for_function(
                f"[...document.querySelectorAll('#replicas tbody tr')].find(r => r.dataset.url === '{chosen[0]}')"
                ".children[5].textContent === '2'", timeout=30_000)
            page.screenshot(path=str(tmp_path / "router.png"))
            assert errors == []
            browser.close()
    finally:
        if router is not None:
            router.stop()
        for s in replicas:
            s.stop()
