"""An incremental scanner for the JSON objects of tool calls in a stream of characters."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


def _loads(raw: str):
    """A JSON value the model wrote, or None where it is not valid JSON (a bad escape, a raw newline)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass(slots=True)
class ObjectScanner:
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
