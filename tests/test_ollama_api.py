"""Ollama's API against a real `kvserve serve` of the tiny random model, through the `ollama`
package's Client (chat and generate, streamed and not; list, show, ps) and raw HTTP where the
wire is the point (NDJSON by default, error bodies).

The tiny model's greedy output never reaches its end-of-turn token within the context, so
lengths are exact; a JSON schema in `format` makes its output valid by grammar.
"""
from __future__ import annotations

import json
import socket

import httpx
import ollama
import pytest
from server_harness import API_KEY, MODEL_NAME, start_server, wait_for

CONTEXT = 256
HI = [{"role": "user", "content": "Name a colour."}]
GREEDY = {"temperature": 0, "num_predict": 8}
ABORTED = 'kvserve_request_finished_total{finish_reason="abort"}'
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-model-len", str(CONTEXT))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=60)


def test_list_show_ps_and_version(client, server):
    (model,) = client.list().models
    assert model.model == f"{MODEL_NAME}:latest" and model.size > 0 and len(model.digest) == 64
    assert model.details.family == "llama" and model.details.format == "safetensors"
    show = client.show(MODEL_NAME)
    assert show.modelinfo["llama.context_length"] == CONTEXT and show.modelinfo["general.architecture"] == "llama"
    assert "<|im_start|>" in show.template and "completion" in show.capabilities
    assert client.show(f"{MODEL_NAME}:latest").modelinfo == show.modelinfo
    (running,) = client.ps().models
    assert running.model == model.model and running.context_length == CONTEXT
    # Open, as Ollama's clients probe it to find the server (the ollama package has no call for it).
    version = httpx.get(server.url + "/api/version")
    assert version.status_code == 200 and version.json()["version"].count(".") == 2


def test_chat_whole_and_streamed_agree(client, server):
    whole = client.chat(model=MODEL_NAME, messages=HI, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 8 and whole.message.content
    prompt = httpx.post(server.url + "/tokenize", json={"messages": HI}, headers=AUTH).json()["count"]
    assert whole.prompt_eval_count == prompt
    for name in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(getattr(whole, name), int) and getattr(whole, name) > 0  # nanoseconds
    assert whole.total_duration >= whole.eval_duration and whole.load_duration == 0
    parts = list(client.chat(model=f"{MODEL_NAME}:latest", messages=HI, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 8 and parts[-1].message.content == ""
    assert parts[-1].model == f"{MODEL_NAME}:latest"  # the name as the client gave it


def test_ndjson_streaming_is_the_default(server):
    body = {"model": MODEL_NAME, "messages": HI, "options": GREEDY}
    with httpx.stream("POST", server.url + "/api/chat", json=body, headers=AUTH, timeout=60) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert len(lines) > 2 and lines[-1]["done"] is True and all(not x["done"] for x in lines[:-1])
    whole = httpx.post(server.url + "/api/chat", json={**body, "stream": False}, headers=AUTH, timeout=60).json()
    assert whole["done"] and whole["message"]["content"] == "".join(x["message"]["content"] for x in lines)
    assert whole["created_at"].endswith("Z")


def test_generate_whole_streamed_and_with_context(client):
    whole = client.generate(model=MODEL_NAME, prompt="The capital of France is", options=GREEDY)
    assert whole.done_reason == "length" and whole.eval_count == 8 and whole.response
    assert len(whole.context) == whole.prompt_eval_count + whole.eval_count
    parts = list(client.generate(model=MODEL_NAME, prompt="The capital of France is", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].context == whole.context
    follow = client.generate(model=MODEL_NAME, prompt="And of Italy?", context=whole.context, options=GREEDY)
    assert follow.prompt_eval_count > len(whole.context) and follow.context[:len(whole.context)] == whole.context
    raw = client.generate(model=MODEL_NAME, prompt="The capital of France is", raw=True, options=GREEDY)
    assert raw.prompt_eval_count < whole.prompt_eval_count  # no chat template around it


def test_format_schema_gives_valid_json(client):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
              "required": ["colour", "bright"], "additionalProperties": False}
    r = client.chat(model=MODEL_NAME, messages=HI, format=schema, options={"temperature": 0, "num_predict": 40})
    assert r.done_reason == "stop"
    answer = json.loads(r.message.content)
    assert answer["colour"] in ("red", "green", "blue") and isinstance(answer["bright"], bool)
    parts = list(client.generate(model=MODEL_NAME, prompt="A colour:", format=schema, stream=True,
                                 options={"temperature": 0, "num_predict": 40}))
    assert set(json.loads("".join(p.response for p in parts))) == {"colour", "bright"}


def test_options_stop_seed_and_num_ctx(client):
    text = client.generate(model=MODEL_NAME, prompt="Hello", options=GREEDY).response
    stop = text[len(text) // 2:][:3]
    r = client.generate(model=MODEL_NAME, prompt="Hello", options={**GREEDY, "stop": [stop]})
    assert r.done_reason == "stop" and r.response == text[:text.index(stop)]
    sampled = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 7, "num_predict": 8}
    a, b = (client.generate(model=MODEL_NAME, prompt="Hello", options=sampled).response for _ in range(2))
    assert a == b
    # num_ctx narrows the context: the answer stops where 64 tokens are used.
    r = client.generate(model=MODEL_NAME, prompt="Hello", options={"temperature": 0, "num_ctx": 64, "num_predict": -1})
    assert r.done_reason == "length" and r.prompt_eval_count + r.eval_count == 64
    # num_predict -2: all the context leaves
    r = client.generate(model=MODEL_NAME, prompt="Hello", options={"temperature": 0, "num_predict": -2})
    assert r.prompt_eval_count + r.eval_count == CONTEXT


def test_nothing_to_generate_loads_the_model(client):
    assert client.generate(model=MODEL_NAME, prompt="").done_reason == "load"
    assert client.chat(model=MODEL_NAME, messages=[]).done_reason == "load"


def test_tool_definitions_calls_and_results_render(client, server):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                               "parameters": {"type": "object", "required": ["city"],
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                  "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "21 C", "tool_name": "get_weather"}]
    r = client.chat(model=MODEL_NAME, messages=messages, tools=tools, options=GREEDY)
    bare = client.chat(model=MODEL_NAME, messages=messages[:1], options=GREEDY)
    assert r.done_reason in ("length", "stop") and r.prompt_eval_count > bare.prompt_eval_count + 30


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    assert "Traceback" not in r.text and ".py" not in r.text, r.text
    return body["error"]


BAD = [
    ("chat", {"messages": HI, "options": {"num_ctx": 100_000}}, "num_ctx"),
    ("chat", {"messages": HI, "options": {"mirostat": 2}}, "mirostat"),
    ("chat", {"messages": HI, "options": {"typical_p": 0.5}}, "typical_p"),
    ("chat", {"messages": HI, "options": {"num_predcit": 5}}, "options.num_predcit: is not a known parameter"),
    ("chat", {"messages": HI, "options": {"num_predict": 0}}, "num_predict must be"),
    ("chat", {"messages": HI, "options": {"temperature": 5}}, "options.temperature must be"),
    ("chat", {"messages": HI, "options": {"stop": [""]}}, "options.stop must be"),
    ("chat", {"messages": HI, "think": True}, "does not think"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]}, "text-only"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": HI, "format": "xml"}, "format"),
    ("chat", {"messages": [{"role": "user", "content": "hello " * 400}]}, "256"),
    ("chat", {"messages": [{"role": "user", "content": "hello " * 40}], "options": {"num_ctx": 20}}, "num_ctx"),
    ("generate", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("generate", {"prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
    ("generate", {"prompt": "hi", "context": [-1]}, "prompt"),
    ("generate", {"prompt": "hi", "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
]


@pytest.mark.parametrize("route, body, words", BAD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD)])
def test_bad_requests_are_400_in_ollamas_error_body(server, route, body, words):
    r = httpx.post(f"{server.url}/api/{route}", json={"model": MODEL_NAME, "stream": False, **body}, headers=AUTH,
                   timeout=60)
    assert words in _error(r, 400)


def test_other_errors_in_ollamas_error_body(client, server):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=HI)
    assert e.value.status_code == 404 and "llama3.2" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3.2")
    assert e.value.status_code == 404
    url = server.url + "/api/chat"
    assert "not valid JSON" in _error(httpx.post(url, content=b'{"model": ', headers=AUTH), 400)
    _error(httpx.post(url, content=json.dumps({"model": MODEL_NAME, "messages": HI, "x": "y" * (5 << 20)}),
                      headers=AUTH), 413)
    _error(httpx.get(url, headers=AUTH), 405)
    _error(httpx.get(server.url + "/api/nope", headers=AUTH), 404)
    # The API key: as Ollama's clients send it (Authorization: Bearer, e.g. from OLLAMA_API_KEY).
    _error(httpx.post(url, json={"model": MODEL_NAME, "messages": HI}), 401)
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url, headers={"Authorization": "Bearer wrong"}).list()
    assert e.value.status_code == 401


def test_embed_and_embeddings_are_the_embeddings_routes_vectors(client, server):
    """/api/embed and /api/embeddings through the ollama package: the same vectors as /v1/embeddings."""
    texts = ["The sky is blue.", "Grass is green."]
    r = client.embed(model=MODEL_NAME, input=texts)
    openai = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": texts}, headers=AUTH).json()
    assert r.model == MODEL_NAME and r.embeddings == [d["embedding"] for d in openai["data"]]
    assert r.prompt_eval_count == openai["usage"]["prompt_tokens"] and r.total_duration > 0 and r.load_duration == 0
    one = client.embed(model=f"{MODEL_NAME}:latest", input=texts[0])  # alone, not in a batch of two: to rounding
    assert one.embeddings[0] == pytest.approx(r.embeddings[0], abs=1e-5) and one.model == f"{MODEL_NAME}:latest"
    assert list(client.embeddings(model=MODEL_NAME, prompt=texts[1]).embedding) == pytest.approx(r.embeddings[1], abs=1e-5)
    assert client.embed(model=MODEL_NAME, input=[]).embeddings == []  # nothing to embed: the model "loads"


def test_embed_truncates_to_the_context_unless_told_not_to(client, server):
    long = "hello world " * 300  # > CONTEXT tokens
    ids = httpx.post(server.url + "/tokenize", json={"prompt": long}, headers=AUTH).json()["tokens"]
    assert len(ids) > CONTEXT
    for num_ctx in (None, 64):
        cut = client.embed(model=MODEL_NAME, input=long, options={"num_ctx": num_ctx} if num_ctx else None)
        n = num_ctx or CONTEXT
        first = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": ids[:n]}, headers=AUTH)
        assert cut.prompt_eval_count == n and cut.embeddings == [first.json()["data"][0]["embedding"]]
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=MODEL_NAME, input=long, truncate=False)
    assert e.value.status_code == 400 and "input" in e.value.error and str(CONTEXT) in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.embeddings(model=MODEL_NAME, prompt=long)
    assert e.value.status_code == 400 and "prompt" in e.value.error


@pytest.mark.parametrize("route, body, words", [
    ("embed", {"input": "hi", "dimensions": 7}, "dimensions"),
    ("embed", {"input": "hi", "options": {"num_ctx": 100_000}}, "num_ctx"),
    ("embed", {"input": 5}, "input"),
    ("embed", {"input": "hi", "stream": False}, "stream: is not a known parameter"),
    ("embed", {"input": ["a"] * 65}, "input"),
    ("embeddings", {"prompt": ["a"]}, "prompt"),
])
def test_bad_embed_requests_are_400_in_ollamas_error_body(server, route, body, words):
    r = httpx.post(f"{server.url}/api/{route}", json={"model": MODEL_NAME, **body}, headers=AUTH, timeout=60)
    assert words in _error(r, 400)


def test_logprobs(client):
    r = client.generate(model=MODEL_NAME, prompt="Hello", options={**GREEDY, "num_predict": 3}, logprobs=True,
                        top_logprobs=2)
    assert len(r.logprobs) == 3 and all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in r.logprobs)
    assert "".join(lp.token for lp in r.logprobs) == r.response
    assert all(lp.top_logprobs[0].logprob == lp.logprob for lp in r.logprobs)  # greedy: the best one


def test_a_client_that_leaves_mid_stream_aborts_the_request(server):
    aborted = server.metric(ABORTED)
    payload = json.dumps({"model": MODEL_NAME, "prompt": "Hello", "options": {"num_predict": 200}}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /api/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while received.count(b'"done":false') < 3:
        received += sock.recv(65536)
    sock.close()
    wait_for(lambda: server.metric("kvserve_kv_cache_blocks_used") == 0)
    wait_for(lambda: server.metric(ABORTED) == aborted + 1)
    assert server.metric("kvserve_requests_admitted") == 0


def test_a_tool_call_streamed_in_pieces_reaches_ollamas_stream_whole():
    """The chat path streams a call's arguments in pieces (OpenAI's form); Ollama's stream sends
    each call once, whole, with its arguments as an object: the model's Hermes text fed a few
    characters at a time through the server's own ChoiceDeltas, then gathered."""
    from kvserve.server.ollama.answers import WholeCalls
    from kvserve.server.canonical import ChoiceDeltas

    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    deltas, calls, content = ChoiceDeltas("auto"), WholeCalls(), ""
    for i in range(0, len(text), 3):
        for d in deltas.feed(text[i:i + 3]):
            calls.feed(d.get("tool_calls") or [])
            content += d.get("content") or ""
    rest, reason = deltas.finish("stop")
    for d in rest:
        calls.feed(d.get("tool_calls") or [])
    assert len(calls.by_index) == 1 and reason == "tool_calls" and content.strip() == ""
    assert calls.whole() == [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]
