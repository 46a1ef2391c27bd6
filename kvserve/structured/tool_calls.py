"""Model output → OpenAI `tool_calls`, whole or streamed as deltas.

Chat templates teach a model one way to write a call; kvserve reads the ones its supported model
families use — those the model's template names (`template_formats`: a Qwen template's model
writing `{"name": ..., "parameters": ...}` as its answer is not making a Llama 3 call), or any of
them where the template names none:
  - Hermes style (Qwen2.5, Qwen3, SmolLM2/3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
    one block per call, text allowed around them;
  - Llama 3.x JSON: the whole reply is `{"name": ..., "parameters": {...}}` (optionally after
    `<|python_tag|>`, several calls separated by `;`);
  - Mistral: the reply is `[TOOL_CALLS]` and a JSON list of calls (v0.3, Nemo), or
    `[TOOL_CALLS]name[ARGS]{...}` once per call (the v11 tokenizer's);
  - Phi-4-mini: the reply is `functools` and a JSON list of calls.
Replies of the last three kinds are read whole at their end.
When `tool_choice` forces a call the output is grammar-constrained JSON (see tool_grammar):
a list of `{"name", "arguments"}` objects, or one such object for a named function.
The streaming parser holds back text that may still become a call, emits content deltas for
the rest, and streams each call as OpenAI does: a first delta with its id, type and name, then its
arguments in pieces as the model writes them (ToolCallStream); a response's `arguments` is the
same text, so the pieces of a stream concatenate to it exactly.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
PHI4_TAG = "functools"
HERMES, LLAMA3, MISTRAL, PHI4 = "hermes", "llama3", "mistral", "phi4"
# A reply that starts so (after whitespace) is read whole at its end: it may be all calls.
_WHOLE_STARTS = {LLAMA3: ("{", PYTHON_TAG), MISTRAL: (MISTRAL_TAG,), PHI4: (PHI4_TAG + "[",)}


def template_formats(source: str) -> frozenset[str] | None:
    """The call formats a chat template teaches (by the markers it writes), or None: it names none
    of them, and a reply may hold any (a template that does not know tools gets them in its system
    prompt, kvserve/tokenizer/tool_messages.py, in Hermes' words)."""
    found = {f for f, markers in ((HERMES, (HERMES_OPEN,)), (MISTRAL, (MISTRAL_TAG,)), (PHI4, (PHI4_TAG,)),
                                  (LLAMA3, (PYTHON_TAG, '"parameters"', "ipython")))
             if any(m in source for m in markers)}
    return frozenset(found) if found else None


def _reads(formats: frozenset[str] | None, f: str) -> bool:
    return formats is None or f in formats


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


def parse_tool_calls(text: str, formats: frozenset[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished reply, in the `formats` read (None: any). Without a
    well-formed call the text is all content."""
    if HERMES_OPEN in text and _reads(formats, HERMES):
        calls = _calls(_HERMES_BLOCK.findall(text + (HERMES_CLOSE if text.count(HERMES_OPEN) > text.count(HERMES_CLOSE) else "")))
        if calls is None:
            return text, []
        content = text[: text.index(HERMES_OPEN)].strip()
        return (content or None), calls
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if stripped.startswith("{") and _reads(formats, LLAMA3):  # Llama 3.x: the reply is the call(s)
        calls = _calls(_split_top_level(stripped))
        return (text, []) if calls is None else (None, calls)
    if stripped.startswith(MISTRAL_TAG) and _reads(formats, MISTRAL):
        calls = _mistral_calls(stripped)
        return (text, []) if calls is None else (None, calls)
    if stripped.startswith(PHI4_TAG + "[") and _reads(formats, PHI4):
        calls = _list_calls(stripped[len(PHI4_TAG):])
        return (text, []) if calls is None else (None, calls)
    return text, []


def _list_calls(text: str) -> list[ToolCall] | None:
    """A JSON list of {"name", "arguments"} objects as calls; None if it is not one."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [c for o in items if (c := _call_from_json(o)) is not None]
    return calls if len(calls) == len(items) else None


def _mistral_calls(text: str) -> list[ToolCall] | None:
    """`[TOOL_CALLS][{...}, ...]`, or `[TOOL_CALLS]name[ARGS]{...}` repeated."""
    rest = text[len(MISTRAL_TAG):].strip()
    if rest.startswith("["):
        return _list_calls(rest)
    calls = []
    for part in text.split(MISTRAL_TAG)[1:]:
        name, sep, args = part.partition(MISTRAL_ARGS)
        call = _call_from_json({"name": name.strip(), "arguments": args.strip()}) if sep and name.strip() else None
        if call is None:
            return None
        calls.append(call)
    return calls or None


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


# The head of a call whose arguments can be streamed: its name, then an arguments object.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass
class _Block:
    """One call being read from the text: its head, then its arguments object as it grows."""

    body: int  # where the call's JSON starts in the text
    close: str | None  # the tag that ends the block (Hermes); None: the object's own end (forced JSON)
    call: ToolCall | None = None  # once the head is read: the call, its arguments growing
    sent: int = -1  # how far the arguments are handed out
    scan: int = -1  # how far the arguments are read (depth, strings)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    args_end: int = -1  # where the arguments object ends, once it has


class ToolCallStream:
    """Feed text deltas of one choice; get OpenAI chat deltas back.

    forced: the output is tool_grammar's JSON (tool_choice required/named) — nothing is content.

    A call written `{"name": ..., "arguments": {...}}` is streamed as OpenAI streams it: a first
    delta with index, id, type and name (arguments ""), then deltas of index and the arguments' next
    characters, exactly as the model writes them; the call's `arguments` is their concatenation, so
    a response and a stream of the same text agree to the character. Other shapes (arguments as a
    string, keys in another order, Llama 3.x JSON) are read whole at their end: one delta per call.
    """

    def __init__(self, forced: bool = False, formats: frozenset[str] | None = None) -> None:
        self.forced = forced
        self.formats = formats  # the call formats read (template_formats; None: any)
        self._starts = tuple(s for f, starts in _WHOLE_STARTS.items() if _reads(formats, f) for s in starts)
        self.text = ""
        self._emitted = 0  # characters of text handed out as content, or read as calls
        self.calls: list[ToolCall] = []
        self._block: _Block | None = None  # the call being read

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        return self._feed_forced() if self.forced else self._feed_hermes()

    def _feed_hermes(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        head = self.text.lstrip()
        if not self.calls and self._block is None and self._emitted == 0 and self._starts and (
                head.startswith(self._starts) or any(s.startswith(head) for s in self._starts)):
            return []  # may be a Llama 3.x, Mistral or Phi-4 call (or the start of one's tag): decide at the end
        if not _reads(self.formats, HERMES):  # nothing else is a call: text as it comes
            text, self._emitted = self.text[self._emitted :], len(self.text)
            return [{"content": text}] if text else []
        while True:
            if self._block is not None:
                deltas, end = self._advance(self._block)
                out += deltas
                if end is None:
                    return out
                self._emitted, self._block = end, None
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
            self._emitted += start
            self._block = _Block(self._emitted + len(HERMES_OPEN), HERMES_CLOSE)

    def _feed_forced(self) -> list[dict[str, Any]]:
        """tool_grammar's JSON: one call object, or a list of them."""
        out: list[dict[str, Any]] = []
        while True:
            if self._block is None:
                i = self._emitted
                while i < len(self.text) and self.text[i] in " \t\r\n[,":
                    i += 1
                self._emitted = i
                if i == len(self.text) or self.text[i] != "{":
                    return out
                self._block = _Block(i, None)
            deltas, end = self._advance(self._block)
            out += deltas
            if end is None:
                return out
            self._emitted, self._block = end, None

    def _advance(self, b: _Block) -> tuple[list[dict[str, Any]], int | None]:
        """Deltas for what block b's text says now, and where the block ends once it has."""
        text, out = self.text, []
        if b.call is None:
            region = text[b.body :]
            cut = region.find(b.close) if b.close else -1
            region = region[:cut] if cut >= 0 else region
            head = _HEAD.match(region)
            name = _json_string(head.group(1)) if head else None
            if head is not None and name is not None and region[head.end()] == "{":
                b.call = ToolCall(name, "")
                b.sent = b.scan = b.body + head.end()
                out.append(self._call_delta(b.call))
            elif cut < 0:
                return out, None  # more text may still make it a call
            else:  # a block without a streamable head: read whole (content if it is no call)
                end = b.body + cut + len(HERMES_CLOSE)
                call = _call_from_text(region)
                out.append(self._call_delta(call) if call else {"content": text[b.body - len(HERMES_OPEN) : end]})
                return out, end
        if b.args_end < 0:
            end = self._scan_arguments(b)
            out += self._send_arguments(b, end if end >= 0 else b.scan)
            if end < 0:
                return out, None
            b.args_end = end
        if b.close:
            c = text.find(b.close, b.args_end)
            return out, (c + len(b.close) if c >= 0 else None)
        return out, _value_end(text, b.body)  # forced: the call object's own end

    def _scan_arguments(self, b: _Block) -> int:
        """Read the arguments object on from b.scan: where it ends (after its closing brace, or at a
        close tag written outside any string), or -1 while it goes on."""
        text, i = self.text, b.scan
        while i < len(text):
            ch = text[i]
            if b.in_string:
                b.escaped, b.in_string = (False, True) if b.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                b.in_string = True
            elif ch in "{[":
                b.depth += 1
            elif ch in "}]":
                b.depth -= 1
                if b.depth == 0:
                    b.scan = i + 1
                    return i + 1
            elif ch == "<" and b.close:  # not JSON: the block closing on unbalanced arguments?
                if text.startswith(b.close, i):
                    b.scan = i
                    return i
                if b.close.startswith(text[i:]):
                    break  # wait for the rest of the tag
            i += 1
        b.scan = i
        return -1

    def _send_arguments(self, b: _Block, upto: int) -> list[dict[str, Any]]:
        if upto <= b.sent or b.call is None:  # (b.call is set before its arguments are read)
            return []
        piece, b.sent = self.text[b.sent : upto], upto
        b.call.arguments += piece
        return [{"tool_calls": [{"index": self.calls.index(b.call), "function": {"arguments": piece}}]}]

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for what was held back, at the end of the choice."""
        b, self._block = self._block, None
        if b is not None and b.call is not None:  # cut short (max_tokens): the arguments as far as they got
            self._emitted = len(self.text)
            return self._send_arguments(b, len(self.text) if b.args_end < 0 else b.args_end)
        rest = self.text[self._emitted :]
        self._emitted = len(self.text)
        if self.forced:
            if self.calls:  # streamed ones, then any other left whole
                call = _call_from_text(rest.strip().rstrip("]").strip()) if b is not None else None
                return [self._call_delta(call)] if call else []
            calls = parse_forced(self.text)
            return [self._call_delta(c) for c in calls] if calls else ([{"content": self.text}] if self.text else [])
        if not rest:
            return []
        content, calls = parse_tool_calls(rest, self.formats)
        out = [{"content": content}] if content and not self.calls else []
        return out + [self._call_delta(c) for c in calls]

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        index = len(self.calls)
        self.calls.append(call)
        return {"tool_calls": [{"index": index, **call.to_openai()}]}


def _json_string(body: str) -> str | None:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return None


def _call_from_text(text: str) -> ToolCall | None:
    try:
        return _call_from_json(json.loads(text))
    except json.JSONDecodeError:
        return None


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON value starting at text[start] ends, or None if it does not yet."""
    try:
        return json.JSONDecoder().raw_decode(text, start)[1]
    except json.JSONDecodeError:
        return None
