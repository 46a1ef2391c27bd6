"""What real OpenAI clients send beyond kvserve's core parameters, and how it is answered.

- Fields OpenAI defines that kvserve has no use for are dropped with a logged warning (as vLLM
  does) instead of failing as misspellings; unknown fields still fail, by name.
- `response_format`, vLLM's `structured_outputs` / `guided_*` and a forcing `tool_choice`
  become one output Constraint (kvserve/structured/).
- With tools, the choice's text is read for tool calls (kvserve/structured/tool_calls.py):
  whole for a response, as deltas for a stream.
- OpenAI's deprecated function calling, still sent by older clients and agents, is mapped onto
  tools (`apply_legacy_functions`), and answered in its own shape (`legacy_message`,
  `LegacyDeltas`):

    functions=[f, ...]             ->  tools=[{"type": "function", "function": f}, ...]
    function_call="none" | "auto"  ->  tool_choice="none" | "auto"
    function_call={"name": n}      ->  tool_choice={"type": "function", "function": {"name": n}}

  Messages (protocol.ChatMessage.for_template): an assistant's `function_call` becomes one tool
  call and a `function` message a `tool` result, paired by the id `call_<name>`
  (protocol.legacy_call_id). A request that used `functions` is answered in the legacy shape:
  `message.function_call` (the first call) with finish_reason "function_call", streamed as
  `function_call` deltas.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from kvserve.errors import InvalidParam, shown
from kvserve.server.errors import APIError
from kvserve.server.protocol import ChatCompletionRequest, NamedFunction, NamedToolChoice, Tool
from kvserve.structured import reasoning
from kvserve.structured.spec import Constraint, from_response_format, from_vllm
from kvserve.structured.tool_calls import ToolCallStream
from kvserve.structured.tools import forced_call_constraint
from kvserve.tokenizer.chat_template import ChatPrompt

log = logging.getLogger("kvserve.server")
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
    guided = {k: v for k in GUIDED_KINDS if (v := getattr(req, f"guided_{k}", None)) is not None}
    if guided and (c := from_vllm(guided, "guided_")) is not None:  # most requests set none of these
        found.append(c)
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if tools and choice not in (None, "auto", "none"):
        # One call unless parallel_tool_calls is set true: a valid answer either way, and small
        # models forced into an open-ended list repeat calls until max_tokens cuts the JSON.
        choice = choice if isinstance(choice, str) else choice.model_dump()
        forced = forced_call_constraint([t.model_dump() for t in tools], choice, req.parallel_tool_calls is True)
        if forced is not None:
            found.append(forced)
    if len(found) > 1:
        raise InvalidParam(found[1].param, f"{found[1].param} cannot be combined with {found[0].param}: give one output constraint")
    return found[0] if found else None


def tool_mode(req: Any) -> str | None:
    """None (no tool parsing), "auto" (calls parsed from free text) or "forced" (constrained JSON)."""
    if not getattr(req, "tools", None) or req.tool_choice == "none":
        return None
    return "auto" if req.tool_choice in (None, "auto") else "forced"


def chat_message(text: str, finish_reason: str | None, mode: str | None, inside: bool | None = None,
                 formats: frozenset[str] | None = None) -> tuple[dict, str | None]:
    """The assistant message of a finished choice and its finish_reason ("tool_calls" when the
    text held calls). inside: None for a model that does not think; else whether its output starts
    inside <think> (EngineClient.reasoning): the reasoning goes to `reasoning_content`, as vLLM's.
    formats: the call formats the model's template teaches (EngineClient.tool_formats; None: any)."""
    head: dict = {"role": "assistant"}
    if inside is not None:
        reasoning_content, text = reasoning.split(text, inside)
        head["reasoning_content"] = reasoning_content
    if mode is None:
        return {**head, "content": text}, finish_reason
    stream = ToolCallStream(forced=mode == "forced", formats=formats)
    deltas = stream.feed(text) + stream.finish()
    content = "".join(d.get("content", "") for d in deltas) or None
    if not stream.calls:
        return {**head, "content": text}, finish_reason
    calls = [c.to_openai() for c in stream.calls]
    return {**head, "content": content, "tool_calls": calls}, ("tool_calls" if finish_reason == "stop" else finish_reason)


class ChoiceDeltas:
    """Per streamed choice: text deltas in, chat deltas out (reasoning_content, content, or tool_calls).
    The pieces of a stream concatenate to chat_message's fields for the same text."""

    def __init__(self, mode: str | None, inside: bool | None = None, formats: frozenset[str] | None = None) -> None:
        self.mode = mode
        self.stream = ToolCallStream(forced=mode == "forced", formats=formats) if mode else None
        self.split = reasoning.ReasoningSplit(inside) if inside is not None else None

    def feed(self, text: str) -> list[dict]:
        if self.split is None:
            return self._answer(text)
        return self._parts(self.split.feed(text))

    def _parts(self, parts: list[tuple[str, str]]) -> list[dict]:
        out: list[dict] = []
        for kind, piece in parts:
            out += [{"reasoning_content": piece}] if kind == reasoning.REASONING else self._answer(piece)
        return out

    def _answer(self, text: str) -> list[dict]:
        if self.stream is None:
            return [{"content": text}] if text else []
        return self.stream.feed(text)

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        deltas = self._parts(self.split.finish()) if self.split is not None else []
        if self.stream is None:
            return deltas, finish_reason
        deltas += self.stream.finish()
        if self.stream.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return deltas, finish_reason

def apply_legacy_functions(req: ChatCompletionRequest) -> None:
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


def prompt_of_body(body: dict[str, Any]) -> ChatPrompt | None:
    """The prompt of a raw chat completion body, as the chat route renders it (legacy functions as
    tools), or None where the server would refuse the body: a router's rendering of it."""
    try:
        req = ChatCompletionRequest.model_validate(body)
        apply_legacy_functions(req)
    except (ValidationError, APIError, ValueError):
        return None
    return req.chat_prompt() if req.messages else None


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
