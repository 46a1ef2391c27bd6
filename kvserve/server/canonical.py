"""kvserve's chat, whichever API speaks it.

On the way in, `ChatTurn`: the prompt the chat template renders (tools and the template's
switches included), the sampling it asks for, and how its answer is read for tool calls. Each
chat API turns its parsed body into one (`to_chat`, beside its request models); its route runs
it, and a router reads raw bodies through the same function (`read_body`), so the router's
prompt ids and prefix hashes are the server's.

On the way out, the answer's text: a thinking model's reasoning apart (`reasoning_content`,
kvserve/structured/reasoning.py), then content, or tool calls read from it
(kvserve/structured/tool_calls.py) — whole for a response (`chat_message`), as deltas for a
stream (`ChoiceDeltas`). Each API then says these in its own shapes.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from kvserve.sampling_params import SamplingParams, with_defaults
from kvserve.server.errors import APIError
from kvserve.structured import reasoning
from kvserve.structured.tool_calls import ToolCallStream
from kvserve.tokenizer.chat_template import ChatPrompt

M = TypeVar("M", bound=BaseModel)
# How an answer is read for tool calls: "auto" (from free text), "forced" (constrained JSON), None (not at all).
ToolMode = str | None


@dataclass(frozen=True)
class Sampling:
    """What a body asks of the sampler, before the server's defaults apply."""

    given: Mapping[str, Any] = field(default_factory=dict)  # sampling fields it set (None: left out), over the defaults
    fixed: Mapping[str, Any] = field(default_factory=dict)  # fields no default applies to (stop, n, logprobs, ...)
    max_tokens: int | None = None  # None: all the context leaves
    defaulted: bool = False  # the client named no limit: the server's default applies, cut to what the context leaves

    def params(self, defaults: Mapping[str, Any], default_max_tokens: int) -> SamplingParams:
        """SamplingParams (ValueError "<param> must be ..." for a value out of range)."""
        max_tokens = default_max_tokens if self.defaulted else self.max_tokens
        return with_defaults(defaults, self.given, max_tokens=max_tokens, **self.fixed)

    @property
    def n(self) -> int:
        return int(self.fixed.get("n", 1))


@dataclass(frozen=True)
class ChatTurn:
    prompt: ChatPrompt
    sampling: Sampling
    tool_mode: ToolMode = None


def read_body(model: type[M], to_chat: Callable[[M], ChatTurn | None], body: dict[str, Any]) -> ChatTurn | None:
    """A raw body as its route reads it (`to_chat`'s None: no chat to render), or None where the
    route would refuse it: a router's reading."""
    try:
        return to_chat(model.model_validate(body))
    except (ValidationError, ValueError, APIError):
        return None


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
