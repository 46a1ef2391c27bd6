"""Every kind of bad input gets OpenAI's error body with the right status, type and param:
never a 422, a 500, a traceback or a file path."""
from __future__ import annotations

import json

import httpx
import pytest

from server_harness import API_KEY, MODEL_NAME, start_server

MAX_MODEL_LEN = 128
C, CHAT, E = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
USER = [{"role": "user", "content": "Hi"}]
LONG = "hello " * 200  # > MAX_MODEL_LEN tokens
BAD = "invalid_request_error"


def comp(**kw) -> dict:
    return {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL_NAME, "messages": USER, "max_tokens": 4, **kw}


def emb(**kw) -> dict:
    return {"model": MODEL_NAME, "input": "Hello", **kw}


# (id, path, body: dict to send as JSON or raw bytes, status, type, param)
CASES = [
    # the context
    ("prompt-too-long", C, comp(prompt=LONG), 400, BAD, "prompt"),
    ("prompt-ids-too-long", C, comp(prompt=[5] * 200), 400, BAD, "prompt"),
    ("messages-too-long", CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400, BAD, "messages"),
    ("max-tokens-too-many", C, comp(max_tokens=MAX_MODEL_LEN), 400, BAD, "max_tokens"),
    ("max-completion-tokens-too-many", CHAT, chat(max_completion_tokens=1000), 400, BAD, "max_completion_tokens"),
    ("max-tokens-negative", C, comp(max_tokens=-1), 400, BAD, "max_tokens"),
    ("max-tokens-zero-chat", CHAT, chat(max_tokens=0), 400, BAD, "max_tokens"),
    ("max-completion-tokens-zero", CHAT, chat(max_completion_tokens=0), 400, BAD, "max_completion_tokens"),
    ("max-tokens-zero-prompt-fills-the-context", C, comp(prompt=[5] * (MAX_MODEL_LEN + 1), max_tokens=0), 400, BAD, "prompt"),
    # sampling parameters out of range
    ("temperature", C, comp(temperature=2.5), 400, BAD, "temperature"),
    ("temperature-negative", CHAT, chat(temperature=-0.1), 400, BAD, "temperature"),
    ("temperature-inf", C, b'{"prompt": "x", "temperature": 1e999}', 400, BAD, "temperature"),
    ("top-p-zero", C, comp(top_p=0), 400, BAD, "top_p"),
    ("top-p-above-one", CHAT, chat(top_p=1.5), 400, BAD, "top_p"),
    ("top-k-zero", C, comp(top_k=0), 400, BAD, "top_k"),
    ("min-p", C, comp(min_p=1.5), 400, BAD, "min_p"),
    ("repetition-penalty", C, comp(repetition_penalty=0), 400, BAD, "repetition_penalty"),
    ("presence-penalty", C, comp(presence_penalty=2.5), 400, BAD, "presence_penalty"),
    ("frequency-penalty", CHAT, chat(frequency_penalty=-3), 400, BAD, "frequency_penalty"),
    ("min-tokens-negative", C, comp(min_tokens=-1), 400, BAD, "min_tokens"),
    ("min-tokens-over-max", C, comp(min_tokens=10, max_tokens=4), 400, BAD, "min_tokens"),
    ("stop-token-ids-negative", C, comp(stop_token_ids=[-1]), 400, BAD, "stop_token_ids"),
    ("stop-empty-string", C, comp(stop=[""]), 400, BAD, "stop"),
    ("stop-too-many", C, comp(stop=[f"s{i}" for i in range(17)]), 400, BAD, "stop"),
    ("stop-too-long", CHAT, chat(stop="x" * 257), 400, BAD, "stop"),
    ("stop-token-ids-too-many", C, comp(stop_token_ids=list(range(257))), 400, BAD, "stop_token_ids"),
    ("logprobs-above-limit", C, comp(logprobs=21), 400, BAD, "logprobs"),
    ("logprobs-negative", C, comp(logprobs=-1), 400, BAD, "logprobs"),
    ("top-logprobs-above-limit", CHAT, chat(logprobs=True, top_logprobs=21), 400, BAD, "top_logprobs"),
    ("top-logprobs-negative", CHAT, chat(logprobs=True, top_logprobs=-1), 400, BAD, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, BAD, "top_logprobs"),
    # n
    ("n-above-limit", C, comp(n=5), 400, BAD, "n"),
    ("n-above-limit-chat", CHAT, chat(n=5), 400, BAD, "n"),
    ("n-zero", C, comp(n=0), 400, BAD, "n"),
    # empty input
    ("empty-prompt", C, comp(prompt=""), 400, BAD, "prompt"),
    ("empty-prompt-list", C, comp(prompt=[]), 400, BAD, "prompt"),
    ("empty-prompt-in-batch", C, comp(prompt=["a", ""]), 400, BAD, "prompt"),
    ("empty-messages", CHAT, chat(messages=[]), 400, BAD, "messages"),
    ("missing-prompt", C, {"model": MODEL_NAME}, 400, BAD, "prompt"),
    ("missing-messages", CHAT, {"model": MODEL_NAME}, 400, BAD, "messages"),
    # roles and message shapes
    ("unknown-role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), 400, BAD, "messages[0].role"),
    ("tool-call-type", CHAT, chat(messages=[*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "code", "function": {"name": "f", "arguments": "{}"}}]}]), 400, BAD,
     "messages[1].tool_calls[0].type"),
    ("missing-role", CHAT, chat(messages=[{"content": "x"}]), 400, BAD, "messages[0].role"),
    ("function-result-without-name", CHAT, chat(messages=[*USER, {"role": "function", "content": "21"}]), 400, BAD,
     "messages[1]"),
    ("image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     400, BAD, "messages[0].content"),
    # malformed JSON
    ("malformed-json", C, b'{"prompt": "x",', 400, BAD, None),
    ("not-an-object", C, b'["prompt"]', 400, BAD, None),
    ("nan-literal", C, b'{"prompt": "x", "temperature": NaN}', 400, BAD, "temperature"),
    ("empty-body", CHAT, b"", 400, BAD, None),
    ("deep-nesting", C, b"[" * 100000 + b"]" * 100000, 400, BAD, None),
    # wrong types: strictly
    ("stream-as-string", C, comp(stream="true"), 400, BAD, "stream"),
    ("stream-as-int", CHAT, chat(stream=1), 400, BAD, "stream"),
    ("speculative-as-string", C, comp(speculative="no"), 400, BAD, "speculative"),
    ("speculative-as-int", CHAT, chat(speculative=0), 400, BAD, "speculative"),
    ("temperature-as-string", C, comp(temperature="0.5"), 400, BAD, "temperature"),
    ("temperature-as-bool", C, comp(temperature=True), 400, BAD, "temperature"),
    ("max-tokens-as-float", C, comp(max_tokens=1.5), 400, BAD, "max_tokens"),
    ("max-tokens-as-string", CHAT, chat(max_tokens="4"), 400, BAD, "max_tokens"),
    ("n-as-string", C, comp(n="2"), 400, BAD, "n"),
    ("seed-as-string", C, comp(seed="1"), 400, BAD, "seed"),
    ("logprobs-as-int-in-chat", CHAT, chat(logprobs=1), 400, BAD, "logprobs"),
    ("logprobs-as-bool-in-completions", C, comp(logprobs=True), 400, BAD, "logprobs"),
    ("ignore-eos-as-string", C, comp(ignore_eos="yes"), 400, BAD, "ignore_eos"),
    ("stop-as-int", C, comp(stop=5), 400, BAD, "stop"),
    ("prompt-as-int", C, comp(prompt=5), 400, BAD, "prompt"),
    ("prompt-ids-with-bool", C, comp(prompt=[1, True]), 400, BAD, "prompt"),
    ("prompt-id-out-of-vocab", C, comp(prompt=[10**9]), 400, BAD, "prompt"),
    ("messages-as-string", CHAT, chat(messages="hi"), 400, BAD, "messages"),
    ("content-as-int", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400, BAD, "messages[0].content"),
    ("stream-options-as-string", CHAT, chat(stream=True, stream_options="usage"), 400, BAD, "stream_options"),
    ("unknown-parameter", C, comp(max_token=4), 400, BAD, "max_token"),
    ("model-as-int", C, comp(model=3), 400, BAD, "model"),
    # not Unicode
    ("invalid-utf8", C, b'{"prompt": "caf\xe9"}', 400, BAD, None),
    ("lone-surrogate", C, b'{"prompt": "x\\ud800y"}', 400, BAD, "prompt"),
    ("lone-surrogate-in-list", C, b'{"prompt": ["ok", "\\udfff"]}', 400, BAD, "prompt[1]"),
    ("lone-surrogate-in-message", CHAT, b'{"messages": [{"role": "user", "content": "\\ud83d"}]}',
     400, BAD, "messages[0].content"),
    ("lone-surrogate-in-key", CHAT, b'{"\\ud800": 1, "messages": []}', 400, BAD, None),
    # unsupported features say so
    ("suffix", C, comp(suffix="x"), 400, BAD, "suffix"),
    ("echo-as-string", C, comp(echo="true"), 400, BAD, "echo"),
    ("echo-of-ids-out-of-vocab", C, comp(prompt=[[5, -3], [10**12]], echo=True), 400, BAD, "prompt"),
    ("tool-choice-not-a-tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                          tool_choice={"type": "function", "function": {"name": "g"}}), 400, BAD, "tool_choice"),
    ("response-format-yaml", CHAT, chat(response_format={"type": "yaml"}), 400, BAD, "response_format.type"),
    ("bad-regex", C, comp(guided_regex="(unclosed"), 400, BAD, "guided_regex"),
    ("bad-schema", CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
     400, BAD, "response_format.json_schema.schema"),
    ("two-constraints", C, comp(guided_regex="a", guided_choice=["a"]), 400, BAD, "guided_regex"),
    ("logit-bias-out-of-vocab", C, comp(logit_bias={"999999": 1.0}), 400, BAD, "logit_bias"),
    ("logit-bias-not-an-id", CHAT, chat(logit_bias={"hi": 1.0}), 400, BAD, "logit_bias"),
    # OpenAI's limits on metadata, kvserve's on user
    ("metadata-17-keys", CHAT, chat(metadata={f"k{i}": "v" for i in range(17)}), 400, BAD, "metadata"),
    ("metadata-long-key", CHAT, chat(metadata={"k" * 65: "v"}), 400, BAD, "metadata"),
    ("metadata-long-value", CHAT, chat(metadata={"k": "v" * 513}), 400, BAD, "metadata"),
    ("metadata-not-a-string", CHAT, chat(metadata={"k": 1}), 400, BAD, "metadata"),
    ("user-too-long", C, comp(user="u" * 257), 400, BAD, "user"),
    ("embeddings-user-too-long", E, emb(user="u" * 257), 400, BAD, "user"),
    # other endpoints
    ("tokenize-neither", "/tokenize", {"model": MODEL_NAME}, 400, BAD, "prompt"),
    ("detokenize-out-of-vocab", "/detokenize", {"tokens": [1, -5]}, 400, BAD, "tokens"),
    ("detokenize-strings", "/detokenize", {"tokens": ["a"]}, 400, BAD, "tokens[0]"),
    # embeddings
    ("embeddings-input-too-long", E, emb(input=LONG), 400, BAD, "input"),
    ("embeddings-ids-too-long", E, emb(input=[5] * 200), 400, BAD, "input"),
    ("embeddings-empty", E, emb(input=""), 400, BAD, "input"),
    ("embeddings-empty-list", E, emb(input=[]), 400, BAD, "input"),
    ("embeddings-empty-in-batch", E, emb(input=["a", ""]), 400, BAD, "input"),
    ("embeddings-too-many-inputs", E, emb(input=["a"] * 65), 400, BAD, "input"),
    ("embeddings-mixed-batch", E, emb(input=["a", [1, 2]]), 400, BAD, "input"),
    ("embeddings-id-out-of-vocab", E, emb(input=[10**9]), 400, BAD, "input"),
    ("embeddings-input-as-int", E, emb(input=5), 400, BAD, "input"),
    ("embeddings-missing-input", E, {"model": MODEL_NAME}, 400, BAD, "input"),
    ("embeddings-dimensions", E, emb(dimensions=8), 400, BAD, "dimensions"),
    ("embeddings-dimensions-as-string", E, emb(dimensions="8"), 400, BAD, "dimensions"),
    ("embeddings-encoding-format", E, emb(encoding_format="hex"), 400, BAD, "encoding_format"),
    ("embeddings-generation-field", E, emb(temperature=0), 400, BAD, "temperature"),
    ("embeddings-lone-surrogate", E, b'{"input": ["ok", "\\udfff"]}', 400, BAD, "input[1]"),
    ("embeddings-malformed-json", E, b'{"input": ', 400, BAD, None),
    ("embeddings-unknown-model", E, emb(model="nope"), 404, BAD, "model"),
    # unknown model: 404
    ("unknown-model", C, comp(model="gpt-4"), 404, BAD, "model"),
    ("unknown-model-chat", CHAT, chat(model="nope"), 404, BAD, "model"),
    ("unknown-model-tokenize", "/tokenize", {"model": "nope", "prompt": "x"}, 404, BAD, "model"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-model-len", str(MAX_MODEL_LEN), "--max-n", "4")
    yield s
    s.stop()


def _assert_error(r: httpx.Response, status: int, type_: str, param: str | None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == type_ and err["param"] == param, err
    assert isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text and ".py" not in r.text and "/tmp" not in r.text, r.text
    return err


@pytest.mark.parametrize("path, body, status, type_, param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(server, path, body, status, type_, param):
    with server.client() as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = c.post(path, json=body)
    _assert_error(r, status, type_, param)


def test_body_over_the_limit_is_413(server):
    # The default limit is 4 MiB; refused from Content-Length, before the body is read.
    body = json.dumps({"prompt": "x" * (4 << 20)}).encode()
    with server.client() as c:
        err = _assert_error(c.post(C, content=body), 413, BAD, None)
    assert "4194304" in err["message"]


def test_body_over_the_limit_without_content_length_is_413(server):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5):
            yield b"x" * (1 << 20)
        yield b'"}'

    with server.client() as c:
        _assert_error(c.post(C, content=chunks()), 413, BAD, None)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}], ids=["missing", "wrong", "no-scheme", "basic"])
def test_missing_or_wrong_api_key_is_401(server, headers):
    for path, body in ((C, comp()), (E, emb())):
        r = httpx.post(server.url + path, json=body, headers=headers)
        err = _assert_error(r, 401, "authentication_error", None)
        assert err["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"


def test_unknown_route_and_method(server):
    with server.client() as c:
        _assert_error(c.get("/v1/nope"), 404, BAD, None)
        _assert_error(c.get(C), 405, BAD, None)


def test_server_still_serves_after_all_that(server):
    with server.client() as c:
        r = c.post(C, json=comp())
        e = c.post(E, json=emb(input=["a", "b"]))
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert e.status_code == 200 and [d["index"] for d in e.json()["data"]] == [0, 1]
    assert "Traceback" not in server.log()  # nothing above was an unexpected error
