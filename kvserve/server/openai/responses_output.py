"""A Responses answer as OpenAI's objects and events: the response object (`response_object`), and
the choice's text, as it comes, made into output items with the typed events that build them
(`Output`, numbered by `Events`). The route (server/openai/responses.py) runs them.
"""
from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.outputs import RequestOutput
from kvserve.server.canonical import ChoiceDeltas
from kvserve.server.generation import Job
from kvserve.server.openai.responses_protocol import ResponsesFunctionTool, ResponsesRequest, text_format


@dataclass
class ResponseObject:
    """What a response object says of its request: made once, then one object per status."""

    req: ResponsesRequest
    tools: list[ResponsesFunctionTool]
    choice: str | dict[str, Any]
    store: bool
    model: str
    created_at: int

    def __call__(self, job: Job, status: str, output: list[dict[str, Any]], final: RequestOutput | None = None,
                 reasoning_tokens: int = 0, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The response object (OpenAI's field order)."""
        req, params = self.req, job.params
        usage = None
        if final is not None:
            prompt, completion = len(final.prompt_token_ids), len(final.outputs[0].token_ids)
            usage = {"input_tokens": prompt,
                     "input_tokens_details": {"cached_tokens": final.num_cached_tokens, "cache_write_tokens": 0},
                     "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": prompt + completion}
        done = status in ("completed", "incomplete", "failed")
        return {
            "id": job.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "completed_at": int(time.time()) if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": self.model, "output": output, "parallel_tool_calls": req.parallel_tool_calls is True,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default", "store": self.store, "temperature": params.temperature,
            "text": {"format": text_format(req), "verbosity": "medium"}, "tool_choice": self.choice,
            "tools": [t.model_dump(exclude_none=True, include={"type", "name", "description", "parameters", "strict"})
                      for t in self.tools],
            "top_logprobs": req.top_logprobs or 0, "top_p": params.top_p, "truncation": "disabled",
            "usage": usage if done else None, "user": req.user, "metadata": req.metadata or {},
        }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _opened(item: dict[str, Any] | None) -> dict[str, Any]:
    """An output item that was just opened, or open already."""
    if item is None:
        raise RuntimeError("no open output item")
    return item


class Events:
    """One typed event per call, numbered from 0 (sequence_number)."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        # A copy: the items an event carries grow as the next events are made, before it is framed.
        return {"type": kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}


class Output:
    """The choice's text, as it comes, → output items, and (streamed) the events that build them.

    Text goes through the chat route's reasoning and tool-call readers (server/canonical.py):
    reasoning opens a reasoning item (one reasoning_text part), content a message item (one
    output_text part), each call is a function_call item; text after a call is not kept (as on the
    chat route). A whole response runs the same code with no events.
    """

    def __init__(self, mode: str | None, logprobs: Callable[[list], list] | None, events: Events | None,
                 inside: bool | None = None, formats: frozenset[str] | None = None) -> None:
        self.deltas = ChoiceDeltas(mode, inside, formats)
        self.logprobs = logprobs  # token logprobs → OpenAI's entries; None: not asked for
        self.emit = events
        self.items: list[dict[str, Any]] = []
        self.reasoning: dict[str, Any] | None = None  # the open reasoning item
        self.message: dict[str, Any] | None = None  # the open message item
        self.call: dict[str, Any] | None = None  # the open function_call item
        self.status = "in_progress"

    def _event(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        return [self.emit(kind, **fields)] if self.emit is not None else []

    def feed(self, text: str, lps: list | None) -> list[dict[str, Any]]:
        entries = self.logprobs(lps) if self.logprobs is not None and lps else []
        out: list[dict[str, Any]] = []
        for j, delta in enumerate(self.deltas.feed(text)):
            out += self._delta(delta, entries if j == 0 else [])
        return out

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        rest, finish_reason = self.deltas.finish(finish_reason)
        out: list[dict[str, Any]] = []
        for delta in rest:
            out += self._delta(delta, [])
        cut = finish_reason == "length"
        out += self._close_reasoning() + self._close_call()
        if not any(item["type"] != "reasoning" for item in self.items):  # no answer: still one (empty) message, as OpenAI answers
            out += self._open_message()
        out += self._close_message("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        return out

    def _delta(self, delta: dict[str, Any], entries: list) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if thought := delta.get("reasoning_content"):
            if self.reasoning is None:
                out += self._open_reasoning()
            reasoning = _opened(self.reasoning)
            part = reasoning["content"][0]
            part["text"] += thought
            out += self._event("response.reasoning_text.delta", item_id=reasoning["id"],
                               output_index=len(self.items) - 1, content_index=0, delta=thought)
        if delta.get("content") or delta.get("tool_calls"):
            out += self._close_reasoning()
        if delta.get("content"):
            if self.message is None:
                out += self._open_message()
            message = _opened(self.message)
            part = message["content"][0]
            part["text"] += delta["content"]
            part["logprobs"] += entries
            out += self._event("response.output_text.delta", item_id=message["id"], output_index=len(self.items) - 1,
                               content_index=0, delta=delta["content"], logprobs=entries)
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:  # a call begins (its arguments follow in pieces as the model writes them)
                out += self._close_message("completed") + self._close_call()
                self.call = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "arguments": "",
                             "call_id": call["id"], "name": fn["name"]}
                self.items.append(self.call)
                out += self._event("response.output_item.added", output_index=len(self.items) - 1, item=self.call)
            piece = fn.get("arguments") or ""
            if piece and self.call is not None:
                self.call["arguments"] += piece
                out += self._event("response.function_call_arguments.delta", item_id=self.call["id"],
                                   output_index=len(self.items) - 1, delta=piece)
        return out

    def _close_call(self) -> list[dict[str, Any]]:
        call, self.call = self.call, None
        if call is None:
            return []
        index = self.items.index(call)
        call["status"] = "completed"
        return (self._event("response.function_call_arguments.done", item_id=call["id"], output_index=index,
                            arguments=call["arguments"])
                + self._event("response.output_item.done", output_index=index, item=call))

    def _open_reasoning(self) -> list[dict[str, Any]]:
        self.reasoning = {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
        index = len(self.items)
        self.items.append(self.reasoning)
        part = {"type": "reasoning_text", "text": ""}
        out = self._event("response.output_item.added", output_index=index, item=self.reasoning)
        self.reasoning["content"].append(part)
        return out + self._event("response.content_part.added", item_id=self.reasoning["id"], output_index=index,
                                 content_index=0, part=part)

    def _close_reasoning(self) -> list[dict[str, Any]]:
        item, self.reasoning = self.reasoning, None
        if item is None:
            return []
        index, part = self.items.index(item), item["content"][0]
        item["status"] = "completed"
        return (self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"])
                + self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=index, item=item))

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = {"id": _item_id("msg"), "type": "message", "status": "in_progress", "content": [], "role": "assistant"}
        index = len(self.items)
        self.items.append(self.message)
        part = {"type": "output_text", "annotations": [], "logprobs": [], "text": ""}
        out = self._event("response.output_item.added", output_index=index, item=self.message)
        self.message["content"].append(part)
        return out + self._event("response.content_part.added", item_id=self.message["id"], output_index=index,
                                 content_index=0, part=part)

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self.message = self.message, None
        if message is None:
            return []
        index, part = self.items.index(message), message["content"][0]
        message["status"] = status
        return (self._event("response.output_text.done", item_id=message["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=part["logprobs"])
                + self._event("response.content_part.done", item_id=message["id"], output_index=index,
                              content_index=0, part=part)
                + self._event("response.output_item.done", output_index=index, item=message))
