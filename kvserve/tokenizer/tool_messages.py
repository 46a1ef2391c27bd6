"""Tools on the way into a chat template: the conversation it sees.

Templates written for tool use (Qwen2.5, Llama 3.x, Hermes, SmolLM3) receive `tools` and render
`tool` messages and assistant `tool_calls` themselves; they expect each call's arguments as an
object, so the JSON text OpenAI clients send is parsed first. A template that never mentions
tools (SmolLM2's ChatML) would drop them silently, so for it the tools are written into the
system message in the Hermes form kvserve's parser reads back (kvserve/structured/tool_calls.py).
"""
from __future__ import annotations

import json
from typing import Any

_INSTRUCTIONS = (
    "You can call functions to help answer. The available functions, one JSON signature per line:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, reply with its name and arguments as JSON inside tags, one block per call:\n"
    '<tool_call>\n{{"name": "function name", "arguments": {{...}}}}\n</tool_call>'
)


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's function: OpenAI's {"type": "function", "function": {...}}, or the function itself."""
    return tool.get("function", tool)


def _arguments_as_object(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            pass  # the template gets the text as it came
    return {**call, "function": fn}


def template_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      template_source: str) -> list[dict[str, Any]]:
    """The messages as the chat template should see them (see the module docstring)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "tool_calls": [_arguments_as_object(c) for c in m["tool_calls"]]}
        out.append(m)
    if "tools" in template_source or "tool_calls" in template_source:
        return out
    # A template without tool support: tools in the system message, calls and results as text.
    plain = []
    for m in out:
        if m.get("tool_calls"):
            calls = "\n".join("<tool_call>\n" + json.dumps({"name": c["function"].get("name"),
                                                            "arguments": c["function"].get("arguments")})
                              + "\n</tool_call>" for c in m["tool_calls"])
            m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + calls).strip()}
        elif m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        plain.append(m)
    if tools:
        note = _INSTRUCTIONS.format(tools="\n".join(json.dumps(function_of(t)) for t in tools))
        if plain and plain[0].get("role") == "system":
            plain[0] = {**plain[0], "content": f"{plain[0].get('content') or ''}\n\n{note}".strip()}
        else:
            plain.insert(0, {"role": "system", "content": note})
    return plain
