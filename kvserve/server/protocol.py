"""Request bodies of the OpenAI-compatible API, as strict pydantic models.

Strict means JSON types are taken at their word: "1" is not a number and 1 is not a boolean
(an integer is accepted where a number is expected, as OpenAI does). Unknown fields are an error,
so a misspelt parameter is reported instead of silently ignored. Ranges are checked afterwards
by SamplingParams and the server's limits, which know the allowed values. `null` means "the
default" for every optional field, as in OpenAI's API; OpenAI's fields that kvserve has no use
for are accepted and listed by `ignored_fields()` so the route can log them.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.errors import InvalidParam, shown
from kvserve.sampling_params import SamplingParams, with_defaults
from kvserve.tokenizer.chat_template import ChatPrompt

# OpenAI request fields (chat and completions) that change nothing kvserve does: accepted, and
# logged by the route (server/openai_compat.py), instead of failing as misspellings.
IGNORED_FIELDS = frozenset({
    "store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier",
    "modalities", "audio", "prediction", "web_search_options", "verbosity", "function_call", "functions",
    "prompt_cache_retention", "truncation",
})

ROLES = ("system", "user", "assistant", "developer", "tool", "function")  # function: legacy tool results

# What a union-typed field accepts, for the error message (pydantic would list every branch).
UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string, a list of strings or null",
    "content": "a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "tool_choice": "\"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
    "guided_json": "a JSON schema (an object, or a string holding one)",
    "input": ("a string or a list: of strings, token ids or lists of token ids (embeddings), or of input items "
              "(objects: responses)"),
    "output": "a string or a list of {\"type\": \"input_text\", \"text\": ...} parts",
    "system": "a string or a list of {\"type\": \"text\", \"text\": ...} blocks",
}


# OpenAI's limits on `metadata` and kvserve's on `user`: a stored response keeps both and echoes
# them back, so a client must not be able to park megabytes in them.
METADATA_KEYS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
USER_CHARS = 256


def _small_metadata(metadata: dict[str, str]) -> dict[str, str]:
    if len(metadata) > METADATA_KEYS:
        raise ValueError(f"at most {METADATA_KEYS} keys, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise ValueError(f"keys are at most {METADATA_KEY_CHARS} characters, got {len(key)} in {shown(key)}")
        if len(value) > METADATA_VALUE_CHARS:
            raise ValueError(f"values are at most {METADATA_VALUE_CHARS} characters, got {len(value)} in the value "
                             f"of {shown(key)}")
    return metadata


def _short_user(user: str) -> str:
    if len(user) > USER_CHARS:
        raise ValueError(f"must be at most {USER_CHARS} characters (an id for the end user), got {len(user)}")
    return user


Metadata = Annotated[dict[str, str], AfterValidator(_small_metadata)]
User = Annotated[str, AfterValidator(_short_user)]


def legacy_call_id(name: str) -> str:
    """The id pairing an assistant's legacy function_call with the `function` message answering it."""
    return f"call_{name}"


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """An explicit null for an optional field means its default (OpenAI's clients send them)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


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
    user: User | None = None  # accepted and ignored
    logit_bias: dict[str, float] | None = None  # {"token id": bias in [-100, 100]}, OpenAI's form
    # Extras (not in OpenAI's API).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    speculative: bool = True  # false: never drafted for when the server speculates (--speculative)
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* forms.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # SGLang's, which its router (sglang-router) writes into every request it forwards: accepted
    # at the values that ask for nothing kvserve lacks (the routes refuse the others by name).
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    separate_reasoning: bool = True  # kvserve has no reasoning parser: there is nothing to separate
    stream_reasoning: bool = True
    include_reasoning: bool = True  # vLLM's, which vllm-router writes likewise: no reasoning parser, nothing to include
    # OpenAI's, accepted and ignored (logged): kvserve has no use for them.
    store: Any = None
    metadata: Metadata | None = None
    service_tier: Any = None
    reasoning_effort: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    function_call: Any = None
    functions: Any = None
    prompt_cache_retention: Any = None

    def ignored_fields(self) -> list[str]:
        return sorted(k for k in IGNORED_FIELDS - self.USED_FIELDS if getattr(self, k, None) is not None)

    USED_FIELDS: ClassVar[frozenset[str]] = frozenset()  # of IGNORED_FIELDS, those this endpoint uses
    kvserve: KVServeOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: Mapping[str, Any] | None = None, constraint: Any = None) -> SamplingParams:
        """Raises ValueError "<param> must be ..." for a value out of range. `defaults` fill the
        sampling fields the request left out (the model's or the server's, generation_defaults.py)."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                                               "min_p", "repetition_penalty")}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return with_defaults(
            defaults or {}, given, n=self.n, seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=max_tokens, min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, priority=self.priority, constraint=constraint,
            logit_bias=_token_ids(self.logit_bias), speculative=self.speculative,
        )


def _token_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings: "15339", not "hello"."""
    if not bias:
        return None
    bad = next((k for k in bias if not (k.isascii() and k.isdigit() and len(k) <= 10)), None)
    if bad is not None:
        raise InvalidParam("logit_bias", f"logit_bias keys must be token ids written as decimal strings (\"15339\"), "
                           f"got {bad!r:.60}: POST /tokenize gives a text's ids")
    return {int(k): b for k, b in bias.items()}


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


class FunctionCall(_Strict):
    name: str
    arguments: str  # a JSON object as text


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    function_call: FunctionCall | None = None  # assistant, legacy: rendered as one tool call
    # A thinking model's reasoning of an earlier turn (vLLM's name): the template decides whether to render it.
    reasoning_content: str | None = None
    # Echoed back from an OpenAI response (model_dump()): accepted, not rendered.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unknown role {shown(role)}: use one of {', '.join(ROLES)}")
        return role

    @model_validator(mode="after")
    def _function_result_names_its_function(self) -> ChatMessage:
        if self.role == "function" and not self.name:
            raise ValueError('a "function" message (a legacy function result) needs "name": the function it answers')
        return self

    def for_template(self) -> dict[str, Any]:
        """The plain message a chat template expects: content as one string; developer is system;
        legacy function calls and results as tool calls and results (server/openai_compat.py)."""
        if isinstance(self.content, list):
            text = "".join(p.text for p in self.content)
        else:
            text = self.content or ""
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        out: dict[str, Any] = {"role": role, "content": text}
        if self.name is not None:
            out["name"] = self.name
        if self.reasoning_content is not None and self.role == "assistant":
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        elif self.function_call is not None and self.role == "assistant":
            out["tool_calls"] = [{"id": legacy_call_id(self.function_call.name), "type": "function",
                                  "function": self.function_call.model_dump()}]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        elif self.role == "function" and self.name is not None:
            out["tool_call_id"] = legacy_call_id(self.name)
        return out


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


# The template variables a request sets through its own fields (and the tokenizer through the model's).
TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token"})


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's deprecated forms of tools / tool_choice, mapped onto them (server/openai_compat.py).
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    USED_FIELDS: ClassVar[frozenset[str]] = frozenset({"functions", "function_call"})
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's and SGLang's; only false is supported
    # vLLM's: more variables for the chat template, e.g. {"enable_thinking": false} (Qwen3)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _own_names_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(kwargs or {}) & TEMPLATE_NAMES)
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's own fields say those")
        return kwargs

    def chat_prompt(self) -> ChatPrompt:
        """The prompt of a checked request (its legacy `functions` already turned into tools)."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools and self.tool_choice != "none" else None
        return ChatPrompt([m.for_template() for m in self.messages], self.add_generation_prompt, tools,
                          self.chat_template_kwargs)


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings body. `dimensions` (a shorter vector) is refused by the route unless it
    is the model's own size; `user` is accepted and ignored."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: User | None = None


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class _Echoed(_Strict):
    """An item a client may send back as an SDK dumped it (OpenAI's output items, Anthropic's
    content blocks): fields kvserve has no use for (ids, statuses, annotations, fields of newer API
    versions) are dropped instead of refused, as those APIs take them."""

    model_config = ConfigDict(extra="ignore")


class ResponsesContentPart(_Echoed):
    """input_text / output_text (text), refusal (refusal); the route refuses images, files, audio."""

    type: str
    text: str | None = None
    refusal: str | None = None


class ResponsesMessageItem(_Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponsesContentPart]


class ResponsesFunctionCallItem(_Echoed):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object as text


class ResponsesFunctionCallOutputItem(_Echoed):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponsesContentPart]


class ResponsesFunctionTool(_Strict):
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


class ResponsesTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesTextConfig(_Strict):
    format: ResponsesTextFormat | None = None
    verbosity: Any = None  # accepted and ignored


class ResponsesRequest(_Strict):
    """POST /v1/responses (OpenAI's Responses API). Input items and tools are checked one by one
    by the route (kvserve/server/responses.py), so that each unsupported kind is refused by name."""

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


def field_names() -> frozenset[str]:
    """The field names (and aliases) of every strict request model, of every API, for error paths."""
    names: set[str] = set()
    stack: list[type[_Strict]] = [_Strict]
    while stack:
        cls = stack.pop()
        stack += cls.__subclasses__()
        names.update(cls.model_fields)
        names.update(f.alias for f in cls.model_fields.values() if f.alias)
    return frozenset(names)

