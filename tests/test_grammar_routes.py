"""Every generation route compiles its grammar on the grammar pool, before its prompt is tokenized:
a schema that takes minutes to compile (an object of 4,000 optional properties, 51 KB, inside the
size limits) gets a 400 within the compile timeout on every API family, and a plain request sent
beside six of them is answered at once — the worker threads that tokenize for everyone are never
held by a compile; the compile's process is killed at the timeout, so the next schema compiles at
once. A real server process on loopback."""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

from server_harness import MODEL_NAME, gone, grammar_processes, slow_schema, start_server, wait_for

COMPILE_TIMEOUT = 2.0
PLAIN_WITHIN = 2.5  # seconds: a two-token answer on an idle server takes ~0.1 s; before, none came in minutes


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-model-len", "256", "--grammar-compile-timeout", str(COMPILE_TIMEOUT))
    with s.client() as c:  # the compile processes started with the server: the first schema waits for them, once
        assert c.post("/v1/chat/completions", json=_chat({"type": "integer"})).status_code == 200
    yield s
    s.stop()


def _chat(schema: dict | None) -> dict:
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}} if schema else {}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fmt}


def _responses(schema: dict | None) -> dict:
    fmt = {"text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}} if schema else {}
    return {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2, "store": False, **fmt}


def _anthropic(schema: dict | None) -> dict:
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": schema}}} if schema else {}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fmt}


def _ollama_chat(schema: dict | None) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "stream": False,
            "options": {"num_predict": 2}, **({"format": schema} if schema else {})}


def _ollama_generate(schema: dict | None) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hi", "stream": False, "options": {"num_predict": 2},
            **({"format": schema} if schema else {})}


ROUTES = {
    "openai-chat": ("/v1/chat/completions", _chat, "response_format.json_schema.schema"),
    "responses": ("/v1/responses", _responses, "text.format.schema"),
    "anthropic": ("/v1/messages", _anthropic, "output_config.format.schema"),
    "ollama-chat": ("/api/chat", _ollama_chat, "format"),
    "ollama-generate": ("/api/generate", _ollama_generate, "format"),
}


def test_a_schema_compiled_on_the_pool_is_enforced_on_every_route(server):
    # The check reads the grammar the pool compiled: a small schema still constrains each route's output.
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    texts: dict[str, str] = {}
    with server.client() as c:
        for family, (path, body, _) in ROUTES.items():
            req = body(schema)
            if family.startswith("ollama"):
                req["options"]["num_predict"] = 16
            elif family == "responses":
                req["max_output_tokens"] = 16
            else:
                req["max_tokens"] = 16
            r = c.post(path, json=req)
            assert r.status_code == 200, (family, r.text)
            texts[family] = _text(family, r.json())
    for family, text in texts.items():
        assert json.loads(text) in ({"ok": True}, {"ok": False}), (family, text)


@pytest.mark.parametrize("family", ROUTES)
def test_a_slow_schema_gets_a_400_in_the_compile_timeout_and_a_plain_request_beside_six_is_answered(server, family):
    path, body, param = ROUTES[family]
    answers: list[tuple[int, float, str]] = []

    def slow(tag: str) -> None:
        t0 = time.monotonic()
        with server.client() as c:
            r = c.post(path, json=body(slow_schema(tag)))
        answers.append((r.status_code, time.monotonic() - t0, r.text))

    tag = "abcde"[list(ROUTES).index(family)]
    threads = [threading.Thread(target=slow, args=(f"{tag}{k}",)) for k in range(6)]  # six distinct schemas
    for t in threads:
        t.start()
    # The compiles are on the grammar pool (before, this gauge stayed 0 and the compiles held the
    # worker threads); compiles an earlier test left running count here too.
    wait_for(lambda: server.metric("kvserve_grammar_compiles_pending") >= 6, timeout=COMPILE_TIMEOUT)
    t0 = time.monotonic()
    with server.client() as c:
        plain = c.post(path, json=body(None))
    took = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert plain.status_code == 200, plain.text
    assert took < PLAIN_WITHIN, f"a plain request beside six slow schemas took {took:.2f} s"
    assert len(answers) == 6
    for status, elapsed, text in answers:
        assert status in (400, 429), text
        assert elapsed < COMPILE_TIMEOUT + 1.5, f"answered after {elapsed:.1f} s: {text}"
        if status == 400:
            assert f"{param} took longer than {COMPILE_TIMEOUT:g} s to compile" in text, text


def test_two_slow_schemas_are_killed_at_their_timeout_and_the_next_schema_compiles_at_once(server):
    answers: list[tuple[int, float, str]] = []

    def slow(tag: str) -> None:
        t0 = time.monotonic()
        with server.client() as c:
            r = c.post("/v1/chat/completions", json=_chat(slow_schema(tag)))
        answers.append((r.status_code, time.monotonic() - t0, r.text))

    threads = [threading.Thread(target=slow, args=(tag,)) for tag in "yz"]  # two compiles: both workers
    for t in threads:
        t.start()
    wait_for(lambda: server.metric("kvserve_grammar_compiles_pending") == 2, timeout=COMPILE_TIMEOUT)
    time.sleep(0.3)  # (each worker has its compile)
    _, busy = grammar_processes(server.proc.pid)
    for t in threads:
        t.join(30)
    assert [status for status, _, _ in answers] == [400, 400], answers
    assert all(elapsed < COMPILE_TIMEOUT + 1.0 for _, elapsed, _ in answers), answers
    assert all("took longer than 2 s to compile" in text for _, _, text in answers), answers
    # Killed at the timeout, not left compiling for minutes: their processes are gone, their slots free.
    assert len(busy) == 2
    assert wait_for(lambda: gone(busy), timeout=2.0) < 0.5
    assert server.metric("kvserve_grammar_compiles_pending") == 0
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}  # not compiled before on this server
    t0 = time.monotonic()
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={**_chat(schema), "max_tokens": 16})
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert took < 1.0, f"a small schema after two killed compiles took {took:.2f} s"
    assert set(json.loads(_text("openai-chat", r.json()))) == {"n"}


def _text(family: str, body: dict) -> str:
    pick: dict[str, Callable[[dict], str]] = {
        "openai-chat": lambda b: b["choices"][0]["message"]["content"],
        "responses": lambda b: b["output"][0]["content"][0]["text"],
        "anthropic": lambda b: b["content"][0]["text"],
        "ollama-chat": lambda b: b["message"]["content"],
        "ollama-generate": lambda b: b["response"],
    }
    return pick[family](body)
