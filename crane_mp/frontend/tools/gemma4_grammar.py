"""Forcing a Gemma 4 call: Lark rules of `call:NAME{...}` whose arguments follow each tool's schema in
Gemma 4's own syntax (tools/gemma4_calls.py reads it back): the schema's properties in its order,
the required ones always, as `key:value` pairs; strings between `<|"|>` marks (the mark's token where
the vocabulary has it as one), numbers bare, enums of strings as their quoted choices, nested objects
and arrays in braces and brackets; a value of no narrower schema is any Gemma 4 value."""

from __future__ import annotations

import json
import re

from crane_mp.frontend.tools.gemma4_calls import QUOTE

_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?/"
_INTEGER = r"/-?(0|[1-9][0-9]*)/"
_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_DEPTH = 8  # deeper schemas take any value there


class _Rules:
    def __init__(self, quote_token: int | None, prefix: str) -> None:
        self.lines: list[str] = []
        self.prefix = prefix
        self.quote = f"<[{quote_token}]>" if quote_token is not None else json.dumps(QUOTE)
        self.token_quote = quote_token is not None
        self._any: str | None = None

    def rule(self, body: str, header: str = "") -> str:
        name = f"{self.prefix}_{len(self.lines)}"
        self.lines.append(f"{name}{header}: {body}")
        return name

    def string(self) -> str:
        if self.token_quote:  # the closing mark is a token no text lexeme can swallow
            return f"{self.quote} {self.rule('/(?s:.*)/')} {self.quote}"
        # the text mark ends the string: a lazy lexeme up to it, the mark included (as the XML values' end)
        return f"{self.quote} {self.rule('/(?s:.*)/', f'[suffix={json.dumps(QUOTE)}]')}"

    def quoted(self, text: str) -> str:
        return f"{self.quote} {json.dumps(text)} {self.quote}"

    def key(self, name: str) -> str:
        return json.dumps(f"{name}:") if _BARE_KEY.fullmatch(name) else f"{self.quoted(name)} \":\""

    def any_value(self) -> str:
        """Any Gemma 4 value (a rule of its own, recursive)."""
        if self._any is None:
            self._any = name = f"{self.prefix}_any"
            pair = f"/[A-Za-z_][A-Za-z0-9_]*/ \":\" {name}"
            self.lines.append(f"{name}: {self.string()} | {_NUMBER} | \"true\" | \"false\" | \"null\" "
                              f"| \"{{\" ({pair} (\",\" {pair})*)? \"}}\" | \"[\" ({name} (\",\" {name})*)? \"]\"")
        return self._any

    def value(self, schema: object, defs: dict, depth: int = 0) -> str:
        if not isinstance(schema, dict) or depth > _MAX_DEPTH:
            return self.any_value()
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.rsplit("/", 1)[-1] in defs:
            return self.value(defs[ref.rsplit("/", 1)[-1]], defs, depth + 1)
        if "const" in schema:
            return self._literal(schema["const"]) or self.any_value()
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            literals = [self._literal(choice) for choice in enum]
            return f"({' | '.join(literals)})" if all(literals) else self.any_value()
        kinds = schema.get("type")
        kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
        if not kinds:
            return self.any_value()
        return "(" + " | ".join(self._typed(kind, schema, defs, depth) for kind in kinds) + ")"

    def _typed(self, kind: str, schema: dict, defs: dict, depth: int) -> str:
        if kind == "string":
            return self.string()
        if kind == "integer":
            return _INTEGER
        if kind == "number":
            return _NUMBER
        if kind == "boolean":
            return '"true" | "false"'
        if kind == "null":
            return '"null"'
        if kind == "array":
            item = self.value(schema.get("items"), defs, depth + 1)
            return f"\"[\" ({item} (\",\" {item})*)? \"]\""
        if kind == "object" and isinstance(schema.get("properties"), dict) and schema["properties"]:
            return self.object(schema, defs, depth)
        return self.any_value()

    def object(self, schema: dict, defs: dict, depth: int = 0) -> str:
        """`{...}` with the schema's properties in order, each optional one optional, commas between."""
        names = list(schema["properties"])
        required = set(schema.get("required") or ())
        pairs = [f"{self.key(name)} {self.value(schema['properties'][name], defs, depth + 1)}" for name in names]
        needed_from = [any(name in required for name in names[i:]) for i in range(len(names) + 1)]
        first: str | None = None
        after: str | None = None
        for i in range(len(names) - 1, -1, -1):  # from the last property: the rules of what may follow
            rest = f" {after}" + ("" if needed_from[i + 1] else "?") if after else ""
            later_first = f" | {first}" if first and names[i] not in required else ""
            later_after = f" | {after}" if after and names[i] not in required else ""
            after = self.rule(f"\",\" {pairs[i]}{rest}{later_after}")
            first = self.rule(f"{pairs[i]}{rest}{later_first}")
        return f"\"{{\" {first}{'' if needed_from[0] else '?'} \"}}\"" if first else '"{" "}"'

    def _literal(self, value: object) -> str | None:
        if isinstance(value, str):
            return self.quoted(value)
        if isinstance(value, bool) or value is None:
            return json.dumps(json.dumps(value))
        if isinstance(value, (int, float)):
            return json.dumps(json.dumps(value))
        return None


def gemma4_call_rules(functions: list[dict], quote_token: int | None) -> list[str]:
    """One `obj{i}` rule per callable function (`call:NAME{...}`), and the rules they use."""
    lines: list[str] = []
    for calls, function in enumerate(functions):
        parameters = function.get("parameters") or {}
        defs = {**(parameters.get("definitions") or {}), **(parameters.get("$defs") or {})}
        rules = _Rules(quote_token, f"g{calls}")
        if isinstance(parameters.get("properties"), dict) and parameters["properties"]:
            arguments = rules.object(parameters, defs)
        else:
            arguments = '"{" "}"'
        lines += rules.lines
        lines.append(f"obj{calls}: {json.dumps('call:' + function['name'])} {arguments}")
    return lines
