"""Bounds a JSON schema leaves out, put in before compiling, so constrained output can finish.

A schema's `{"type": "integer"}` lets a grammar emit digits for ever, and a sampled small model
will: at temperature 1 one more digit is always allowed, and `max_tokens` then cuts the JSON
mid-number. Here every integer without a bound gets int64's ([-2^63, 2^63 - 1]: at most 19
digits) and every number without one gets [-1e15, 1e15] (16 integer digits: float64 is exact to
the unit there; xgrammar writes a bounded number with at most 6 decimals and no exponent).
Bounds the schema gives are kept, on either side. Whitespace needs nothing here: JSON is
compiled without free whitespace (kvserve/structured/grammar.py).

The request's schema is left as it came (it keys the grammar cache); only the compiled text
carries the bounds.
"""
from __future__ import annotations

import json
from typing import Any

INT_MIN, INT_MAX = -(2**63), 2**63 - 1
NUMBER_LIMIT = 1e15
# Keywords whose values are data, not subschemas: a {"type": "integer"} inside them is a value.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


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


def _walk(node: Any) -> Any:
    if isinstance(node, list):
        return [_walk(x) for x in node]
    if not isinstance(node, dict):
        return node
    return _bound({k: v if k in _DATA_KEYWORDS else _walk(v) for k, v in node.items()})


def bounded(schema_json: str) -> str:
    """The schema (JSON text) with int64 / float64-exact bounds on its unbounded integers and numbers."""
    return json.dumps(_walk(json.loads(schema_json)))
