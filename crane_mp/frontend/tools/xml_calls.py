"""Qwen3-Coder's tool calls, XML rather than JSON, read whole or as they stream:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes JSON by the type the tool's schema gives that parameter
(integer, number, boolean, object, array, null; a string otherwise, also where a value does not
parse as its type), as vLLM's `qwen3_coder` parser reads it. The calls' `arguments` stream as JSON
text, one parameter at a time.
"""

from __future__ import annotations

import json
import math
import re

from crane_mp.frontend.tools.formats import ToolFormat, new_call_id
from crane_mp.frontend.tools.parser import ParsedCall, ToolCallParser

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_PARAMETER_END = "</parameter>"
_FUNCTION_END = "</function>"


def parameter_types(tools: list[dict] | None) -> dict[str, dict[str, object]]:
    """{function name: {parameter name: its schema's `type`}} of the offered tools."""
    types: dict[str, dict[str, object]] = {}
    for tool in tools or []:
        function = tool.get("function") or {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        types[function.get("name", "")] = {name: (schema or {}).get("type") for name, schema in properties.items()
                                           if isinstance(schema, dict)}
    return types


def parameter_value(text: str, kind: object):
    """A parameter's text as the JSON value its schema's type names; the text itself when it is a
    string or does not parse as its type."""
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if text.strip().lower() == "null" and ("null" in kinds or "string" not in kinds):
        return None
    if kinds & {"integer", "number"}:
        try:
            number = float(text) if "number" in kinds else int(text.strip())
        except ValueError:
            return text
        if not math.isfinite(number):  # "inf", "nan", 1e999: no JSON number
            return text
        if isinstance(number, float) and number.is_integer() and re.fullmatch(r"\s*-?\d+\s*", text):
            return int(number)
        return number
    if "boolean" in kinds and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    if kinds & {"object", "array"}:
        try:
            return json.loads(text)
        except ValueError:
            return text
    return text


class XmlCallParser(ToolCallParser):
    """ToolCallParser's contract (content before the first `<tool_call>`, OpenAI `delta.tool_calls`
    items, `well_formed`) for Qwen3-Coder's XML calls. The calls region is read again as a whole on
    each feed, and only what completed since is sent: a call's name once `<function=...>` is whole, its
    arguments one whole parameter at a time, the closing brace with `</function>`."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True, tools: list[dict] | None = None) -> None:
        super().__init__(fmt, parallel)
        self.types = parameter_types(tools)
        self.region = ""  # the calls region from the first call not yet closed
        self._closed = 0  # calls closed and cut from the region
        self._sent: list[int] = []  # parameters sent, per call

    @property
    def well_formed(self) -> bool:
        return self.calls_whole

    def _scan(self, text: str) -> list[dict]:
        if not self.calls:
            self.unread += text
        self.region += text
        deltas: list[dict] = []
        cut = 0
        for offset, (name, parameters, end) in enumerate(_read_calls(self.region)):
            index, closed = self._closed + offset, end is not None
            if index and not self.parallel:
                break
            if index == len(self.calls):
                self.calls.append(ParsedCall(new_call_id(self.fmt), name=name))
                self._sent.append(0)
                deltas.append({"index": index, "id": self.calls[index].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            call, kinds = self.calls[index], self.types.get(name, {})
            piece = ""
            for key, value in parameters[self._sent[index]:]:
                opening = "{" if not call.arguments and not piece else ", "
                piece += f"{opening}{json.dumps(key)}: {json.dumps(parameter_value(value, kinds.get(key)))}"
            self._sent[index] = len(parameters)
            if closed and not call.complete:
                piece += "}" if call.arguments or piece else "{}"
                call.complete = True
            if piece:
                call.arguments += piece
                deltas.append({"index": index, "function": {"arguments": piece}})
            if closed and cut == offset:  # closed calls at the front are read once: cut off below
                cut, keep_from = cut + 1, end
        if cut:
            self.region, self._closed = self.region[keep_from:], self._closed + cut
        return deltas


def _read_calls(region: str) -> list[tuple[str, list[tuple[str, str]], int | None]]:
    """(name, whole parameters [(name, value)], where its `</function>` ends or None while open) of
    each function the region has opened."""
    calls = []
    opened = list(_FUNCTION.finditer(region))
    for match, following in zip(opened, [*opened[1:], None]):
        limit = following.start() if following else len(region)  # an unclosed function ends at the next
        body_end = region.find(_FUNCTION_END, match.end(), limit)
        body = region[match.end() : body_end if body_end >= 0 else limit]
        parameters = []
        for parameter in _PARAMETER.finditer(body):
            end = body.find(_PARAMETER_END, parameter.end())
            if end < 0:
                break
            value = body[parameter.end() : end]
            value = value[1:] if value.startswith("\n") else value
            parameters.append((parameter.group(1), value[:-1] if value.endswith("\n") else value))
        calls.append((match.group(1).strip(), parameters, body_end + len(_FUNCTION_END) if body_end >= 0 else None))
    return calls
