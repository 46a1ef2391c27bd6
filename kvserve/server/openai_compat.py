"""What real OpenAI clients send beyond kvserve's core parameters, and how it is answered.

- Fields OpenAI defines that kvserve has no use for are dropped with a logged warning (as vLLM
  does) instead of failing as misspellings; unknown fields still fail, by name.
- `response_format`, vLLM's `structured_outputs` / `guided_*` and a forcing `tool_choice`
  become one output Constraint (kvserve/structured/).
- With tools, the choice's text is read for tool calls (kvserve/structured/tool_calls.py):
  whole for a response, as deltas for a stream.
"""
from __future__ import annotations

import logging
from typing import Any

from kvserve.errors import InvalidParam
from kvserve.structured.spec import Constraint, from_response_format, from_vllm
from kvserve.structured.tool_calls import ToolCallStream
from kvserve.structured.tools import forced_call_constraint

log = logging.getLogger("kvserve.server")

# OpenAI request fields (chat and completions) that change nothing kvserve does.
IGNORED_FIELDS = frozenset({
    "store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier",
    "modalities", "audio", "prediction", "web_search_options", "verbosity", "function_call", "functions",
    "prompt_cache_retention", "truncation",
})
GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def log_ignored(req: Any) -> None:
    """A warning naming the OpenAI fields of `req` that kvserve accepted but does not use."""
    ignored = req.ignored_fields()
    if ignored:
        log.warning("ignored OpenAI field(s) kvserve does not use: %s", ", ".join(ignored))


def constraint(req: Any) -> Constraint | None:
    """The one output constraint a request asks for (ValueError naming the field if several or
    if one is malformed)."""
    found = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        c = from_response_format(fmt if isinstance(fmt, dict) else fmt.model_dump())
        if c is not None:
            found.append(c)
    so = getattr(req, "structured_outputs", None)
    if so:
        c = from_vllm({k: so.get(k) for k in so}, "structured_outputs.")
        if c is not None:
            found.append(c)
    c = from_vllm({k: getattr(req, f"guided_{k}", None) for k in GUIDED_KINDS}, "guided_")
    if c is not None:
        found.append(c)
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if tools and choice not in (None, "auto", "none"):
        # One call unless parallel_tool_calls is set true: a valid answer either way, and small
        # models forced into an open-ended list repeat calls until max_tokens cuts the JSON.
        choice = choice if isinstance(choice, str) else choice.model_dump()
        found.append(forced_call_constraint([t.model_dump() for t in tools], choice,
                                            req.parallel_tool_calls is True))
    if len(found) > 1:
        raise InvalidParam(found[1].param, f"{found[1].param} cannot be combined with {found[0].param}: give one output constraint")
    return found[0] if found else None


def tool_mode(req: Any) -> str | None:
    """None (no tool parsing), "auto" (calls parsed from free text) or "forced" (constrained JSON)."""
    if not getattr(req, "tools", None) or req.tool_choice == "none":
        return None
    return "auto" if req.tool_choice in (None, "auto") else "forced"


def chat_message(text: str, finish_reason: str | None, mode: str | None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice and its finish_reason ("tool_calls" when the
    text held calls)."""
    if mode is None:
        return {"role": "assistant", "content": text}, finish_reason
    stream = ToolCallStream(forced=mode == "forced")
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas) or None
    if not stream.calls:
        return {"role": "assistant", "content": text}, finish_reason
    calls = [c.to_openai() for c in stream.calls]
    return {"role": "assistant", "content": content, "tool_calls": calls}, \
        ("tool_calls" if finish_reason == "stop" else finish_reason)


class ChoiceDeltas:
    """Per streamed choice: text deltas in, chat deltas out (content, or tool_calls)."""

    def __init__(self, mode: str | None) -> None:
        self.mode = mode
        self.stream = ToolCallStream(forced=mode == "forced") if mode else None

    def feed(self, text: str) -> list[dict]:
        if self.stream is None:
            return [{"content": text}] if text else []
        return self.stream.feed(text)

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        if self.stream is None:
            return [], finish_reason
        deltas = self.stream.finish()
        if self.stream.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return deltas, finish_reason
