"""Anthropic's answer shapes: a finished message (`message`), and chat deltas as content block
events (`BlockEvents`); stop_reason and usage as Anthropic counts them. The route is
server/anthropic/messages.py.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server.anthropic.protocol import MessagesRequest, tool_mode
from kvserve.server.canonical import chat_message
from kvserve.server.generation import Job


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call (or the opening delta of one) as a tool_use block."""
    fn = call["function"]
    call_id = call.get("id") or f"call_{uuid.uuid4().hex[:24]}"
    return {"type": "tool_use", "id": call_id.replace("call_", "toolu_", 1), "name": fn["name"],
            "input": json.loads(fn["arguments"]) if fn.get("arguments") else {}}


def stop(c: CompletionOutput, finish_reason: str | None, asked: int) -> tuple[str, str | None]:
    """stop_reason and stop_sequence of a finished answer (finish_reason after tool-call parsing)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return ("max_tokens" if len(c.token_ids) >= asked else "model_context_window_exceeded"), None
    if finish_reason == "stop" and isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage(final: RequestOutput) -> dict[str, int]:
    prompt, cached = len(final.prompt_token_ids), final.num_cached_tokens
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached,
            "output_tokens": len(final.outputs[0].token_ids)}


def head(job: Job, model: str) -> dict[str, Any]:
    return {"id": job.request_id, "type": "message", "role": "assistant", "model": model}


def message(job: Job, req: MessagesRequest, final: RequestOutput, model: str, inside: bool | None,
            formats: frozenset[str] | None) -> dict[str, Any]:
    c = final.outputs[0]
    answer, finish_reason = chat_message(c.text, c.finish_reason, tool_mode(req), inside, formats)
    thinking = answer.get("reasoning_content") if req.thinking_on else None
    content = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking is not None else []
    content += [{"type": "text", "text": answer["content"]}] if answer["content"] else []
    content += [_tool_use(call) for call in answer.get("tool_calls", [])]
    stop_reason, stop_sequence = stop(c, finish_reason, req.max_tokens)
    return {**head(job, model), "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage(final)}


class BlockEvents:
    """Chat deltas (reasoning_content, content, or tool_calls as canonical.ChoiceDeltas gives
    them) in, Anthropic's content block events out: a thinking block while reasoning comes (when the
    client asked for thinking), a text block while text comes, a tool_use block per call."""

    def __init__(self, thinking: bool = False) -> None:
        self.thinking = thinking
        self.index = -1  # of the open block, or of the last one
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.call: int | None = None  # the OpenAI index of the open tool call

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        if (thought := delta.get("reasoning_content")) and self.thinking:
            if self.open != "thinking":
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": thought}})
        if text := delta.get("content"):
            if self.open != "text":
                out += self._start({"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": text}})
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id") is not None or self.open != "tool_use" or call.get("index") != self.call:
                out += self._start({**_tool_use({**call, "function": {"name": fn.get("name")}})})
                self.call = call.get("index")
            if fn.get("arguments"):
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": fn["arguments"]}})
        return out

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        if self.index == 0:
            out.append({"type": "ping"})  # where Anthropic sends its first
        return out

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]
