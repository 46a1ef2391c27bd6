"""Request bodies of the OpenAI-compatible API, as strict pydantic models, and a chat body as
kvserve's chat (`to_chat`, server/canonical.py), for the route and for a router (`read`).

What real OpenAI clients send beyond kvserve's core parameters:
- Fields OpenAI defines that kvserve has no use for are dropped with a logged warning (as vLLM
  does) instead of failing as misspellings; unknown fields still fail, by name.
- `response_format`, vLLM's `structured_outputs` / `guided_*` and a forcing `tool_choice`
  become one output Constraint (kvserve/structured/).
- OpenAI's deprecated function calling, still sent by older clients and agents, is mapped onto
  tools (`apply_legacy_functions`; answered in its own shape: server/openai/legacy.py):

    functions=[f, ...]             ->  tools=[{"type": "function", "function": f}, ...]
    function_call="none" | "auto"  ->  tool_choice="none" | "auto"
    function_call={"name": n}      ->  tool_choice={"type": "function", "function": {"name": n}}

  Messages (`ChatMessage.for_template`): an assistant's `function_call` becomes one tool call
  and a `function` message a `tool` result, paired by the id `call_<name>` (`legacy_call_id`).

Strict (server/parsing.py): JSON types at their word, unknown fields refused, `null` for "the
default" of every optional field, as in OpenAI's API. OpenAI's fields that kvserve has no use
for are accepted and listed by `ignored_fields()` so the route can log them.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from kvserve.errors import InvalidParam, shown
from kvserve.server.canonical import ChatTurn, Sampling, read_body
from kvserve.server.errors import APIError
from kvserve.server.parsing import FunctionDef, KVServeOptions, Metadata, Strict, User, legacy_call_id
from kvserve.structured.spec import Constraint, from_response_format, from_vllm
from kvserve.structured.tools import forced_call_constraint
from kvserve.tokenizer.chat_template import ChatPrompt

# OpenAI request fields (chat and completions) that change nothing kvserve does: accepted, and
# logged by the route (`log_ignored`), instead of failing as misspellings.
IGNORED_FIELDS = frozenset({
    "store", "metadata", "service_tier", "reasoning_effort", "prompt_cache_key", "safety_identifier",
    "modalities", "audio", "prediction", "web_search_options", "verbosity", "function_call", "functions",
    "prompt_cache_retention", "truncation",
})

ROLES = ("system", "user", "assistant", "developer", "tool", "function")  # function: legacy tool results


class StreamOptions(Strict):
    include_usage: bool = False


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None  # {"name", "schema", "strict", "description"}


class _Sampling(Strict):
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

    def sampling(self, max_tokens: int | None, logprobs: int | None, constraint: Any = None,
                 defaulted: bool = False) -> Sampling:
        """What the request asks of the sampler (server/canonical.py); InvalidParam for a bad logit_bias."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                                               "min_p", "repetition_penalty")}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        fixed = dict(n=self.n, seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                     min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
                     skip_special_tokens=self.skip_special_tokens, priority=self.priority, constraint=constraint,
                     logit_bias=_token_ids(self.logit_bias), speculative=self.speculative)
        return Sampling(given, fixed, max_tokens, defaulted)


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

    def prompts(self) -> list[str | list[int]]:
        """A string, token ids, or a batch of either → a list of prompts."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise InvalidParam("prompt", "prompt must not be empty")
        return list(prompt)  # type: ignore[arg-type]


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object as text


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
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
        legacy function calls and results as tool calls and results (`apply_legacy_functions`)."""
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


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
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
    # OpenAI's deprecated forms of tools / tool_choice, mapped onto them (`apply_legacy_functions`).
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


class EmbeddingRequest(Strict):
    """OpenAI's embeddings body. `dimensions` (a shorter vector) is refused by the route unless it
    is the model's own size; `user` is accepted and ignored."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: User | None = None


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


log = logging.getLogger("kvserve.server")
GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def log_ignored(req: Any) -> None:
    """A warning naming the OpenAI fields of `req` that kvserve accepted but does not use."""
    ignored = req.ignored_fields()
    if ignored:
        log.warning("ignored OpenAI field(s) kvserve does not use: %s", ", ".join(ignored))


def constraint(req: Any) -> Constraint | None:
    """The one output constraint a request asks for (ValueError naming the field if several or
    if one is malformed)."""
    found = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        c = from_response_format(fmt if isinstance(fmt, dict) else fmt.model_dump())
        if c is not None:
            found.append(c)
    so = getattr(req, "structured_outputs", None)
    if so:
        c = from_vllm({k: so.get(k) for k in so}, "structured_outputs.")
        if c is not None:
            found.append(c)
    guided = {k: v for k in GUIDED_KINDS if (v := getattr(req, f"guided_{k}", None)) is not None}
    if guided and (c := from_vllm(guided, "guided_")) is not None:  # most requests set none of these
        found.append(c)
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if tools and choice not in (None, "auto", "none"):
        # One call unless parallel_tool_calls is set true: a valid answer either way, and small
        # models forced into an open-ended list repeat calls until max_tokens cuts the JSON.
        choice = choice if isinstance(choice, str) else choice.model_dump()
        forced = forced_call_constraint([t.model_dump() for t in tools], choice, req.parallel_tool_calls is True)
        if forced is not None:
            found.append(forced)
    if len(found) > 1:
        raise InvalidParam(found[1].param, f"{found[1].param} cannot be combined with {found[0].param}: give one output constraint")
    return found[0] if found else None


def tool_mode(req: Any) -> str | None:
    """None (no tool parsing), "auto" (calls parsed from free text) or "forced" (constrained JSON)."""
    if not getattr(req, "tools", None) or req.tool_choice == "none":
        return None
    return "auto" if req.tool_choice in (None, "auto") else "forced"


def apply_legacy_functions(req: ChatCompletionRequest) -> None:
    """Turn the request's functions/function_call into tools/tool_choice, in place (400 if it mixes both)."""
    if req.functions is None:
        if req.function_call is not None:
            raise APIError(400, "function_call needs functions: list the functions it may call (or use tools "
                           "and tool_choice)", param="function_call")
        return
    if req.tools is not None or req.tool_choice is not None:
        raise APIError(400, "functions cannot be combined with tools or tool_choice: give one or the other "
                       "(functions is OpenAI's deprecated form of tools)", param="functions")
    if not req.functions:
        raise APIError(400, "functions must not be empty: list at least one function or leave it out",
                       param="functions")
    req.tools = [Tool(type="function", function=f) for f in req.functions]
    choice = req.function_call
    if choice is None or isinstance(choice, str):
        req.tool_choice = choice
    else:
        if choice.name not in {f.name for f in req.functions}:
            raise APIError(400, f"function_call names {shown(choice.name)}, which is not in functions",
                           param="function_call")
        req.tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))


def to_chat(req: ChatCompletionRequest) -> ChatTurn:
    """The chat a parsed body asks for (server/canonical.py), its legacy functions as tools; 400
    (an InvalidParam, named in the engine's words: "max_tokens") for what is wrong with it."""
    apply_legacy_functions(req)  # functions / function_call: as tools / tool_choice from here on
    if not req.messages:
        raise InvalidParam("prompt", "messages must not be empty")
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise InvalidParam("tool_choice", "tool_choice forces a tool call, which needs tools: give tools, or leave "
                           "tool_choice out")
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidParam("top_logprobs", "top_logprobs needs logprobs set to true")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if max_tokens == 0:
        raise InvalidParam("max_tokens", "max_tokens must be at least 1: a chat answer has a token (only "
                           "/v1/completions scores a prompt with max_tokens 0)")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return ChatTurn(req.chat_prompt(), req.sampling(max_tokens, logprobs, constraint(req), max_tokens is None),
                    tool_mode(req))


read = functools.partial(read_body, ChatCompletionRequest, to_chat)
