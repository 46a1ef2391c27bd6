"""Anthropic's Messages API against a real `kvserve serve` of the tiny random model, through the
official `anthropic` SDK (streamed with messages.stream and with stream=True, and not), and raw
HTTP where the wire itself is the point (event names and order, error bodies).

The tiny model's greedy output never reaches its end-of-turn token within a 256-token context
(checked below), so lengths are exact; a forced tool_choice makes its tool call valid by grammar.
"""
from __future__ import annotations

import json
import socket

import anthropic
import httpx
import pytest

from server_harness import API_KEY, MODEL_NAME, start_server, wait_for

CONTEXT = 256
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # not among the SDK's arguments any more: sent as extra_body
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
ABORTED = 'kvserve_request_finished_total{finish_reason="abort"}'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-model-len", str(CONTEXT))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0)


def sse_events(server, body: dict, headers: dict | None = None) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed answer, read off the wire."""
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=60,
                      headers=headers or {"x-api-key": API_KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_a_message_whole_and_streamed_two_ways_agree(client, server):
    kw = dict(model=MODEL_NAME, max_tokens=10, system="Be brief.", messages=ASK, extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL_NAME
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 10
    prompt = client.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=ASK).input_tokens
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == prompt

    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10
    # The prefix cache served the repeated prompt: the usage says how much of it.
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    assert final.usage.cache_read_input_tokens > 0

    raw = list(client.messages.create(**kw, stream=True))
    assert "".join(e.delta.text for e in raw if e.type == "content_block_delta") == text


def test_stream_events_are_named_and_ordered_as_anthropic_sends_them(server):
    events = sse_events(server, {"model": MODEL_NAME, "max_tokens": 5, "messages": ASK, **GREEDY})
    names = [n for n, _ in events]
    assert all(n == data["type"] for n, data in events)  # each `event:` line names its data's type
    assert names == ["message_start", "content_block_start", "ping"] + ["content_block_delta"] * (len(names) - 6) + [
        "content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["delta"]["type"] == "text_delta" and d["index"] == 0 for n, d in events if n == "content_block_delta")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} and delta["usage"]["output_tokens"] == 5
    # The prompt's tokens split as the final usage splits them (here the second time: read from the prefix cache).
    again = sse_events(server, {"model": MODEL_NAME, "max_tokens": 5, "messages": ASK, **GREEDY})
    start, last = again[0][1]["message"]["usage"], again[-2][1]["usage"]
    assert start == {**last, "output_tokens": 0} and start["cache_read_input_tokens"] > 0, (start, last)


def test_system_as_text_blocks_counts_as_the_string(client):
    blocks = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in French."}]
    as_blocks = client.messages.count_tokens(model=MODEL_NAME, system=blocks, messages=ASK).input_tokens
    as_string = client.messages.count_tokens(model=MODEL_NAME, system="Be brief.\nAnswer in French.", messages=ASK)
    assert as_blocks == as_string.input_tokens  # blocks joined by a newline
    assert as_blocks != client.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=ASK).input_tokens


def test_stop_sequences_set_stop_reason_and_stop_sequence(client):
    text = client.messages.create(model=MODEL_NAME, max_tokens=12, messages=ASK, extra_body=GREEDY).content[0].text
    stop = text[len(text) // 2:][:4]  # four characters from the middle of the greedy answer
    kw = dict(model=MODEL_NAME, max_tokens=12, messages=ASK, stop_sequences=["never appears", stop], extra_body=GREEDY)
    whole = client.messages.create(**kw)
    assert whole.stop_reason == "stop_sequence" and whole.stop_sequence == stop
    assert whole.content[0].text == text[:text.index(stop)]
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, final.content[0].text) == ("stop_sequence", stop, whole.content[0].text)


def test_a_tool_round_trip_forced_with_tool_choice(client):
    first = client.messages.create(model=MODEL_NAME, max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = first.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input["city"] in ("Paris", "Rome") and call.input["unit"] in ("celsius", "fahrenheit")
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C, sunny"}]}
    conversation = [*ASK, {"role": "assistant", "content": first.content}, result]
    second = client.messages.create(model=MODEL_NAME, max_tokens=6, messages=conversation, tools=[WEATHER],
                                    extra_body=GREEDY)
    assert second.stop_reason == "max_tokens" and second.content[0].type == "text"
    # The tool result is part of the prompt the model saw.
    without = client.messages.count_tokens(model=MODEL_NAME, messages=[*ASK], tools=[WEATHER]).input_tokens
    with_result = client.messages.count_tokens(model=MODEL_NAME, messages=conversation, tools=[WEATHER]).input_tokens
    assert with_result > without + 5

    # Streamed, with tool_choice any: the call arrives as a tool_use block and input_json_delta.
    with client.messages.stream(model=MODEL_NAME, max_tokens=60, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds and final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == call.input  # greedy: the same call


def test_blocks_passed_back_as_model_dump_are_taken(client):
    """The SDK's `block.model_dump()` writes fields a request does not use (`toolset_name: null`,
    `caller`, `citations`): Anthropic's API takes such blocks, and so does kvserve."""
    first = client.messages.create(model=MODEL_NAME, max_tokens=60, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    (call,) = first.content
    dumped = call.model_dump()
    assert "toolset_name" in dumped and "caller" in dumped  # what anthropic 2.17 writes
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C, sunny"}]}
    dumped_turn = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in first.content]}, result]
    typed_turn = [*ASK, {"role": "assistant", "content": first.content}, result]
    counts = [client.messages.count_tokens(model=MODEL_NAME, messages=m, tools=[WEATHER]).input_tokens
              for m in (dumped_turn, typed_turn)]
    assert counts[0] == counts[1]  # the same prompt: the extra fields are dropped, nothing else
    text = client.messages.create(model=MODEL_NAME, max_tokens=3, messages=ASK, extra_body=GREEDY).content[0]
    again = [*ASK, {"role": "assistant", "content": [text.model_dump()]}, {"role": "user", "content": "And Rome?"}]
    assert client.messages.create(model=MODEL_NAME, max_tokens=3, messages=again, extra_body=GREEDY).content


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ({"type": "none"}, {"type": "auto"}):
        m = client.messages.create(model=MODEL_NAME, max_tokens=4, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                   extra_body=GREEDY)
        assert m.stop_reason == "max_tokens" and m.content[0].type == "text"


def test_max_tokens_is_a_ceiling_the_context_cuts(client):
    """Agents send max_tokens far past a small model's context: served, not refused, and the answer
    says the context ended it."""
    with client.messages.stream(model=MODEL_NAME, max_tokens=32000, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    used = final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) + final.usage.output_tokens
    assert final.stop_reason == "model_context_window_exceeded" and used == CONTEXT


def _error(r: httpx.Response, status: int, kind: str = "invalid_request_error") -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    assert "Traceback" not in r.text and ".py" not in r.text, r.text
    return body["error"]["message"]


BAD = [
    ("max-tokens-missing", {"messages": ASK}, "max_tokens: is required"),
    ("max-tokens-zero", {"max_tokens": 0, "messages": ASK}, "max_tokens must be"),
    ("messages-empty", {"max_tokens": 4, "messages": []}, "messages must not be empty"),
    ("prefill", {"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "last message"),
    ("bad-role", {"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ("image", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages[0].content[0]: image blocks are not supported"),
    ("tool-result-in-assistant", {"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}, *ASK]}, "cannot be in a assistant message"),
    ("unknown-tool", {"max_tokens": 4, "messages": ASK, "tools": [WEATHER],
                      "tool_choice": {"type": "tool", "name": "nope"}}, "'nope', which is not among the tools"),
    ("tool-choice-without-name", {"max_tokens": 4, "messages": ASK, "tools": [WEATHER],
                                  "tool_choice": {"type": "tool"}}, "tool_choice"),
    ("server-tool", {"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search",
                                                                  "input_schema": {}}]}, "server tool"),
    ("temperature", {"max_tokens": 4, "messages": ASK, "temperature": 3}, "temperature must be"),
    ("stop-sequences", {"max_tokens": 4, "messages": ASK, "stop_sequences": [""]}, "stop_sequences must be"),
    ("misspelt", {"max_tokens": 4, "messages": ASK, "max_token": 4}, "max_token: is not a known parameter"),
    ("too-long", {"max_tokens": 4, "messages": [{"role": "user", "content": "hello " * 400}]}, "256"),
    # A block's own errors name the block and its field.
    ("tool-use-without-id", {"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "get_weather", "input": {}}]}, *ASK]}, "messages[1].content[0].id: is required"),
    ("text-not-a-string", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text: Input should be a valid string"),
    ("block-without-type", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"text": "hi"}]}]},
     "messages[0].content[0].type: is required"),
    ("unknown-block-type", {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages[0].content[0].type: Input tag 'video'"),
    ("tool-result-inner-block", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": [{"type": "text"}]}]}]},
     "messages[0].content[0].content[0].text: is required"),
    ("content-not-a-list", {"max_tokens": 4, "messages": [{"role": "user", "content": 5}]}, "messages[0].content: must be"),
]


@pytest.mark.parametrize("body, words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_requests_are_400_in_anthropics_error_body(server, body, words):
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL_NAME, **body}, headers={"x-api-key": API_KEY})
    assert words in _error(r, 400)


def test_other_errors_in_anthropics_error_body(server):
    url, key = server.url + "/v1/messages", {"x-api-key": API_KEY}
    body = {"model": MODEL_NAME, "max_tokens": 4, "messages": ASK}
    assert "not valid JSON" in _error(httpx.post(url, content=b'{"model": ', headers=key), 400)
    assert "'claude-x'" in _error(httpx.post(url, json={**body, "model": "claude-x"}, headers=key), 404, "not_found_error")
    _error(httpx.post(url, content=json.dumps({**body, "system": "x" * (5 << 20)}), headers=key), 413)
    _error(httpx.get(url, headers=key), 405)
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0).messages.count_tokens(
            model=MODEL_NAME, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}],
                         ids=["missing", "wrong-x-api-key", "wrong-bearer"])
def test_the_api_key_is_checked_and_answered_in_anthropics_shape(server, headers):
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL_NAME, "max_tokens": 2, "messages": ASK},
                   headers=headers)
    _error(r, 401, "authentication_error")


def test_x_api_key_or_bearer_is_accepted(server):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": ASK}
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert httpx.post(server.url + "/v1/messages", json=body, headers=headers, timeout=60).status_code == 200
    # and on the OpenAI routes too: one key, two ways to send it
    chat = {"model": MODEL_NAME, "max_tokens": 2, "messages": ASK}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"x-api-key": API_KEY},
                      timeout=60).status_code == 200


def test_a_client_that_leaves_mid_stream_aborts_the_request(server):
    aborted = server.metric(ABORTED)
    payload = json.dumps({"model": MODEL_NAME, "max_tokens": 200, "messages": ASK, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"x-api-key: {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload)
    received = b""
    while received.count(b"event: content_block_delta") < 3:
        received += sock.recv(65536)
    sock.close()
    wait_for(lambda: server.metric("kvserve_kv_cache_blocks_used") == 0)
    wait_for(lambda: server.metric(ABORTED) == aborted + 1)
    assert server.metric("kvserve_requests_admitted") == 0
