"""Speculative decoding's per-request opt-out on the APIs beyond OpenAI's chat and completions
(which tests/test_speculative.py and test_server_validation.py cover): Responses and Anthropic
Messages take `"speculative": false` in the body, Ollama in `options`. The app runs in this
process so that the SamplingParams each request reaches the engine's checks with can be read;
a wrong type is the API's own 400 body, naming the field."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvserve.config import CacheConfig
from kvserve.llm import LLM
from kvserve.server.app import ServerSettings, build_app
from kvserve.server.generation import EngineClient
from server_harness import tiny_model_dir

HI = [{"role": "user", "content": "hi"}]
# path, a body without the field, where the field goes (None: top level), the error body's message
ROUTES = {
    "responses": ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1}, None,
                  lambda body: body["error"]["message"]),
    "messages": ("/v1/messages", {"model": "tiny", "messages": HI, "max_tokens": 1}, None,
                 lambda body: body["type"] == "error" and body["error"]["message"]),
    "ollama-chat": ("/api/chat", {"model": "tiny", "messages": HI, "stream": False, "options": {"num_predict": 1}},
                    "options", lambda body: body["error"]),
    "ollama-generate": ("/api/generate", {"model": "tiny", "prompt": "hi", "stream": False,
                                          "options": {"num_predict": 1}}, "options", lambda body: body["error"]),
}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    llm = LLM(str(tiny_model_dir(tmp_path_factory)), dtype="float32", cache=CacheConfig(num_blocks=64))
    with TestClient(build_app(ServerSettings(model_name="tiny"), llm=llm)) as c:
        yield c


@pytest.fixture
def seen(monkeypatch) -> list:
    """The SamplingParams of each request the engine checks."""
    params, check = [], EngineClient.validate

    def validate(self, ids, p):
        params.append(p)
        return check(self, ids, p)

    monkeypatch.setattr(EngineClient, "validate", validate)
    return params


def _with(body: dict, where: str | None, value: object) -> dict:
    if where is None:
        return {**body, "speculative": value}
    return {**body, where: {**body[where], "speculative": value}}


@pytest.mark.parametrize("route", ROUTES)
def test_speculative_false_reaches_sampling_params(client, seen, route):
    path, body, where, _ = ROUTES[route]
    assert client.post(path, json=body).status_code == 200
    r = client.post(path, json=_with(body, where, False))
    assert r.status_code == 200, r.text
    assert [p.speculative for p in seen] == [True, False]


@pytest.mark.parametrize("route", ROUTES)
def test_speculative_of_the_wrong_type_is_the_apis_400(client, seen, route):
    path, body, where, message = ROUTES[route]
    r = client.post(path, json=_with(body, where, "no"))
    field = "speculative" if where is None else f"{where}.speculative"
    assert r.status_code == 400 and message(r.json()).startswith(f"{field}: ") and "bool" in message(r.json())
    assert seen == []
