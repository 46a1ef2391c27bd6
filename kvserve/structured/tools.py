"""Tools on the way in: the conversation a chat template sees, and the grammar of a forced call.

Templates written for tool use (Qwen2.5, Llama 3.x, Hermes, SmolLM3) receive `tools` and render
`tool` messages and assistant `tool_calls` themselves; they expect each call's arguments as an
object, so the JSON text OpenAI clients send is parsed first. A template that never mentions
tools (SmolLM2's ChatML) would drop them silently, so for it kvserve writes the tools into the
system message in the Hermes form its parser reads back (kvserve/structured/tool_calls.py).

`tool_choice` "required" or a named function constrains the output with a JSON schema built from
the tools' parameter schemas, so the arguments are valid by construction.
"""
from __future__ import annotations

import json
from typing import Any

from kvserve.errors import InvalidParam, shown
from kvserve.structured.spec import Constraint

_INSTRUCTIONS = (
    "You can call functions to help answer. The available functions, one JSON signature per line:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, reply with its name and arguments as JSON inside tags, one block per call:\n"
    '<tool_call>\n{{"name": "function name", "arguments": {{...}}}}\n</tool_call>'
)


def _function(tool: dict[str, Any]) -> dict[str, Any]:
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
        note = _INSTRUCTIONS.format(tools="\n".join(json.dumps(_function(t)) for t in tools))
        if plain and plain[0].get("role") == "system":
            plain[0] = {**plain[0], "content": f"{plain[0].get('content') or ''}\n\n{note}".strip()}
        else:
            plain.insert(0, {"role": "system", "content": note})
    return plain


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_constraint(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> Constraint | None:
    """The constraint for tool_choice "required" or {"type": "function", "function": {"name": ...}};
    None for "auto" / "none". ValueError for a named function not among the tools."""
    if tool_choice in (None, "auto", "none") or not tools:
        return None
    fns = [_function(t) for t in tools]
    if tool_choice == "required":
        item = {"anyOf": [_call_schema(f) for f in fns]} if len(fns) > 1 else _call_schema(fns[0])
        schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return Constraint("json", json.dumps(schema), "tool_choice")
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    match = [f for f in fns if f.get("name") == name]
    if not match:
        names = ", ".join(repr(f.get("name")) for f in fns)
        raise InvalidParam("tool_choice", f"tool_choice names the function {shown(name)}, which is not among the tools ({names})")
    return Constraint("json", json.dumps(_call_schema(match[0])), "tool_choice")
