"""Ollama's API on the way in: request bodies as strict pydantic models (field names as in the
`ollama` package's ollama/_types.py), and the conversation as kvserve's chat template sees it.

`options` take Ollama's names: temperature, top_p, top_k, min_p, seed, num_predict (-1 or -2:
until the context is full), stop, repeat_penalty (kvserve's repetition_penalty),
presence_penalty, frequency_penalty, and num_ctx, which may narrow the served context but not
widen it; kvserve's own `speculative: false` keeps a request out of speculative decoding.
Options about hardware and loading (num_gpu, num_thread, use_mmap, ...) change nothing here and
are accepted; samplers kvserve does not have (mirostat, typical_p, tfs_z) are refused
unless they are at their off values. Unknown fields are refused by name, as everywhere in kvserve.

`to_chat` (and `sampling`) turn a body into kvserve's chat (server/canonical.py), for the route
and for a router (`read_chat`, `read_generate`); `chat_messages` and `generate_messages` work on
plain JSON too, for a router's rough reading of a body.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import PrivateAttr, model_validator

from kvserve.errors import InvalidParam
from kvserve.server.canonical import ChatTurn, Sampling, read_body
from kvserve.server.parsing import FunctionDef, Strict, legacy_call_id
from kvserve.structured.spec import Constraint, json_schema
from kvserve.tokenizer.chat_template import ChatPrompt

# Off values of the samplers kvserve lacks: anything else is refused.
_OFF = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}


class Options(Strict):
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    num_predict: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    num_ctx: int | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    speculative: bool | None = None  # kvserve's: false, never drafted for when the server speculates
    # How Ollama loads and runs a model: nothing to do with kvserve's engine.
    numa: Any = None
    num_batch: Any = None
    num_gpu: Any = None
    main_gpu: Any = None
    low_vram: Any = None
    f16_kv: Any = None
    logits_all: Any = None
    vocab_only: Any = None
    use_mmap: Any = None
    use_mlock: Any = None
    embedding_only: Any = None
    num_thread: Any = None
    num_keep: Any = None
    repeat_last_n: Any = None
    penalize_newline: Any = None

    def context(self, limit: int) -> int:
        """The context a request's tokens must fit in: num_ctx narrows the server's (`limit`), never widens it."""
        if self.num_ctx is None:
            return limit
        if not 1 <= self.num_ctx <= limit:
            raise InvalidParam("options.num_ctx", f"options.num_ctx {self.num_ctx} is not in [1, {limit}], this "
                               "server's context: kvserve does not widen it; send at most that, or leave it out")
        return self.num_ctx

    def sampling(self) -> dict[str, Any]:
        """SamplingParams fields (max_tokens apart: see num_predict); InvalidParam for a sampler kvserve lacks."""
        for name, off in _OFF.items():
            value = getattr(self, name)
            if value is not None and value != off:
                raise InvalidParam(f"options.{name}", f"options.{name}: kvserve has no {name} sampler; leave it out "
                                   f"or send {off}")
        if self.num_predict is not None and self.num_predict not in (-1, -2) and self.num_predict < 1:
            raise InvalidParam("options.num_predict", "options.num_predict must be -1 or -2 (until the context is "
                               "full) or a number of tokens >= 1")
        names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
                 "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                 "frequency_penalty": "frequency_penalty"}
        out = {ours: getattr(self, theirs) for theirs, ours in names.items() if getattr(self, theirs) is not None}
        if self.speculative is not None:
            out["speculative"] = self.speculative
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return out


class FunctionCall(Strict):
    name: str
    arguments: dict[str, Any] = {}
    index: int | None = None
    description: str | None = None


class ToolCall(Strict):
    function: FunctionCall
    id: str | None = None
    type: str | None = None


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[Any] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None  # a thinking model's earlier reasoning: given to the template as reasoning_content


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class _Named(Strict):
    """A request naming the model, as Ollama names it."""

    model: str
    options: Options | None = None
    keep_alive: Any = None  # the model stays loaded as long as kvserve runs
    _name: str = PrivateAttr("")  # the model as the client named it (echoed back)

    @model_validator(mode="after")
    def _tagless(self) -> _Named:
        """Ollama's names carry a tag; `tags` lists the served model as NAME:latest."""
        self._name = self.model
        self.model = self.model.removesuffix(":latest")
        return self


class _Generation(_Named):
    """What /api/chat and /api/generate share."""

    format: Literal["", "json"] | dict[str, Any] | None = None
    stream: bool = True  # Ollama streams unless told not to
    think: bool | Literal["low", "medium", "high"] | None = None  # a thinking model's reasoning, apart (None: on)
    logprobs: bool = False
    top_logprobs: int | None = None

    def checked(self, thinks: bool) -> None:
        """thinks: whether the model thinks (a <think> block before its answer: structured/reasoning.py)."""
        if self.think not in (None, False) and not thinks:
            raise InvalidParam("think", f"think: the model {self._name!r} does not think; leave it out or send false")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("top_logprobs", "top_logprobs needs logprobs set to true")


    @property
    def template_variables(self) -> dict[str, Any] | None:
        """think false: a thinking template's own switch (Qwen3's enable_thinking) turned off."""
        return {"enable_thinking": False} if self.think is False else None


class ChatRequest(_Generation):
    messages: list[Message] = []
    tools: list[Tool] | None = None
    truncate: Any = None
    shift: Any = None

    def checked(self, thinks: bool) -> None:
        super().checked(thinks)
        for i, m in enumerate(self.messages):
            if m.images:
                raise InvalidParam(f"messages[{i}].images", f"messages[{i}].images: kvserve serves a text-only model")

    def chat_prompt(self) -> ChatPrompt:
        """The conversation and its tools as the chat template takes them."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        messages = chat_messages([m.model_dump(exclude_none=True) for m in self.messages])
        return ChatPrompt(messages, True, tools or None, self.template_variables)


class GenerateRequest(_Generation):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None

    def checked(self, thinks: bool) -> None:
        super().checked(thinks)
        if self.images:
            raise InvalidParam("images", "images: kvserve serves a text-only model")
        if self.suffix:
            raise InvalidParam("suffix", "suffix (fill in the middle) is not supported on /api/generate")
        if self.template:
            raise InvalidParam("template", "template is not supported: kvserve renders prompts with the model's own "
                               "chat template (or none, with raw: true)")

    def chat_prompt(self) -> ChatPrompt | None:
        """The prompt as one templated user turn; None when it is sent raw (its text is the prompt)."""
        if self.raw:
            return None
        return ChatPrompt(generate_messages(self.prompt, self.system), variables=self.template_variables)


class EmbedRequest(_Named):
    """/api/embed. Of `options`, only num_ctx matters (the context inputs are cut to)."""

    input: str | list[str] = ""
    truncate: bool | None = None  # None: Ollama's default, true
    dimensions: int | None = None


class EmbeddingsRequest(_Named):
    """/api/embeddings, Ollama's older form: one prompt."""

    prompt: str = ""


class ShowRequest(Strict):
    model: str | None = None
    name: str | None = None  # older clients' name for it
    verbose: bool = False

    @model_validator(mode="after")
    def _tagless(self) -> ShowRequest:
        self.model = self.model.removesuffix(":latest") if self.model is not None else None
        return self


def sampling(req: _Generation) -> Sampling:
    """What a chat or generate body asks of the sampler: its options (num_predict -1 or -2: all the
    context leaves), `format` as a constraint, logprobs; InvalidParam for a sampler kvserve lacks."""
    options = req.options
    given = options.sampling() if options is not None else {}
    predict = options.num_predict if options is not None else None
    fmt = req.format
    constraint = (None if fmt in (None, "") else Constraint("json_object", "", "format") if fmt == "json"
                  else json_schema(fmt, "format"))
    fixed = {"logprobs": (req.top_logprobs or 0) if req.logprobs else None, "constraint": constraint}
    return Sampling(given, fixed, None if predict in (None, -1, -2) else predict, predict is None)


def to_chat(req: ChatRequest) -> ChatTurn:
    """The chat a parsed /api/chat body asks for (server/canonical.py); tool calls are read from
    free text whenever tools are given (Ollama has no tool_choice)."""
    return ChatTurn(req.chat_prompt(), sampling(req), "auto" if req.tools else None)


def _chat_of_generate(req: GenerateRequest) -> ChatTurn | None:
    """/api/generate's prompt as the one user turn the route templates (None for a raw prompt, one
    that continues a context, or none)."""
    prompt = req.chat_prompt()
    return ChatTurn(prompt, sampling(req)) if prompt is not None and req.prompt and not req.context else None


def read_chat(body: dict[str, Any]) -> ChatTurn | None:
    """A raw /api/chat body as the route reads it, for a router (None also for no messages: a load)."""
    return read_body(ChatRequest, lambda req: to_chat(req) if req.messages else None, body)


def read_generate(body: dict[str, Any]) -> ChatTurn | None:
    """The same for /api/generate."""
    return read_body(GenerateRequest, _chat_of_generate, body)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages (plain JSON) as the chat template's. Tool calls and results pair up by the
    tool's name (Ollama's messages carry no call ids)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m["role"], "content": m.get("content") or ""}
        calls = [c["function"] for c in m.get("tool_calls") or []]
        if calls:
            msg["tool_calls"] = [{"id": legacy_call_id(f["name"]), "type": "function",
                                  "function": {"name": f["name"], "arguments": json.dumps(f.get("arguments") or {},
                                                                                         ensure_ascii=False)}}
                                 for f in calls]
        if m["role"] == "tool" and m.get("tool_name"):
            msg["tool_call_id"] = legacy_call_id(m["tool_name"])
        if m["role"] == "assistant" and m.get("thinking"):
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    return out


def generate_messages(prompt: str, system: str | None) -> list[dict[str, Any]]:
    """/api/generate's prompt as one user turn of the chat template (Ollama templates it too)."""
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
