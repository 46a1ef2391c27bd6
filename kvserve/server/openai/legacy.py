"""OpenAI's deprecated function calling answered in its own shape: a request that used
`functions` (mapped onto tools on the way in: protocol.apply_legacy_functions) gets
`message.function_call` (the first call) with finish_reason "function_call", streamed as
`function_call` deltas.
"""
from __future__ import annotations

from typing import Any


def legacy_message(message: dict[str, Any], finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
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
