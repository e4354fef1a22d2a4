"""JSON schemas whose numbers end: a grammar that lets a number grow forever lets a model write
`0.8000000000…` until max_tokens and return invalid JSON. As llama.cpp's schema converter does, every
number a schema leaves open gets at most 16 integer digits and, here, at most 10 fraction digits (a
`multipleOf` of 1e-10; llguidance writes no exponent for bounded numbers); a value the schema leaves
free (`{}`, `true`, an object's unnamed properties, an array's unnamed items) becomes any JSON value
with numbers so bounded. Every document the bounded schema admits, the original admits too: bounds a
schema states itself are kept as they are.
"""

from __future__ import annotations

import copy
from typing import Any

_INTEGER_BOUND = 10**16 - 1  # 16 digits
_FRACTION_STEP = 1e-10  # llguidance reads 1e-10 exactly; 1e-15 has too many digits as a double
_ANY_VALUE = "crane_mp_any_value"
_ANY_REF = {"$ref": f"#/$defs/{_ANY_VALUE}"}

# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_schema(schema: Any) -> Any:
    """`schema` (parsed JSON) with its open numbers and free values bounded; the input is not changed."""
    if schema is True or schema == {}:
        return _with_any_value(dict(_ANY_REF))
    if not isinstance(schema, dict):
        return schema
    bounded = _bound(copy.deepcopy(schema))
    return _with_any_value(bounded)


def _with_any_value(schema: dict) -> dict:
    defs = schema.setdefault("$defs", {})
    if isinstance(defs, dict):
        defs[_ANY_VALUE] = {"anyOf": [
            {"type": "null"}, {"type": "boolean"}, _bound_number({"type": "number"}), {"type": "string"},
            {"type": "array", "items": _ANY_REF}, {"type": "object", "additionalProperties": _ANY_REF},
        ]}
    return schema


def _bound(node: Any) -> Any:
    if node is True or node == {}:
        return dict(_ANY_REF)
    if not isinstance(node, dict):
        return node
    types = node.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "number" in types or "integer" in types:
        _bound_number(node)
    if "object" in types and "additionalProperties" not in node and "unevaluatedProperties" not in node:
        node["additionalProperties"] = dict(_ANY_REF)
    if "array" in types and "items" not in node and "prefixItems" not in node:
        node["items"] = dict(_ANY_REF)
    for key in _ONE:
        if key in node:
            node[key] = _bound(node[key])
    for key in _LIST:
        if isinstance(node.get(key), list):
            node[key] = [_bound(item) for item in node[key]]
    for key in _MAP:
        if isinstance(node.get(key), dict):
            node[key] = {name: _bound(sub) for name, sub in node[key].items()}
    return node


def _bound_number(node: dict) -> dict:
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node["minimum"] = -_INTEGER_BOUND
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node["maximum"] = _INTEGER_BOUND
    if node.get("type") != "integer" and "multipleOf" not in node:
        node["multipleOf"] = _FRACTION_STEP
    return node
