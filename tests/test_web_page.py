"""The live page at / in real headless Chromium, against a real server under load; and the
engine snapshot it draws from."""
from __future__ import annotations

import os
import re
import shutil
import threading
from pathlib import Path

import httpx
import openai
import pytest

from kvserve import LLM
from kvserve.config import CacheConfig
from kvserve.engine.snapshot import engine_state
from kvserve.sampling_params import SamplingParams
from server_harness import API_KEY, MODEL_NAME, start_server

STATIC = Path(__file__).resolve().parent.parent / "kvserve" / "server" / "static"


def chromium() -> str:
    """Debian's chromium (CI installs it: .ci/run). Missing is a failure, not a skip."""
    path = os.environ.get("KVSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("no Chromium found: apt-get install -y chromium (or set KVSERVE_CHROMIUM to its path)")
    return path


def test_snapshot_accounts_for_every_block(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=40))
    shared = list(range(200, 240))  # 40 tokens: 2 full blocks the second request can reuse
    engine = llm.engine
    engine.add_request("a", shared + [1, 2, 3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request("b", shared + [4, 5], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()
    st = engine_state(engine)
    pool = st["pool"]
    assert pool["num_blocks"] == len(pool["map"]) == 40 and pool["blocks_per_cell"] == 1
    assert pool["used"] + pool["cached"] + pool["free"] == 40
    assert pool["used"] == sum(1 for c in pool["map"] if c >= 2) == llm.manager.pool.num_used_blocks
    assert pool["free"] == pool["map"].count(0) and pool["cached"] == pool["map"].count(1)
    assert pool["owners"] == ["a", "b"]
    # b took a's two full prompt blocks from the prefix cache: they show as a's (first holder).
    a_blocks = set(llm.manager.block_ids("a#0"))
    assert {i for i, c in enumerate(pool["map"]) if c == 2} == a_blocks
    assert st["prefix_cache"]["hits"] == 32 and st["num_running"] == 2
    rows = {r["id"]: r for r in st["requests"]}
    assert rows["b"]["cached_tokens"] == 32 and rows["a"]["output_tokens"] == 4
    assert st["num_steps"] == 4 and st["steps"][0]["prefill_tokens"] == 43 and st["steps"][-1]["decode_tokens"] == 1
    assert st["steps"][-1]["prefill_tokens"] == 42 - 32 and sum(st["ttft"]["counts"]) == 2


def test_static_files_are_open_and_self_contained(tmp_path_factory) -> None:
    for f in ("index.html", "app.js", "app.css"):
        text = (STATIC / f).read_text()
        assert not re.search(r"(src|href)=\"(https?:)?//|url\(\s*['\"]?https?:|import\s.*https?:", text), f"{f} loads from the network"
    server = start_server(tmp_path_factory)
    try:
        page = httpx.get(server.url + "/", timeout=10)  # no API key: the page itself is open
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert httpx.get(server.url + "/static/app.js", timeout=10).headers["content-type"].startswith("text/javascript")
        assert httpx.get(server.url + "/static/nope.js", timeout=10).status_code in (401, 404)
        assert httpx.get(server.url + "/v1/engine/state", timeout=10).status_code == 401  # the data is not
        st = httpx.get(server.url + "/v1/engine/state", headers=server.headers, timeout=10).json()
        assert st["model"] == MODEL_NAME and st["num_running"] == 0 and st["pool"]["used"] == 0
    finally:
        server.stop()


@pytest.mark.slow
def test_page_shows_the_engine_live_in_chromium(tmp_path_factory, tmp_path) -> None:
    from playwright.sync_api import sync_playwright

    exe = chromium()
    server = start_server(tmp_path_factory, "--speculative", "ngram")  # drafted tokens to draw too
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    stop = threading.Event()
    failures: list[BaseException] = []

    def load(i: int) -> None:  # other users, so the page has something to show
        while not stop.is_set():
            try:
                client.completions.create(model=MODEL_NAME, prompt=f"Request {i}: once upon a time", max_tokens=48,
                                          temperature=0.8, extra_body={"ignore_eos": True})
            except Exception as e:  # noqa: BLE001 - reported below
                failures.append(e)
                return

    workers = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(3)]
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.add_init_script(f"localStorage.setItem('kvserve-api-key', '{API_KEY}')")
            page.goto(server.url + "/")
            page.wait_for_function("window.kvserveView && window.kvserveView.snapshots > 0", timeout=30_000)
            num_blocks = httpx.get(server.url + "/v1/engine/state", headers=server.headers, timeout=10).json()["pool"]["num_blocks"]
            pool = page.locator("#pool")
            assert pool.get_attribute("data-cells") == str(num_blocks) and pool.bounding_box()["height"] > 20

            for w in workers:
                w.start()
            page.wait_for_function("Number(document.querySelector('#pool').dataset.used) > 0", timeout=60_000)
            before = [page.inner_text(s) for s in ("#stat-steps", "#stat-gen")]
            # Record every change of the answer's text, to see it arrive in pieces.
            page.evaluate("""() => { window.lengths = []; new MutationObserver(() => {
                const m = document.querySelector('.msg.assistant'); if (m) window.lengths.push(m.textContent.length);
            }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
            page.fill("#max-tokens", "160")
            page.fill("#prompt", "Tell me a story about a cache.")
            page.press("#prompt", "Enter")
            page.wait_for_function("Number(document.querySelector('#pool').dataset.ownMax) > 0", timeout=120_000)
            page.wait_for_function("document.querySelector('.msg.assistant').dataset.state === 'done'", timeout=180_000)
            answer = page.locator(".msg.assistant")
            assert answer.get_attribute("data-request-id").startswith("chatcmpl-")
            assert "first token" in answer.locator(".meta").inner_text()  # the timeline, from the final chunk
            lengths = page.evaluate("window.lengths")
            assert len({n for n in lengths if n > 0}) >= 3, lengths  # streamed, not all at once
            page.wait_for_function(f"document.querySelector('#stat-gen').textContent !== '{before[1]}'", timeout=30_000)
            after = [page.inner_text(s) for s in ("#stat-steps", "#stat-gen")]
            assert int(after[0]) > int(before[0]) and int(after[1]) > int(before[1])
            assert int(page.locator("#ttft").get_attribute("data-total")) > 0
            assert int(page.locator("#itl").get_attribute("data-total")) > 0
            # Drafts were verified: the steps chart counts them and the acceptance stat is the engine's.
            page.wait_for_function("Number(document.querySelector('#steps').dataset.drafted) > 0", timeout=30_000)
            drafted, accepted = (int(page.locator("#steps").get_attribute(f"data-{k}")) for k in ("drafted", "accepted"))
            assert drafted >= accepted >= 0
            spec = httpx.get(server.url + "/v1/engine/state", headers=server.headers, timeout=10).json()["speculative"]
            assert page.locator("#spec-stat").is_visible()
            assert page.inner_text("#stat-spec").endswith("%") and "drafted tokens" in page.inner_text("#stat-spec-detail")
            assert spec["enabled"] and spec["drafted_tokens"] >= drafted
            shot = tmp_path / "page.png"
            page.screenshot(path=str(shot))
            assert shot.stat().st_size > 10_000
            assert errors == []
            browser.close()
    finally:
        stop.set()
        for w in workers:
            if w.is_alive():
                w.join(60)
        server.stop()
    assert failures == []
