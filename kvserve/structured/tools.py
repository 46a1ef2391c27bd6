"""The grammar of a forced tool call (the conversation a chat template sees with tools is
kvserve/tokenizer/tool_messages.py's).

`tool_choice` "required" or a named function constrains the output with a JSON schema built from
the tools' parameter schemas, so the arguments are valid by construction.
"""
from __future__ import annotations

import json
from typing import Any

from kvserve.errors import InvalidParam, shown
from kvserve.structured.spec import Constraint
from kvserve.tokenizer.tool_messages import function_of


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_constraint(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool) -> Constraint | None:
    """The constraint for tool_choice "required" or {"type": "function", "function": {"name": ...}};
    None for "auto" / "none". ValueError for a named function not among the tools."""
    if tool_choice in (None, "auto", "none") or not tools:
        return None
    fns = [function_of(t) for t in tools]
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
