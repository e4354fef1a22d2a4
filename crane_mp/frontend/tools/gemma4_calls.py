"""Gemma 4's tool calls, read whole or as they stream:

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,units:{metric:true}}<tool_call|>

Keys are bare (or between quote marks), strings sit between `<|"|>` marks and are taken as they are
(no escapes), numbers, true, false and null are bare, objects and arrays nest in braces and brackets;
each call has its own `<|tool_call>` ... `<tool_call|>`, nothing between them. The marks are special
tokens of Gemma 4's vocabulary, which the detokenizer keeps for this reader (Detokenizer's
`skip_ids`). A call's name is sent once `call:NAME{` is whole, its arguments as JSON once it closes.
"""

from __future__ import annotations

import json
import re

from crane_mp.frontend.tools.formats import GEMMA4_MARKS, ToolFormat, new_call_id
from crane_mp.frontend.tools.parser import ParsedCall, ToolCallParser, merge_deltas

MARKS = GEMMA4_MARKS  # special tokens whose text the reader needs
CALL_START, CALL_END, QUOTE = MARKS
_CALL_HEAD = re.compile(r"\s*call:([\w.\-]+)\{")
_NAME_ARRIVING = re.compile(r"call:[\w.\-]*")
_BARE_WORD = re.compile(r"[^\s:<>\"']+")
_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")


class Incomplete(Exception):
    """The text ends inside the value."""


class Malformed(Exception):
    """The text is no value of Gemma 4's syntax."""


def read_object(text: str, i: int) -> tuple[dict, int]:
    """The object whose `{` ends just before `i`, and where its `}` ends."""
    pairs, end = _read_items(text, i, "}", _read_pair)
    return dict(pairs), end


def _read_pair(text: str, i: int) -> tuple[tuple[str, object], int]:
    key, i = _read_key(text, i)
    value, i = read_value(text, _skip_space(text, i))
    return (key, value), i


def _read_items(text: str, i: int, close: str, read_item) -> tuple[list, int]:
    """The comma-separated items (each read by `read_item`) from `i` to `close`, and where it ends."""
    items: list = []
    while True:
        i = _skip_space(text, i)
        if i >= len(text):
            raise Incomplete
        if text[i] == close:
            return items, i + 1
        if items:
            if text[i] != ",":
                raise Malformed
            i = _skip_space(text, i + 1)
        item, i = read_item(text, i)
        items.append(item)


def read_value(text: str, i: int) -> tuple[object, int]:
    """The value starting at `i`, and where it ends."""
    if i >= len(text) or QUOTE.startswith(text[i:]):
        raise Incomplete
    if text.startswith(QUOTE, i):
        end = text.find(QUOTE, i + len(QUOTE))
        if end < 0:
            raise Incomplete
        return text[i + len(QUOTE) : end], end + len(QUOTE)
    if text[i] == "{":
        return read_object(text, i + 1)
    if text[i] == "[":
        return _read_items(text, i + 1, "]", read_value)
    end = i
    while end < len(text) and text[end] not in ",}]":
        end += 1
    if end == len(text):
        raise Incomplete  # a bare value is whole only once what follows it arrived
    return _bare(text[i:end].strip()), end


def _read_key(text: str, i: int) -> tuple[str, int]:
    if text.startswith(QUOTE, i):
        key, i = read_value(text, i)
    else:
        end = text.find(":", i)
        if end < 0:
            if any(c in text[i:] for c in ",{}[]"):
                raise Malformed
            raise Incomplete
        key = text[i:end].strip()
        if not key or any(c in key for c in ",{}[]"):
            raise Malformed
        return key, end + 1
    i = _skip_space(text, i)
    if i >= len(text):
        raise Incomplete
    if text[i] != ":":
        raise Malformed
    return str(key), i + 1


def _bare(text: str) -> object:
    if text in ("true", "false"):
        return text == "true"
    if text == "null":
        return None
    if _NUMBER.fullmatch(text):
        return json.loads(text)
    if not _BARE_WORD.fullmatch(text):
        raise Malformed
    return text  # a bare word: the text, as Gemma 4's other readers take it


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def read_call(region: str) -> tuple[str | None, dict | None, int]:
    """(name, arguments, where the call's `<tool_call|>` ends) of the call at the front of `region` (the
    text after its `<|tool_call>`); arguments None while it is open, name None while `call:NAME{` is not
    whole. Raises Malformed where the text is no call."""
    head = _CALL_HEAD.match(region)
    if head is None:
        stripped = region.lstrip()
        if "call:".startswith(stripped) or _NAME_ARRIVING.fullmatch(stripped):
            return None, None, 0
        raise Malformed
    try:
        arguments, end = read_object(region, head.end())
    except Incomplete:
        return head.group(1), None, 0
    end = _skip_space(region, end)
    if CALL_END.startswith(region[end : end + len(CALL_END)]) and len(region) - end < len(CALL_END):
        return head.group(1), None, 0  # the closing mark is still arriving
    if not region.startswith(CALL_END, end):
        raise Malformed
    return head.group(1), arguments, end + len(CALL_END)


class Gemma4CallParser(ToolCallParser):
    """ToolCallParser's contract (content before the first `<|tool_call>`, OpenAI `delta.tool_calls`
    items, `well_formed`) for Gemma 4's calls. The open call is read again as a whole on each feed;
    text after a closed call up to the next `<|tool_call>` is dropped (whatever separates calls)."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
        super().__init__(fmt, parallel)
        self.region = ""  # the open call's text, after its <|tool_call>
        self.between = False  # after a closed call: waiting for the next <|tool_call>

    @property
    def well_formed(self) -> bool:
        return bool(self.calls) and not self._malformed and all(call.complete for call in self.calls)

    def _scan(self, text: str) -> list[dict]:
        if not self.calls:
            self.unread += text
        self.region += text
        deltas: list[dict] = []
        while not self._malformed:
            if self.between:
                start = self.region.find(CALL_START)
                if start < 0:
                    break
                if not self.parallel:
                    self.region = ""
                    break
                self.region, self.between = self.region[start + len(CALL_START):], False
            try:
                name, arguments, end = read_call(self.region)
            except Malformed:
                self._malformed = True
                break
            if name is None:
                break
            if not self.calls or self.calls[-1].complete:
                self.calls.append(ParsedCall(new_call_id(self.fmt), name=name))
                deltas.append({"index": len(self.calls) - 1, "id": self.calls[-1].id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            if arguments is None:
                break
            call = self.calls[-1]
            call.arguments, call.complete = json.dumps(arguments), True
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": call.arguments}})
            self.region, self.between = self.region[end:], True
        return merge_deltas(deltas)
