"""OpenAI's deprecated function calling, still sent by older clients and agents, mapped onto tools.

    functions=[f, ...]             ->  tools=[{"type": "function", "function": f}, ...]
    function_call="none" | "auto"  ->  tool_choice="none" | "auto"
    function_call={"name": n}      ->  tool_choice={"type": "function", "function": {"name": n}}

Messages (protocol.ChatMessage.for_template): an assistant's `function_call` becomes one tool call
and a `function` message a `tool` result, paired by the id `call_<name>` (protocol.legacy_call_id). A request that used
`functions` is answered in the legacy shape: `message.function_call` (the first call) with
finish_reason "function_call", streamed as `function_call` deltas.
"""
from __future__ import annotations

from typing import Any

from kvserve.errors import shown
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, NamedFunction, NamedToolChoice, Tool


def apply(req: ChatCompletionRequest) -> None:
    """Turn the request's functions/function_call into tools/tool_choice, in place (400 if it mixes both)."""
    if req.functions is None:
        if req.function_call is not None:
            raise APIError(400, "function_call needs functions: list the functions it may call (or use tools "
                           "and tool_choice)", param="function_call")
        return
    if req.tools is not None or req.tool_choice is not None:
        raise APIError(400, "functions cannot be combined with tools or tool_choice: give one or the other "
                       "(functions is OpenAI's deprecated form of tools)", param="functions")
    if not req.functions:
        raise APIError(400, "functions must not be empty: list at least one function or leave it out",
                       param="functions")
    req.tools = [Tool(type="function", function=f) for f in req.functions]
    choice = req.function_call
    if choice is None or isinstance(choice, str):
        req.tool_choice = choice
    else:
        if choice.name not in {f.name for f in req.functions}:
            raise APIError(400, f"function_call names {shown(choice.name)}, which is not in functions",
                           param="function_call")
        req.tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def message(message: dict[str, Any], finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A tool-call reply in the legacy shape: the first call as `function_call`."""
    calls = message.pop("tool_calls", None)
    if not calls:
        return message, finish_reason
    message["function_call"] = dict(calls[0]["function"])
    return message, ("function_call" if finish_reason == "tool_calls" else finish_reason)


class LegacyDeltas:
    """Streamed tool_calls deltas as function_call deltas (the first call only)."""

    def delta(self, delta: dict[str, Any]) -> dict[str, Any] | None:
        calls = delta.get("tool_calls")
        if calls is None:
            return delta
        first = [c for c in calls if c.get("index", 0) == 0]
        if not first:
            return None  # a second call: the legacy shape has room for one
        rest = {k: v for k, v in delta.items() if k != "tool_calls"}
        return {**rest, "function_call": {k: v for k, v in first[0]["function"].items() if v is not None}}

    @staticmethod
    def finish_reason(reason: str | None) -> str | None:
        return "function_call" if reason == "tool_calls" else reason
