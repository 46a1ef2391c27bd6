"""Structured output in the engine (xgrammar masks per sequence) and the tool-call parser."""
from __future__ import annotations

import json
import re

import pytest

from kvserve import LLM, CacheConfig, SamplingParams
from kvserve.structured import grammar
from kvserve.structured.spec import Constraint, from_response_format, from_vllm, json_schema
from kvserve.structured.tool_calls import ToolCallStream, parse_forced, parse_tool_calls, template_formats


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=256))


# -- request fields → Constraint ---------------------------------------------------------------
def test_response_format_forms() -> None:
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    c = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                                      "schema": {"type": "integer"}}})
    assert (c.kind, json.loads(c.value), c.param) == ("json", {"type": "integer"}, "response_format.json_schema.schema")
    with pytest.raises(ValueError, match="response_format.type must be text, json_object or json_schema"):
        from_response_format({"type": "yaml"})


def test_vllm_forms_take_one_constraint() -> None:
    assert from_vllm({"regex": r"\d+", "json": None}, "guided_").kind == "regex"
    assert json.loads(from_vllm({"choice": ["a", "b"]}, "structured_outputs.").value) == ["a", "b"]
    with pytest.raises(ValueError, match="give one structured output constraint, got guided_json, guided_regex"):
        from_vllm({"regex": "a", "json": {}}, "guided_")
    with pytest.raises(ValueError, match="guided_choice must be a non-empty list of strings"):
        from_vllm({"choice": []}, "guided_")
    with pytest.raises(ValueError, match="guided_json must be a JSON schema"):
        from_vllm({"json": "{not json"}, "guided_")


def test_bad_schema_is_a_value_error_naming_the_field(tiny) -> None:
    bad = SamplingParams(constraint=json_schema({"type": "object", "properties": {"a": {"type": "nope"}}}, "guided_json"))
    with pytest.raises(ValueError, match=r"^guided_json is not a valid JSON schema"):
        tiny.engine.inputs.process("hi", bad)
    with pytest.raises(ValueError, match=r"^guided_regex is not a valid regular expression"):
        tiny.engine.inputs.process("hi", SamplingParams(constraint=Constraint("regex", "(unclosed", "guided_regex")))


# -- the engine obeys the grammar, whatever the (random) model prefers -------------------------
def test_regex_and_choice_hold_in_one_batch_with_free_rows(tiny) -> None:
    free = SamplingParams(temperature=1.0, seed=3, max_tokens=8)
    regex = SamplingParams(temperature=1.0, seed=4, max_tokens=20, n=3,
                           constraint=Constraint("regex", r"[0-9]{3}-[a-c]{2}", "guided_regex"))
    choice = SamplingParams(temperature=1.0, seed=5, max_tokens=20, n=2,
                            constraint=Constraint("choice", json.dumps(["yes", "no", "maybe not"]), "guided_choice"))
    outs = tiny.generate(["a", "b", "c"], [free, regex, choice], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length"  # unconstrained row untouched
    for c in outs[1].outputs:
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", c.text) and c.finish_reason == "stop"
    for c in outs[2].outputs:
        assert c.text in ("yes", "no", "maybe not") and c.finish_reason == "stop"


def test_json_schema_with_enums_is_valid_json(tiny) -> None:
    schema = {"type": "object", "properties": {"level": {"enum": ["low", "high"]}, "ok": {"type": "boolean"},
                                               "ids": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 3}},
              "required": ["level", "ok", "ids"], "additionalProperties": False}
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=64, n=4, constraint=json_schema(schema, "x"))
    for c in tiny.generate("data:", params, use_tqdm=False)[0].outputs:
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        assert value["level"] in ("low", "high") and isinstance(value["ok"], bool)
        assert set(value["ids"]) <= {1, 2} and len(value["ids"]) <= 3


def test_a_grammar_that_cannot_continue_ends_with_finish_reason_grammar(tiny) -> None:
    # min_tokens bans the stop token the finished grammar requires: no allowed token is left.
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                            constraint=Constraint("choice", json.dumps(["ok"]), "guided_choice"))
    out = tiny.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("ok", grammar.FINISH_REASON)
    tiny.manager.pool.check_invariant()
    assert tiny.manager.pool.num_used_blocks == 0


# -- tool calls --------------------------------------------------------------------------------
def test_hermes_tool_calls_with_text_before() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n' \
           '<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Paris"}), ("time", {})]


def test_llama3_json_calls_and_plain_text() -> None:
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert parse_tool_calls("Paris is the capital.") == ("Paris is the capital.", [])
    assert parse_tool_calls("{not a call}") == ("{not a call}", [])
    assert [c.name for c in parse_forced('[{"name": "f", "arguments": {"a": 1}}]')] == ["f"]


# Replies as Mistral (v0.3 and the v11 tokenizer's form) and Phi-4-mini write calls; and near misses.
RECORDED_CALLS = {
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]': [("get_weather", '{"city": "Paris"}')],
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}': [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]': [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    "functools is a Python module.": [],
    "[TOOL_CALLS] not a call": [],
    "f": [],
}


@pytest.mark.parametrize("text", RECORDED_CALLS)
def test_mistral_and_phi4_calls_whole_and_streamed(text: str) -> None:
    want = RECORDED_CALLS[text]
    content, calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == want and content == (None if want else text)
    stream, deltas = ToolCallStream(), []
    for i in range(0, len(text), 3):
        deltas += stream.feed(text[i:i + 3])
    deltas += stream.finish()
    assert [(c.name, c.arguments) for c in stream.calls] == want
    assert "".join(d.get("content", "") for d in deltas) == ("" if want else text)


# Template excerpts as each family writes its tool instructions, and a template without tools.
TEMPLATES = {
    "qwen": ('For each function call, return a json object with function name and arguments within '
             '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}',
             {"hermes"}),
    "llama3": ('Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
               '{%- if message.role == "ipython" %}<|python_tag|>', {"llama3"}),
    "mistral": ("{%- if message.tool_calls %}[TOOL_CALLS][{%- for tool_call in message.tool_calls %}", {"mistral"}),
    "smollm2": ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>",
                None),
}
JSON_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("family", TEMPLATES)
def test_the_call_formats_read_are_the_ones_the_template_teaches(family: str) -> None:
    source, formats = TEMPLATES[family]
    assert template_formats(source) == (frozenset(formats) if formats else None)
    read = template_formats(source)
    for text, format_ in [(JSON_CALL, "llama3"), (HERMES_CALL, "hermes"), ('[TOOL_CALLS]get_weather[ARGS]{}', "mistral")]:
        calls = format_ in formats if formats else True  # a template that names none: any format is read
        content, whole = parse_tool_calls(text, read)
        stream, deltas = ToolCallStream(formats=read), []
        for i in range(0, len(text), 4):
            deltas += stream.feed(text[i:i + 4])
        deltas += stream.finish()
        assert (len(whole) == 1, len(stream.calls) == 1) == (calls, calls), (family, text)
        assert content == (None if calls else text)
        assert "".join(d.get("content", "") for d in deltas) == ("" if calls else text)


def _streamed(text: str, size: int, forced: bool = False) -> tuple[str, list[dict], list]:
    """Feed text in pieces of `size`: (content, the tool_calls deltas, the calls read)."""
    stream = ToolCallStream(forced=forced)
    deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])] + stream.finish()
    return "".join(d.get("content", "") for d in deltas), [tc for d in deltas for tc in d.get("tool_calls", [])], stream.calls


@pytest.mark.parametrize("text, forced, content", [
    ('Sure.<tool_call>{"name": "weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"d": 2}]}}</tool_call>'
     '<tool_call>{"name": "time", "arguments": {}}</tool_call>', False, "Sure."),
    ('[{"name": "weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"d": 2}]}}, {"name": "time", "arguments": {}}]',
     True, ""),
])
def test_streamed_tool_call_arguments_come_in_pieces_that_add_up_to_the_whole_parse(text, forced, content) -> None:
    whole_content, _, whole = _streamed(text, len(text), forced)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole] == \
        [("weather", '{"city": "Pa\\"ris}", "n": [1, {"d": 2}]}'), ("time", "{}")]  # as the model wrote them
    for size in (1, 3, 7):
        streamed_content, deltas, _ = _streamed(text, size, forced)
        assert streamed_content == content
        firsts = [d for d in deltas if "id" in d]
        assert [(d["index"], d["type"], d["function"]["name"], d["function"]["arguments"]) for d in firsts] == \
            [(0, "function", "weather", ""), (1, "function", "time", "")]
        assert all(d["id"].startswith("call_") for d in firsts)
        pieces = [d for d in deltas if "id" not in d]
        assert all(d.keys() == {"index", "function"} and d["function"].keys() == {"arguments"} for d in pieces)
        assert len(pieces) > 2  # in pieces, not whole
        for i, call in enumerate(whole):
            assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == i) == call.arguments


def test_a_call_cut_short_streams_what_was_written_and_other_shapes_come_whole() -> None:
    _, deltas, calls = _streamed('<tool_call>{"name": "f", "arguments": {"a": "xy', 2)
    assert calls[0].arguments == '{"a": "xy' == "".join(d["function"]["arguments"] for d in deltas)
    # Arguments as a string, or before the name: read whole at the block's end (one delta per call).
    for text in ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'):
        _, deltas, calls = _streamed(text, 3)
        assert len(deltas) == 1 and deltas[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    # A block that closes on unbalanced arguments ends its call there; text that is no call stays content.
    _, deltas, calls = _streamed('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>', 4)
    assert calls[0].arguments == '{"a": 1'
    assert _streamed("<tool_call>not json</tool_call>", 5)[0] == "<tool_call>not json</tool_call>"


# -- tools into the template, forced calls ------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_template_without_tools_gets_them_in_the_system_message() -> None:
    from kvserve.tokenizer.tool_messages import template_messages

    chatml = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = template_messages([{"role": "user", "content": "Weather?"},
                              {"role": "assistant", "content": None, "tool_calls": [call]},
                              {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}], [WEATHER], chatml)
    assert msgs[0]["role"] == "system" and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content":
                       '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"}
    # A template that knows tools gets the messages as they are, arguments as an object.
    kept = template_messages([{"role": "assistant", "tool_calls": [call]}], [WEATHER], "{{ tools }}")
    assert kept[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_forced_tool_choice_constrains_the_arguments(tiny) -> None:
    from kvserve.structured.tools import forced_call_constraint

    with pytest.raises(ValueError, match="tool_choice names the function 'nope', which is not among the tools"):
        forced_call_constraint([WEATHER], {"type": "function", "function": {"name": "nope"}}, True)
    assert forced_call_constraint([WEATHER], "auto", True) is None
    c = forced_call_constraint([WEATHER], "required", False)
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=80, n=3, constraint=c)
    for out in tiny.generate("call:", params, use_tqdm=False)[0].outputs:
        if out.finish_reason == "length":  # a random model may write a long city name
            continue
        [call] = parse_forced(out.text)
        assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)


def test_sampling_defaults(tmp_path) -> None:
    from kvserve.generation_defaults import SERVER_DEFAULTS, resolve

    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": 2}')
    d = resolve(tmp_path)
    assert d.given() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20} and d.source == "generation_config.json"
    assert resolve(tmp_path, "none") == SERVER_DEFAULTS
    assert resolve(tmp_path, "auto", '{"temperature": 0.1}').given()["temperature"] == 0.1
    with pytest.raises(ValueError, match="--default-sampling: unknown field"):
        resolve(tmp_path, "auto", '{"temp": 0.1}')
    with pytest.raises(ValueError, match="temperature must be a finite number in"):
        resolve(tmp_path, "auto", '{"temperature": 9}')


def test_unbounded_integers_and_numbers_get_bounds_and_given_ones_stay() -> None:
    from kvserve.structured.bounds import INT_MAX, INT_MIN, NUMBER_LIMIT, bounded

    schema = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}, "c": {"type": ["number", "null"]},
        "d": {"type": "integer", "exclusiveMaximum": 10}, "e": {"enum": [{"type": "integer"}]},
        "f": {"type": "array", "items": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "type": {"type": "string"}}}
    out = json.loads(bounded(json.dumps(schema)))["properties"]
    assert out["a"] == {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX}
    assert out["b"] == {"type": "integer", "minimum": 0, "maximum": INT_MAX}
    assert out["c"] == {"type": ["number", "null"], "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}
    assert out["d"] == {"type": "integer", "minimum": INT_MIN, "exclusiveMaximum": 10}
    assert out["e"] == {"enum": [{"type": "integer"}]}  # data, not a schema
    assert out["f"]["items"]["anyOf"][0] == {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX}
    assert out["type"] == {"type": "string"}


def test_any_value_places_and_json_object_get_the_bounded_any_value() -> None:
    from kvserve.structured.bounds import ANY_REF, JSON_OBJECT, bounded

    schema = {"type": "object", "properties": {"description": {"type": "string"}, "x": {"description": "anything"},
                                               "y": {}, "z": True}, "additionalProperties": True}
    out = json.loads(bounded(json.dumps(schema)))
    props = out["properties"]
    assert props["description"] == {"type": "string"}  # a property named like an annotation is a property
    assert props["x"] == {"description": "anything", **ANY_REF} and props["y"] == props["z"] == ANY_REF
    assert out["additionalProperties"] == ANY_REF
    anyof = out["$defs"]["kvserve_any_json_value"]["anyOf"]
    assert {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1} in anyof
    assert json.loads(bounded(json.dumps({"type": "string"}))) == {"type": "string"}  # no $defs when not needed
    assert json.loads(bounded(JSON_OBJECT))["additionalProperties"] == ANY_REF


def test_compiled_json_object_and_any_values_refuse_a_number_past_int64(default_gguf) -> None:
    import xgrammar as xgr

    from kvserve.structured.grammar import GrammarCompiler
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(default_gguf)
    compiler = GrammarCompiler(tok, tok.vocab_size, frozenset(tok.eos_token_ids))

    def accepts(c: Constraint, text: str) -> bool:
        return xgr.GrammarMatcher(compiler.build(c)).accept_string(text)

    json_object = Constraint("json_object")
    assert accepts(json_object, '{"a": [{"b": 1.5, "c": null}], "d": 9223372036854775807}')
    assert not accepts(json_object, '{"a": 99999999999999999999}')  # 20 digits
    assert not accepts(json_object, '{"a":  1}')  # no run of whitespace
    anything = Constraint("json", json.dumps({"type": "object", "properties": {"v": {"description": "any"}},
                                              "required": ["v"]}))
    assert accepts(anything, '{"v": [1, "x"]}') and not accepts(anything, '{"v": 99999999999999999999}')
