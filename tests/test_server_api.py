"""The OpenAI-compatible API against a real server process, through the official `openai` client."""
from __future__ import annotations

import json
import subprocess
import sys

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from server_harness import API_KEY, MODEL_NAME, REPO, start_server, tiny_model_dir

PROMPT = "The capital of France is"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
GREEDY = dict(temperature=0, max_tokens=12, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory, "--max-n", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ready"}


def test_completion_stream_equals_whole(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    assert whole.object == "text_completion" and whole.model == MODEL_NAME
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_equals_whole(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    msg = whole.choices[0].message
    assert whole.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


FORECAST = {"type": "function", "function": {"name": "forecast", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}}}


def test_streamed_tool_call_arguments_come_in_pieces_that_add_up_to_the_response(client):
    """A forced call (deterministic on the random model), streamed through the SDK's helper: the
    arguments arrive in many deltas and concatenate to the non-streamed arguments exactly."""
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}], tools=[FORECAST],
              tool_choice={"type": "function", "function": {"name": "forecast"}}, temperature=0, max_tokens=60)
    whole = client.chat.completions.create(**kw)
    [call] = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "forecast"
    args = json.loads(call.function.arguments)
    assert args["unit"] in ("celsius", "fahrenheit") and 1 <= args["days"] <= 7
    pieces = []
    with client.chat.completions.stream(**kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = stream.get_final_completion()
    assert len(pieces) > 3 and "".join(pieces) == call.function.arguments
    [streamed] = final.choices[0].message.tool_calls
    assert streamed.function.arguments == call.function.arguments and streamed.function.parsed_arguments == args
    # The raw chunks: the first names the call (arguments ""), the rest carry only index and arguments.
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert (deltas[0].index, deltas[0].type, deltas[0].function.name, deltas[0].function.arguments) == \
        (0, "function", "forecast", "") and deltas[0].id.startswith("call_")
    assert all(d.index == 0 and d.id is None and d.type is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_forced_tool_choice_without_tools_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       tool_choice="required")
    assert e.value.body["param"] == "tool_choice" and "needs tools" in e.value.body["message"]


def test_a_legacy_function_message_is_a_tool_result(server, client):
    """role "function" with its name (OpenAI's deprecated form) renders as the tool message answering the
    assistant's call, and a chat completion accepts it."""
    call = {"name": "forecast", "arguments": '{"city": "Paris"}'}
    ask = [{"role": "user", "content": "Weather?"}]
    legacy = [*ask, {"role": "assistant", "content": None, "function_call": call},
              {"role": "function", "name": "forecast", "content": '{"temperature": 21}'}]
    tools = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_forecast", "type": "function", "function": call}]},
        {"role": "tool", "name": "forecast", "tool_call_id": "call_forecast", "content": '{"temperature": 21}'}]
    with server.client() as c:
        tokens = [c.post("/tokenize", json={"messages": m}).json()["tokens"] for m in (legacy, tools)]
        assert tokens[0] == tokens[1]
        assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in \
            c.post("/detokenize", json={"tokens": tokens[0]}).json()["prompt"]
    r = client.chat.completions.create(model=MODEL_NAME, messages=legacy, **GREEDY)
    assert r.usage.prompt_tokens == len(tokens[0]) and r.usage.completion_tokens == 12


def test_max_completion_tokens_and_content_parts(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    a = client.chat.completions.create(model=MODEL_NAME, messages=parts, temperature=0, max_completion_tokens=5)
    b = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Name a colour."}],
                                       temperature=0, max_tokens=5)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 5


def test_n2_completions_and_chat(client):
    params = dict(temperature=1.0, seed=7, max_tokens=8, n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **params)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.usage.completion_tokens == 16
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPT, stream=True, **params):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {c.index: c.text for c in whole.choices}  # seeded: the same two samples

    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **params)
    assert sorted(c.index for c in chat.choices) == [0, 1]
    streamed: dict[int, str] = {0: "", 1: ""}
    finished = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **params):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.append(c.index)
    assert streamed == {c.index: c.message.content for c in chat.choices}
    assert sorted(finished) == [0, 1]


def test_seed_reproduces(client):
    a, b = (client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=1.0, top_p=0.9, seed=123,
                                      max_tokens=10, extra_body={"top_k": 50, "min_p": 0.01}) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the top token
        assert top[token] == pytest.approx(logprob)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, logprobs=3, stream=True, **GREEDY))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 12
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace") == out.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    no_top = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, logprobs=True, **GREEDY)
    assert all(t.top_logprobs == [] for t in no_top.choices[0].logprobs.content)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_stop_string(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip() and full.index(stop) > 0
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, stop=stop, **GREEDY).choices[0]
    assert out.finish_reason == "stop" and out.text == full[: full.index(stop)]
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, stop=[stop], stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == out.text


def test_batch_and_token_prompts(server, client):
    single = [client.completions.create(model=MODEL_NAME, prompt=p, **GREEDY).choices[0].text for p in (PROMPT, "Once")]
    batch = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "Once"], **GREEDY)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == single
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}, headers=server.headers).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == single[0]


def test_tokenize_detokenize(server, tmp_path_factory):
    reference = Tokenizer.from_file(str(tiny_model_dir(tmp_path_factory) / "tokenizer.json"))
    text = "Héllo, wörld ✓ 123"
    with server.client() as c:
        tok = c.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
        assert tok["tokens"] == reference.encode(text).ids and tok["count"] == len(tok["tokens"])
        assert tok["max_model_len"] > 0
        assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
        chat = c.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["count"] > len(reference.encode("Be brief. Name a colour.").ids)


def test_api_key(server):
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
    bad = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + "/v1/completions", json=body, headers=server.headers).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200  # open
    assert httpx.get(server.url + "/metrics").status_code == 200  # open


def test_cors_is_off_by_default(server):
    r = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_metrics(server, client):
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    for name in ("kvserve_time_to_first_token_seconds_bucket", "kvserve_inter_token_latency_seconds_bucket",
                 "kvserve_e2e_request_latency_seconds_bucket", "kvserve_request_queue_time_seconds_bucket",
                 "kvserve_num_requests_running", "kvserve_num_requests_waiting", "kvserve_kv_cache_usage_perc",
                 "kvserve_prefix_cache_queries_total", "kvserve_prefix_cache_hits_total",
                 "kvserve_prompt_tokens_total", "kvserve_generation_tokens_total",
                 'kvserve_request_finished_total{finish_reason="length"}'):
        assert name in text, name
    assert server.metric("kvserve_generation_tokens_total") >= 12
    assert server.metric("kvserve_time_to_first_token_seconds_count") >= 1
    assert server.metric("kvserve_prefix_cache_hits_total") > 0  # the same prompt came many times


def test_chat_cli_streams_from_the_server(server):
    cmd = [sys.executable, "-m", "kvserve", "chat", "--url", server.url, "--model", MODEL_NAME,
           "--api-key", API_KEY, "--max-tokens", "6"]
    run = subprocess.run(cmd, input="Hello!\n", capture_output=True, text=True, cwd=REPO, timeout=60)
    assert run.returncode == 0, run.stderr
    want = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}], temperature=0, max_tokens=6)
    assert run.stdout.strip() == want.choices[0].message.content.strip()


def test_chat_cli_in_process_gives_the_same_answer(server, tmp_path_factory):
    model = str(tiny_model_dir(tmp_path_factory))
    cmd = [sys.executable, "-m", "kvserve", "chat", "--model", model, "--dtype", "float32", "--max-tokens", "6"]
    run = subprocess.run(cmd, input="Hello!\n", capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    want = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY).chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}], temperature=0, max_tokens=6)
    assert run.stdout.strip() == want.choices[0].message.content.strip()


def test_request_id_header_and_system_fingerprint(server):
    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
    with server.client() as c:
        r = c.post("/v1/chat/completions", json=body)
        made = r.headers["x-request-id"]
        assert r.status_code == 200 and made == r.json()["id"] and made.startswith("chatcmpl-")
        assert c.get(f"/v1/requests/{made}/timeline").json()["id"] == made  # the timeline's key too
        fp = r.json()["system_fingerprint"]
        assert fp.startswith("fp_") and len(fp) == 15
        done = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})
        assert done.headers["x-request-id"] == done.json()["id"] and done.json()["system_fingerprint"] == fp
        mine = c.post("/v1/chat/completions", json=body, headers={"x-request-id": "client-42_a.b"})
        assert mine.headers["x-request-id"] == "client-42_a.b" and mine.json()["id"].startswith("chatcmpl-")
        assert "x-request-id client-42_a.b is " + mine.json()["id"] in server.log()
        for insane in ("a" * 129, "has space", "tab\there"):
            r = c.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1},
                       headers={"x-request-id": insane})
            assert r.headers["x-request-id"] == r.json()["id"]
        assert c.get("/v1/models", headers={"x-request-id": "m1"}).headers["x-request-id"] == "m1"
        assert len(c.get("/v1/nope").headers["x-request-id"]) == 32  # errors too: a made-up hex id
        bad = c.post("/v1/chat/completions", json={**body, "temperature": 9}, headers={"x-request-id": "e1"})
        assert bad.status_code == 400 and bad.headers["x-request-id"] == "e1"
    unauthorized = httpx.get(server.url + "/v1/models", headers={"x-request-id": "u1"})
    assert unauthorized.status_code == 401 and unauthorized.headers["x-request-id"] == "u1"


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_usage_is_null_on_every_chunk_but_the_last(server, route):
    """Under stream_options.include_usage the OpenAI SDK expects the key on every chunk."""
    path, body = (("/v1/chat/completions", {"messages": MESSAGES}) if route == "chat"
                  else ("/v1/completions", {"prompt": PROMPT}))
    body = {**body, "model": MODEL_NAME, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with server.client() as c:
        lines = c.post(path, json=body).text.split("\n\n")
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines if line and line != "data: [DONE]"]
    # at least one chunk of text before the usage: a loaded machine may merge all four tokens' deltas into one
    # (engine/async_engine.py merges what the stream has not read yet)
    assert len(chunks) >= 2 and all("usage" in ch and ch["usage"] is None for ch in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert all(ch["system_fingerprint"].startswith("fp_") for ch in chunks)
    plain = {k: v for k, v in body.items() if k != "stream_options"}
    with server.client() as c:
        lines = c.post(path, json=plain).text.split("\n\n")
    assert not any('"usage"' in line for line in lines)


def test_logit_bias_reaches_the_sampler(server, client):
    """+100 on two tokens: greedy picks one of them (A); -100 on A then leaves B."""
    with server.client() as c:
        a_b = c.post("/tokenize", json={"prompt": " blue green", "add_special_tokens": False}).json()["tokens"][:2]
        kw = dict(model=MODEL_NAME, temperature=0, max_tokens=3, extra_body={"ignore_eos": True})
        both = client.completions.create(prompt=PROMPT, logit_bias={str(t): 100 for t in a_b}, **kw).choices[0].text
        first = next(t for t in a_b if c.post("/detokenize", json={"tokens": [t] * 3}).json()["prompt"] == both)
        [second] = [t for t in a_b if t != first]
        only = {str(first): -100, str(second): 100}
        reply = client.chat.completions.create(messages=MESSAGES, logit_bias=only, **kw)
        assert reply.choices[0].message.content == c.post("/detokenize", json={"tokens": [second] * 3}).json()["prompt"]
        streamed = client.completions.create(prompt=PROMPT, logit_bias=only, stream=True, **kw)
        assert "".join(ch.choices[0].text for ch in streamed) == reply.choices[0].message.content


@pytest.mark.parametrize("bias, words", [({"hello": 1}, "decimal strings"), ({"99999999": 1}, "outside the vocabulary"),
                                         ({"5": 101}, "[-100, 100]"), ({str(i): 1 for i in range(301)}, "at most 300")])
def test_bad_logit_bias_is_a_400_naming_it(client, bias, words):
    for create in (lambda: client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, logit_bias=bias),
                   lambda: client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
                                                          logit_bias=bias)):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.param == "logit_bias" and words in e.value.message
