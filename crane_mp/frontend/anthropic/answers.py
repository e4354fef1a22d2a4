"""Anthropic Messages output: the message object and its content blocks (thinking, text, tool_use) from
a read answer (serving/answers.py), and the streamed event sequence the `anthropic` SDK's `messages.stream`
accumulates (message_start, content blocks started, their deltas and stops, message_delta,
message_stop). No I/O here, so every shape is testable without a server.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from crane_mp.frontend.serving.answers import AnswerReader, ReasoningReading, ToolReading, WholeAnswer
from crane_mp.frontend.serving.generation import Delta
from crane_mp.frontend.web.errors import anthropic_error_body
from crane_mp.frontend.web.http import named_sse_event


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finish_reason: str | None, matched, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a matched stop string, the output limit, a tool call, else the end."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def usage(gen, output_tokens: int | None = None) -> dict[str, Any]:
    """Anthropic counts cached prompt tokens apart from the others."""
    return {"input_tokens": gen.prompt_tokens - gen.cached_tokens, "cache_read_input_tokens": gen.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": gen.completion_tokens if output_tokens is None else output_tokens}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object tool_use carries (a forced call's always is one)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {"value": value}


def content_blocks(answer: WholeAnswer) -> list[dict[str, Any]]:
    blocks = []
    if answer.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": answer.reasoning, "signature": ""})
    if answer.content or not (answer.calls or answer.reasoning is not None):
        blocks.append({"type": "text", "text": answer.content or ""})
    for call in answer.calls or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": tool_input(call["function"]["arguments"])})
    return blocks


@dataclass(slots=True)
class MessageDraft:
    message_id: str
    model: str

    def message(self, content: list[dict[str, Any]], reason: tuple[str | None, str | None],
                usage_: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason[0], "stop_sequence": reason[1], "usage": usage_}


class MessagesStream:
    """The events of a streamed message: a block starts as the answer reaches it (thinking, then text,
    then each tool call) and stops when the next begins; a tool call's arguments arrive as
    input_json_delta pieces that concatenate to its input's JSON."""

    def __init__(self, draft: MessageDraft, gens: list, tools: ToolReading | None,
                 thinking: ReasoningReading | None) -> None:
        self.draft = draft
        self.gens = gens
        self.reader = AnswerReader(tools, thinking)
        self.started = False
        self.blocks = 0  # content blocks started so far
        self.open: str | None = None  # the type of the block being written, if any
        self.calls: dict[int, int] = {}  # the chat parser's call index -> its block index
        self.finish: tuple[str | None, Any] = (None, None)

    def chunks(self, index: int, delta: Delta) -> list[dict[str, Any]]:
        events = []
        if not self.started:
            self.started = True
            events.append({"type": "message_start", "message": self.draft.message(
                [], (None, None), usage(self.gens[0], 0))})
        piece = self.reader.feed(delta)
        if piece.reasoning:
            events += self._text("thinking", piece.reasoning)
        if piece.content:
            events += self._text("text", piece.content)
        for call in piece.calls:
            if "id" in call:
                events += self._stop()
                self.calls[call["index"]] = self.blocks
                events.append(self._start("tool_use", {"type": "tool_use", "id": call["id"],
                                                       "name": call["function"]["name"], "input": {}}))
            arguments = call["function"].get("arguments", "")
            if arguments:
                events.append({"type": "content_block_delta", "index": self.calls[call["index"]],
                               "delta": {"type": "input_json_delta", "partial_json": arguments}})
        if delta.finish_reason:
            self.finish = (delta.finish_reason, delta.stop_reason)
        return events

    def closing(self) -> list[dict[str, Any]]:
        events = self._stop()
        if self.blocks == 0:  # an empty answer still has its (empty) text block
            events += self._text("text", "") + self._stop()
        reason = stop_reason(self.finish[0], self.finish[1], self.reader.called)
        return events + [
            {"type": "message_delta", "delta": {"stop_reason": reason[0], "stop_sequence": reason[1]},
             "usage": usage(self.gens[0])},
            {"type": "message_stop"},
        ]

    event_bytes = staticmethod(named_sse_event)

    end_bytes = b""

    def error_payload(self, status: int, message: str) -> dict[str, Any]:
        return anthropic_error_body(status, message)

    def _start(self, kind: str, block: dict[str, Any]) -> dict[str, Any]:
        self.open = kind
        self.blocks += 1
        return {"type": "content_block_start", "index": self.blocks - 1, "content_block": block}

    def _stop(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.blocks - 1}]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open != kind:
            events += self._stop()
            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" \
                else {"type": "text", "text": ""}
            events.append(self._start(kind, block))
        if text:
            delta = {"type": "thinking_delta", "thinking": text} if kind == "thinking" \
                else {"type": "text_delta", "text": text}
            events.append({"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})
        return events
