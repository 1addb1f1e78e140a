"""Bounded numbers in guided JSON: a JSON schema's `number` and `integer` values get a default
range and precision wherever the schema sets none, so a model cannot write digits until max_tokens.

A JSON number has no length limit, and a small model asked for `"area_km2": float` may write
`105.40000000000...` or `2111222222222...` forever (the grammar allows every digit). llguidance
has no option for a number's length, but it enforces `minimum`, `maximum` and `multipleOf`; so a
number value that lacks them gets:
- a lower and an upper bound: +-NUMBER_LIMIT for `number` (at most 16 integer digits), +-INTEGER_LIMIT
  for `integer` (2**53 - 1: the integers every JSON parser reads exactly, I-JSON's range);
- for `number`, `multipleOf` 10**-NUMBER_DECIMALS (at most 6 decimals, no exponent).
What a schema says is kept: each of the three is added only where that value's schema lacks it (a
pydantic `Field(ge=0)` keeps its 0 and gets an upper bound), and values given by `enum` or `const`
are left alone. A schema turns the defaults off at its top level with
`"x-jpaged": {"bound_numbers": false}` (the key is removed before compiling).
"""

import math

NUMBER_LIMIT = 1e15
INTEGER_LIMIT = 2**53 - 1
NUMBER_DECIMALS = 6
OPTIONS_KEY = "x-jpaged"
_LOWER, _UPPER = ("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")
# Keys whose values are data (or names), not schemas: never rewritten.
_DATA_KEYS = frozenset(("const", "enum", "default", "examples", "required", "x-guidance", "description",
                        "title", "pattern", "format", "$ref", "type"))


def bound_numbers(schema):
    """`schema` with default bounds on its numbers (a copy; the input is not changed), without the
    "x-jpaged" options key. Recursion is safe: the caller bounded the schema's depth."""
    if not isinstance(schema, dict):
        return schema
    options = schema.get(OPTIONS_KEY, {})
    if not isinstance(options, dict) or not set(options) <= {"bound_numbers"} \
            or not isinstance(options.get("bound_numbers", True), bool):
        raise ValueError(f"{OPTIONS_KEY}={options!r:.80}; expected {{'bound_numbers': true or false}}")
    schema = {key: value for key, value in schema.items() if key != OPTIONS_KEY}
    return _bound(schema) if options.get("bound_numbers", True) else schema


def _bound(node):
    if isinstance(node, list):
        return [_bound(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: value if key in _DATA_KEYS else _bound(value) for key, value in node.items()}
    kind = node.get("type")
    types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
    if not types & {"number", "integer"} or "enum" in node or "const" in node:
        return out
    limit = NUMBER_LIMIT if "number" in types else INTEGER_LIMIT
    lower, upper = _given(node, _LOWER), _given(node, _UPPER)
    if lower is None:  # below the given upper bound when that one is under -limit
        out["minimum"] = -limit if upper is None or upper > -limit else _scaled(upper, limit)
    if upper is None:
        out["maximum"] = limit if lower is None or lower < limit else _scaled(lower, limit)
    if "number" in types and "multipleOf" not in node:
        out["multipleOf"] = 10.0 ** -NUMBER_DECIMALS
    return out


def _given(node: dict, keys: tuple) -> float | None:
    """The schema's own bound of one side (draft 4's boolean exclusive* flags are not bounds)."""
    values = [node[k] for k in keys if isinstance(node.get(k), (int, float)) and not isinstance(node.get(k), bool)]
    return values[0] if values else None


def _scaled(bound: float, limit: float) -> float:
    """A default bound past a given one far out: `limit` further on, in the given one's direction."""
    other = bound + math.copysign(limit, bound)
    return int(other) if isinstance(bound, int) else other
