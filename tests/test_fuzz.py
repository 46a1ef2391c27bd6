"""Schema fuzz of every endpoint a real `kvserve serve` lists in /openapi.json (schemathesis):
no input gets a 5xx, every error is its API's error body (OpenAI's; Anthropic's on /v1/messages;
Ollama's on /api/*), no request hangs.

The server reads its request bodies itself (kvserve/server/parsing.py) and describes them in its
OpenAPI document from the same pydantic models (kvserve/server/api_docs.py); the test fails if a POST
route appears without one. Schemathesis then sends valid bodies and invalid ones (wrong types, missing and extra fields, out-of-range values) to each route.
The server is the tiny random model with a 128-token context: every valid request finishes fast.
"""
from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from server_harness import MODEL_NAME, start_server

from kvserve.server.openai.protocol import ROLES
from kvserve.server.routes import ROUTES

pytestmark = pytest.mark.slow

BODIES = {r.path: r.body for r in ROUTES if r.body is not None}  # every POST body the server parses
# Where a request model's schema says less than the server checks, valid bodies are narrowed to the
# accepted values, so that most of them reach the engine (invalid bodies still go anywhere).
RANGES = {"n": {"type": "integer", "minimum": 1, "maximum": 2},
          "temperature": {"minimum": 0, "maximum": 2}, "top_p": {"exclusiveMinimum": 0, "maximum": 1},
          "top_k": {"type": "integer", "minimum": 1, "maximum": 50}, "min_p": {"minimum": 0, "maximum": 1},
          "repetition_penalty": {"minimum": 0.5, "maximum": 2}, "presence_penalty": {"minimum": -2, "maximum": 2},
          "frequency_penalty": {"minimum": -2, "maximum": 2},
          "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
          "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
          "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
          "min_tokens": {"type": "integer", "minimum": 0, "maximum": 1},
          "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
          "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
          # Ollama's options
          "num_predict": {"type": "integer", "minimum": 1, "maximum": 8}, "num_ctx": {"type": "integer", "minimum": 16,
                                                                                     "maximum": 128},
          "repeat_penalty": {"minimum": 0.5, "maximum": 2}}
HANG_S = 30.0  # no request to this server takes more than a few seconds


def narrowed(doc: dict) -> dict:
    """The server's document, its valid bodies narrowed to what reaches the engine."""
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert set(posts) == set(BODIES), f"POST routes without a body model here: {set(posts) ^ set(BODIES)}"
    schemas = doc["components"]["schemas"]
    for path, model in BODIES.items():
        assert posts[path]["requestBody"]["content"]["application/json"]["schema"] == \
            {"$ref": f"#/components/schemas/{model.__name__}"}, path
        props = schemas[model.__name__]["properties"]
        if "model" in props:  # valid bodies name the served model, so they get past that check
            props["model"] = {"enum": [MODEL_NAME]}
    for schema in schemas.values():  # the ranges the server checks itself (sampling_params.py), nested too
        props = schema.get("properties", {})
        for name, bounds in RANGES.items():
            if name in props:
                props[name] = {"anyOf": [{"type": "null"}, {"type": props[name].get("type", "number"), **bounds}]}
    schemas["ChatMessage"]["properties"]["role"] = {"enum": list(ROLES)}
    return doc


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-model-len", "128")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api(server):
    doc = narrowed(httpx.get(server.url + "/openapi.json", timeout=10).json())  # open: no API key
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.update(base_url=server.url, headers=server.headers, request_timeout=HANG_S)
    return schema


def check(case, server, seen: Counter) -> str | None:
    """What is wrong with the server's answer to this case, or None; counts the statuses seen."""
    t0 = time.monotonic()
    try:
        response = case.call()
    except Exception as e:  # noqa: BLE001 — a timeout or a cut connection is the finding
        return f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    seen[f"{case.method} {case.path} {response.status_code}"] += 1
    if took >= HANG_S:
        return f"took {took:.1f} s"
    if response.status_code >= 500 or "server_error" in response.text:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        try:
            body = json.loads(response.text)
            if case.path.startswith("/api/"):  # Ollama's: {"error": "..."}
                assert set(body) == {"error"} and isinstance(body["error"], str)
            else:
                error = body["error"]
                assert isinstance(error["message"], str) and error["type"].endswith("_error")
                assert body.get("type") == "error" if case.path.startswith("/v1/messages") else "param" in error
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"{response.status_code} without its API's error body: {response.text[:300]}"
    if server.proc.poll() is not None:
        return "the server died"
    return None


GENERATED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat", "/api/generate")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzz_every_endpoint(api, server, mode):
    """Every operation, valid bodies then invalid ones; all findings listed at once."""
    findings: list[str] = []
    seen: Counter = Counter()
    operations = [r.ok() for r in api.get_all_operations()]
    assert {(o.method.upper(), o.path) for o in operations} >= {("POST", p) for p in BODIES}
    for op in operations:
        examples = 50 if op.method.upper() == "POST" else 8
        if mode is GenerationMode.POSITIVE and op.path in GENERATED:
            examples = 120  # ~1 valid body in 10 passes a route's semantic checks: enough of them reach the engine
        # derandomize: the same examples every run (for a given checkout), so a verdict is the code's, not the draw's
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  phases=[Phase.generate], derandomize=True)
        @given(case=op.as_strategy(generation_mode=mode))
        def fuzz(case) -> None:
            if (why := check(case, server, seen)) is not None and len(findings) < 50:
                findings.append(f"{case.method} {case.path} {json.dumps(case.body, default=str)[:300]} -> {why}")

        try:
            fuzz()
        except Unsatisfiable:  # an operation without input (GET /version) has no invalid input
            assert mode is GenerationMode.NEGATIVE, op.path
    print(mode.value, dict(sorted(seen.items())))
    assert not findings, "\n".join(findings)
    if mode is GenerationMode.POSITIVE:  # the valid bodies reached the engine, not only the validation
        assert all(seen[f"POST {path} 200"] > 0 for path in GENERATED), seen


def test_chat_default_max_tokens_fits_the_context(server):
    """Found by the fuzz: a chat request without max_tokens got a 400 naming max_tokens (the
    server's default, 1024, did not fit this 128-token context); now the default is cut to what
    the context leaves after the prompt."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello " * 40}], "ignore_eos": True}
    with server.client() as c:
        prompt = c.post("/tokenize", json={"messages": body["messages"]}).json()["count"]
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": prompt, "completion_tokens": 128 - prompt,
                                     "total_tokens": 128} | {k: v for k, v in r.json()["usage"].items()
                                                             if k not in ("prompt_tokens", "completion_tokens",
                                                                          "total_tokens")}
        assert r.json()["choices"][0]["finish_reason"] == "length"
        # A max_tokens the client did send is still checked against the context.
        r = c.post("/v1/chat/completions", json=body | {"max_tokens": 128})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
