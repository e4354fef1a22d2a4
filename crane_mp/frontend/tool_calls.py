"""Tool calling: the model's tool-call output -> OpenAI tool calls, streamed or whole, and the grammar
that forces a call when the client requires one.

Three output formats cover the supported models: Hermes (`<tool_call>{"name": .., "arguments": ..}
</tool_call>`, Qwen2.5 and Qwen3), Llama 3's JSON (`{"name": .., "parameters": ..}`, calls separated by
`;`) and Mistral's (`[TOOL_CALLS][{"name": .., "arguments": ..}, ..]`; the marker is a control token,
gone from the text, so a leading `[` opens the calls too). One parser reads all three: text before the
first call is content; from there, every JSON object is a call, whatever separates them. The call's
name is sent as soon as it is complete, its arguments as they arrive.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

from crane_mp.frontend.errors import ApiError
from crane_mp.frontend.structured import Constraint


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str  # the --tool-call-parser value
    markers: tuple[str, ...]  # texts that open the tool calls anywhere in the output
    leading: str  # the calls also start where the output's first non-space character is one of these
    arguments_keys: tuple[str, ...]  # the call object's keys for the arguments; the first is written when forced
    call_open: str = ""  # the forced grammar's text around each call and between calls
    call_close: str = ""
    separator: str = ""
    list_open: str = ""
    list_close: str = ""
    id_length: int = 0  # Mistral's templates insist on 9-character call ids; 0: OpenAI's call_<hex>


FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",), "", ("arguments",),
                         call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n"),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>",), "{", ("parameters", "arguments"), separator="; "),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",), "[", ("arguments",),
                          separator=", ", list_open="[TOOL_CALLS][", list_close="]", id_length=9),
}
# Texts of the formats that a vocabulary may hold as one (added) token.
MARKER_TEXTS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
# --tool-call-parser auto: the format whose marker the vocabulary holds as a token, else by architecture
# (a Mistral GGUF says "llama"; fine-tunes of other families mostly follow Hermes).
_BY_MARKER = {"[TOOL_CALLS]": "mistral", "<tool_call>": "hermes", "<|python_tag|>": "llama3_json"}
_BY_ARCH = {"qwen2": "hermes", "qwen3": "hermes", "llama": "llama3_json", "mistral": "mistral"}


def tool_format(parser: str, arch: str, marker_tokens: dict[str, int] | None = None) -> ToolFormat | None:
    """The format of --tool-call-parser (`auto`: by the vocabulary's markers, then the architecture);
    None for `none`."""
    if parser == "none":
        return None
    if parser != "auto":
        return FORMATS[parser]
    for marker, name in _BY_MARKER.items():
        if marker in (marker_tokens or {}):
            return FORMATS[name]
    return FORMATS[_BY_ARCH.get(arch, "hermes")]


def new_call_id(fmt: ToolFormat) -> str:
    if fmt.id_length:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(fmt.id_length))
    return f"call_{secrets.token_hex(12)}"


def tool_prompt(fmt: ToolFormat, tools: list[dict]) -> str:
    """Tool definitions and the expected call format, for a chat template that does not render tools."""
    example = json.dumps({"name": "NAME", fmt.arguments_keys[0]: {"ARGUMENT": "VALUE"}})
    call = f"{fmt.list_open}{fmt.call_open}{example}{fmt.call_close}{fmt.list_close}"
    listing = "\n".join(json.dumps(tool["function"]) for tool in tools)
    return f"You can call these functions, described as JSON:\n{listing}\nTo call one, answer with only:\n{call}"


# ---- forcing a call (tool_choice "required" or a named function) ---------------------------------


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
        schema = {"type": "object", "additionalProperties": False, "required": ["name", key],
                  "properties": {"name": {"const": function["name"]}, key: parameters}, **hoisted,
                  "x-guidance": {"lenient": True, "whitespace_flexible": False,
                                 "item_separator": ", ", "key_separator": ": "}}
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


# ---- reading calls out of the output -------------------------------------------------------------


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str | None = None
    arguments: str = ""  # the JSON text of the arguments, as far as it has arrived
    complete: bool = False


class ToolCallParser:
    """Feed the output's text as it arrives; get back content text and OpenAI `delta.tool_calls` items.
    `finish()` flushes what was held back (and, when the calls region never opened a call, its text
    as content); `well_formed` then says whether every call was a complete JSON object with a name and
    JSON arguments (a non-streamed response falls back to plain content when not)."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.in_calls = False
        self.pending = ""  # content held back: it may be the start of a marker
        self.seen_text = False  # a non-space character of content was seen (the calls can no longer lead)
        self.calls: list[ParsedCall] = []
        self.unread = ""  # the calls region's text while it has opened no call
        self._scanner = _ObjectScanner(fmt.arguments_keys)
        self._malformed = False

    @property
    def well_formed(self) -> bool:
        return (bool(self.calls) and not self._malformed and self._scanner.idle
                and all(call.complete and call.name for call in self.calls))

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.in_calls:
            return "", self._scan(text)
        buffer = self.pending + text
        index, marker = _find_marker(buffer, self.fmt.markers)
        if index >= 0:
            self.in_calls, self.pending, self.unread = True, "", marker
            return buffer[:index], self._scan(buffer[index + len(marker):])
        stripped = buffer.lstrip()
        if not self.seen_text and stripped and stripped[0] in self.fmt.leading:
            self.in_calls, self.pending = True, ""
            return "", self._scan(stripped)
        if stripped and not _could_start_marker(stripped, self.fmt.markers):
            self.seen_text = True
        keep = _marker_prefix_length(buffer, self.fmt.markers)
        if not self.seen_text and not stripped:
            keep = len(buffer)  # only whitespace so far: the calls may still lead
        self.pending = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep], []

    def finish(self) -> tuple[str, list[dict]]:
        content, self.pending = self.pending, ""
        if self.in_calls:
            content = "" if self.calls else self.unread
        return content, []

    def _scan(self, text: str) -> list[dict]:
        if not self.calls:
            self.unread += text
        deltas: list[dict] = []
        for event, value in self._scanner.feed(text):
            if event == "start":
                if not self.parallel and self.calls:
                    self._scanner.ignore_rest = True
                    break
                self.calls.append(ParsedCall(new_call_id(self.fmt), name=value))
                deltas.append({"index": len(self.calls) - 1, "id": self.calls[-1].id, "type": "function",
                               "function": {"name": value, "arguments": ""}})
            elif event == "arguments":
                self.calls[-1].arguments += value
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": value}})
            elif event == "end":
                call = self.calls[-1]
                call.complete = _is_json(call.arguments)
            elif event == "invalid" and not self.calls:  # after a call: text that happens to hold braces
                self._malformed = True
        return _merge(deltas)


def parse_tool_calls(fmt: ToolFormat, text: str, parallel: bool = True) -> tuple[str | None, list[dict] | None]:
    """A whole output -> (content, tool calls); (text, None) unless it held well-formed calls."""
    parser = ToolCallParser(fmt, parallel)
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    if not parser.well_formed:
        return text, None
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in parser.calls]
    return (content + rest).strip() or None, calls


def _merge(deltas: list[dict]) -> list[dict]:
    """One item per call per chunk: argument pieces of the same call are joined."""
    merged: list[dict] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"] and delta.keys() == {"index", "function"}:
            merged[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            merged.append(delta)
    return merged


def _loads(raw: str):
    """A JSON value the model wrote, or None where it is not valid JSON (a bad escape, a raw newline)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _find_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str]:
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else (-1, "")


def _could_start_marker(text: str, markers: tuple[str, ...]) -> bool:
    return any(m.startswith(text) for m in markers)


def _marker_prefix_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a marker starts with."""
    best = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:length]):
                best = length
                break
    return best


@dataclass(slots=True)
class _ObjectScanner:
    """Finds the JSON objects in a stream of characters (anything between them is skipped) and, in each,
    the string value of "name" and the raw text of the arguments value as it arrives. Events:
    ("start", name) once the name is complete, ("arguments", text) pieces, ("end", None) when the
    object closes, ("invalid", None) for an object without a name."""

    arguments_keys: tuple[str, ...]
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    obj: list[str] = field(default_factory=list)  # characters of the current object
    key: str | None = None  # the depth-1 key whose value is being read
    expect_key: bool = True
    token_start: int = -1  # where the depth-1 string (key or value) being read began
    value_start: int = -1  # where the current depth-1 value began
    name: str | None = None
    arguments_start: int = -1
    arguments_end: int = -1
    arguments_sent: int = 0  # characters of the arguments already sent
    arguments_string: bool = False  # the arguments came as a JSON string holding the JSON text
    started: bool = False
    ignore_rest: bool = False

    @property
    def idle(self) -> bool:
        return self.depth == 0

    def feed(self, text: str) -> list[tuple[str, str | None]]:
        events: list[tuple[str, str | None]] = []
        if self.ignore_rest:
            return events
        for char in text:
            if self.depth == 0 and char != "{":
                continue  # between calls: markers, separators, brackets
            self.obj.append(char)
            self._step(char, events)
        self._send_arguments(events)
        return events

    def _step(self, char: str, events: list) -> None:
        position = len(self.obj) - 1
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_closed(position, events)
            return
        if char == '"':
            self.in_string = True
            if self.depth == 1:
                self.token_start = position
                if not self.expect_key and self.value_start < 0:
                    self._value_started(position)
        elif char in "{[":
            if self.depth == 1 and not self.expect_key and self.value_start < 0:
                self._value_started(position)
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 1 and self.value_start >= 0 and self.obj[self.value_start] in "{[":
                self._value_done(position + 1, events)
            elif self.depth == 0:
                if self.value_start >= 0:
                    self._value_done(position, events)
                self._object_done(events)
        elif self.depth == 1:
            if char == ":":
                self.expect_key = False
            elif char == ",":
                if self.value_start >= 0:
                    self._value_done(position, events)
                self.expect_key = True
            elif not char.isspace() and not self.expect_key and self.value_start < 0:
                self._value_started(position)

    def _value_started(self, position: int) -> None:
        self.value_start = position
        if self.key in self.arguments_keys and self.arguments_start < 0:
            self.arguments_start = position
            self.arguments_string = self.obj[position] == '"'

    def _string_closed(self, position: int, events: list) -> None:
        raw = "".join(self.obj[self.token_start : position + 1])
        if self.expect_key:
            self.key = _loads(raw)
        elif self.value_start == self.token_start:
            self._value_done(position + 1, events)

    def _value_done(self, end: int, events: list) -> None:
        raw = "".join(self.obj[self.value_start : end]).strip()
        if self.key == "name" and self.name is None and raw.startswith('"'):
            name = _loads(raw)
            if isinstance(name, str) and name:
                self.name, self.started = name, True
                events.append(("start", name))
        if self.key in self.arguments_keys and self.arguments_start == self.value_start:
            self.arguments_end = end
        self.value_start = -1
        self.key = None

    def _send_arguments(self, events: list) -> None:
        if not self.started or self.arguments_start < 0:
            return
        if self.arguments_string:  # only whole: the string's content is the arguments' JSON text
            if self.arguments_end >= 0 and self.arguments_sent == 0:
                text = _loads("".join(self.obj[self.arguments_start : self.arguments_end]))
                events.append(("arguments", text if isinstance(text, str) else ""))
                self.arguments_sent = 1
            return
        end = self.arguments_end if self.arguments_end >= 0 else len(self.obj)
        start = self.arguments_start + self.arguments_sent
        if end > start:
            events.append(("arguments", "".join(self.obj[start:end])))
            self.arguments_sent = end - self.arguments_start

    def _object_done(self, events: list) -> None:
        self._send_arguments(events)
        if not self.started:
            events.append(("invalid", None))
        else:
            if self.arguments_start < 0:
                events.append(("arguments", "{}"))
            events.append(("end", None))
        self.obj, self.key, self.expect_key = [], None, True
        self.value_start = self.token_start = self.arguments_start = self.arguments_end = -1
        self.arguments_sent, self.arguments_string, self.name, self.started = 0, False, None, False


def check_tools(tools: list[dict] | None, tool_choice, fmt: ToolFormat | None) -> tuple[str, str | None]:
    """(mode, named function) for a chat request: mode none | auto | required | named; 400s for a
    choice that cannot be served."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        return "none", None
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools must have distinct function names", "tools")
    if tool_choice is None:
        tool_choice = "auto"
    if not isinstance(tool_choice, str):  # {"type": "function", "function": {"name": ...}}
        name = tool_choice.function.name
        if name not in names:
            raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        mode, only = "named", name
    else:
        mode, only = tool_choice, None
    if mode != "none" and fmt is None:
        raise ApiError(400, "this server reads no tool calls (--tool-call-parser none); use tool_choice none",
                       "tool_choice")
    return mode, only
