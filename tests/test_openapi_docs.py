"""/docs and /openapi.json (kvserve/server/api_docs.py): a real `kvserve serve` (with an API key) serves
Swagger UI from its own files — checked in the HTML and in real headless Chromium, where no request
leaves loopback — and its OpenAPI document holds the request body schema of every generation route."""
from __future__ import annotations

import re

import httpx
import pytest
from server_harness import start_server
from test_web_page import chromium

from kvserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory)  # with an API key: the docs must be open anyway
    yield s
    s.stop()


def test_docs_page_and_its_files_come_from_the_server(server) -> None:
    page = httpx.get(server.url + "/docs", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"https?:|//[a-z]", page.text), "the page names another host"
    loaded = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert sorted(loaded) == ["/docs/favicon.png", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"]
    assert "url: '/openapi.json'" in page.text and '"validatorUrl": null' in page.text
    for path, kind in (("/docs/swagger-ui-bundle.js", "text/javascript"), ("/docs/swagger-ui.css", "text/css"),
                       ("/docs/favicon.png", "image/png")):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and len(r.content) > 1000, path
    missing = httpx.get(server.url + "/docs/redoc.standalone.js", headers=server.headers, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith("no file 'redoc.standalone.js' here")
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401  # the API itself still needs the key


def test_openapi_has_each_routes_request_body(server) -> None:
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    for path, model in BODIES.items():
        body = doc["paths"][path]["post"]["requestBody"]
        assert body == {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}, path
        assert set(schemas[model.__name__]["properties"]) == set(model.model_fields), path
        assert schemas[model.__name__]["additionalProperties"] is False  # unknown fields are refused
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatMessage"]["properties"]["content"]["anyOf"][1]["items"] == {"$ref": "#/components/schemas/TextPart"}


@pytest.mark.slow
def test_docs_render_in_chromium_without_leaving_loopback(server) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page()
            requested: list[str] = []
            errors: list[str] = []
            page.on("request", lambda r: requested.append(r.url))
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/docs")
            chat = page.locator("#operations-OpenAI-ChatCompletion_v1_chat_completions_post")
            chat.wait_for(timeout=30_000)
            chat.locator(".opblock-summary").click()
            page.get_by_text("Request body").first.wait_for(timeout=10_000)
            assert "messages" in chat.inner_text()  # the body's schema is shown
            assert errors == []
            assert requested and all(u.startswith(server.url + "/") for u in requested), requested
            assert server.url + "/openapi.json" in requested
        finally:
            browser.close()
