"""Forcing a call (tool_choice "required" or a named function): a grammar that admits only calls of the
offered tools, in the model's own format, their arguments' numbers bounded (json_bounds.py)."""

from __future__ import annotations

import json

from crane_mp.frontend.json_bounds import bounded_schema
from crane_mp.frontend.structured import Constraint
from crane_mp.frontend.tools.formats import ToolFormat


def forced_call_constraint(fmt: ToolFormat, tools: list[dict], only: str | None, parallel: bool,
                           special_tokens: dict[str, int]) -> Constraint:
    """A Lark grammar that admits only calls, in the model's own format, of the offered tools (or one
    call of `only`). A marker that is one token of the vocabulary (`special_tokens`) is written as that token,
    as the model was trained to produce it."""
    key = fmt.arguments_keys[0]
    rules = []
    for tool in tools:
        function = tool["function"]
        if only is not None and function["name"] != only:
            continue
        parameters = dict(function.get("parameters") or {"type": "object"})
        # References such as "#/$defs/X" resolve from the root of the tool's own schema: keep them there.
        hoisted = {name: parameters.pop(name) for name in ("$defs", "definitions") if name in parameters}
        schema = bounded_schema({"type": "object", "additionalProperties": False, "required": ["name", key],
                                 "properties": {"name": {"const": function["name"]}, key: parameters}, **hoisted})
        schema["x-guidance"] = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
        rules.append(f"obj{len(rules)}: %json {json.dumps(schema)}")

    def text(value: str) -> str:
        parts = []
        for piece in _split_markers(value, special_tokens):
            parts.append(f"<[{special_tokens[piece]}]>" if piece in special_tokens else json.dumps(piece))
        return " ".join(parts)

    call = " ".join(p for p in (text(fmt.call_open), "obj", text(fmt.call_close)) if p)
    calls = f"call ({text(fmt.separator)} call)*" if parallel and only is None else "call"
    start = " ".join(p for p in (text(fmt.list_open), calls, text(fmt.list_close)) if p)
    alternatives = " | ".join(f"obj{i}" for i in range(len(rules)))
    lark = f"start: {start}\ncall: {call}\nobj: {alternatives}\n" + "\n".join(rules) + "\n"
    return Constraint("lark", lark, "tool_choice")


def _split_markers(value: str, special_tokens: dict[str, int]) -> list[str]:
    """`value` cut into the single-token markers it holds and the text around them."""
    pieces = [value] if value else []
    for marker in special_tokens:
        pieces = [p for piece in pieces for p in _split_one(piece, marker)]
    return pieces


def _split_one(value: str, marker: str) -> list[str]:
    if value == marker or marker not in value:
        return [value] if value else []
    head, _, tail = value.partition(marker)
    return [p for p in (head, marker) if p] + _split_one(tail, marker)
