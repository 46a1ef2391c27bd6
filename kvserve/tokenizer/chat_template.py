"""A model's chat template: Jinja source shipped with the model, rendered in a sandbox; and
`ChatPrompt`, the conversation it renders.

Templates come with downloaded models, so they are untrusted code: they run in Jinja's immutable
sandbox (no underscore attributes, no mutation of the inputs). The environment offers what chat
templates are written against: trim_blocks/lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not HTML-escape, and a no-op `{% generation %}` block.

`ChatPrompt` is one rule for the server and the router: the server renders every chat request
through it (`Tokenizer.encode_prompt`); a cache-aware router renders the same request body to
the same `ChatPrompt` (each API's `to_chat`, server/canonical.py) with the replica's own tokenizer, chat template
and special-token rule (checked by `Tokenizer.fingerprint`), so the prompt ids it hashes are the
ones the replica will look up (kvserve/router/kv_index.py). How each API's request becomes one
(tools, tool calls, tool results, legacy functions, content parts) is its protocol's business.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvserve.errors import KVServeError

# Used when the model ships no template.
DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation as its chat template sees it."""

    messages: list[dict[str, Any]]  # as the template wants them: content as one string, and so on
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # OpenAI's function list; None when tool_choice is "none"
    # More template variables (vLLM's chat_template_kwargs), e.g. {"enable_thinking": False} for Qwen3
    variables: dict[str, Any] | None = None


class ChatTemplateError(KVServeError, ValueError):
    """A chat template that does not compile, or that fails (or refuses) to render these messages."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; here it just renders."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Plain JSON: Jinja's own `tojson` HTML-escapes '<', '>' and '&', which would corrupt prompts."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_ENV = _environment()


class ChatTemplate:
    """A compiled template; `render` turns a conversation into the prompt text."""

    def __init__(self, source: str) -> None:
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"the chat template does not compile (line {e.lineno}: {e.message}); fix or replace it."
            ) from e
        self.source = source

    def render(
        self, messages: list[Any], *, add_generation_prompt: bool, variables: Mapping[str, Any]
    ) -> str:
        """`variables` (special token strings, tools, extra flags) are visible to the template."""
        chat = [_plain_message(m) for m in messages]
        context = {"tools": None, "documents": None, **variables}
        try:
            return self._template.render(
                messages=chat, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation, refused: {e}.") from e
        except Exception as e:  # raise_exception(), or a template tripping over unexpected messages
            raise ChatTemplateError(
                f"the chat template failed on these messages: {type(e).__name__}: {e}."
            ) from e


def _plain_message(message: Any) -> dict[str, Any]:
    """A message as a plain dict; keys set to None are dropped (templates test for presence, not None)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    if not isinstance(message, Mapping):
        raise ChatTemplateError(
            f"each chat message must be a dict with 'role' and 'content', got {type(message).__name__}."
        )
    return {k: v for k, v in message.items() if v is not None}
