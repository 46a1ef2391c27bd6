"""What a request asks its output to match, in one form, whichever API field said it.

OpenAI says it with `response_format` ({"type": "json_object"} or {"type": "json_schema",
"json_schema": {"schema": ..., "strict": ...}}); vLLM with `structured_outputs` ({"json": ...,
"regex": ..., "choice": [...], "grammar": ...}) or the older top-level `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar`. Each becomes one `Constraint`, which the
grammar module compiles. Errors are InvalidParam (a ValueError) naming the request field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvserve.errors import InvalidParam, shown

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """kind: json (value: the schema as JSON text, key order kept: it is the output's order),
    json_object (any JSON object), regex, choice (value: a JSON list of strings), grammar (EBNF)."""

    kind: str
    value: str = ""
    param: str = "response_format"  # the request field it came from, for error messages
    # The compiled grammar, once compiled for this request: it stays with the request whatever
    # the shared cache evicts (kvserve/structured/grammar_cache.py). Not part of equality.
    compiled: list = field(default_factory=list, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.value


def json_schema(schema: Any, param: str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidParam(param, f"{param} must be a JSON schema (an object); the string given is not JSON: {e}") from None
    if isinstance(schema, bool):
        schema = {} if schema else None
    if not isinstance(schema, dict):
        raise InvalidParam(param, f"{param} must be a JSON schema (an object), got {type(schema).__name__}")
    return Constraint("json", json.dumps(schema), param)


def from_response_format(fmt: dict[str, Any] | None) -> Constraint | None:
    """OpenAI's response_format (already type-checked as a dict with "type")."""
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return Constraint("json_object", "", "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
            raise InvalidParam("response_format.json_schema", 'response_format.json_schema must be {"name": ..., "schema": {...}}')
        return json_schema(spec.get("schema", {}), "response_format.json_schema.schema")
    raise InvalidParam("response_format.type", f"response_format.type must be text, json_object or json_schema, got {shown(kind)}")


def from_vllm(fields: dict[str, Any], prefix: str) -> Constraint | None:
    """vLLM's forms: `fields` holds json/regex/choice/grammar (prefix "structured_outputs.") or
    guided_json/... (prefix "guided_"). At most one may be set."""
    given = {k: v for k, v in fields.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(prefix + k for k in sorted(given))
        raise InvalidParam(prefix + sorted(given)[1], f"give one structured output constraint, got {names}")
    (kind, value), = given.items()
    param = prefix + kind
    if kind == "json":
        return json_schema(value, param)
    if kind == "json_object":
        if value is not True:
            raise InvalidParam(param, f"{param} must be true or null")
        return Constraint("json_object", "", param)
    if kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidParam(param, f"{param} must be a non-empty string")
        return Constraint(kind, value, param)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidParam(param, f"{param} must be a non-empty list of strings")
        return Constraint("choice", json.dumps(value), param)
    raise InvalidParam(param, f"{param} is not a structured output kind: use one of {', '.join(KINDS)}")
