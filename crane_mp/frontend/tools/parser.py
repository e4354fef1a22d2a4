"""Reading tool calls out of the model's output, whole or as it streams: text before the first call is
content; from there, every JSON object is a call, whatever separates them. A call's name is sent as
soon as it is complete, its arguments as they arrive."""

from __future__ import annotations

from dataclasses import dataclass

from crane_mp.frontend.tools.formats import ToolFormat, new_call_id
from crane_mp.frontend.tools.json_scanner import ObjectScanner, is_json


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
    JSON arguments (a non-streamed response falls back to plain content when not), `kept_calls` which
    calls an answer returns."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True) -> None:
        self.fmt = fmt
        self.parallel = parallel
        self.in_calls = False
        self.pending = ""  # content held back: it may be the start of a marker
        self.seen_text = False  # a non-space character of content was seen (the calls can no longer lead)
        self.calls: list[ParsedCall] = []
        self.unread = ""  # the calls region's text while it has opened no call
        self._scanner = ObjectScanner(fmt.arguments_keys)
        self._malformed = False

    @property
    def well_formed(self) -> bool:
        return self.calls_whole and not self._malformed and self._scanner.idle

    @property
    def calls_whole(self) -> bool:
        """Calls were made, and each has its name and arguments whole."""
        return bool(self.calls) and all(call.complete and call.name for call in self.calls)

    def kept_calls(self, cut: bool) -> list[ParsedCall]:
        """The calls an answer returns: all of a well-formed one's; of one that max_tokens `cut`, the
        whole calls before a last one it left open (dropped), where nothing else is amiss; else none."""
        if self.well_formed:
            return self.calls
        calls = self.calls[:-1] if self.calls and not self.calls[-1].complete else self.calls
        if not cut or self._malformed or not calls or not all(call.complete and call.name for call in calls):
            return []
        return calls

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
                call.complete = is_json(call.arguments)
            elif event == "invalid" and not self.calls:  # after a call: text that happens to hold braces
                self._malformed = True
        return merge_deltas(deltas)


def parse_tool_calls(fmt: ToolFormat, text: str, parallel: bool = True) -> tuple[str | None, list[dict] | None]:
    """A whole output -> (content, tool calls); (text, None) unless it held well-formed calls."""
    return parse_with(ToolCallParser(fmt, parallel), text)


def parse_with(parser: ToolCallParser, text: str, cut: bool = False) -> tuple[str | None, list[dict] | None]:
    """parse_tool_calls with a fresh parser of any format; `cut`: max_tokens ended the output."""
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    kept = parser.kept_calls(cut)
    if not kept:
        return text, None
    calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in kept]
    return (content + rest).strip() or None, calls


def merge_deltas(deltas: list[dict]) -> list[dict]:
    """One item per call per chunk: argument pieces of the same call are joined."""
    merged: list[dict] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"] and delta.keys() == {"index", "function"}:
            merged[-1]["function"]["arguments"] += delta["function"]["arguments"]
        else:
            merged.append(delta)
    return merged


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
