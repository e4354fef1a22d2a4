"""Forcing a call (tool_choice "required" or a named function): a grammar that admits only calls of the
offered tools, in the model's own format (a JSON object, Qwen3-Coder's XML elements, Gemma 4's syntax:
gemma4_grammar.py, or gpt-oss's harmony message), JSON arguments' numbers bounded (json_bounds.py)."""

from __future__ import annotations

import json

from crane_mp.frontend.serving.harmony import CALL, CHANNEL, CONSTRAIN, MESSAGE
from crane_mp.frontend.serving.json_bounds import bounded_schema
from crane_mp.frontend.serving.structured import Constraint
from crane_mp.frontend.tools.formats import ToolFormat
from crane_mp.frontend.tools.gemma4_calls import QUOTE
from crane_mp.frontend.tools.gemma4_grammar import gemma4_call_rules


def forced_call_constraint(fmt: ToolFormat, tools: list[dict], only: str | None, parallel: bool,
                           special_tokens: dict[str, int]) -> Constraint:
    """A Lark grammar that admits only calls, in the model's own format, of the offered tools (or one
    call of `only`). A marker that is one token of the vocabulary (`special_tokens`) is written as that token,
    as the model was trained to produce it."""
    functions = [tool["function"] for tool in tools if only is None or tool["function"]["name"] == only]

    def text(value: str) -> str:
        parts = []
        for piece in _split_markers(value, special_tokens):
            parts.append(f"<[{special_tokens[piece]}]>" if piece in special_tokens else json.dumps(piece))
        return " ".join(parts)

    if fmt.gemma:
        rules = gemma4_call_rules(functions, special_tokens.get(QUOTE))
    elif fmt.harmony:
        rules = _harmony_rules(functions, text)
    else:
        rules = _xml_rules(functions) if fmt.xml else _json_rules(fmt, functions)
    call = " ".join(p for p in (text(fmt.call_open), "obj", text(fmt.call_close)) if p)
    # Harmony's call ends the answer (its <|call|> is a stop token): one call.
    calls = f"call ({text(fmt.separator)} call)*" if parallel and only is None and not fmt.harmony else "call"
    start = " ".join(p for p in (text(fmt.list_open), calls, text(fmt.list_close)) if p)
    alternatives = " | ".join(f"obj{i}" for i in range(sum(rule.startswith("obj") for rule in rules)))
    lark = f"start: {start}\ncall: {call}\nobj: {alternatives}\n" + "\n".join(rules) + "\n"
    return Constraint("lark", lark, "tool_choice")


def _json_rules(fmt: ToolFormat, functions: list[dict]) -> list[str]:
    """One rule per callable function: its call object, `name` and the arguments under the format's key."""
    key = fmt.arguments_keys[0]
    rules = []
    for function in functions:
        parameters = dict(function.get("parameters") or {"type": "object"})
        # References such as "#/$defs/X" resolve from the root of the tool's own schema: keep them there.
        hoisted = {name: parameters.pop(name) for name in ("$defs", "definitions") if name in parameters}
        schema = bounded_schema({"type": "object", "additionalProperties": False, "required": ["name", key],
                                 "properties": {"name": {"const": function["name"]}, key: parameters}, **hoisted})
        schema["x-guidance"] = {"lenient": True, "whitespace_flexible": False, "item_separator": ", ",
                                "key_separator": ": "}
        rules.append(f"obj{len(rules)}: %json {json.dumps(schema)}")
    return rules


def _harmony_rules(functions: list[dict], text) -> list[str]:
    """One rule per callable function: its commentary message to it, the arguments' JSON as the body
    (`text` writes the harmony tags as their tokens)."""
    rules = []
    for function in functions:
        parameters = dict(function.get("parameters") or {"type": "object"})
        header = text(f"{CHANNEL}commentary to=functions.{function['name']} {CONSTRAIN}json{MESSAGE}")
        rules.append(f"obj{len(rules)}: {header} %json {json.dumps(bounded_schema(parameters))} {text(CALL)}")
    return rules


_NEWLINE = "\n"


def _xml_rules(functions: list[dict]) -> list[str]:
    """One rule per callable function: its function element, then a rule per parameter value. Parameters
    come in the schema's order, the required ones always; a string is any text, other values their
    JSON (numbers bounded)."""
    rules: list[str] = []
    for calls, function in enumerate(functions):
        parameters = function.get("parameters") or {}
        defs = {name: parameters[name] for name in ("$defs", "definitions") if name in parameters}
        required = set(parameters.get("required") or ())
        parts = [json.dumps(f"<function={function['name']}>\n")]
        for index, (name, schema) in enumerate((parameters.get("properties") or {}).items()):
            value = f"value{calls}_{index}"
            rules.append(_xml_value(value, schema if isinstance(schema, dict) else {}, defs))
            element = f"{json.dumps(f'<parameter={name}>' + _NEWLINE)} {value}"
            parts.append(element if name in required else f"({element})?")
        parts.append(json.dumps("</function>"))
        rules.append(f"obj{calls}: " + " ".join(parts))
    return rules


def _xml_value(rule: str, schema: dict, defs: dict) -> str:
    """The rule for one parameter's value and the end of its element: free text (lazy, so it runs to
    the first `</parameter>`), one of a string enum, or the JSON of any other schema."""
    closing = json.dumps(_NEWLINE + "</parameter>" + _NEWLINE)
    enum = schema.get("enum")
    if enum and all(isinstance(choice, str) for choice in enum):
        return f"{rule}: ({' | '.join(json.dumps(choice) for choice in enum)}) {closing}"
    if schema.get("type") == "string":
        return f"{rule}[suffix={closing}]: /(?s:.*)/"
    return f"{rule}: %json {json.dumps(bounded_schema({**schema, **defs}))} {closing}"


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
