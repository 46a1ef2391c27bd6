"""How large a constraint may be before it is compiled: checked in microseconds, before any work.

Compile time grows with a constraint's size, and for some shapes far faster than its size: on
this project's CPU a 4096-value `enum` compiles in 0.1 s and 620 KB, a chain of 1024 EBNF rules
in 0.4 s, one of 4096 rules in 37 s. A request over any limit below gets a 400 that names the
limit; what fits compiles in well under a second (the compile timeout, kvserve/server/
grammar_pool.py, catches shapes these counts miss).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvserve.errors import InvalidParam
from kvserve.structured.spec import Constraint

_RULE = re.compile(r"::=")


@dataclass(frozen=True)
class GrammarLimits:
    max_chars: int = 64 << 10  # the constraint's text: a schema as JSON, a regex, an EBNF, the choices as JSON
    max_schema_nodes: int = 4096  # objects, arrays and values in a JSON schema, all nested levels
    max_enum_values: int = 1024  # `enum` values plus `const`s in a JSON schema, all together
    max_choices: int = 1024  # strings of a `choice`
    max_rules: int = 256  # rules ("name ::= ...") of an EBNF grammar


LIMITS = GrammarLimits()


def check(c: Constraint, limits: GrammarLimits = LIMITS) -> None:
    """InvalidParam naming c's field and the limit it is over; nothing when it fits."""
    if len(c.value) > limits.max_chars:
        _over(c, f"{len(c.value)} characters", f"{limits.max_chars} characters")
    if c.kind == "json":
        nodes, enums = _count(json.loads(c.value), limits)
        if nodes > limits.max_schema_nodes:
            _over(c, f"more than {limits.max_schema_nodes} nodes (objects, arrays and values)",
                  f"{limits.max_schema_nodes} nodes")
        if enums > limits.max_enum_values:
            _over(c, f"{enums} enum and const values", f"{limits.max_enum_values} enum and const values")
    elif c.kind == "choice":
        n = len(json.loads(c.value))
        if n > limits.max_choices:
            _over(c, f"{n} choices", f"{limits.max_choices} choices")
    elif c.kind == "grammar":
        n = len(_RULE.findall(c.value))
        if n > limits.max_rules:
            _over(c, f"{n} rules", f"{limits.max_rules} rules")


def _over(c: Constraint, has: str, limit: str) -> None:
    raise InvalidParam(c.param, f"{c.param} has {has}; this server compiles at most {limit} per constraint: "
                       "make it smaller (fewer values or rules)")


def _count(schema: Any, limits: GrammarLimits) -> tuple[int, int]:
    """Nodes and enum/const values in a schema (iterative: a deep schema cannot overflow the
    stack; stops counting nodes past the limit)."""
    nodes = enums = 0
    stack = [schema]
    while stack and nodes <= limits.max_schema_nodes:
        value = stack.pop()
        nodes += 1
        if isinstance(value, dict):
            enum = value.get("enum")
            if isinstance(enum, list):
                enums += len(enum)
            enums += "const" in value
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return nodes, enums
