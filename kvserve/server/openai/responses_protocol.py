"""OpenAI's Responses API on the way in: its request body (strict models, server/parsing.py), and
`to_chat`, which turns it into kvserve's chat (server/canonical.py): its items as messages for
the chat template, OpenAI-form tools, one output constraint, its sampling. Each kind of item or
tool kvserve does not serve is refused by name. A router reads raw bodies with the same code
(`read`), so that it renders exactly what the server renders.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError

from kvserve.server.canonical import ChatTurn, Sampling, read_body
from kvserve.server.errors import APIError
from kvserve.server.parsing import Echoed, Metadata, Strict, User, from_validation_error, reject
from kvserve.structured.spec import Constraint, json_schema
from kvserve.structured.tools import forced_call_constraint
from kvserve.tokenizer.chat_template import ChatPrompt


class ResponsesContentPart(Echoed):
    """input_text / output_text (text), refusal (refusal); the route refuses images, files, audio."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ResponsesMessageItem(Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesContentPart]


class ResponsesFunctionCallItem(Echoed):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object as text


class ResponsesFunctionCallOutputItem(Echoed):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsesContentPart]


class ResponsesFunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None
    # OpenAI's, accepted and unused.
    defer_loading: Any = None
    allowed_callers: Any = None
    output_schema: Any = None
    async_: Any = Field(None, alias="async")


class ResponsesTextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesTextConfig(Strict):
    format: ResponsesTextFormat | None = None
    verbosity: Any = None  # accepted and ignored


class ResponsesRequest(Strict):
    """POST /v1/responses (OpenAI's Responses API). Input items and tools are checked one by one
    by the route (kvserve/server/openai/responses.py), so that each unsupported kind is refused by name."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    metadata: Metadata | None = None
    user: User | None = None  # accepted and ignored
    # Extras (not in OpenAI's API), as on the other routes.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    speculative: bool = True  # false: never drafted for when the server speculates (--speculative)
    # OpenAI's, accepted and ignored (logged): they change nothing kvserve does.
    stream_options: Any = None
    reasoning: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    max_tool_calls: Any = None
    access_programs: Any = None
    # OpenAI's, refused by name when set: kvserve does not do what they ask.
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    background_options: Any = None
    conversation: Any = None
    prompt: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None

    IGNORED: ClassVar[tuple[str, ...]] = (
        "stream_options", "reasoning", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
        "prompt_cache_options", "max_tool_calls", "access_programs", "user")

    def ignored_fields(self) -> list[str]:
        return [k for k in self.IGNORED if getattr(self, k) is not None]


LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")
_TOOL_CHOICES = ("none", "auto", "required")


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming each OpenAI field that asks for what kvserve does not do."""
    reject(req.background is True, "background", "is not supported: kvserve answers a response while the request is "
           "open (stream it for progress); send false or leave it out")
    reject(req.background_options is not None, "background_options", "is not supported: kvserve has no background mode")
    reject(req.conversation is not None, "conversation", "is not supported: kvserve has no Conversations API; chain "
           "responses with previous_response_id, or send the whole conversation as input")
    reject(req.prompt is not None, "prompt", "is not supported: kvserve has no stored prompt templates; send "
           "instructions and input")
    reject(req.truncation == "auto", "truncation", "\"auto\" is not supported: kvserve never drops input to fit the "
           "context (a conversation that does not fit is refused); send \"disabled\" or leave it out")
    reject(req.context_management is not None, "context_management", "is not supported: kvserve does not compact "
           "conversations")
    reject(req.moderation is not None, "moderation", "is not supported: kvserve runs no moderation model")
    reject(req.image is not None, "image", "is not supported: kvserve serves a text-only model")


def _validated(model: type[BaseModel], data: Any, where: str) -> Any:
    """`data` as `model`, or a 400 whose message and param start with `where` (e.g. input[2])."""
    if not isinstance(data, dict):
        raise APIError(400, f"{where}: must be an object", param=where)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        inner = from_validation_error(e)
        if inner.param is None:
            raise APIError(400, f"{where}: {inner.message}", param=where) from None
        raise APIError(400, f"{where}.{inner.message}", param=f"{where}.{inner.param}") from None


def _text(content: str | list[ResponsesContentPart], where: str) -> str:
    """A message's or a tool result's content as one string (text parts joined)."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type in _TEXT_PARTS:
            if part.text is None:
                raise APIError(400, f"{where}[{j}].text: is required", param=f"{where}[{j}].text")
            texts.append(part.text)
        elif part.type == "refusal":
            texts.append(part.refusal or "")
        else:
            raise APIError(400, f"{where}[{j}].type: {part.type!r} content is not supported: kvserve serves a "
                           "text-only model; send input_text parts", param=f"{where}[{j}].type")
    return "".join(texts)


def plain_items(raw: list[dict[str, Any]], where: str = "input") -> list[dict[str, Any]]:
    """Input (or output) items as the plain forms this module works with:
        {"type": "message", "role", "content": str}
        {"type": "function_call", "call_id", "name", "arguments"}
        {"type": "function_call_output", "call_id", "output": str}
    Reasoning items are dropped (a turn's reasoning is not shown to the next, as Qwen3's template
    does not); every other kind is a 400 naming it."""
    out = []
    for i, item in enumerate(raw):
        here = f"{where}[{i}]"
        kind = item.get("type", "message" if "role" in item else None) if isinstance(item, dict) else None
        if kind == "message":
            m = _validated(ResponsesMessageItem, item, here)
            out.append({"type": "message", "role": m.role, "content": _text(m.content, f"{here}.content")})
        elif kind == "function_call":
            c = _validated(ResponsesFunctionCallItem, item, here)
            out.append({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments})
        elif kind == "function_call_output":
            r = _validated(ResponsesFunctionCallOutputItem, item, here)
            out.append({"type": "function_call_output", "call_id": r.call_id, "output": _text(r.output, f"{here}.output")})
        elif kind == "reasoning":
            continue
        elif not isinstance(item, dict):
            raise APIError(400, f"{here}: must be an object", param=here)
        elif kind is None:
            raise APIError(400, f"{here}: give its type (message, function_call or function_call_output), or a role "
                           "for a message", param=f"{here}.type")
        else:
            raise APIError(400, f"{here}.type: {kind!r} items are not supported: kvserve takes message, function_call "
                           "and function_call_output items", param=f"{here}.type")
    return out


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as plain items (a string is one user message)."""
    if isinstance(req.input, list):
        return plain_items(req.input)
    return [{"type": "message", "role": "user", "content": req.input}]


def chat_prompt(req: ResponsesRequest, items: list[dict[str, Any]], tools: list[ResponsesFunctionTool],
                mode: str | None) -> ChatPrompt:
    """The conversation (instructions, then the items) and, when tool calls are read (`mode`), the tools."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + chat_messages(items)
    return ChatPrompt(messages, True, [chat_tool(t) for t in tools] if mode is not None and tools else None)


def to_chat(req: ResponsesRequest, items: Sequence[dict[str, Any]]) -> ChatTurn:
    """The chat a parsed body asks for (server/canonical.py), whose conversation is `items` (its
    input's plain items, after those of the stored response it continues); 400 for what is wrong."""
    refuse_unsupported(req)
    tools = function_tools(req.tools)
    choice = tool_choice(req.tool_choice, tools)
    constraint = output_constraint(req, tools, choice)
    mode = tool_mode(tools, choice, constraint)
    prompt = chat_prompt(req, list(items), tools, mode)
    reject(not prompt.messages, "input", "must not be empty")
    reject(req.max_output_tokens is not None and req.max_output_tokens < 1, "max_output_tokens", "must be at least 1")
    want_logprobs = LOGPROBS_INCLUDE in (req.include or []) or req.top_logprobs is not None
    given = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    fixed = dict(n=1, seed=req.seed, stop=stop, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
                 logprobs=(req.top_logprobs or 0) if want_logprobs else None, priority=req.priority,
                 constraint=constraint, speculative=req.speculative)
    return ChatTurn(prompt, Sampling(given, fixed, req.max_output_tokens, req.max_output_tokens is None), mode)


def read(body: dict[str, Any]) -> ChatTurn | None:
    """A raw body as the route reads it (None also where it continues a stored response: its start
    is on one replica), for a router."""
    if body.get("previous_response_id") is not None:
        return None
    return read_body(ResponsesRequest, lambda req: to_chat(req, input_items(req)), body)


def chat_messages(items: list[dict[str, Any]] | tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """Plain items → the messages a chat template renders: developer is system, consecutive
    function calls are one assistant message's tool_calls (after its text, if any), and each
    function_call_output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": "system" if item["role"] == "developer" else item["role"],
                             "content": item["content"]})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def function_tools(raw: list[dict[str, Any]] | None) -> list[ResponsesFunctionTool]:
    tools = []
    for i, tool in enumerate(raw or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            where = f"tools[{i}].type" if isinstance(tool, dict) else f"tools[{i}]"
            what = f"the built-in tool {kind!r}" if isinstance(kind, str) else "a tool without a type"
            raise APIError(400, f"{where}: {what} is not supported: kvserve serves function tools only "
                           "({\"type\": \"function\", \"name\": ..., \"parameters\": {...}})", param=where)
        tools.append(_validated(ResponsesFunctionTool, tool, f"tools[{i}]"))
    names = [t.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise APIError(400, f"tools: two tools are named {dup!r}; names must be unique", param="tools")
    return tools


def tool_choice(choice: str | dict[str, Any] | None, tools: list[ResponsesFunctionTool]) -> str | dict[str, Any]:
    """"none", "auto", "required" or {"type": "function", "name": ...} (400 for the rest)."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in _TOOL_CHOICES:
            raise APIError(400, f"tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                           f"\"name\": ...}}, got {choice!r:.60}", param="tool_choice")
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice \"required\" needs tools: list the functions it may call", param="tool_choice")
        return choice
    kind = choice.get("type")
    if kind != "function":
        raise APIError(400, f"tool_choice: {kind!r:.60} is not supported: kvserve serves function tools only (\"none\", "
                       "\"auto\", \"required\" or {\"type\": \"function\", \"name\": ...})", param="tool_choice.type")
    name = choice.get("name", (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None)
    if not isinstance(name, str):
        raise APIError(400, "tool_choice.name: is required (the function to call)", param="tool_choice.name")
    if name not in {t.name for t in tools}:
        listed = ", ".join(repr(t.name) for t in tools) or "none"
        raise APIError(400, f"tool_choice names the function {name!r:.80}, which is not among the tools ({listed})",
                       param="tool_choice.name")
    return {"type": "function", "name": name}


def chat_tool(t: ResponsesFunctionTool) -> dict[str, Any]:
    fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
    return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


def text_format(req: ResponsesRequest) -> dict[str, Any]:
    """text.format as the response echoes it."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return {"type": "text"}
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "description": fmt.description,
            "strict": fmt.strict}


def output_constraint(req: ResponsesRequest, tools: list[ResponsesFunctionTool], choice: str | dict) -> Constraint | None:
    """The output's one constraint. A forced call (tool_choice "required" or named) wins over
    text.format: that turn's output is the call, and text.format shapes a later turn's message
    (an agent forcing a tool and then answering in a schema sends both, each turn)."""
    if tools and choice not in ("auto", "none"):
        named = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice["name"]}}
        return forced_call_constraint([chat_tool(t) for t in tools], named, req.parallel_tool_calls is True)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        return Constraint("json_object", "", "text.format")
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format.schema: is required for a json_schema format", param="text.format.schema")
        return json_schema(fmt.schema_, "text.format.schema")
    return None


def tool_mode(tools: list, choice: str | dict, constraint: Constraint | None) -> str | None:
    """As openai/protocol.tool_mode: None (no tool parsing), "auto" or "forced"."""
    if not tools or choice == "none":
        return None
    if choice == "auto":  # under text.format the answer is the schema's JSON, never a call
        return None if constraint is not None else "auto"
    return "forced"
