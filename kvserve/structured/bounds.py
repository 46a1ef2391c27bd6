"""Bounds a JSON schema leaves out, put in before compiling, so constrained output can finish.

A schema's `{"type": "integer"}` lets a grammar emit digits for ever, and a sampled small model
will: at temperature 1 one more digit is always allowed, and `max_tokens` then cuts the JSON
mid-number. Here every integer without a bound gets int64's ([-2^63, 2^63 - 1]: at most 19
digits) and every number without one gets [-1e15, 1e15] (16 integer digits: float64 is exact to
the unit there; xgrammar writes a bounded number with at most 6 decimals and no exponent).
Bounds the schema gives are kept, on either side.

A place where the schema allows any value (`{}`, `true`, a subschema of annotations only such as
`{"description": ...}`, `additionalProperties: true`) and `response_format: json_object` (any
object) would let numbers run the same way; there the value becomes a reference to one bounded
"any JSON value" definition (`ANY_REF`): null, booleans, bounded integers and numbers, strings,
and arrays and objects of such values.

Whitespace needs nothing here: JSON is compiled without free whitespace (one space after `,` and
`:`, none elsewhere: kvserve/structured/grammar.py), so no run of blank space can grow either.

The request's schema is left as it came (it keys the grammar cache); only the compiled text
carries the bounds.
"""
from __future__ import annotations

import json
from typing import Any

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
NUMBER_LIMIT = 1e15
_ANY_NAME = "kvserve_any_json_value"
ANY_REF = {"$ref": f"#/$defs/{_ANY_NAME}"}
_ANY = {"anyOf": [
    {"type": "null"}, {"type": "boolean"}, {"type": "integer", "minimum": INT_MIN, "maximum": INT_MAX},
    {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT}, {"type": "string"},
    {"type": "array", "items": ANY_REF}, {"type": "object", "additionalProperties": ANY_REF}]}
JSON_OBJECT = json.dumps({"type": "object", "additionalProperties": True})  # response_format json_object

# Keywords whose values are subschemas: one, a list of them, or a map of names to them. Any other
# keyword's value is data (enum, const, default, examples...) or a plain setting, and is kept as is.
_ONE = frozenset({"items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "contains",
                  "not", "if", "then", "else", "propertyNames", "additionalItems"})
_LIST = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})
_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Keywords that say nothing about the value: a schema of only these allows any value.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "$schema", "$id", "$anchor"})


def _types(schema: dict[str, Any]) -> set[str]:
    t = schema.get("type")
    return {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _bound(schema: dict[str, Any]) -> dict[str, Any]:
    types = _types(schema)
    if "number" in types:
        low, high = -NUMBER_LIMIT, NUMBER_LIMIT
    elif "integer" in types:
        low, high = INT_MIN, INT_MAX
    else:
        return schema
    out = dict(schema)
    if "minimum" not in out and "exclusiveMinimum" not in out:
        out["minimum"] = low
    if "maximum" not in out and "exclusiveMaximum" not in out:
        out["maximum"] = high
    return out


def _schema(node: Any, used: list[bool]) -> Any:
    """One subschema with its numbers bounded and its "any value" places made ANY_REF."""
    if node is True or (isinstance(node, dict) and node.keys() <= _ANNOTATIONS):
        used[0] = True
        return {**node, **ANY_REF} if isinstance(node, dict) else dict(ANY_REF)
    if not isinstance(node, dict):
        return node  # false, or something xgrammar will refuse with its own message
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _ONE or (k == "items" and isinstance(v, list)):
            out[k] = [_schema(x, used) for x in v] if isinstance(v, list) else _schema(v, used)
        elif k in _LIST and isinstance(v, list):
            out[k] = [_schema(x, used) for x in v]
        elif k in _MAP and isinstance(v, dict):
            out[k] = {name: _schema(x, used) for name, x in v.items()}
        else:
            out[k] = v
    return _bound(out)


def bounded(schema_json: str) -> str:
    """The schema (JSON text) with int64 / float64-exact bounds on its unbounded integers and
    numbers, its "any value" places included."""
    used = [False]
    schema = _schema(json.loads(schema_json), used)
    if used[0] and isinstance(schema, dict):
        schema["$defs"] = {**schema.get("$defs", {}), _ANY_NAME: _ANY}
    return json.dumps(schema)
