"""Model output → OpenAI `tool_calls`, whole or streamed as deltas.

Chat templates teach a model one way to write a call; kvserve reads the two its supported model
families use:
  - Hermes style (Qwen2.5, SmolLM2/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call, text allowed around them;
  - Llama 3.x JSON: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`, several calls separated by `;`).
When `tool_choice` forces a call the output is grammar-constrained JSON (see tool_grammar):
a list of `{"name", "arguments"}` objects, or one such object for a named function.
The streaming parser holds back text that may still become a call, emits content deltas for
the rest, and emits one delta per call (name, id and the complete arguments) when it closes —
a form every OpenAI client accumulates correctly.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object as text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _calls(bodies: list[str]) -> list | None:
    """Each JSON body as a call, or None if any is not one (then the reply is plain text)."""
    calls = []
    for body in bodies:
        try:
            call = _call_from_json(json.loads(body))
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


def _call_from_json(obj: Any) -> ToolCall | None:
    """{"name": str, "arguments"|"parameters": object|str} → ToolCall; anything else → None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_forced(text: str) -> list[ToolCall]:
    """The grammar-constrained output of tool_choice required/named: an object or a list of them."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return []
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call_from_json(o) for o in items]
    return [c for c in calls if c is not None]


_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.S)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply. Without a well-formed call the text is all content."""
    if HERMES_OPEN in text:
        calls = _calls(_HERMES_BLOCK.findall(text + (HERMES_CLOSE if text.count(HERMES_OPEN) > text.count(HERMES_CLOSE) else "")))
        if calls is None:
            return text, []
        content = text[: text.index(HERMES_OPEN)].strip()
        return (content or None), calls
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if stripped.startswith("{"):  # Llama 3.x: the reply is the call(s)
        calls = _calls(_split_top_level(stripped))
        return (text, []) if calls is None else (None, calls)
    return text, []


def _split_top_level(text: str) -> list[str]:
    """'{..}; {..}' → ['{..}', '{..}'] (the separator Llama 3.x uses between parallel calls)."""
    decoder = json.JSONDecoder()
    parts, i = [], 0
    while i < len(text):
        try:
            _, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[i:end])
        i = end
        while i < len(text) and text[i] in " \n\t;":
            i += 1
    return parts


class ToolCallStream:
    """Feed text deltas of one choice; get OpenAI chat deltas back.

    forced: the output is tool_grammar's JSON (tool_choice required/named) — nothing is content.
    """

    def __init__(self, forced: bool = False) -> None:
        self.forced = forced
        self.text = ""
        self._emitted = 0  # characters of text handed out as content
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        if self.forced:
            return []
        out = []
        pending = self.text[self._emitted :]
        if not self.calls and self._emitted == 0 and pending.lstrip().startswith(("{", PYTHON_TAG)):
            return []  # may be a Llama 3.x call: decide at the end
        while True:
            pending = self.text[self._emitted :]
            start = pending.find(HERMES_OPEN)
            if start == -1:
                # Hold back a tail that could be the start of "<tool_call>".
                keep = next((k for k in range(min(len(HERMES_OPEN) - 1, len(pending)), 0, -1)
                             if HERMES_OPEN.startswith(pending[-k:])), 0)
                text = pending[: len(pending) - keep]
                if text and not self.calls:
                    out.append({"content": text})
                    self._emitted += len(text)
                elif text:  # after a call: whitespace between calls is dropped
                    self._emitted += len(text)
                return out
            if start and not self.calls:
                out.append({"content": pending[:start]})
            end = pending.find(HERMES_CLOSE, start)
            if end == -1:
                self._emitted += start
                return out
            body = pending[start + len(HERMES_OPEN) : end]
            try:
                call = _call_from_json(json.loads(body))
            except json.JSONDecodeError:
                call = None
            self._emitted += end + len(HERMES_CLOSE)
            if call is None:  # not a call after all: it is content
                out.append({"content": pending[start : end + len(HERMES_CLOSE)]})
                continue
            out.append(self._call_delta(call))

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what was held back, at the end of the choice."""
        rest = self.text[self._emitted :]
        self._emitted = len(self.text)
        if self.forced:
            calls = parse_forced(self.text)
            return [self._call_delta(c) for c in calls] if calls else ([{"content": self.text}] if self.text else [])
        if not rest:
            return []
        content, calls = parse_tool_calls(rest)
        out = [{"content": content}] if content and not self.calls else []
        return out + [self._call_delta(c) for c in calls]

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        index = len(self.calls)
        self.calls.append(call)
        return {"tool_calls": [{"index": index, **call.to_openai()}]}
