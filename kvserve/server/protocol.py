"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict means JSON types are taken at their word: "1" is not a number and 1 is not a boolean
(an integer is accepted where a number is expected, as OpenAI does). Unknown fields are an error,
so a misspelt parameter is reported instead of silently ignored. Ranges are checked afterwards
by SamplingParams and the server's limits, which know the allowed values.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator

from kvserve.sampling_params import SamplingParams

ROLES = ("system", "user", "assistant", "developer")

# What a union-typed field accepts, for the error message (pydantic would list every branch).
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string, a list of strings or null",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class KVServeOptions(_Strict):
    """kvserve's extension field `"kvserve": {...}` (docs/server.md)."""

    timeline: bool = False  # the request's timeline in the final chunk (or the body)


class _Sampling(_Strict):
    """Sampling fields shared by both endpoints: OpenAI's names, then the extras' common names."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    logit_bias: dict[str, float] | None = None  # only empty: the engine has no logit bias
    # Extras (not in OpenAI's API).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    kvserve: KVServeOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError "<param> must be ..." for a value out of range."""
        given = {
            k: getattr(self, k)
            for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                      "repetition_penalty")
            if getattr(self, k) is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n, seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, priority=self.priority, **given,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # legacy: how many top tokens per position
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        return role

    def for_template(self) -> dict[str, Any]:
        """The plain message a chat template expects: content as one string; developer is system."""
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        return out


class ResponseFormat(_Strict):
    type: Literal["text"]  # structured output is not supported


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None  # only empty: no tool calling
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


MODELS = (StreamOptions, CompletionRequest, TextPart, ChatMessage, ResponseFormat, ChatCompletionRequest,
          TokenizeRequest, DetokenizeRequest)
