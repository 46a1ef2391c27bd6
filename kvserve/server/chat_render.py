"""A chat request's prompt as its chat template sees it: one rule for the server and the router.

The server renders every chat completion through `ChatPrompt`; a cache-aware router renders the
same request body through the same class with the replica's own tokenizer, chat template and
special-token rule (checked by `Tokenizer.fingerprint`), so the prompt ids it hashes are the ones
the replica will look up (kvserve/router/kv_index.py). Tools, tool calls, tool results, legacy
functions and content parts are all part of that rule, here and nowhere else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kvserve.server import openai_compat
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.tokenizer import Tokenizer
from kvserve.web.errors import APIError


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict[str, Any]]  # as the template wants them: content as one string, and so on
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # OpenAI's function list; None when tool_choice is "none"

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> ChatPrompt:
        """The prompt of a checked request (its legacy `functions` already turned into tools)."""
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools and req.tool_choice != "none" else None
        return cls([m.for_template() for m in req.messages], req.add_generation_prompt, tools)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> ChatPrompt | None:
        """The prompt of a raw chat completion body, or None where the server would refuse it."""
        try:
            req = ChatCompletionRequest.model_validate(body)
            openai_compat.apply_legacy_functions(req)
        except (ValidationError, APIError, ValueError):
            return None
        return cls.of(req) if req.messages else None

    def encode(self, tok: Tokenizer, special_tokens_in_content: bool = False,
               max_tokens: int | None = None) -> list[int]:
        """The prompt ids (`Tokenizer.encode_chat`: client text stays text unless allowed)."""
        extra = {"tools": self.tools} if self.tools else {}
        return tok.encode_chat(self.messages, self.add_generation_prompt, max_tokens=max_tokens,
                               special_tokens_in_content=special_tokens_in_content, **extra)
