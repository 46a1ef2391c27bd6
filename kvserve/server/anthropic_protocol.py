"""Anthropic's Messages API on the way in: request bodies as strict pydantic models, and the
conversation as kvserve's chat template sees it.

Field names follow the `anthropic` SDK's types (anthropic/types/message_create_params.py and the
block params beside it). What maps onto kvserve:
  system (a string or text blocks)     a system message first
  text blocks                          the message's content (blocks joined by a newline)
  assistant tool_use blocks            the assistant's tool calls (input as JSON arguments)
  user tool_result blocks              tool messages, in order, before the user's text
  thinking / redacted_thinking blocks  dropped (Anthropic drops earlier turns' thinking too)
  thinking {type: enabled|adaptive}    a thinking model thinks and its reasoning comes back as a
                                       thinking block; otherwise its template's enable_thinking is
                                       false and reasoning it writes anyway is dropped
  tools (input_schema), tool_choice    OpenAI-form tools: auto, any = required, tool = named, none
  output_config.format json_schema     structured output
Image and document blocks, server tools and a prefilled (last) assistant turn are refused by name.
A block's fields kvserve has no use for (`toolset_name`, `caller`, `citations`, ... as the SDK's
`block.model_dump()` writes them) are dropped; a block's own errors name it and the field
(`messages[1].content[0].id: is required`).

`template_messages` works on plain JSON so the router renders exactly what the server renders
(kvserve/router/request.py); it raises ValueError on a shape it does not know.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ValidationError, model_validator

from kvserve.errors import InvalidParam
from kvserve.server.protocol import KVServeOptions, _Echoed, _Strict
from kvserve.tokenizer.chat_template import ChatPrompt

# Fields of Anthropic's API that change nothing kvserve does: accepted, logged.
IGNORED = ("metadata", "service_tier", "cache_control", "container", "inference_geo", "speed",
           "diagnostics", "context_management", "mcp_servers", "user_profile_id", "workspace_id")


class TextBlock(_Echoed):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # kvserve's prefix cache needs no marks
    citations: Any = None


class ToolUseBlock(_Echoed):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None


class _Unsupported(_Echoed):
    """A block kvserve cannot read (images, documents): parsed so that its refusal names it."""

    type: Literal["image", "document"]
    source: Any = None
    title: Any = None
    context: Any = None
    citations: Any = None
    cache_control: Any = None


class ToolResultBlock(_Echoed):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | _Unsupported, Field(discriminator="type")]] = ""
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(_Echoed):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str = ""
    data: str = ""


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | _Unsupported,
                  Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Strict):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom" (or left out); Anthropic's server tools have other types
    strict: bool | None = None
    cache_control: Any = None
    input_examples: Any = None
    defer_loading: Any = None
    allowed_callers: Any = None
    eager_input_streaming: Any = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only there')
        return self


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    format: OutputFormat | None = None
    effort: Any = None  # kvserve has no reasoning to spend effort on


class CountTokensRequest(_Strict):
    """POST /v1/messages/count_tokens (and the conversation part of a message request)."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    thinking: Any = None
    cache_control: Any = None
    speed: Any = None
    IGNORED: ClassVar[tuple[str, ...]] = ("cache_control", "speed")

    def ignored_fields(self) -> list[str]:
        return [k for k in self.IGNORED if getattr(self, k, None) is not None]

    @property
    def thinking_on(self) -> bool:
        """Whether the client asked for thinking (budget_tokens is not enforced: max_tokens bounds it all)."""
        return isinstance(self.thinking, dict) and self.thinking.get("type") in ("enabled", "adaptive")

    def checked(self) -> CountTokensRequest:
        """400 (InvalidParam) for what kvserve cannot do, naming where it is."""
        if not self.messages:
            raise InvalidParam("messages", "messages must not be empty: send at least one user message")
        if self.messages[-1].role != "user":
            raise InvalidParam("messages", "the last message must be the user's: kvserve does not continue a "
                               "prefilled assistant turn")
        for i, m in enumerate(self.messages):
            for j, b in enumerate(m.content if isinstance(m.content, list) else []):
                inner = b.content if isinstance(b, ToolResultBlock) and isinstance(b.content, list) else []
                for where, block in [(f"messages[{i}].content[{j}]", b),
                                     *((f"messages[{i}].content[{j}].content[{k}]", x) for k, x in enumerate(inner))]:
                    if isinstance(block, _Unsupported):
                        raise InvalidParam(where, f"{where}: {block.type} blocks are not supported: kvserve serves a "
                                           "text-only model")
                if isinstance(b, (ToolUseBlock, ThinkingBlock)) and m.role != "assistant" or \
                        isinstance(b, ToolResultBlock) and m.role != "user":
                    raise InvalidParam(f"messages[{i}].content[{j}]", f"messages[{i}].content[{j}]: a {b.type} block "
                                       f"cannot be in a {m.role} message")
        for i, t in enumerate(self.tools or []):
            if t.type not in (None, "custom"):
                raise InvalidParam(f"tools[{i}].type", f"tools[{i}]: the server tool {t.type!r} is not supported: "
                                   "kvserve runs client tools (name, description, input_schema) only")
        if self.tool_choice is not None and self.tool_choice.type in ("any", "tool") and not self.tools:
            raise InvalidParam("tool_choice", f'tool_choice "{self.tool_choice.type}" needs tools')
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.model_dump(include={"system", "messages"}, exclude_none=True))

    def chat_prompt(self) -> ChatPrompt:
        """The conversation and its tools as the chat template takes them. Without `thinking` asked
        for, a thinking template's switch is off, as Anthropic's models do not think then."""
        return ChatPrompt(self.template_messages(), True, self.openai_tools() or None,
                          None if self.thinking_on else {"enable_thinking": False})

    def openai_tools(self) -> list[dict[str, Any]] | None:
        """The tools in the form kvserve's template and grammar code take; None when tool_choice is none."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                  **({"description": t.description} if t.description else {})}}
                for t in self.tools]

    def openai_tool_choice(self) -> Any:
        c = self.tool_choice
        if c is None or c.type == "auto":
            return "auto"
        return {"any": "required", "none": "none"}.get(c.type) or {"type": "function", "function": {"name": c.name}}


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    speculative: bool = True  # kvserve's: false, never drafted for when the server speculates (--speculative)
    metadata: Any = None
    service_tier: Any = None
    container: Any = None
    inference_geo: Any = None
    diagnostics: Any = None
    context_management: Any = None
    mcp_servers: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None
    kvserve: KVServeOptions | None = None
    IGNORED: ClassVar[tuple[str, ...]] = IGNORED


def prompt_of_body(body: dict[str, Any]) -> ChatPrompt | None:
    """The prompt of a raw /v1/messages body as the route renders it, or None where the server
    would refuse the body: a router's rendering of it."""
    try:
        return MessagesRequest.model_validate(body).checked().chat_prompt()
    except (ValidationError, ValueError):
        return None


def _text(blocks: Any) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list) or not all(isinstance(b, dict) for b in blocks):
        raise ValueError("not a string or a list of blocks")
    return "\n".join(b["text"] for b in blocks if b.get("type") == "text" and isinstance(b.get("text"), str))


def template_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`system` and `messages` of a request body (plain JSON) as the chat template's messages."""
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text(body["system"])})
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ValueError("messages is not a list")
    for m in messages:
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise ValueError(f"role {role!r}")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        text = _text(content)
        if role == "assistant":
            calls = [{"id": b["id"], "type": "function",
                      "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}}
                     for b in content if b.get("type") == "tool_use"]
            out.append({"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})})
            continue
        for b in content:
            if b.get("type") == "tool_result":
                result = _text(b.get("content", ""))
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": f"Error: {result}" if b.get("is_error") else result})
        if text or not any(b.get("type") == "tool_result" for b in content):
            out.append({"role": "user", "content": text})
    return out

