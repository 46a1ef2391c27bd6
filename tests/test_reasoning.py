"""A thinking model's reasoning apart from its answer (kvserve/structured/reasoning.py): the split
of recorded outputs of each family, whole and streamed in any pieces; and a real server with a
thinking chat template, where the reasoning never reaches `content` — OpenAI chat completions
(`reasoning_content`, as vLLM) and Ollama (`thinking`), streamed or not, and
`chat_template_kwargs` / `think: false` turn thinking off in the template."""
from __future__ import annotations

import json
import random

import httpx
import pytest

from kvserve.server.canonical import ChoiceDeltas, chat_message
from kvserve.structured.reasoning import ReasoningSplit, reasoning_tokens, split, thinks
from kvserve.tokenizer import Tokenizer
from server_harness import MODEL_NAME, start_server

# Outputs as the families write them (their templates: Qwen3 lets the model open the block; the
# R1 distills' template opens it in the prompt, so the output starts inside).
RECORDED = {
    "qwen3": ("<think>\nThe user wants 2 + 2. That is 4 (and 3 < 4, and </thi is not a tag).\n</think>\n\n2 + 2 = 4.",
              False, "The user wants 2 + 2. That is 4 (and 3 < 4, and </thi is not a tag).\n", "2 + 2 = 4."),
    "qwen3-off": ("<think>\n\n</think>\n\nHello!", False, "", "Hello!"),
    "r1-distill": ("Okay, the capital of France.\nIt is Paris.\n</think>\n\nThe capital of France is Paris.", True,
                   "Okay, the capital of France.\nIt is Paris.\n", "The capital of France is Paris."),
    "plain": ("An answer that mentions <think> later.", False, None, "An answer that mentions <think> later."),
    "cut-off": ("<think>\nStill weighing it </th", False, "Still weighing it </th", ""),
    "half-tag": ("<thin", False, None, "<thin"),
}


@pytest.mark.parametrize("name", RECORDED)
def test_each_family_splits_the_same_whole_and_in_any_pieces(name: str) -> None:
    text, inside, reasoning, content = RECORDED[name]
    assert split(text, inside) == (reasoning, content)
    for seed in range(100):
        rng = random.Random(seed)
        s, parts, i = ReasoningSplit(inside), [], 0
        while i < len(text):
            j = i + rng.randint(1, 7)
            parts += s.feed(text[i:j])
            i = j
        parts += s.finish()
        assert "".join(t for k, t in parts if k == "reasoning") == (reasoning or "")
        assert "".join(t for k, t in parts if k == "content") == content


def test_a_tool_call_after_the_reasoning_is_read_as_a_call() -> None:
    text = '<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    message, finish = chat_message(text, "stop", "auto", False)
    assert message["reasoning_content"] == "I should look it up.\n" and message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert finish == "tool_calls"
    deltas = ChoiceDeltas("auto", False)
    streamed = [d for piece in (text[:20], text[20:50], text[50:]) for d in deltas.feed(piece)]
    streamed += deltas.finish("stop")[0]
    assert "".join(d.get("reasoning_content", "") for d in streamed) == "I should look it up.\n"
    assert not any(d.get("content") for d in streamed)
    assert "".join(c["function"].get("arguments", "") for d in streamed for c in d.get("tool_calls", [])) == '{"city": "Paris"}'


@pytest.mark.parametrize("name", RECORDED)
def test_reasoning_tokens_count_the_block_up_to_the_token_that_closes_it(default_gguf, name: str) -> None:
    """usage's reasoning_tokens: a recorded output tokenized in two parts, its block (up to and with
    `</think>`, which this vocabulary spells in several tokens) and the rest; all of it when the
    block never closes, none without a block."""
    tok = Tokenizer.from_gguf(default_gguf)
    text, inside, thought, _ = RECORDED[name]
    end = text.find("</think>") + len("</think>") if thought is not None and "</think>" in text else None
    head, rest = (text[:end], text[end:]) if end is not None else (text, "")
    ids = tok.encode(head) + tok.encode(rest)
    expected = len(ids) if thought is not None and end is None else len(tok.encode(head)) if end else 0
    assert reasoning_tokens(ids, tok.decode, inside) == expected, (name, expected)


def test_which_templates_think() -> None:
    assert thinks(THINKING_TEMPLATE)
    assert not thinks("{% for m in messages %}{{ m.content }}{% endfor %}")


# A thinking template as the R1 distills' (the prompt opens the block) with Qwen3's switch.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    s = start_server(tmp_path_factory, "--max-model-len", "256", "--chat-template", str(template))
    yield s
    s.stop()


def _chat(stream: bool = False, **extra) -> dict:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 12,
            "temperature": 0, "stream": stream, **extra}


def _sse(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_chat_completions_return_the_reasoning_apart_streamed_or_not(server) -> None:
    # The tiny random model never closes the block within 12 tokens: everything it writes is reasoning.
    with server.client() as c:
        answer = c.post("/v1/chat/completions", json=_chat()).json()
        whole = answer["choices"][0]["message"]
        chunks = _sse(c.post("/v1/chat/completions", json=_chat(stream=True, stream_options={"include_usage": True})))
        off = c.post("/v1/chat/completions", json=_chat(chat_template_kwargs={"enable_thinking": False})).json()
        bad = c.post("/v1/chat/completions", json=_chat(chat_template_kwargs={"messages": []}))
    assert whole["reasoning_content"] and whole["content"] == ""
    assert answer["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    deltas = [ch["choices"][0]["delta"] for ch in chunks if ch["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    # Thinking off: the template writes an empty block into the prompt, and the output is the answer.
    message = off["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"] and off["usage"]["completion_tokens"] == 12
    assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}
    assert bad.status_code == 400 and "chat_template_kwargs cannot set messages" in bad.text


def test_ollama_returns_thinking_apart_and_think_false_turns_it_off(server) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "options": {"num_predict": 12, "temperature": 0}}
    with server.client() as c:
        whole = c.post("/api/chat", json={**body, "stream": False}).json()["message"]
        lines = [json.loads(line) for line in c.post("/api/chat", json=body).text.splitlines()]
        off = c.post("/api/chat", json={**body, "stream": False, "think": False}).json()["message"]
        generate = c.post("/api/generate", json={"model": MODEL_NAME, "prompt": "What is 2 + 2?", "stream": False,
                                                  "options": {"num_predict": 12, "temperature": 0}}).json()
    assert whole["thinking"] and whole["content"] == ""
    assert "".join(line["message"].get("thinking", "") for line in lines) == whole["thinking"]
    assert "".join(line["message"]["content"] for line in lines) == ""
    assert "thinking" not in off and off["content"]
    assert generate["thinking"] == whole["thinking"] and generate["response"] == ""


def test_anthropic_returns_a_thinking_block_when_asked_and_the_sdk_reads_it(server) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key=server.api_key)
    ask = dict(model=MODEL_NAME, max_tokens=12, extra_body={"temperature": 0.0},
               messages=[{"role": "user", "content": "What is 2 + 2?"}])
    whole = client.messages.create(**ask, thinking={"type": "enabled", "budget_tokens": 1024})
    with client.messages.stream(**ask, thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        thoughts = [e.thinking for e in stream if e.type == "thinking"]
        streamed = stream.get_final_message()
    plain = client.messages.create(**ask)  # not asked for: the template's switch is off, the answer is text
    assert [b.type for b in whole.content] == ["thinking"] and whole.content[0].thinking
    assert "".join(thoughts) == whole.content[0].thinking
    assert [(b.type, b.thinking) for b in streamed.content] == [("thinking", whole.content[0].thinking)]
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text


def test_responses_return_a_reasoning_item_streamed_or_not(server) -> None:
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key)
    ask = dict(model=MODEL_NAME, input="What is 2 + 2?", max_output_tokens=12, temperature=0.0, store=False)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    final = next(e.response for e in events if e.type == "response.incomplete")
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 12
    text = whole.output[0].content[0].text
    assert text and whole.output[1].content[0].text == "" and whole.output_text == ""
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output[0].content[0].text == text
