"""Anthropic's Messages API on the way in: request bodies as strict pydantic models, and
`to_chat`, which turns one into kvserve's chat (server/canonical.py), as the route and a router
read it.

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

`template_messages` works on plain JSON too, for a router's rough reading of a body (its text
for the approximate prefix tree); it raises ValueError on a shape it does not know.
"""
from __future__ import annotations

import functools
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from kvserve.errors import InvalidParam
from kvserve.server.canonical import ChatTurn, Sampling, read_body
from kvserve.server.parsing import Echoed, KVServeOptions, Strict
from kvserve.structured.spec import Constraint, json_schema
from kvserve.structured.tools import forced_call_constraint
from kvserve.tokenizer.chat_template import ChatPrompt

# Fields of Anthropic's API that change nothing kvserve does: accepted, logged.
IGNORED = ("metadata", "service_tier", "cache_control", "container", "inference_geo", "speed",
           "diagnostics", "context_management", "mcp_servers", "user_profile_id", "workspace_id")


class TextBlock(Echoed):
    type: Literal["text"]
    text: str
    cache_control: Any = None  # kvserve's prefix cache needs no marks
    citations: Any = None


class ToolUseBlock(Echoed):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None
    caller: Any = None


class _Unsupported(Echoed):
    """A block kvserve cannot read (images, documents): parsed so that its refusal names it."""

    type: Literal["image", "document"]
    source: Any = None
    title: Any = None
    context: Any = None
    citations: Any = None
    cache_control: Any = None


class ToolResultBlock(Echoed):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | _Unsupported, Field(discriminator="type")]] = ""
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(Echoed):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str = ""
    signature: str = ""
    data: str = ""


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | _Unsupported,
                  Field(discriminator="type")]


class Message(Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(Strict):
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


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('name is required with type "tool", and only there')
        return self


class OutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: OutputFormat | None = None
    effort: Any = None  # kvserve has no reasoning to spend effort on


class CountTokensRequest(Strict):
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


def constraint(req: CountTokensRequest) -> Constraint | None:
    """A forced tool call's grammar, or output_config.format's schema (not both)."""
    tools, choice = req.openai_tools(), req.openai_tool_choice()
    forced = None
    if tools and choice not in ("auto", "none") and req.tool_choice is not None:  # (None is "auto")
        parallel = req.tool_choice.disable_parallel_tool_use is False  # one call unless asked for more
        forced = forced_call_constraint(tools, choice, parallel)
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is None:
        return forced
    if forced is not None:
        raise InvalidParam("output_config.format", "output_config.format cannot be combined with a forced "
                           "tool_choice (any or tool): give one output constraint")
    return json_schema(fmt.schema_, "output_config.format.schema")


def tool_mode(req: CountTokensRequest) -> str | None:
    if req.openai_tools() is None:
        return None
    return "auto" if req.openai_tool_choice() == "auto" else "forced"


def to_chat(req: MessagesRequest) -> ChatTurn:
    """The chat a parsed body asks for (server/canonical.py); InvalidParam for what is wrong with it."""
    req.checked()
    if req.max_tokens < 1:  # (0 scores a prompt on /v1/completions; Anthropic's API asks at least 1)
        raise InvalidParam("max_tokens", f"max_tokens must be at least 1, got {req.max_tokens}")
    given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k")}
    fixed = {"stop": list(req.stop_sequences or []), "constraint": constraint(req), "speculative": req.speculative}
    return ChatTurn(req.chat_prompt(), Sampling(given, fixed, req.max_tokens), tool_mode(req))


read = functools.partial(read_body, MessagesRequest, to_chat)


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

